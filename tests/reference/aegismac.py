"""AEGISMAC-128X4 in plain Python, from the text of draft-irtf-cfrg-aegis-aead-18 (sections
"AEGIS-128X" and "AEGISMAC-128X"): the independent second reading the compiled MAC
(``hostagent/native/aegis_mac.h``) is compared with. Slow (an AES round per 16 bytes in Python);
for tests only.

A state is 8 rows of 4 lanes, each an AES block of 16 bytes (column-major, as AES defines it).
"""

from __future__ import annotations

LANES = 4
HALF = 16 * LANES  # bytes of M0 (or M1)
RATE = 2 * HALF  # bytes absorbed per update

C0 = bytes.fromhex("000101020305080d1522375990e97962")
C1 = bytes.fromhex("db3d18556dc22ff12011314273b528dd")


def _xtime(a: int) -> int:
    return ((a << 1) ^ (0x1B if a & 0x80 else 0)) & 0xFF


def _gmul(a: int, b: int) -> int:
    p = 0
    while b:
        if b & 1:
            p ^= a
        a, b = _xtime(a), b >> 1
    return p


def _sbox() -> list[int]:
    box = []
    for v in range(256):
        inv = 0
        if v:  # v ** 254 in GF(2^8)
            inv, base, e = 1, v, 254
            while e:
                if e & 1:
                    inv = _gmul(inv, base)
                base, e = _gmul(base, base), e >> 1
        rot = lambda x, n: ((x << n) | (x >> (8 - n))) & 0xFF  # noqa: E731
        box.append(inv ^ rot(inv, 1) ^ rot(inv, 2) ^ rot(inv, 3) ^ rot(inv, 4) ^ 0x63)
    return box


SBOX = _sbox()


def aes_round(block: bytes, rk: bytes) -> bytes:
    """AESRound(in, rk): SubBytes, ShiftRows, MixColumns, AddRoundKey (FIPS-197 section 5.1)."""
    t = [SBOX[block[r + 4 * ((c + r) % 4)]] for c in range(4) for r in range(4)]
    out = bytearray(16)
    for c in range(4):
        a = t[4 * c:4 * c + 4]
        for r in range(4):
            out[4 * c + r] = _gmul(a[r], 2) ^ _gmul(a[(r + 1) % 4], 3) ^ a[(r + 2) % 4] ^ a[(r + 3) % 4] ^ rk[4 * c + r]
    return bytes(out)


def _x(a: bytes, b: bytes) -> bytes:
    return bytes(p ^ q for p, q in zip(a, b))


def _lanes(m: bytes) -> list[bytes]:
    return [m[16 * i:16 * i + 16] for i in range(LANES)]


class _State:
    def __init__(self, key: bytes, nonce: bytes) -> None:
        kn = _x(key, nonce)
        row = [kn, C1, C0, C1, kn, _x(key, C0), _x(key, C1), _x(key, C0)]
        self.v = [[b for _ in range(LANES)] for b in row]  # v[j][i]: block j of lane i
        ctx = [bytes([i, LANES - 1]) + bytes(14) for i in range(LANES)]
        for _ in range(10):
            for i in range(LANES):
                self.v[3][i] = _x(self.v[3][i], ctx[i])
                self.v[7][i] = _x(self.v[7][i], ctx[i])
            self.update(nonce * LANES, key * LANES)

    def update(self, m0: bytes, m1: bytes) -> None:
        v, a, b = self.v, _lanes(m0), _lanes(m1)
        new = [[b""] * LANES for _ in range(8)]
        for i in range(LANES):
            new[0][i] = aes_round(v[7][i], _x(v[0][i], a[i]))
            new[4][i] = aes_round(v[3][i], _x(v[4][i], b[i]))
            for j in (1, 2, 3, 5, 6, 7):
                new[j][i] = aes_round(v[j - 1][i], v[j][i])
        self.v = new

    def fold7(self, lane: int) -> bytes:
        out = bytes(16)
        for j in range(7):
            out = _x(out, self.v[j][lane])
        return out


def aegismac_128x4(key: bytes, nonce: bytes, data: bytes) -> bytes:
    """The 128-bit tag of ``data`` (Mac and FinalizeMac of AEGISMAC-128X, D = 4)."""
    st = _State(key, nonce)
    padded = data + bytes(-len(data) % RATE)
    for k in range(0, len(padded), RATE):
        st.update(padded[k:k + HALF], padded[k + HALF:k + RATE])
    u = (8 * len(data)).to_bytes(8, "little") + (128).to_bytes(8, "little")
    t = b"".join(_x(st.v[2][i], u) for i in range(LANES))
    for _ in range(7):
        st.update(t, t)
    tags = b"".join(st.fold7(i) for i in range(LANES))
    for k in range(0, len(tags), 32):
        st.update(tags[k:k + 16] + bytes(HALF - 16), tags[k + 16:k + 32] + bytes(HALF - 16))
    e = _x(st.v[2][0], LANES.to_bytes(8, "little") + (128).to_bytes(8, "little")) + bytes(HALF - 16)
    for _ in range(7):
        st.update(e, e)
    return st.fold7(0)
