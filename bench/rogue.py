"""A scripted hostile or faulty peer on real sockets: control handshakes and data datagrams.

It speaks the handshake of :mod:`dlcp.hostagent.auth` step by step, with whatever secret (or none)
the test gives it, so a test can stop anywhere: never answer, answer wrongly, complete the
handshake and then stop reading, or claim a rank it is not. :func:`hostile_datagrams` makes
data packets of every hostile kind. ``bench/hostile.py`` and the transport's tests use both, so it
lives with the benchmark, above every layer it attacks.
"""

from __future__ import annotations

import socket

import numpy as np

from dlcp.hostagent import auth, wire
from dlcp.hostagent.packetizer import MessageMeta, elems_per_packet, packetize
from dlcp.hostagent.policy import Policy


def send_hello(sock: socket.socket, rank: int, job_id: int, step: int, nonce: bytes = b"", proof: bytes = b"",
               key: bytes = b"") -> None:
    sock.sendall(wire.pack_frame(wire.Header(ptype=wire.PacketType.HELLO, job_id=job_id, message_id=0,
                                             sender_rank=rank), wire.HELLO_BODY.pack(step, nonce, proof, key)))


def read_frame(sock: socket.socket, timeout: float = 5.0) -> tuple[wire.Header, bytes]:
    """The next control frame (header, body); raises ``ConnectionError`` when the peer closed."""
    sock.settimeout(timeout)
    prefix = _read_exact(sock, wire.FRAME_PREFIX.size)
    (size,) = wire.FRAME_PREFIX.unpack(prefix)
    return wire.split_frame(_read_exact(sock, size))


def read_hello(sock: socket.socket, timeout: float = 5.0) -> tuple[wire.Header, int, bytes, bytes, bytes]:
    """The next frame, which must be a HELLO: (header, step, nonce, proof, key)."""
    h, body = read_frame(sock, timeout)
    assert h.ptype == wire.PacketType.HELLO, f"expected a HELLO, got {h.ptype.name}"
    step, nonce, proof, key = wire.HELLO_BODY.unpack(body)
    return h, step, nonce, proof, key


def accept_as(listener: socket.socket, rank: int, job_id: int = 1, secret: bytes | None = None,
              timeout: float = 10.0) -> tuple[socket.socket, bytes, bytes]:
    """Accept one connection on ``listener`` and complete the handshake as ``rank``.

    Returns (socket, the initiator's key for our tokens, our key for its tokens)."""
    listener.settimeout(timeout)
    sock, _ = listener.accept()
    h, step, nonce_i, _, _ = read_hello(sock, timeout)
    assert step == auth.STEP_HELLO
    nonce_a = auth.new_nonce()
    send_hello(sock, rank, job_id, auth.STEP_CHALLENGE, nonce=nonce_a,
               proof=auth.proof(secret, "accept", job_id, h.sender_rank, rank, nonce_i, nonce_a))
    _, step, _, _, their_key = read_hello(sock, timeout)
    assert step == auth.STEP_RESPONSE
    our_key = auth.new_key()
    send_hello(sock, rank, job_id, auth.STEP_KEY, key=our_key)
    return sock, their_key, our_key


def dial_as(host: str, port: int, rank: int, acceptor: int, job_id: int = 1, secret: bytes | None = None,
            timeout: float = 5.0) -> tuple[socket.socket, bytes]:
    """Connect and run the initiator's side of the handshake claiming ``rank``.

    Returns (socket, the acceptor's key for tokens of data we send it). Raises
    ``ConnectionError`` if the acceptor closes on us (it refused the claim or the proof)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    nonce_i = auth.new_nonce()
    send_hello(sock, rank, job_id, auth.STEP_HELLO, nonce=nonce_i)
    _, step, nonce_a, _, _ = read_hello(sock, timeout)
    assert step == auth.STEP_CHALLENGE
    send_hello(sock, rank, job_id, auth.STEP_RESPONSE, key=auth.new_key(),
               proof=auth.proof(secret, "initiate", job_id, rank, acceptor, nonce_i, nonce_a))
    _, step, _, _, key = read_hello(sock, timeout)
    assert step == auth.STEP_KEY
    return sock, key


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def hostile_datagrams(n: int, job: int, victim: int, real: list[tuple[int, int]], seed: int = 0) -> list[bytes]:
    """``n`` datagrams of every hostile kind, in turn: forged copies of the headers of the real
    messages ``real`` (sender, message id), with the right job, sender, message and offsets, a
    guessed token and a garbage payload; data for unknown messages from a configured rank (0),
    from the ``victim`` itself and from a rank that does not exist (7); random bytes; a
    truncated header; another version; another job."""
    rng = np.random.default_rng(seed)
    policy = Policy(loss_bound_push=0.0)
    garbage = rng.standard_normal(elems_per_packet(1500, np.float32) * 4).astype(np.float32) * 1e6
    kinds: list[list[bytes]] = []
    kinds.append([d for sender, mid in real for d in  # one kind: forgeries of every real message in turn
                  packetize(garbage, MessageMeta(job_id=job, message_id=mid, sender_rank=sender,
                                                 token=int(rng.integers(1 << 32))), policy)])
    for sender in (0, victim, 7):
        kinds.append([d for _ in range(16) for d in
                      packetize(garbage, MessageMeta(job_id=job, message_id=int(rng.integers(1 << 30)),
                                                     sender_rank=sender), policy)])
    kinds.append([rng.integers(0, 256, int(rng.integers(1, 1500)), dtype=np.uint8).tobytes() for _ in range(64)])
    kinds.append([bytes(wire.HEADER_SIZE - 1)])
    other_job = list(packetize(garbage, MessageMeta(job_id=job + 1, message_id=1, sender_rank=0), policy))
    kinds.append(other_job)
    old = bytearray(other_job[0])
    old[0] = wire.VERSION - 1
    kinds.append([bytes(old)])
    return [kinds[i % len(kinds)][(i // len(kinds)) % len(kinds[i % len(kinds)])] for i in range(n)]
