"""Who may speak for a rank: the control handshake's proofs, the data keys derived from it, and
the data packets' protection.

Pure functions; the control path (:mod:`dlcp.hostagent.control_path`) runs the exchange, and the
packet protection itself is compiled code (``hostagent/native/seal.h``) that the data path
calls.

**Handshake.** A control connection from initiator I to acceptor A opens with four HELLO
records (:data:`dlcp.hostagent.wire.HELLO_BODY`)::

    1. I -> A  nonce_I                          (A checks: I is a configured rank other than A,
                                                 connecting from I's configured address)
    2. A -> I  nonce_A, proof(A), kn_A          (I checks A's proof)
    3. I -> A  proof(I), kn_I                   (A checks I's proof; only now A takes I's data)
    4. A -> I  (done)                           (I takes A's data)

``proof`` is an HMAC-SHA256 under the job secret of both nonces, both ranks, the job, the
prover's role and its key nonce ``kn``, so it can be neither replayed from another connection
nor reflected back, and nobody without the secret can put another key nonce in its place.
Without a secret (``TransportConfig.secret`` unset) proofs are empty and not checked.

**Keys.** Each endpoint draws a key nonce per peer (16 random bytes, kept until it has no
connection with the peer left). The key of a direction S -> R is HKDF-SHA256 (RFC 5869) of the
job secret, with the job, both ranks and both key nonces in its info (:func:`direction_key`):
both sides compute it, neither sends it. Every datagram S sends R on the data path (data and
credits) is sealed under it, every one R takes from S opened under it. Why key nonces per peer
and not the connection's nonces: two ranks may hold two connections at once (both dialled), and
both must give the same keys, whichever a side heard first; a side's key nonce is the same on
each. Why both sides' nonces: a sender's packet numbers restart with its process, so its key
must too (a new nonce of its own), whatever the receiver kept; and a receiver that restarted
must not accept what was recorded for its previous life (a new nonce of its own).

**Without a secret** the keys come from the nonces alone, which travel in the clear in the
handshake: they stop blind forgery (an off-path host or process that never saw the handshake
guesses a 128-bit tag), nothing more. Whoever can read the control connection can compute them.

**Control frames.** After its handshake, every frame of a control connection ends in the same
trailer as a datagram (:data:`dlcp.hostagent.wire.TRAILER_SIZE`): a MAC under a key of that
connection and direction (:func:`control_key`) over the frame's length prefix and content, its
packet number the frame's index on the connection, which the reader checks. A frame changed,
dropped, replayed or inserted on the way drops the connection (``ctl_rejected["bad_mac"]``).

**Tokens.** A packet's header ``token`` is :data:`DATA_TOKEN` (zero) on data and credits alike:
the trailer's tag (:data:`dlcp.hostagent.wire.TRAILER_SIZE`) authenticates the whole datagram.
(Credits carried a keyed BLAKE2b of their header until wire version 4; behind the tag it
protected nothing more, and it was hand-written crypto.)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct


#: Bytes of a nonce (handshake or key nonce), a direction key, and a proof (HMAC-SHA256).
NONCE_BYTES = 16
KEY_BYTES = 16
PROOF_BYTES = 32
#: Shortest job secret accepted: 128 bits, as a random key should have.
MIN_SECRET_BYTES = 16

#: The ``token`` field of a data packet since wire version 3, and of a credit since 4: zero. On
#: data it was a 32-bit keyed hash of (job, sender, message, iteration) that covered neither
#: ``seq``, the offset, the flags nor the payload; the trailer's 128-bit tag covers all of them
#: (``hostagent/native/seal.h``).
DATA_TOKEN = 0

#: Handshake steps (the first byte of a HELLO body). STEP_KEY (4) now says only "done": no
#: key is sent (its name is kept for the wire's step numbers).
STEP_HELLO, STEP_CHALLENGE, STEP_RESPONSE, STEP_KEY = 1, 2, 3, 4

_PROOF_INPUT = struct.Struct("!8sIHH16s16s16s")
_KEY_INFO = struct.Struct("!16sIHH16s16s")
_KEY_SALT = b"DLCP direction key v1"


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
          nonce_a: bytes, key_nonce: bytes = bytes(NONCE_BYTES)) -> bytes:
    """What ``role`` ("accept" or "initiate") sends to show it holds ``secret``, binding the key
    nonce it sends with it; zeros without a secret."""
    if secret is None:
        return bytes(PROOF_BYTES)
    msg = _PROOF_INPUT.pack(role.encode(), job_id, initiator, acceptor, nonce_i, nonce_a, key_nonce)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def proof_ok(secret: bytes | None, got: bytes, role: str, job_id: int, initiator: int, acceptor: int,
             nonce_i: bytes, nonce_a: bytes, key_nonce: bytes = bytes(NONCE_BYTES)) -> bool:
    """Whether ``got`` is ``role``'s proof for this connection and key nonce (always true
    without a secret)."""
    if secret is None:
        return True
    return hmac.compare_digest(got, proof(secret, role, job_id, initiator, acceptor, nonce_i, nonce_a, key_nonce))


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF (RFC 5869) with HMAC-SHA256: extract a key from ``ikm`` under ``salt``, expand it to
    ``length`` bytes bound to ``info``. Built on the standard library's HMAC (the construction
    is two lines of the RFC; no cipher is written here).

    Example: ``hkdf_sha256(b"secret", b"salt", b"info", 16)``
    """
    if not 0 < length <= 255 * 32:
        raise ValueError(f"HKDF-SHA256 gives 1..{255 * 32} bytes, not {length}")
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def control_key(secret: bytes | None, job_id: int, sender: int, receiver: int, nonce_i: bytes, nonce_a: bytes,
                sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    """The 16-byte key of the frames ``sender`` sends ``receiver`` on one control connection
    after its handshake: as :func:`direction_key`, with the connection's own handshake nonces
    too, so two connections of a pair never share a key (each numbers its frames from 0).

    Example::

        k = control_key(secret, 1, 0, 1, conn.nonce_i, conn.nonce_a, kn_0, kn_1)
    """
    info = _KEY_INFO.pack(b"DLCP control", job_id, sender, receiver, sender_nonce, receiver_nonce) + nonce_i + nonce_a
    return hkdf_sha256(secret or b"", _KEY_SALT, info, KEY_BYTES)


def direction_key(secret: bytes | None, job_id: int, sender: int, receiver: int, sender_nonce: bytes,
                  receiver_nonce: bytes) -> bytes:
    """The 16-byte AES key of everything ``sender`` sends ``receiver`` on the data path, from the
    job secret and both sides' key nonces (see the module's docstring); never on the wire.
    Without a secret it comes from the nonces alone: it stops only blind forgery.

    Raises:
        ValueError: a nonce of the wrong size.

    Example::

        k = direction_key(secret, 1, 0, 1, kn_0, kn_1)   # rank 0 -> rank 1; both compute it
    """
    if len(sender_nonce) != NONCE_BYTES or len(receiver_nonce) != NONCE_BYTES:
        raise ValueError(f"key nonces have {NONCE_BYTES} bytes, got {len(sender_nonce)} and {len(receiver_nonce)}")
    info = _KEY_INFO.pack(b"DLCP data", job_id, sender, receiver, sender_nonce, receiver_nonce)
    return hkdf_sha256(secret or b"", _KEY_SALT, info, KEY_BYTES)


