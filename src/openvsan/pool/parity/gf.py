"""GF(2^8) arithmetic for RAID 6, and the slow reference encoder the fast kernels are tested against.

The field is the one Linux md uses (H. Peter Anvin, "The mathematics of RAID-6"): polynomial
x^8 + x^4 + x^3 + x^2 + 1 (0x11d), generator g = 2, P = sum D_i and Q = sum g^i * D_i. ISA-L's
`gf_gen_rs_matrix` rows for two parity chunks are the same P and Q, so members are interchangeable with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

POLY = 0x11D
GENERATOR = 2

Buffer = bytes | bytearray | memoryview


def _tables() -> tuple[tuple[int, ...], tuple[int, ...]]:
    exp = [0] * 510  # doubled, so exp[log a + log b] needs no modulo
    log = [0] * 256
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= POLY
    for i in range(255, 510):
        exp[i] = exp[i - 255]
    return tuple(exp), tuple(log)


EXP, LOG = _tables()  # EXP[i] = g^i; LOG[a] for a != 0 (LOG[0] is meaningless)


def gf_mul(a: int, b: int) -> int:
    if a == 0 or b == 0:
        return 0
    return EXP[LOG[a] + LOG[b]]


def gf_inv(a: int) -> int:
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return EXP[255 - LOG[a]]


def gf_div(a: int, b: int) -> int:
    return gf_mul(a, gf_inv(b))


def gf_pow2(i: int) -> int:
    """g^i for any integer i (negative too: g^-i = inverse of g^i); the Q coefficient of data chunk i."""
    return EXP[i % 255]


@cache
def mul_table(c: int) -> bytes:
    """The 256 products c * x, x = 0..255: one constant's lookup table for `np.take`-style kernels."""
    return bytes(gf_mul(c, x) for x in range(256))


def raid6_two_data_coefficients(x: int, y: int) -> tuple[int, int]:
    """(A, B) such that D_x = A * (P ^ Pxy) ^ B * (Q ^ Qxy), where Pxy and Qxy are P and Q computed with D_x and
    D_y taken as zero (x < y); then D_y = (P ^ Pxy) ^ D_x. Anvin, "The mathematics of RAID-6", §4."""
    gyx = gf_pow2(y - x)
    denom = gf_inv(gyx ^ 1)
    return gf_mul(gyx, denom), gf_mul(gf_pow2(-x), denom)


def reference_xor(data: Sequence[Buffer]) -> bytes:
    """P, byte by byte: slow and obviously right."""
    out = bytearray(len(data[0]))
    for chunk in data:
        for j, b in enumerate(bytes(chunk)):
            out[j] ^= b
    return bytes(out)


def reference_pq(data: Sequence[Buffer]) -> tuple[bytes, bytes]:
    """(P, Q) straight from the definition, Q = sum g^i * D_i, with no table tricks beyond gf_mul: the oracle for
    the fast kernels. Slow: meant for a few hundred bytes."""
    if not data:
        raise ValueError("no data chunks")
    length = len(data[0])
    p = bytearray(length)
    q = bytearray(length)
    for i, chunk in enumerate(data):
        raw = bytes(chunk)
        if len(raw) != length:
            raise ValueError(f"chunk {i} is {len(raw)} bytes, chunk 0 is {length}")
        coef = gf_pow2(i)
        for j, b in enumerate(raw):
            p[j] ^= b
            q[j] ^= gf_mul(coef, b)
    return bytes(p), bytes(q)


def raid6_recovery_rows(
    n: int, missing: Sequence[int], have_p: bool, have_q: bool
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Lost data chunks as linear combinations of the surviving members, for kernels that compute
    out_j = sum_s rows[j][s] * member[sources[s]] in one pass (ISA-L's ec_encode_data).

    Members are numbered data 0..n-1, then P = n, Q = n + 1. Returns (sources, rows), row j rebuilding
    missing[j]. One data chunk lost: from P when present (all ones), else D_x = g^-x * (Q ^ sum g^i D_i). Two:
    the expansion of D_x = A (P ^ Pxy) ^ B (Q ^ Qxy) and D_y = P ^ Pxy ^ D_x over the members."""
    lost = sorted(missing)
    if not 1 <= len(lost) <= 2 or len(lost) + (not have_p) + (not have_q) > 2:
        raise ValueError(
            f"cannot rebuild data {lost} with P {'present' if have_p else 'lost'}, Q {'present' if have_q else 'lost'}"
        )
    present = tuple(i for i in range(n) if i not in lost)
    if len(lost) == 1 and have_p:
        return (*present, n), ((1,) * (len(present) + 1),)
    if len(lost) == 1:
        c = gf_pow2(-lost[0])
        return (*present, n + 1), ((*(gf_mul(c, gf_pow2(i)) for i in present), c),)
    a, b = raid6_two_data_coefficients(*lost)
    row_x = (*(a ^ gf_mul(b, gf_pow2(i)) for i in present), a, b)
    row_y = (*(1 ^ a ^ gf_mul(b, gf_pow2(i)) for i in present), 1 ^ a, b)
    return (*present, n, n + 1), (row_x, row_y)
