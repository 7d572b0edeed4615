"""The ISA-L parity backend: Intel's erasure-code kernels (AVX-512/AVX2/SSE, chosen by ISA-L at run time) called
through ctypes. Needs the system library (Debian: `apt-get install libisal2`); without it this backend is
unavailable and the numpy one is used.

Everything is one call of `ec_encode_data`, which computes rows of GF(2^8) dot products over source chunks:
P is a row of ones, Q the row g^i (ISA-L's own `gf_gen_rs_matrix` parity rows, and md's), a rebuild the rows
of gf.raid6_recovery_rows, a read-modify-write the rows of P' = P ^ old ^ new and Q' = Q ^ g^i (old ^ new).
`ec_encode_data` takes any length and unaligned pointers (lengths under 32 bytes go to ISA-L's portable
code), unlike `pq_gen`, which wants 32-byte aligned buffers. ctypes lets go of the GIL during the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence
from functools import cache, lru_cache
from typing import Any

import numpy as np

from openvsan.pool.parity import Stripe
from openvsan.pool.parity.base import (
    Buffer,
    check_data,
    check_out,
    check_recover,
    check_update,
    encode_stripes,
    stripe_views,
    xor_host,
    xor_into,
    xor_update_into,
)
from openvsan.pool.parity.gf import gf_pow2, raid6_recovery_rows

_MAX_LEN = 2**31 - 1  # ISA-L takes the length as a C int


@cache
def _library() -> Any:
    """The loaded libisal, or ValueError saying why not."""
    name = ctypes.util.find_library("isal") or "libisal.so.2"
    try:
        lib = ctypes.CDLL(name)
        encode, init = lib.ec_encode_data, lib.ec_init_tables
    except (OSError, AttributeError) as e:
        raise ValueError(f"parity backend 'isal' is unavailable: {e} (Debian: apt-get install libisal2)") from None
    encode.restype = None
    init.restype = None
    for gen in (lib.xor_gen, lib.pq_gen):
        gen.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        gen.restype = ctypes.c_int
    return lib


def unavailable_reason() -> str | None:
    try:
        _library()
    except ValueError as e:
        return str(e)
    return None


@lru_cache(maxsize=256)
def _tables(rows: tuple[tuple[int, ...], ...]) -> ctypes.Array[ctypes.c_char]:
    """ISA-L's expanded multiply tables (32 bytes per coefficient) for a coefficient matrix, rows x sources."""
    k = len(rows[0])
    tables = (ctypes.c_char * (32 * k * len(rows)))()
    _library().ec_init_tables(k, len(rows), bytes(c for row in rows for c in row), tables)
    return tables


def _pointer(buf: Buffer, keep: list[object]) -> bytes | int:
    """What a c_char_p array slot takes for this buffer without copying it: bytes themselves, else an address
    (the object that owns the address goes into `keep` until the call returns)."""
    if type(buf) is bytes:
        return buf
    at = _address(buf, keep)
    if at is not None:
        return at
    np_view = np.frombuffer(memoryview(buf), dtype=np.uint8)   # read-only (or empty)
    keep.append(np_view)
    return int(np_view.ctypes.data)


# xor_gen and pq_gen want every pointer and the length aligned to its vector (32 bytes for AVX2; 64 taken, for AVX-512);
# a RAM member's memory at a block boundary is
ALIGN = 64


def _aligned(bufs: Sequence[Buffer], keep: list[object]) -> list[int] | None:
    """The addresses of writable buffers that all start on ALIGN, or None (one is read-only, empty or not
    aligned); each buffer is held in `keep` until the call returns."""
    out = []
    for b in bufs:
        at = _address(b, keep)
        if at is None or at % ALIGN:
            return None
        out.append(at)
    return out


def _address(buf: Buffer, keep: list[object]) -> int | None:
    """The address of a writable buffer's first byte, or None (read-only, or empty): a one-byte ctypes object
    over it (half the cost of an array type of the buffer's length), kept in `keep`, which holds the buffer
    until the call returns."""
    try:
        first = ctypes.c_char.from_buffer(buf)
    except (TypeError, ValueError):
        return None
    keep.append(first)
    return ctypes.addressof(first)


@cache
def _pointers(n: int) -> type[ctypes.Array[ctypes.c_char_p]]:
    return ctypes.c_char_p * n  # making the array type costs more than filling it


@cache
def _addresses(n: int) -> type[ctypes.Array[ctypes.c_void_p]]:
    return ctypes.c_void_p * n


class IsalParity:
    name = "isal"

    def __init__(self) -> None:
        self._lib = _library()
        self._encode = self._lib.ec_encode_data

    def _combine(self, sources: Sequence[Buffer], rows: tuple[tuple[int, ...], ...], length: int) -> list[bytes]:
        chunk = ctypes.c_char * length
        outs = [chunk() for _ in rows]
        self._combine_into(sources, rows, length, outs)
        return [o.raw for o in outs]

    def _combine_into(self, sources: Sequence[Buffer], rows: tuple[tuple[int, ...], ...], length: int,
                      outs: Sequence[Any]) -> None:
        """One ec_encode_data call: row i of the coefficients over `sources` into outs[i] (writable buffers)."""
        if length > _MAX_LEN:
            raise ValueError(f"chunks of {length} bytes: the isal backend takes at most {_MAX_LEN}")
        keep: list[object] = []
        pointers = [s if type(s) is bytes else _pointer(s, keep) for s in sources]
        src = _pointers(len(sources))(*pointers)  # type: ignore[misc]  # c_char_p slots take bytes or addresses
        dst = _addresses(len(rows))(*[ctypes.addressof(o) if isinstance(o, ctypes.Array)
                                      else _address(o, keep) or 0 for o in outs])
        self._encode(length, len(sources), len(rows), _tables(rows), src, dst)

    def encode_into(self, data: Sequence[Buffer], out: Sequence[Buffer]) -> None:
        if len(out) == 1:
            xor_into(data, out)   # numpy's XOR costs less than a call into ISA-L through ctypes
            return
        length = check_data(data, pq=True)
        check_out(out, length)
        if len(data) > 1 and not length % ALIGN and length <= _MAX_LEN:
            # chunks in members' memory, aligned: ISA-L's RAID 6 kernel, one call over one array of pointers
            # and no coefficient tables (a 4 KiB row of two data chunks: 10 us against 11.5)
            keep: list[object] = []
            at = _aligned([*data, *out], keep)
            if at is not None and self._lib.pq_gen(len(at), length, _addresses(len(at))(*at)) == 0:
                return
        self._combine_into(data, _pq_rows(len(data)), length, out)

    def encode_stripes_into(self, spans: Sequence[Buffer], stripes: Sequence[Stripe]) -> None:
        """Where every buffer is writable memory on ALIGN (members' memory), each buffer's address taken once
        and each stripe one call of ISA-L's RAID kernel, xor_gen (P) or pq_gen (P and Q), over addresses in
        them (a 1 MiB RAID 5 write: 197 us against 225-229 through encode_into per row, the glue around each
        call being most of a call's cost); elsewhere encode_into per stripe."""
        keep: list[object] = []
        at = _aligned(spans, keep)
        if at is None:
            encode_stripes(self.encode_into, spans, stripes)
            return
        within = min(memoryview(b).nbytes for b in spans)   # a stripe ending past it goes the checked way
        xor_gen, pq_gen = self._lib.xor_gen, self._lib.pq_gen
        for stripe in stripes:
            data, parity, start, length = stripe
            chunks = (*data, *parity)
            n = len(chunks)
            gen = pq_gen if len(parity) == 2 else xor_gen
            if (len(data) < 2 or len(parity) not in (1, 2) or start < 0 or start + length > within or not length
                    or start % ALIGN or length % ALIGN or length > _MAX_LEN
                    or gen(n, length, _addresses(n)(*[at[i] + start for i in chunks])) != 0):
                self.encode_into(*stripe_views(spans, stripe))

    def xor(self, data: Sequence[Buffer]) -> bytearray:
        return xor_host(data, check_data(data, pq=False))  # faster than ec_encode_data's GF multiply by one

    def pq(self, data: Sequence[Buffer]) -> tuple[bytes, bytes]:
        length = check_data(data, pq=True)
        p, q = self._combine(data, _pq_rows(len(data)), length)
        return p, q

    def recover(self, data: Sequence[Buffer | None], p: Buffer | None, q: Buffer | None) -> list[bytes]:
        missing, length = check_recover(data, p, q)
        out = [b"" if d is None else bytes(d) for d in data]
        if missing:
            members = [*data, p, q]
            sources, rows = raid6_recovery_rows(len(data), missing, p is not None, q is not None)
            chosen: list[Buffer] = []
            for s in sources:
                member = members[s]
                assert member is not None  # the rows name surviving members only
                chosen.append(member)
            rebuilt = self._combine(chosen, rows, length)
            for x, chunk in zip(missing, rebuilt, strict=True):
                out[x] = chunk
        return out

    def pq_update(
        self, index: int, old: Buffer, new: Buffer, p: Buffer, q: Buffer | None
    ) -> tuple[Buffer, Buffer | None]:
        length = check_update(index, old, new, p, q)
        if q is None:
            return xor_host([p, old, new], length), None
        g = gf_pow2(index)
        p2, q2 = self._combine([old, new, p, q], ((1, 1, 1, 0), (g, g, 0, 1)), length)
        return p2, q2

    def update_into(self, index: int, old: Buffer, new: Buffer, p: Buffer, q: Buffer | None) -> None:
        if q is None:
            xor_update_into(index, old, new, p)
            return
        length = check_update(index, old, new, p, q)
        g = gf_pow2(index)
        # P' and Q' made in buffers of their own, then copied over P and Q: ISA-L must not take an output as a
        # source too (its kernels end a length that is not a multiple of their vector by going over the last
        # vector again, reading what they stored)
        chunk = ctypes.c_char * length
        outs = [chunk(), chunk()]
        self._combine_into([old, new, p, q], ((1, 1, 1, 0), (g, g, 0, 1)), length, outs)
        memoryview(p).cast("B")[:] = memoryview(outs[0]).cast("B")
        memoryview(q).cast("B")[:] = memoryview(outs[1]).cast("B")


@cache
def _pq_rows(n: int) -> tuple[tuple[int, ...], ...]:
    return (1,) * n, tuple(gf_pow2(i) for i in range(n))
