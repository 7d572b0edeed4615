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

from openvsan.pool.parity.base import (
    Buffer,
    check_data,
    check_out,
    check_recover,
    check_update,
    xor_host,
    xor_into,
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
    view = memoryview(buf)
    if not view.readonly:
        arr = (ctypes.c_char * view.nbytes).from_buffer(view)
        keep.append(arr)
        return ctypes.addressof(arr)
    np_view = np.frombuffer(view, dtype=np.uint8)
    keep.append(np_view)
    return int(np_view.ctypes.data)


@cache
def _pointers(n: int) -> type[ctypes.Array[ctypes.c_char_p]]:
    return ctypes.c_char_p * n  # making the array type costs more than filling it


@cache
def _addresses(n: int) -> type[ctypes.Array[ctypes.c_void_p]]:
    return ctypes.c_void_p * n


class IsalParity:
    name = "isal"

    def __init__(self) -> None:
        self._encode = _library().ec_encode_data

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
        targets = [o if isinstance(o, ctypes.Array) else (ctypes.c_char * length).from_buffer(o) for o in outs]
        dst = _addresses(len(rows))(*[ctypes.addressof(t) for t in targets])
        self._encode(length, len(sources), len(rows), _tables(rows), src, dst)

    def encode_into(self, data: Sequence[Buffer], out: Sequence[Buffer]) -> None:
        if len(out) == 1:
            xor_into(data, out)
            return
        length = check_data(data, pq=True)
        check_out(out, length)
        self._combine_into(data, _pq_rows(len(data)), length, out)

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


@cache
def _pq_rows(n: int) -> tuple[tuple[int, ...], ...]:
    return (1,) * n, tuple(gf_pow2(i) for i in range(n))
