"""The RAID 5/6 algebra, written once over a few array primitives that each backend (numpy, CuPy) supplies.

Argument checks, the choice of how to rebuild lost chunks, and the coefficients live here, so a backend only
has to be fast at: XOR of chunks, P/Q of chunks (a missing one counted as zeros), and multiplying a chunk by a
GF(2^8) constant. Recovery follows Anvin, "The mathematics of RAID-6" (what Linux md does): rebuild from the
syndromes P ^ Pxy and Q ^ Qxy, where Pxy/Qxy are P/Q over the surviving data.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from openvsan.pool.parity import Stripe
from openvsan.pool.parity.gf import gf_pow2, raid6_two_data_coefficients

Buffer = bytes | bytearray | memoryview
Array = Any  # a 1-D uint8 array of the backend's array module (numpy.ndarray, cupy.ndarray)

# Q = sum g^i * D_i has 255 distinct coefficients; with more data chunks two of them would share one and a
# two-chunk loss could not be solved (md has the same limit).
MAX_PQ_DATA = 255


def buffer_length(buf: Buffer) -> int:
    # len() of a memoryview counts items, not bytes; bytes themselves skip the view (a 4 KiB stripe notices)
    return len(buf) if type(buf) is bytes else memoryview(buf).nbytes


def check_data(data: Sequence[Buffer], *, pq: bool) -> int:
    """The common chunk length of an encode's data, or ValueError."""
    if not data:
        raise ValueError("no data chunks")
    if pq and len(data) > MAX_PQ_DATA:
        raise ValueError(f"{len(data)} data chunks: RAID 6 P+Q supports at most {MAX_PQ_DATA}")
    lengths = [buffer_length(d) for d in data]
    if any(x != lengths[0] for x in lengths):
        raise ValueError(f"data chunks differ in length: {sorted(set(lengths))}")
    return lengths[0]


def check_recover(data: Sequence[Buffer | None], p: Buffer | None, q: Buffer | None) -> tuple[list[int], int]:
    """(indices of the missing data chunks, chunk length), or ValueError when the loss is beyond P+Q."""
    n = len(data)
    if n == 0:
        raise ValueError("recover needs at least one data chunk slot")
    if n > MAX_PQ_DATA:
        raise ValueError(f"{n} data chunks: RAID 6 P+Q supports at most {MAX_PQ_DATA}")
    missing = [i for i, d in enumerate(data) if d is None]
    lost = len(missing) + (p is None) + (q is None)
    if lost > 2:
        raise ValueError(
            f"{lost} chunks lost ({len(missing)} data{', P' if p is None else ''}{', Q' if q is None else ''}):"
            " P+Q can rebuild at most two"
        )
    lengths = [buffer_length(b) for b in (*data, p, q) if b is not None]
    if any(x != lengths[0] for x in lengths):
        raise ValueError(f"chunks differ in length: {sorted(set(lengths))}")
    return missing, lengths[0]


def check_update(index: int, old: Buffer, new: Buffer, p: Buffer, q: Buffer | None) -> int:
    """The chunk length of a read-modify-write, or ValueError."""
    if not 0 <= index < MAX_PQ_DATA:
        raise ValueError(f"data index {index} outside 0..{MAX_PQ_DATA - 1}")
    n = buffer_length(p)
    if buffer_length(old) != n or buffer_length(new) != n or (q is not None and buffer_length(q) != n):
        lengths = {buffer_length(b) for b in (old, new, p, q) if b is not None}
        raise ValueError(f"chunks differ in length: {sorted(lengths)}")
    return n


def xor_host(data: Sequence[Buffer], length: int) -> bytearray:
    """D0 ^ D1 ^ ... of chunks in host memory, XORed by numpy eight bytes a lane where the length allows (into a
    new buffer: xor_host_into). Both CPU backends take RAID 5's XOR (P, a read-modify-write without Q) from
    here: for 3 x 64 KiB it costs 6 us against 15 us through ISA-L's `ec_encode_data` (a GF multiply by one,
    behind ctypes' setup) or the numpy backend's tiles, and 3 us against 8 us at 4 KiB."""
    out = bytearray(length)
    xor_host_into(data, out, length)
    return out


def xor_host_into(data: Sequence[Buffer], out: Buffer, length: int) -> None:
    """xor_host's XOR, written into `out` (writable, `length` bytes: a RAM member's own memory)."""
    dtype = np.uint64 if length % 8 == 0 else np.uint8
    acc = np.frombuffer(out, dtype)
    if len(data) == 1:
        acc[:] = np.frombuffer(data[0], dtype)
        return
    # out may be data[0] itself (an update in place: P ^= old ^ new)
    np.bitwise_xor(acc if data[0] is out else np.frombuffer(data[0], dtype), np.frombuffer(data[1], dtype), acc)
    for d in data[2:]:
        np.bitwise_xor(acc, np.frombuffer(d, dtype), acc)


def xor_update_into(index: int, old: Buffer, new: Buffer, p: Buffer) -> None:
    """RAID 5's update_into on the host (both CPU backends): P ^= old ^ new, in P's own memory."""
    xor_host_into([p, old, new], p, check_update(index, old, new, p, None))


def xor_into(data: Sequence[Buffer], out: Sequence[Buffer]) -> None:
    """encode_into for RAID 5 on the host (both CPU backends): P into out[0]."""
    length = check_data(data, pq=False)
    check_out(out, length)
    xor_host_into(data, out[0], length)


def stripe_views(spans: Sequence[Buffer], stripe: Stripe
                 ) -> tuple[list[memoryview], list[memoryview]]:
    """A stripe's data and parity chunks as views of the buffers they lie in (encode_stripes_into), or
    ValueError when it reaches outside them."""
    data, parity, start, length = stripe
    views = []
    for i in (*data, *parity):
        view = memoryview(spans[i]).cast("B")
        if start < 0 or start + length > view.nbytes:
            raise ValueError(f"stripe [{start}, {start + length}) outside a buffer of {view.nbytes} bytes")
        views.append(view[start:start + length])
    return views[:len(data)], views[len(data):]


def encode_stripes(encode_into: Callable[[Sequence[Buffer], Sequence[Buffer]], None], spans: Sequence[Buffer],
                   stripes: Sequence[Stripe]) -> None:
    """encode_stripes_into as one encode_into per stripe."""
    for stripe in stripes:
        encode_into(*stripe_views(spans, stripe))


def check_out(out: Sequence[Buffer], length: int) -> None:
    """encode_into's outputs: P, or P and Q, writable buffers of the chunks' length, or ValueError."""
    if len(out) not in (1, 2):
        raise ValueError(f"{len(out)} output chunks: 1 (P) or 2 (P and Q)")
    for o in out:
        view = memoryview(o)
        if view.readonly or view.nbytes != length:
            raise ValueError(f"an output chunk of {view.nbytes} bytes{' (read-only)' if view.readonly else ''}, "
                             f"not {length} writable bytes")


class ArrayParity(ABC):
    """Parity (see openvsan.pool.parity) over an array module; subclasses give the primitives."""

    name: str

    # -- primitives ---------------------------------------------------------------------------------------------

    @abstractmethod
    def _load(self, buf: Buffer) -> Array:
        """A uint8 view (or device copy) of a buffer; read only."""

    @abstractmethod
    def _store(self, arr: Array) -> bytes: ...

    @abstractmethod
    def _xor(self, arrs: Sequence[Array]) -> Array:
        """A new array, the XOR of one or more equal-length arrays."""

    @abstractmethod
    def _pq(self, arrs: Sequence[Array | None], length: int) -> tuple[Array, Array]:
        """(P, Q) arrays of `length` bytes; a None chunk counts as zeros (it still has its index i). They may be
        scratch that the next _pq call on the same thread overwrites: the algebra below is done with them
        (stored, or folded into arrays of its own) before it calls _pq again."""

    @abstractmethod
    def _mul(self, c: int, arr: Array) -> Array:
        """A new array c * arr in GF(2^8)."""

    @abstractmethod
    def _ixor(self, acc: Array, arr: Array) -> None:
        """acc ^= arr, in place (acc is an array this backend made)."""

    # -- the Parity protocol --------------------------------------------------------------------------------------

    def xor(self, data: Sequence[Buffer]) -> Buffer:
        check_data(data, pq=False)
        return self._store(self._xor([self._load(d) for d in data]))

    def pq(self, data: Sequence[Buffer]) -> tuple[bytes, bytes]:
        length = check_data(data, pq=True)
        p, q = self._pq([self._load(d) for d in data], length)
        return self._store(p), self._store(q)

    def encode_into(self, data: Sequence[Buffer], out: Sequence[Buffer]) -> None:
        # these backends compute in arrays of their own (tiles, device memory): the result is copied out
        length = check_data(data, pq=len(out) == 2)
        check_out(out, length)
        got = [self.xor(data)] if len(out) == 1 else self.pq(data)
        for o, g in zip(out, got, strict=True):
            memoryview(o).cast("B")[:] = memoryview(g).cast("B")

    def encode_stripes_into(self, spans: Sequence[Buffer],
                            stripes: Sequence[Stripe]) -> None:
        encode_stripes(self.encode_into, spans, stripes)

    def recover(self, data: Sequence[Buffer | None], p: Buffer | None, q: Buffer | None) -> list[bytes]:
        missing, length = check_recover(data, p, q)
        out: list[bytes | None] = [None if d is None else bytes(d) for d in data]
        if not missing:
            return [b for b in out if b is not None]
        arrs: list[Array | None] = [None if d is None else self._load(d) for d in data]
        if len(missing) == 1 and p is not None:
            # one data chunk and at most Q lost: RAID 5 rule, D_x = P ^ (XOR of the other data)
            x = missing[0]
            out[x] = self._store(self._xor([self._load(p), *(a for a in arrs if a is not None)]))
        elif len(missing) == 1:
            # data and P lost: D_x = g^-x * (Q ^ Qx), Qx being Q over the surviving data
            assert q is not None
            x = missing[0]
            _, qx = self._pq(arrs, length)
            self._ixor(qx, self._load(q))
            out[x] = self._store(self._mul(gf_pow2(-x), qx))
        else:
            # two data chunks lost, P and Q present
            assert p is not None and q is not None
            x, y = missing
            pxy, qxy = self._pq(arrs, length)
            self._ixor(pxy, self._load(p))  # D_x ^ D_y
            self._ixor(qxy, self._load(q))  # g^x D_x ^ g^y D_y
            a, b = raid6_two_data_coefficients(x, y)
            dx = self._mul(a, pxy)
            self._ixor(dx, self._mul(b, qxy))
            self._ixor(pxy, dx)
            out[x] = self._store(dx)
            out[y] = self._store(pxy)
        return [b for b in out if b is not None]

    def pq_update(
        self, index: int, old: Buffer, new: Buffer, p: Buffer, q: Buffer | None
    ) -> tuple[Buffer, Buffer | None]:
        check_update(index, old, new, p, q)
        delta = self._xor([self._load(old), self._load(new)])
        p2 = self._xor([self._load(p), delta])
        if q is None:
            return self._store(p2), None
        q2 = self._mul(gf_pow2(index), delta)
        self._ixor(q2, self._load(q))
        return self._store(p2), self._store(q2)

    def update_into(self, index: int, old: Buffer, new: Buffer, p: Buffer, q: Buffer | None) -> None:
        # these backends compute in arrays of their own: pq_update's result is copied over P and Q
        p2, q2 = self.pq_update(index, old, new, p, q)
        memoryview(p).cast("B")[:] = memoryview(p2).cast("B")
        if q is not None and q2 is not None:
            memoryview(q).cast("B")[:] = memoryview(q2).cast("B")
