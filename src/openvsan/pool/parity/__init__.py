"""RAID 5/6 parity kernels: XOR (P) and GF(2^8) Reed-Solomon P+Q encode, recovery of up to two lost chunks, and
the read-modify-write update of P and Q.

    from openvsan.pool.parity import backend
    par = backend()                     # CuPy when a CUDA GPU is there, else the fastest CPU backend
    p, q = par.pq([d0, d1, d2, d3])
    d0, d1, d2, d3 = par.recover([None, d1, None, d3], p, q)

Conventions are Linux md's (see gf.py): Q = sum g^i * D_i, g = 2, polynomial 0x11d. Every backend takes
bytes, bytearray or memoryview chunks of any (equal) length and returns bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Protocol, runtime_checkable

from openvsan.pool.parity.gf import gf_inv, gf_mul, gf_pow2, reference_pq, reference_xor

Buffer = bytes | bytearray | memoryview
# (indices of the data chunks' buffers, indices of the parity chunks' buffers, byte offset, length in bytes)
Stripe = tuple[Sequence[int], Sequence[int], int, int]

__all__ = [
    "Buffer",
    "Parity",
    "Stripe",
    "available",
    "backend",
    "gf_inv",
    "gf_mul",
    "gf_pow2",
    "reference_pq",
    "reference_xor",
]


@runtime_checkable
class Parity(Protocol):
    name: str

    def xor(self, data: Sequence[Buffer]) -> Buffer:
        """RAID 5 P = D0 ^ D1 ^ ... (all chunks of equal length)."""
        ...

    def pq(self, data: Sequence[Buffer]) -> tuple[bytes, bytes]:
        """RAID 6 (P, Q), Q = sum g^i * D_i."""
        ...

    def encode_into(self, data: Sequence[Buffer], out: Sequence[Buffer]) -> None:
        """What xor() (one output) or pq() (two: P, Q) returns, written into `out`: writable buffers of the
        chunks' length, such as a RAM member's own memory, so the parity is not made elsewhere and copied."""
        ...

    def encode_stripes_into(self, spans: Sequence[Buffer], stripes: Sequence[Stripe]) -> None:
        """encode_into for several stripes whose chunks lie in a few writable buffers (each member's memory over
        the rows a request spans): stripe (data, parity, start, length) is encode_into of spans[i][start:start +
        length] for i in data into the same range of spans[j] for j in parity. One call for a request's rows,
        so a backend that calls into C takes each buffer's address once. ValueError for a stripe outside its
        buffers."""
        ...

    def recover(self, data: Sequence[Buffer | None], p: Buffer | None, q: Buffer | None) -> list[bytes]:
        """All data chunks: the given ones unchanged, the missing (None) ones rebuilt. At most two of data chunks,
        P and Q may be missing (ValueError otherwise). One data chunk lost: from P when present, else from Q;
        two: from P and Q."""
        ...

    def pq_update(
        self, index: int, old: Buffer, new: Buffer, p: Buffer, q: Buffer | None
    ) -> tuple[Buffer, Buffer | None]:
        """Read-modify-write of data chunk `index`: P' = P ^ old ^ new, Q' = Q ^ g^index * (old ^ new); Q None
        gives None (RAID 5)."""
        ...

    def update_into(self, index: int, old: Buffer, new: Buffer, p: Buffer, q: Buffer | None) -> None:
        """pq_update's P' and Q' written over P and Q themselves (writable buffers: a RAM member's own memory),
        so a small write's parity is updated where it lies; `old` and `new` overlap neither."""
        ...


def _numpy() -> Parity:
    from openvsan.pool.parity.cpu import NumpyParity

    return NumpyParity()


def _isal() -> Parity:
    from openvsan.pool.parity import isal

    why = isal.unavailable_reason()
    if why:
        raise ValueError(why)
    return isal.IsalParity()


def _cupy() -> Parity:
    from openvsan.pool.parity import gpu

    why = gpu.unavailable_reason()
    if why:
        raise ValueError(f"parity backend 'cupy' is unavailable: {why}")
    return gpu.CupyParity()


# CPU backends, fastest first (bench/parity_bench.py).
_CPU: dict[str, Callable[[], Parity]] = {"isal": _isal, "numpy": _numpy}
_ALL: dict[str, Callable[[], Parity]] = {**_CPU, "cupy": _cupy}


def available() -> dict[str, str | None]:
    """Every backend name with None when it can be used here, else the reason it cannot."""
    out: dict[str, str | None] = {}
    for name in _ALL:
        try:
            backend(name)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def backend(name: str | None = None) -> Parity:
    """name: "isal" | "numpy" | "cupy" | "auto" (or None). Auto is CuPy when a CUDA GPU is present and cupy
    imports, else the fastest CPU backend: ISA-L where the library is installed, else numpy. ValueError for an
    unknown or unavailable name, saying why. One object per backend, shared by all threads."""
    return _backend(name or "auto")


@cache
def _backend(name: str) -> Parity:
    if name == "auto":
        try:
            return _cupy()
        except ValueError:
            pass
        errors = []
        for make in _CPU.values():
            try:
                return make()
            except ValueError as e:
                errors.append(str(e))
        raise ValueError("no parity backend is usable: " + "; ".join(errors))
    if name not in _ALL:
        raise ValueError(f"unknown parity backend {name!r}: choose one of auto, {', '.join(_ALL)}")
    return _ALL[name]()
