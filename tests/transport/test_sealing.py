"""Every datagram's trailer (dlcp.hostagent.sealing, hostagent/native/seal.h), on both data paths:
a changed bit anywhere is refused and counted, encryption round-trips, both paths put the same
bytes on the wire, and the keys never cross it."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from dlcp.hostagent import auth, sealing, wire
from dlcp.hostagent.datapath import native_available
from dlcp.hostagent.datapath.credits import max_datagram
from dlcp.hostagent.loopback import free_port_pairs
from dlcp.hostagent.messages import Expect, TransportError
from dlcp.hostagent.packetizer import MessageMeta, elems_per_packet, packetize
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.protocol.port import RxBuffers, RxSpec, TxSpec
from dlcp.hostagent.transport import Endpoint, LossInjection, Peer, TransportConfig
from tests.conftest import loopback_peers

PER = elems_per_packet(1500, np.float32)
KEY1 = bytes(range(16))  # the key of rank 1's direction to rank 0
POLICY = Policy(loss_bound_push=0.0)
SECRET = auth.new_secret()

pytestmark = pytest.mark.skipif(native_available() is not None, reason=str(native_available()))


def _paths(**config):
    """A native and a numpy data path for rank 0 of a 2-rank job, threads not started."""
    from dlcp.hostagent.datapath.native import NativeDatapath
    from tests.reference.numpy_path import NumpyDatapath

    cfg = TransportConfig(rank=0, peers=tuple(Peer(r, "127.0.0.1", 43000 + 2 * r, 43001 + 2 * r) for r in range(2)),
                          **config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    paths: list[Any] = [NativeDatapath(cfg, sock, False), NumpyDatapath(cfg, sock, False)]
    for dp in paths:
        dp.set_keys(1, KEY1, KEY1)
        dp.add_peer(1, "127.0.0.1", 43002)
    return paths, sock, cfg


def _ingest(dp, d: bytes, width: int, now: float = 1.0) -> None:
    row = np.zeros((1, width), np.uint8)
    row[0, : min(len(d), width)] = np.frombuffer(d, np.uint8)[:width]
    dp.ingest_for_test(row, np.array([len(d)]), now)


def _flips(d: bytes, rng: np.random.Generator) -> list[bytes]:
    """``d`` with one bit changed: every bit of the header and of the trailer, 64 of the payload's."""
    n = len(d)
    head = range(wire.HEADER_SIZE * 8)
    tail = range((n - wire.TRAILER_SIZE) * 8, n * 8)
    middle: list[int] = (rng.integers(wire.HEADER_SIZE * 8, (n - wire.TRAILER_SIZE) * 8, 64).tolist()
                         if n > wire.HEADER_SIZE + wire.TRAILER_SIZE else [])
    out = []
    for bit in [*head, *middle, *tail]:
        b = bytearray(d)
        b[int(bit) // 8] ^= 0x80 >> (int(bit) % 8)
        out.append(bytes(b))
    return out


def _credit(seq: int, consumed: int, window: int) -> bytes:
    h = wire.Header(ptype=wire.PacketType.CREDIT, job_id=1, message_id=0, sender_rank=1, priority=7,
                    iteration=seq, elem_count=window, total_pkts=consumed >> 32, elem_offset=consumed & 0xFFFFFFFF)
    return wire.pack_header(h)


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_flipped_bit_anywhere_in_a_datagram_is_refused_and_counted_by_both_paths(encrypt):
    """Every bit of the header and trailer, and bits across the payload, of data packets (the
    short last one too) and of a credit: each copy with one bit changed is rejected under a
    reason and counted, the same on both paths, and nothing of it reaches the tensor or the
    window; the originals then place the message exactly and grant the window."""
    protection = sealing.ENCRYPT if encrypt else sealing.MAC
    rng = np.random.default_rng(1)
    x = rng.standard_normal(PER * 2 + 5).astype(np.float32)
    sealer = sealing.new_sealer(KEY1, protection)
    meta = MessageMeta(job_id=1, message_id=9, sender_rank=1, token=auth.DATA_TOKEN)
    genuine = [sealing.seal(sealer, d) for d in packetize(x, meta, POLICY)] + [sealing.seal(sealer, _credit(1, 3, 64))]
    paths, sock, cfg = _paths(encrypt=encrypt)
    width = max_datagram(cfg)
    flipped = [f for d in genuine for f in _flips(d, rng)]
    outs = []
    for dp in paths:
        out = np.zeros(x.size, np.float32)
        dp.expect(RxSpec(1, 9, auth.DATA_TOKEN, int(wire.Dtype.FLOAT32), x.size, PER,
                         RxBuffers.allocate(out, 3, 0), False, x.size))
        outs.append(out)
        for i, d in enumerate(flipped):
            _ingest(dp, d, width, now=1.0 + i * 1e-6)
        s = dp.stats()
        assert sum(s["rejected"].values()) == len(flipped), type(dp).__name__
        assert s["accepted"] == s["parked"] == s["credits_received"] == 0 and not out.any()
        assert s["rejected"]["bad_mac"] > len(flipped) * 0.9  # (a changed version, type or job is refused first)
    assert paths[0].stats()["rejected"] == paths[1].stats()["rejected"]
    for dp, out in zip(paths, outs):
        for d in genuine:
            _ingest(dp, d, width, now=2.0)
        s = dp.stats()
        assert (s["accepted"], s["credits_received"]) == (3, 1), type(dp).__name__
        np.testing.assert_array_equal(out, x)
        dp.stop()
    sock.close()


@pytest.mark.parametrize("which", ["native", "numpy"])
@pytest.mark.parametrize("encrypt", [False, True])
def test_what_a_path_puts_on_the_wire_opens_under_the_key_and_is_encrypted_when_asked(which, encrypt):
    """A message sent by a path, as a plain socket standing in for rank 1 reads it: every
    datagram opens under the direction's key, with packet numbers 0, 1, 2, ... in the order
    they left; encrypted, no payload leaves in the clear; opened, they place the message."""
    from tests.transport.test_datapath import wire_capture

    x = np.random.default_rng(2).standard_normal(PER * 6 + 11).astype(np.float32)
    spec = TxSpec(1, 7, x, 0, PER, auth.DATA_TOKEN, 2, 3, 0, 6, None, None, np.zeros(7, np.uint8))
    got = wire_capture(which, spec, 7, encrypt=encrypt)
    opener = sealing.new_sealer(KEY1, sealing.ENCRYPT if encrypt else sealing.MAC)
    assert [int.from_bytes(d[-wire.TRAILER_SIZE: -16], "big") for d in got] == list(range(7))  # packet numbers
    placed = np.zeros(x.size, np.float32)
    for d in got:
        p = sealing.open_datagram(opener, d)
        assert p is not None
        h = wire.unpack_header(p)
        payload = p[wire.HEADER_SIZE:]
        placed[h.elem_offset : h.elem_offset + h.elem_count] = np.frombuffer(payload, np.float32)
        on_wire = d[wire.HEADER_SIZE : len(d) - wire.TRAILER_SIZE]
        assert (on_wire != payload) if encrypt else (on_wire == payload)
        assert sealing.open_datagram(sealing.new_sealer(bytes(16), opener.mode), d) is None  # another key
    np.testing.assert_array_equal(placed, x)


@pytest.mark.parametrize("encrypt", [False, True])
def test_messages_round_trip_with_and_without_encryption_through_loss_and_resends(endpoints, encrypt):
    """Exact messages both ways, float32 and float16, under 5 % injected loss: every resend is
    sealed afresh (a new packet number, its RETX header) and opens at the receiver."""
    a, b = endpoints(2, policy=POLICY, encrypt=encrypt, secret=SECRET,
                     per_rank={1: {"loss": LossInjection(drop_probabilities=(0.05,) * 4, seed=3)}})
    for i, dtype in enumerate((np.float32, np.float16, np.float32)):
        x = np.random.default_rng(i).standard_normal(PER * 40 + 3).astype(dtype)
        h = b.recv(0, 10 + i)
        s = a.send(1, x, 10 + i)
        np.testing.assert_array_equal(h.wait(20).data, x)
        s.wait(20)
        back = b.send(0, x[::-1].copy(), 50 + i)
        np.testing.assert_array_equal(a.recv(1, 50 + i).wait(20).data, x[::-1])
        back.wait(20)
    assert a.endpoint_stats()["retransmitted_pkts"] > 0
    for ep in (a, b):
        assert ep.endpoint_stats()["reassembly"]["rejected"].get("bad_mac", 0) == 0


class _Relay:
    """A TCP relay that records every byte both ways: what an eavesdropper on the control
    connection sees."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.port = self.listener.getsockname()[1]
        self.target = target
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.tamper: str | None = None  # "flip" or "replay": done to the next chunk upstream, once
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            for src, dst, upstream in ((c, up, True), (up, c, False)):
                threading.Thread(target=self._pump, args=(src, dst, upstream), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.seen += data
                    how, self.tamper = (self.tamper, None) if upstream else (None, self.tamper)
                if how == "flip":
                    data = data[:-1] + bytes([data[-1] ^ 1])
                elif how == "replay":
                    data = data + data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def _through_relay(datapath: str, secret: str | None) -> tuple[Endpoint, Endpoint, _Relay]:
    """Ranks 0 and 1, started; rank 0 reaches rank 1's control port through a relay that records
    (and may change) everything on the way."""
    (d0, c0), (d1, c1) = free_port_pairs(2)
    relay = _Relay(("127.0.0.1", c1))
    true = (Peer(0, "127.0.0.1", d0, c0), Peer(1, "127.0.0.1", d1, c1))
    via_relay = (true[0], Peer(1, "127.0.0.1", d1, relay.port))
    a = Endpoint(TransportConfig(rank=0, peers=via_relay, datapath=datapath, secret=auth.parse_secret(secret))).start()
    b = Endpoint(TransportConfig(rank=1, peers=true, datapath=datapath, secret=auth.parse_secret(secret))).start()
    return a, b, relay


@pytest.mark.parametrize("secret", [SECRET, None])
def test_the_keys_never_cross_the_wire(datapath, secret):
    """Rank 0 reaches rank 1's control port through a relay that records the handshake and
    everything after it. Both ranks derive the same key for each direction, the two directions'
    keys differ, and neither key nor the secret appears in what the relay saw (the key nonces
    do: they are public)."""
    a, b, relay = _through_relay(datapath, secret)
    try:
        a.connect([1])
        x = np.arange(PER * 8, dtype=np.float32)
        h = b.recv(0, 3)
        a.send(1, x, 3).wait(10)
        np.testing.assert_array_equal(h.wait(10).data, x)
        ca, cb = a.core, b.core
        assert ca is not None and cb is not None
        assert ca.tx_keys[1] == cb.rx_keys[0] and ca.rx_keys[1] == cb.tx_keys[0]
        assert ca.tx_keys[1] != ca.rx_keys[1]
        with relay.lock:
            seen = bytes(relay.seen)
        assert a._key_nonces[1] in seen and b._key_nonces[0] in seen  # the handshake went through it
        for key in (ca.tx_keys[1], ca.rx_keys[1]):
            assert key not in seen
        raw = auth.parse_secret(secret)
        if raw is not None:
            assert raw not in seen
    finally:
        a.close()
        b.close()
        relay.close()


def test_an_encrypting_rank_and_a_plain_one_do_not_understand_each_other(datapath):
    """Protection is a job setting: datagrams sealed one way fail the other's check (counted
    bad_mac), never reach a tensor, and the message times out rather than arrive wrong."""
    peers = loopback_peers(2)
    a = Endpoint(TransportConfig(rank=0, peers=peers, datapath=datapath, encrypt=True, message_deadline=1.0)).start()
    b = Endpoint(TransportConfig(rank=1, peers=peers, datapath=datapath, message_deadline=1.0)).start()
    try:
        x = np.ones(PER * 4, np.float32)
        h = b.recv(0, 4, expect=Expect(x.size, np.float32, 0.0))
        a.send(1, x, 4, announce=False)
        with pytest.raises(TransportError):  # (the message's deadline, 1 s)
            h.wait(5)
        assert b.endpoint_stats()["reassembly"]["rejected"].get("bad_mac", 0) > 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("how", ["flip", "replay"])
def test_a_control_frame_changed_or_replayed_on_the_way_drops_the_connection(datapath, how):
    """After the handshake every control frame is sealed under its connection's key with its
    index: a frame with a bit changed on the way, or sent twice, is refused (ctl_rejected
    bad_mac) and the connection dropped, never handled as a record."""
    a, b, relay = _through_relay(datapath, SECRET)
    try:
        a.connect([1])
        x = np.arange(PER * 2, dtype=np.float32)
        h = b.recv(0, 1)
        a.send(1, x, 1).wait(10)
        np.testing.assert_array_equal(h.wait(10).data, x)  # sealed frames (META, STOP, ...) both ways
        assert b.endpoint_stats()["ctl_rejected"] == {}
        with relay.lock:
            relay.tamper = how
        a.announce(1, 2, PER, np.float32, 0.0)  # its next frame, changed or twice
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not b.endpoint_stats()["ctl_rejected"]:
            time.sleep(0.01)
        assert b.endpoint_stats()["ctl_rejected"] == {"bad_mac": 1}
    finally:
        a.close()
        b.close()
        relay.close()


@pytest.mark.skipif(bool(native_available()), reason="the compiled module is not built")
def test_a_packet_number_is_taken_once_and_one_older_than_the_window_is_refused():
    """ReplayWindow (seal.h): under one key and packet type each packet number opens once; a
    copy, or a datagram more than the window's 8192 numbers behind the highest, is REPLAYED; a
    forged one is FORGED and moves nothing (its number stays free for the real datagram)."""
    key = bytes(range(16))
    sender, receiver = sealing.new_sealer(key, sealing.MAC), sealing.new_sealer(key, sealing.MAC)
    header = wire.pack_header(wire.Header(ptype=wire.PacketType.DATA, job_id=1, message_id=2))
    sealed = [sealing.seal(sender, header + bytes([i % 256]) * 8) for i in range(8300)]

    def found(d: bytes) -> int:
        row = np.frombuffer(d, np.uint8).copy().reshape(1, -1)
        return int(sealing.open_rows(receiver, row, np.array([len(d)]), np.array([0]))[0])

    forged = bytearray(sealed[1])
    forged[-1] ^= 1
    assert found(bytes(forged)) == sealing.FORGED
    assert [found(sealed[i]) for i in (1, 0, 1, 0, 2)] == [sealing.OPENED, sealing.OPENED, sealing.REPLAYED,
                                                           sealing.REPLAYED, sealing.OPENED]
    assert found(sealed[8250]) == sealing.OPENED  # the window moves up to it
    assert found(sealed[50]) == sealing.REPLAYED  # 8200 numbers behind: older than the window
    assert found(sealed[8100]) == sealing.OPENED  # inside the window, not seen yet
    assert found(sealed[8100]) == sealing.REPLAYED
    assert sealing.open_datagram(receiver, sealed[8299]) is not None
    assert sealing.open_datagram(receiver, sealed[8299]) is None  # a replay opens to nothing


def _opened(receiver, d: bytes) -> int:
    row = np.frombuffer(d, np.uint8).copy().reshape(1, -1)
    return int(sealing.open_rows(receiver, row, np.array([len(d)]), np.array([0]))[0])


def _with_pn(d: bytes, pn: int) -> bytes:
    """``d`` with its trailer's packet number changed (its tag left: a forgery)."""
    at = len(d) - wire.TRAILER_SIZE
    return d[:at] + pn.to_bytes(8, "big") + d[at + 8:]


@pytest.mark.skipif(bool(native_available()), reason="the compiled module is not built")
@pytest.mark.parametrize("protection", [sealing.MAC, sealing.ENCRYPT])
def test_keys_are_renewed_every_epoch_of_packet_numbers_and_the_receiver_follows(protection):
    """With epochs of 8 datagrams (the data paths use 2^22), 40 datagrams cross five epochs: each
    opens, in order and a few out of order across a boundary; the sealer derived a key per
    epoch, and so did the receiver. A datagram two epochs ahead of the receiver is refused,
    genuine or not; one of the epoch before is still taken."""
    key = bytes(range(16))
    sender, receiver = sealing.new_sealer(key, protection, 3), sealing.new_sealer(key, protection, 3)
    header = wire.pack_header(wire.Header(ptype=wire.PacketType.DATA, job_id=1, message_id=2))
    sealed = [sealing.seal(sender, header + bytes([i]) * 16) for i in range(40)]
    assert sender.keys_derived == 1 + 5  # (the constructor's check derives one more)
    order = [*range(7), 8, 9, 7, *range(10, 15), 16, 15, *range(17, 40)]  # 7 and 15 late, across a boundary
    assert [_opened(receiver, sealed[i]) for i in order] == [sealing.OPENED] * 40
    assert receiver.keys_derived == 1 + 5
    assert sealing.open_datagram(sealing.new_sealer(key, protection, 3), sealed[20]) is None  # epoch 2: too far ahead

    # the key did change at each boundary: an epoch-1 datagram does not open under epoch 0's key
    assert _opened(sealing.new_sealer(key, protection, 4), sealed[8]) == sealing.FORGED
    late = sealing.new_sealer(key, protection, 3)
    assert [_opened(late, sealed[i]) for i in (0, 9, 3, 17, 5)] == [sealing.OPENED, sealing.OPENED, sealing.OPENED,
                                                                    sealing.OPENED, sealing.FORGED]  # 5: two behind


@pytest.mark.skipif(bool(native_available()), reason="the compiled module is not built")
def test_forged_datagrams_claiming_other_epochs_move_nothing_and_derive_at_most_one_key():
    """A forger cannot make a receiver derive keys in a loop nor move its epoch: a claim of the
    next epoch derives that key once, further ones none, and the receiver stays where it was."""
    key = bytes(range(16))
    sender, receiver = sealing.new_sealer(key, sealing.MAC, 3), sealing.new_sealer(key, sealing.MAC, 3)
    header = wire.pack_header(wire.Header(ptype=wire.PacketType.DATA, job_id=1, message_id=2))
    sealed = [sealing.seal(sender, header + bytes([i]) * 16) for i in range(20)]
    assert _opened(receiver, sealed[0]) == sealing.OPENED
    derived = receiver.keys_derived
    for pn in (9, 10, 11, 12, 30, 1 << 40, 70):
        assert _opened(receiver, _with_pn(sealed[1], pn)) == sealing.FORGED
    assert receiver.keys_derived == derived + 1  # epoch 1's, once
    assert [_opened(receiver, sealed[i]) for i in (1, 8, 16)] == [sealing.OPENED, sealing.OPENED, sealing.OPENED]


@pytest.mark.skipif(bool(native_available()), reason="the compiled module is not built")
def test_an_epoch_key_is_hkdf_sha256_of_the_direction_key_as_documented():
    """seal.h's rule, computed independently: HKDF-SHA256 (RFC 5869, no salt) of the direction
    key, info ``"dlcp epoch" | type | epoch (8 bytes, big-endian)``, 16 bytes."""
    key = bytes(range(16))
    for ptype, epoch in ((1, 0), (1, 1), (6, 5), (1, 1 << 40)):
        info = b"dlcp epoch" + bytes([ptype]) + epoch.to_bytes(8, "big")
        assert sealing.epoch_key(key, ptype, epoch) == auth.hkdf_sha256(key, b"", info, 16)
    assert len({sealing.epoch_key(key, 1, e) for e in range(100)}) == 100


#: What follows the header of one datagram sealed as its sender's 1st, 2nd and 5th DATA datagram
#: (with epochs of 4: the 5th is epoch 1's first), with a MAC and encrypted: the payload (or its
#: ciphertext), the packet number and the tag, at wire version 5. The MAC's tags are AEGISMAC-128X4's
#: (the model of tests/reference/aegismac.py gives them: test_aegis_mac.py), the encrypted ones
#: AES-128-GCM's (the `cryptography` package's AESGCM gave the same bytes). Every build, whichever
#: MAC build or AES-GCM library it runs, must give these bytes.
_KAT_KEY = bytes.fromhex("000102030405060708090a0b0c0d0e0f")
_PLAIN = bytes(range(32)).hex()
_KAT = {
    sealing.MAC: {0: _PLAIN + "0000000000000000" "5a684ec5c2b69638a676583a0179b2cd",
                  1: _PLAIN + "0000000000000001" "c709f38bf2f064f03bfefd1b1620d0b1",
                  4: _PLAIN + "0000000000000004" "691a50aefc51b0817ac0588d4087444a"},
    sealing.ENCRYPT: {0: "25909d42532504db8359e50bc6e4c4740c2c03fde1f97989102ca3c9e7e888a6" "0000000000000000"
                         "1753e5974fabc4283ba8b874296241e0",
                      1: "c557910c28bbe4cb48f93869e48705b3a3e8e812ec6f62c6b6a5341cb19d81b6" "0000000000000001"
                         "c6518feb4cbdec3126f224afffa47687",
                      4: "1981c7f8473dfe39330d1dfd3d618bc70248f7dc64c04388a8c24c06c180e47a" "0000000000000004"
                         "2d88f2809a6011988992743887cd6b9a"},
}


def _kat_datagram() -> bytes:
    header = wire.pack_header(wire.Header(ptype=wire.PacketType.DATA, job_id=1, message_id=7, seq=3, elem_offset=1053,
                                          elem_count=8, total_pkts=9, priority=5, sender_rank=1))
    return header + bytes(range(32))


@pytest.mark.skipif(bool(native_available()), reason="the compiled module is not built")
@pytest.mark.parametrize("protection", [sealing.MAC, sealing.ENCRYPT])
def test_the_tags_are_the_standard_ones_whichever_library_computes_them(protection):
    """Known answers: the bytes on the wire for a fixed key and datagram do not depend on the
    build (the MAC's for this CPU, intel-ipsec-mb or OpenSSL for AES-GCM), nor change by accident."""
    d = _kat_datagram()
    sender = sealing.new_sealer(_KAT_KEY, protection, 2)  # epochs of 4: the 5th datagram is epoch 1's first
    wire_bytes = [sealing.seal(sender, d) for _ in range(5)]
    got = {n: wire_bytes[n][wire.HEADER_SIZE:].hex() for n in (0, 1, 4)}
    assert got == _KAT[protection], (sealing.library(), got)
