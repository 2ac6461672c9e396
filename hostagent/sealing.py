"""Every datagram's trailer, from Python: the compiled sealer (``hostagent/native/seal.h``)
behind the control connections, tests, tools and the tests' numpy reference model.

A datagram on the data path is ``header | payload | pn | tag`` (:data:`dlcp.hostagent.wire.TRAILER_SIZE`):
the tag AEGISMAC-128X4's (AES-128-GCM's when the payload is encrypted) under a key derived, per
epoch of packet numbers, from its direction's (:func:`dlcp.hostagent.auth.direction_key`), with
a nonce made of the packet type and the sender's packet number. Why one compiled implementation
for the data path and all else: the rule of what a tag covers must be written once (issue 44,
item 7), and compiled code (:func:`mac_build`; AES-GCM intel-ipsec-mb's, else OpenSSL's:
:func:`library`) is what runs at line rate; Python only groups the rows and calls it.

Example::

    s = new_sealer(key, protection=1)
    wire_bytes = seal(s, header + payload)          # what a sender puts on the wire
    assert open_datagram(new_sealer(key, 1), wire_bytes) == header + payload
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dlcp.hostagent import wire

#: What a trailer does (``TransportConfig.protection``): nothing, a MAC, or encryption too.
NONE, MAC, ENCRYPT = 0, 1, 2
#: What opening a datagram found (:func:`open_rows`): not authentic, authentic, or authentic but
#: with a packet number its key took already (a replay; ``hostagent/native/seal.h``, ReplayWindow).
FORGED, OPENED, REPLAYED = 0, 1, 2

_PTYPE_AT = wire.FIELD_OFFSET["ptype"]


def _native() -> Any:
    try:
        from dlcp.hostagent import _datapath
    except ImportError as exc:  # pragma: no cover - the package is built by `make setup`
        raise ImportError("sealing datagrams needs the compiled module dlcp.hostagent._datapath (run `make setup`; "
                          "it needs libssl-dev)") from exc
    return _datapath


def new_sealer(key: bytes, protection: int, epoch_bits: int | None = None) -> Any:
    """A sealer for one direction's ``key`` (one thread at a time; its packet numbers count
    from 0, so a key's sealer must live as long as the key is used to send). Its AES keys are
    renewed every ``2**epoch_bits`` datagrams of a type (``hostagent/native/seal.h``; the default,
    22, is what the data paths use; tests make epochs short to cross several).

    Raises:
        ValueError: a key that is not 16 bytes, an unknown protection, epoch_bits not 1..62.
    """
    if protection not in (NONE, MAC, ENCRYPT):
        raise ValueError(f"protection is {NONE} (none), {MAC} (MAC) or {ENCRYPT} (encrypt), not {protection}")
    native = _native()
    return native.PacketSealer(key, protection, native.EPOCH_BITS if epoch_bits is None else epoch_bits)


def library() -> str:
    """The library that computes AES-GCM (encrypted datagrams) in this build: ``"intel-ipsec-mb
    1.3.0"`` where the build found it, else OpenSSL's version text (``hostagent/native/seal.h``)."""
    return str(_native().SEAL_LIBRARY)


def mac_build() -> str:
    """Which build of AEGISMAC-128X4 (the MAC of every datagram not encrypted) this CPU runs:
    ``"vaes512"``, ``"vaes256"``, ``"aesni"`` or ``"portable"`` (``hostagent/native/aegis_mac.h``)."""
    return str(_native().MAC_TARGET)


def epoch_key(key: bytes, ptype: int, epoch: int) -> bytes:
    """The AES key that seals epoch ``epoch`` of packet type ``ptype`` under a direction's ``key``
    (HKDF-SHA256 of it, info ``"dlcp epoch" | ptype | epoch``; ``hostagent/native/seal.h``)."""
    return _native().epoch_key(key, ptype, epoch)


def seal_rows(sealer: Any, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Seal datagram ``i`` (``rows[i, :lengths[i]]``) in place: its trailer written after it, its
    payload encrypted when the sealer encrypts. Returns the lengths on the wire.

    Raises:
        ValueError: a row without a header or without room for its trailer.
    """
    lengths = np.ascontiguousarray(lengths, np.int64)
    sealer.seal_rows(rows, lengths, wire.HEADER_SIZE, _PTYPE_AT)
    return lengths + wire.TRAILER_SIZE


def open_rows(sealer: Any, rows: np.ndarray, lengths: np.ndarray, which: np.ndarray) -> np.ndarray:
    """Check rows ``which`` of ``rows`` (each ``lengths[i]`` bytes, trailer included), in order,
    and, when the sealer encrypts, decrypt them in place. Returns per row of ``which`` what it
    found: :data:`FORGED`, :data:`OPENED` or :data:`REPLAYED` (uint8)."""
    which = np.ascontiguousarray(which, np.int64)
    found = np.zeros(len(which), np.uint8)
    sealer.open_rows(rows, np.ascontiguousarray(lengths, np.int64), which, wire.HEADER_SIZE, _PTYPE_AT, found)
    return found


def seal(sealer: Any, datagram: bytes) -> bytes:
    """One datagram (header and payload) as it goes on the wire, trailer included."""
    row = np.zeros((1, len(datagram) + wire.TRAILER_SIZE), np.uint8)
    row[0, : len(datagram)] = np.frombuffer(datagram, np.uint8)
    seal_rows(sealer, row, np.array([len(datagram)]))
    return row.tobytes()


def open_datagram(sealer: Any, datagram: bytes) -> bytes | None:
    """A datagram from the wire without its trailer (decrypted), or None if not authentic."""
    if len(datagram) < wire.HEADER_SIZE + wire.TRAILER_SIZE:
        return None
    row = np.frombuffer(datagram, np.uint8).copy().reshape(1, -1)
    if open_rows(sealer, row, np.array([len(datagram)]), np.array([0]))[0] != OPENED:
        return None
    return row[0, : len(datagram) - wire.TRAILER_SIZE].tobytes()
