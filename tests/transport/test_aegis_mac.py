"""The packet MAC, AEGISMAC-128X4 (hostagent/native/aegis_mac.h): every build this CPU runs gives
the draft's known answer and the tags of an independent model written from the draft
(tests/reference/aegismac.py), however the data is cut in two; and a datagram's tag is that MAC of
its header and payload under its epoch's key, with its type and packet number as the nonce."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dlcp.hostagent import sealing, wire
from dlcp.hostagent.datapath import native_available
from tests.reference.aegismac import aegismac_128x4, aes_round

pytestmark = pytest.mark.skipif(native_available() is not None, reason=str(native_available()))

BUILDS = ("vaes512", "vaes256", "aesni", "portable")


def _mac(key: bytes, nonce: bytes, data: bytes, build: str, split: int | None = None) -> bytes:
    from dlcp.hostagent import _datapath

    arr = np.frombuffer(data, np.uint8) if data else np.zeros(0, np.uint8)
    kw = {} if split is None else {"split": split}
    try:
        return bytes(_datapath.aegis_mac(key, nonce, arr, build, **kw))
    except ValueError:
        pytest.skip(f"this CPU cannot run the {build} build")


def test_the_model_gives_the_drafts_known_answers():
    """draft-irtf-cfrg-aegis-aead-18, test vectors: "AESRound" and "AEGISMAC-128X4" (tag128)."""
    assert aes_round(bytes(range(16)), bytes(range(16, 32))).hex() == "7a7b4e5638782546a8c0477a3b813f43"
    key, nonce = bytes.fromhex("10010000000000000000000000000000"), bytes.fromhex("10000200000000000000000000000000")
    assert aegismac_128x4(key, nonce, bytes(range(35))).hex() == "c45a98fd9ab8956ce616eb008cfe4e53"


@pytest.mark.parametrize("build", BUILDS)
def test_every_build_gives_the_drafts_known_answer(build):
    key, nonce = bytes.fromhex("10010000000000000000000000000000"), bytes.fromhex("10000200000000000000000000000000")
    assert _mac(key, nonce, bytes(range(35)), build).hex() == "c45a98fd9ab8956ce616eb008cfe4e53"


@pytest.mark.parametrize("build", BUILDS)
def test_every_build_agrees_with_the_model_at_block_edges_and_any_cut(build):
    """Lengths around the 128-byte block and its 64-byte halves, cut in two anywhere (a block
    straddling header and payload), against the model; a changed bit changes the tag."""
    rng = random.Random(7)
    key, nonce = rng.randbytes(16), rng.randbytes(16)
    for n in (0, 1, 15, 16, 40, 63, 64, 65, 127, 128, 129, 191, 255, 256, 300, 1000):
        data = rng.randbytes(n)
        want = aegismac_128x4(key, nonce, data)
        for cut in sorted({0, min(1, n), min(40, n), n // 2, max(0, n - 1), n}):
            assert _mac(key, nonce, data, build, split=cut) == want, (n, cut)
        if n:
            flipped = bytearray(data)
            flipped[rng.randrange(n)] ^= 1 << rng.randrange(8)
            assert _mac(key, nonce, bytes(flipped), build) != want


def test_the_builds_agree_on_a_largest_datagram():
    """64 KB (a loopback datagram's payload) through every build this CPU runs, cut at a header."""
    rng = random.Random(11)
    key, nonce, data = rng.randbytes(16), rng.randbytes(16), rng.randbytes(65_535)
    from dlcp.hostagent import _datapath

    arr, tags = np.frombuffer(data, np.uint8), set()
    for build in BUILDS:
        try:
            tags.add(bytes(_datapath.aegis_mac(key, nonce, arr, build, split=wire.HEADER_SIZE)))
        except ValueError:
            continue
    assert len(tags) == 1
    assert tags == {bytes(_datapath.aegis_mac(key, nonce, arr))}


def test_unknown_builds_and_bad_keys_are_refused():
    from dlcp.hostagent import _datapath

    with pytest.raises(ValueError, match="cannot run"):
        _datapath.aegis_mac(bytes(16), bytes(16), np.zeros(4, np.uint8), "sparc")
    with pytest.raises(ValueError, match="16-byte key"):
        _datapath.aegis_mac(bytes(15), bytes(16), np.zeros(4, np.uint8))
    assert _datapath.MAC_TARGET in BUILDS


def test_a_datagrams_tag_is_the_mac_of_its_number_header_and_payload_under_its_epoch_key():
    """seal.h's rule, computed independently: tag = AEGISMAC-128X4(K(type, epoch), nonce = 16 zero
    bytes, data = type | 3 zero bytes | packet number (8 bytes, big-endian) | 4 zero bytes | header |
    payload)."""
    key = bytes(range(16))
    header = wire.pack_header(wire.Header(ptype=wire.PacketType.DATA, job_id=1, message_id=7, seq=3,
                                          elem_offset=1053, elem_count=8, total_pkts=9, priority=5, sender_rank=1))
    d = header + bytes(range(32))
    sender = sealing.new_sealer(key, sealing.MAC, 2)  # epochs of 4 datagrams
    ptype = int(wire.PacketType.DATA)
    for pn in range(6):
        sealed = sealing.seal(sender, d)
        assert sealed[:len(d)] == d and int.from_bytes(sealed[len(d):len(d) + 8], "big") == pn
        first = bytes([ptype, 0, 0, 0]) + pn.to_bytes(8, "big") + bytes(4)
        want = aegismac_128x4(sealing.epoch_key(key, ptype, pn >> 2), bytes(16), first + d)
        assert sealed[len(d) + 8:] == want, pn
