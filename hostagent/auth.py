"""Who may speak for a rank: the control handshake's proofs and the data packets' tokens.

Pure functions; the control path (:mod:`dlcp.hostagent.control_path`) runs the exchange.

**Handshake.** A control connection from initiator I to acceptor A opens with four HELLO
records (:data:`dlcp.hostagent.wire.HELLO_BODY`)::

    1. I -> A  nonce_I                          (A checks: I is a configured rank other than A,
                                                 connecting from I's configured address)
    2. A -> I  nonce_A, proof(A)                (I checks A's proof)
    3. I -> A  proof(I), key(A->I)              (A checks I's proof; only now A learns a key)
    4. A -> I  key(I->A)

``proof`` is an HMAC-SHA256 under the job secret of both nonces, both ranks, the job and the
prover's role, so it can be neither replayed from another connection nor reflected back. A
key is given only to a peer that proved the secret, and only after the giver checked it.
Without a secret (``TransportConfig.secret`` unset) proofs are empty and not checked: the
address check and the tokens still stop blind forgery from other hosts and other processes
that never connected, but not a process that connects as a rank from that rank's address.

**Tokens.** Each receiver draws a random key per sender and gives it in the handshake. Every
data packet of message m of iteration i from S to R carries ``message_token(key_R[S], job, S,
m, i)``; R checks it before a byte of the payload is used. Without the key a forger guesses a
32-bit value per packet. The iteration is bound in because message ids repeat (an exchange's
ids wrap every 1,024 iterations): without it, a packet recorded at iteration i would carry a
valid token again at i + 1,024. The full 32-bit iteration repeats only after 2^32 uses. Keys and
tokens travel in the clear: an attacker who can read the packets on the path is out of scope
(that is what network encryption, such as IPsec or WireGuard, is for).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from dlcp.hostagent import wire

#: Bytes of a nonce, a receive key, and a proof (HMAC-SHA256).
NONCE_BYTES = 16
KEY_BYTES = 16
PROOF_BYTES = 32
#: Shortest job secret accepted: 128 bits, as a random key should have.
MIN_SECRET_BYTES = 16

#: Handshake steps (the first byte of a HELLO body).
STEP_HELLO, STEP_CHALLENGE, STEP_RESPONSE, STEP_KEY = 1, 2, 3, 4

_PROOF_INPUT = struct.Struct("!8sIHH16s16s")
_TOKEN_INPUT = struct.Struct("!IHII")
# Where the token sits in a header (a credit's token is computed over the header around it).
_TOKEN_AT = wire.FIELD_OFFSET["token"]
_TOKEN_END = _TOKEN_AT + wire.FIELD_DTYPE["token"].itemsize


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def new_secret() -> str:
    """A fresh job secret, as hex text (what ``DLCP_SECRET`` and the testbed carry)."""
    return os.urandom(32).hex()


def parse_secret(text: str | bytes | None) -> bytes | None:
    """A job secret from configuration: bytes as they are, text as hex (else its UTF-8 bytes).

    Raises:
        ValueError: shorter than MIN_SECRET_BYTES; a guessable secret protects nothing.
    """
    if text is None or text == "" or text == b"":
        return None
    if isinstance(text, str):
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = text.encode()
    else:
        raw = bytes(text)
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"the job secret has {len(raw)} bytes; use at least {MIN_SECRET_BYTES} random bytes "
                         f"(e.g. {new_secret()[:16]}... from dlcp.hostagent.auth.new_secret())")
    return raw


def proof(secret: bytes | None, role: str, job_id: int, initiator: int, acceptor: int, nonce_i: bytes,
          nonce_a: bytes) -> bytes:
    """What ``role`` ("accept" or "initiate") sends to show it holds ``secret``; zeros without one."""
    if secret is None:
        return bytes(PROOF_BYTES)
    msg = _PROOF_INPUT.pack(role.encode(), job_id, initiator, acceptor, nonce_i, nonce_a)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def proof_ok(secret: bytes | None, got: bytes, role: str, job_id: int, initiator: int, acceptor: int,
             nonce_i: bytes, nonce_a: bytes) -> bool:
    """Whether ``got`` is ``role``'s proof for this connection (always true without a secret)."""
    if secret is None:
        return True
    return hmac.compare_digest(got, proof(secret, role, job_id, initiator, acceptor, nonce_i, nonce_a))


def credit_token(key: bytes, header: bytes) -> int:
    """The 32-bit token of a CREDIT (:data:`dlcp.hostagent.wire.PacketType.CREDIT`): keyed BLAKE2b of
    ``C`` and the whole header as sent, its ``token`` field read as zero. Every field is bound
    (the window in ``elem_count``, the count, the sequence, the RELEASE flag), so a copy with any
    of them changed is refused; and its input is longer than a data token's, so no data header
    passes for a credit. The compiled data path computes the same.

    Example::

        h = wire.pack_header(wire.Header(ptype=wire.PacketType.CREDIT, ...))   # token 0
        token = credit_token(key, h)
    """
    if len(header) < _TOKEN_END:
        raise ValueError(f"a credit's header has at least {_TOKEN_END} bytes, got {len(header)}")
    blank = header[:_TOKEN_AT] + bytes(4) + header[_TOKEN_END:]
    return int.from_bytes(hashlib.blake2b(b"C" + blank, digest_size=4, key=key).digest(), "big")


def message_token(key: bytes, job_id: int, sender: int, message_id: int, iteration: int = 0) -> int:
    """The 32-bit token of message ``message_id`` of ``iteration`` from ``sender``, under the
    receiver's ``key`` (keyed BLAKE2b; the compiled data path computes the same)."""
    digest = hashlib.blake2b(_TOKEN_INPUT.pack(job_id, sender, message_id, iteration), digest_size=4,
                             key=key).digest()
    return int.from_bytes(digest, "big")
