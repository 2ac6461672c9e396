"""The handshake's pure parts: HKDF against RFC 5869, direction keys, proofs that bind the key nonce."""

from __future__ import annotations

import pytest

from dlcp.hostagent import auth
from dlcp.hostagent.transport_config import TransportConfig, local_peers

SECRET = bytes(range(32))
KN0, KN1 = b"\x10" * 16, b"\x21" * 16


def test_hkdf_sha256_gives_rfc_5869s_test_vectors():
    # RFC 5869, appendix A.1 (basic) and A.3 (no salt, no info)
    okm = auth.hkdf_sha256(bytes([0x0B] * 22), bytes(range(13)), bytes(range(0xF0, 0xFA)), 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")
    okm = auth.hkdf_sha256(bytes([0x0B] * 22), b"", b"", 42)
    assert okm.hex() == ("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"
                         "9d201395faa4b61a96c8")
    with pytest.raises(ValueError, match="HKDF"):
        auth.hkdf_sha256(b"k", b"", b"", 0)


def test_each_direction_has_its_own_key_and_both_ends_derive_it():
    k01 = auth.direction_key(SECRET, 1, 0, 1, KN0, KN1)
    k10 = auth.direction_key(SECRET, 1, 1, 0, KN1, KN0)
    assert len(k01) == len(k10) == auth.KEY_BYTES and k01 != k10
    assert auth.direction_key(SECRET, 1, 0, 1, KN0, KN1) == k01  # the receiver computes the same
    # every input changes it: the secret, the job, the ranks, either side's nonce
    others = [auth.direction_key(SECRET[::-1], 1, 0, 1, KN0, KN1), auth.direction_key(SECRET, 2, 0, 1, KN0, KN1),
              auth.direction_key(SECRET, 1, 0, 2, KN0, KN1), auth.direction_key(SECRET, 1, 0, 1, KN1, KN1),
              auth.direction_key(SECRET, 1, 0, 1, KN0, KN0), auth.direction_key(None, 1, 0, 1, KN0, KN1)]
    assert len({k01, *others}) == len(others) + 1
    with pytest.raises(ValueError, match="nonce"):
        auth.direction_key(SECRET, 1, 0, 1, KN0[:8], KN1)


def test_a_proof_binds_the_key_nonce_sent_with_it():
    """Nobody without the secret can put another key nonce beside a proof (the keys would
    then be derived from a nonce of their choosing)."""
    nonces = (b"a" * 16, b"b" * 16)
    p = auth.proof(SECRET, "initiate", 1, 0, 1, *nonces, KN0)
    assert auth.proof_ok(SECRET, p, "initiate", 1, 0, 1, *nonces, KN0)
    assert not auth.proof_ok(SECRET, p, "initiate", 1, 0, 1, *nonces, KN1)
    assert not auth.proof_ok(SECRET, p, "accept", 1, 0, 1, *nonces, KN0)


def test_encryption_needs_the_tag():
    peers = local_peers(2, 41000)
    assert TransportConfig(rank=0, peers=peers).protection == 1
    assert TransportConfig(rank=0, peers=peers, encrypt=True).protection == 2
    assert TransportConfig(rank=0, peers=peers, authenticate=False).protection == 0
    with pytest.raises(ValueError, match="encrypt=True needs authenticate=True"):
        TransportConfig(rank=0, peers=peers, encrypt=True, authenticate=False)
