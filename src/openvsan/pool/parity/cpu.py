"""The numpy parity backend: whole-chunk numpy ufuncs, no per-byte Python.

Q uses Horner's rule, Q = ((D_{n-1} * g ^ D_{n-2}) * g ^ ...) * g ^ D_0, so the only multiply on the encode path
is by g = 2, done on uint8 lanes in four SIMD passes: t = (q < 0 as int8) (the bit that falls off), t *= 0x1d
(the reduction by 0x11d), q += q (a shift that drops the carry, per byte), q ^= t. That measured faster than
the same trick on uint64 lanes (six passes with masks) and far faster than a table lookup (np.take runs at
about 0.6 GB/s). Chunks are walked in tiles so the accumulators stay in L2 cache for 1 MiB chunks.

Multiplying by any other constant (recovery, RAID 6 read-modify-write) is a table lookup two bytes at a time
(np.take on a 65536-entry uint16 table, about 1 GB/s), or a few doublings when the constant is a small power
of g.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import cache, lru_cache

import numpy as np
import numpy.typing as npt

from openvsan.pool.parity.base import (
    Array,
    ArrayParity,
    Buffer,
    check_data,
    check_update,
    xor_host,
    xor_into,
    xor_update_into,
)
from openvsan.pool.parity.gf import LOG, mul_table

U8 = npt.NDArray[np.uint8]

# Bytes of each chunk handled per pass. Per-ufunc-call overhead (about 1 µs) favours large tiles; cache favours
# small ones: P, Q and a scratch tile plus one tile of each chunk should fit in L2 (2 MiB a core here). An
# interleaved sweep of 16 KiB..1 MiB tiles over 4 and 8 chunks of 64 KiB..1 MiB: 16 and 32 KiB were 10-40 %
# slower, 64 KiB and up within the noise of one another.
TILE = 128 * 1024

# Up to this many doublings beat one table lookup (four passes of ~15 GB/s each against ~1 GB/s).
MAX_DOUBLINGS = 4


@cache
def _table(c: int) -> U8:
    return np.frombuffer(mul_table(c), dtype=np.uint8)


@lru_cache(maxsize=32)  # 128 KiB each; a pool's recoveries use a few constants over and over
def _table16(c: int) -> npt.NDArray[np.uint16]:
    """c times each byte of a 16-bit word, for lookups two bytes at a time (about twice the bytes per second of
    the 8-bit table): entry (hi << 8 | lo) = c*hi << 8 | c*lo, the same on either byte order."""
    t8 = _table(c).astype(np.uint16)
    table: npt.NDArray[np.uint16] = np.bitwise_or.outer(t8 << 8, t8).ravel()
    return table


def _mul_table(c: int, arr: U8) -> U8:
    out = np.empty_like(arr)
    even = len(arr) & ~1
    if even:
        np.take(_table16(c), arr[:even].view(np.uint16), out=out[:even].view(np.uint16))
    if even != len(arr):
        out[-1] = _table(c)[arr[-1]]
    return out


# Operands as 0-d arrays and `out` given by position: numpy converts a Python int scalar and parses keywords on
# every call, about 0.6 µs each, which is most of a 4 KiB pass.
_ZERO = np.zeros((), dtype=np.int8)
_REDUCE = np.array(0x1D, dtype=np.uint8)  # x^8 = x^4 + x^3 + x^2 + 1 (0x11d without its x^8)


class _Scratch:
    """P, Q and scratch arrays with the int8/bool views the doubling needs. Kept per thread and reused: fresh
    arrays of 256 KiB and more come from mmap, and their page faults cost up to a third of a 4 x 256 KiB
    encode (an interleaved A/B)."""

    __slots__ = ("length", "p", "q", "qi", "t", "tb")

    def __init__(self, length: int, scratch: int) -> None:
        self.length = length
        self.p = np.empty(length, dtype=np.uint8)
        self.q = np.empty(length, dtype=np.uint8)
        self.qi = self.q.view(np.int8)
        self.t = np.empty(scratch, dtype=np.uint8)
        self.tb = self.t.view(np.bool_)


def _mul2(src: U8, srci: npt.NDArray[np.int8], dst: U8, t: U8, tb: npt.NDArray[np.bool_]) -> None:
    """dst = src * g, srci being src viewed as int8 (its sign is the bit that falls off); t and tb are scratch of
    the same length as uint8 and bool. dst may be src."""
    np.less(srci, _ZERO, tb)
    np.multiply(t, _REDUCE, t)
    np.add(src, src, dst)
    np.bitwise_xor(dst, t, dst)


def _pq_tile(ds: Sequence[U8 | None], p: U8, q: U8, qi: npt.NDArray[np.int8], t: U8, tb: npt.NDArray[np.bool_]) -> None:
    """P and Q of one tile into p and q (Horner from the top chunk; a None chunk is zeros); qi views q as int8,
    t/tb are scratch."""
    top = len(ds) - 1
    while top >= 0 and ds[top] is None:
        top -= 1  # leading zero chunks: Q stays zero through their doublings
    if top < 0:
        p.fill(0)
        q.fill(0)
        return
    d = ds[top]
    assert d is not None
    if top == 0:
        np.copyto(p, d)
        np.copyto(q, d)
        return
    nxt = ds[top - 1]
    _mul2(d, d.view(np.int8), q, t, tb)  # the first step reads D_top directly: no copy into q first
    if nxt is None:
        np.copyto(p, d)
    else:
        np.bitwise_xor(d, nxt, p)
        np.bitwise_xor(q, nxt, q)
    for i in range(top - 2, -1, -1):
        _mul2(q, qi, q, t, tb)
        d = ds[i]
        if d is not None:
            np.bitwise_xor(p, d, p)
            np.bitwise_xor(q, d, q)


class NumpyParity(ArrayParity):
    name = "numpy"

    def __init__(self, tile: int = TILE) -> None:
        self.tile = tile
        self._local = threading.local()

    def _scratch(self, length: int) -> _Scratch:
        s: _Scratch | None = getattr(self._local, "scratch", None)
        if s is None or s.length != length:
            s = self._local.scratch = _Scratch(length, min(self.tile, length))
        return s

    def _load(self, buf: Buffer) -> Array:
        return np.frombuffer(buf, dtype=np.uint8)

    def xor(self, data: Sequence[Buffer]) -> bytearray:
        return xor_host(data, check_data(data, pq=False))

    def encode_into(self, data: Sequence[Buffer], out: Sequence[Buffer]) -> None:
        if len(out) == 1:
            xor_into(data, out)   # no tiles for a plain XOR: straight into `out`
        else:
            super().encode_into(data, out)

    def pq_update(
        self, index: int, old: Buffer, new: Buffer, p: Buffer, q: Buffer | None
    ) -> tuple[Buffer, Buffer | None]:
        if q is None:
            return xor_host([p, old, new], check_update(index, old, new, p, q)), None
        return super().pq_update(index, old, new, p, q)

    def update_into(self, index: int, old: Buffer, new: Buffer, p: Buffer, q: Buffer | None) -> None:
        if q is None:
            xor_update_into(index, old, new, p)
        else:
            super().update_into(index, old, new, p, q)

    def _store(self, arr: Array) -> bytes:
        return bytes(arr.tobytes())

    def _xor(self, arrs: Sequence[Array]) -> Array:
        if len(arrs) == 1:
            return arrs[0].copy()
        length = len(arrs[0])
        out = np.empty(length, dtype=np.uint8)
        for start in range(0, length, self.tile):
            stop = min(start + self.tile, length)
            o = out[start:stop]
            np.bitwise_xor(arrs[0][start:stop], arrs[1][start:stop], o)
            for a in arrs[2:]:
                np.bitwise_xor(o, a[start:stop], o)
        return out

    def _pq(self, arrs: Sequence[Array | None], length: int) -> tuple[Array, Array]:
        # P and Q are this thread's scratch, valid until its next _pq: ArrayParity stores or consumes them first
        tile = self.tile
        s = self._scratch(length)
        if length <= tile:
            _pq_tile(arrs, s.p, s.q, s.qi, s.t, s.tb)
            return s.p, s.q
        for start in range(0, length, tile):
            stop = min(start + tile, length)
            n = stop - start
            _pq_tile(
                [None if a is None else a[start:stop] for a in arrs],
                s.p[start:stop], s.q[start:stop], s.qi[start:stop], s.t[:n], s.tb[:n],
            )  # fmt: skip
        return s.p, s.q

    def _mul(self, c: int, arr: Array) -> Array:
        if c == 0:
            return np.zeros_like(arr)
        if c == 1:
            return arr.copy()
        k = LOG[c]
        if k <= MAX_DOUBLINGS:
            out = np.empty_like(arr)
            t = np.empty_like(arr)
            tb = t.view(np.bool_)
            _mul2(arr, arr.view(np.int8), out, t, tb)
            outi = out.view(np.int8)
            for _ in range(k - 1):
                _mul2(out, outi, out, t, tb)
            return out
        return _mul_table(c, arr)

    def _ixor(self, acc: Array, arr: Array) -> None:
        np.bitwise_xor(acc, arr, acc)
