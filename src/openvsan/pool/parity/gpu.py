"""The CuPy parity backend (the GRAID idea: parity on a GPU). Needs `pip install openvsan[gpu]` and a CUDA device.

One elementwise kernel computes P and Q for a byte column across all data chunks (Horner's rule, as in
cpu.py); XOR, constant multiplies (a 256-entry table gathered on the device) and the recovery algebra are
shared with the numpy backend through base.ArrayParity. Chunks are copied to the device and back on every
call: worth it for large stripes, not for 4 KiB ones (bench/parity_bench.py shows where the line lies).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np

from openvsan.pool.parity.base import Array, ArrayParity, Buffer
from openvsan.pool.parity.gf import mul_table

# Q = Q * g ^ x per data chunk from the top one down; (qq << 1) ^ 0x11d reduces the bit shifted out of a byte.
_PQ_SOURCE = """
unsigned int pp = 0, qq = 0;
for (long long k = n - 1; k >= 0; --k) {
    unsigned int x = d[k * length + i];
    pp ^= x;
    qq = ((qq << 1) ^ ((qq & 0x80u) ? 0x11du : 0u)) ^ x;
}
p = (unsigned char)pp;
q = (unsigned char)qq;
"""


def unavailable_reason() -> str | None:
    """None when CuPy imports and sees a CUDA device; otherwise why not, in one line."""
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]
    except Exception as e:  # noqa: BLE001 - ImportError, or a CUDA library that fails to load: either way, no GPU
        return f"no CUDA GPU: cupy not importable ({type(e).__name__}: {e})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError when there is no driver
        return f"no CUDA GPU: no device ({type(e).__name__}: {e})"
    if count == 0:
        return "no CUDA GPU: no device (cupy imports, getDeviceCount() = 0)"
    return None


@cache
def _pq_kernel() -> Any:
    import cupy  # type: ignore[import-not-found,unused-ignore]

    return cupy.ElementwiseKernel(
        "raw uint8 d, int64 n, int64 length", "uint8 p, uint8 q", _PQ_SOURCE, "openvsan_raid6_pq"
    )


@cache
def _device_table(c: int) -> Any:
    import cupy  # type: ignore[import-not-found,unused-ignore]

    return cupy.asarray(np.frombuffer(mul_table(c), dtype=np.uint8))


class CupyParity(ArrayParity):
    name = "cupy"

    def __init__(self) -> None:
        import cupy  # type: ignore[import-not-found,unused-ignore]

        self._cp = cupy

    def _load(self, buf: Buffer) -> Array:
        return self._cp.asarray(np.frombuffer(buf, dtype=np.uint8))

    def _store(self, arr: Array) -> bytes:
        return bytes(self._cp.asnumpy(arr).tobytes())

    def _xor(self, arrs: Sequence[Array]) -> Array:
        out = arrs[0].copy()
        for a in arrs[1:]:
            self._cp.bitwise_xor(out, a, out=out)
        return out

    def _pq(self, arrs: Sequence[Array | None], length: int) -> tuple[Array, Array]:
        cp = self._cp
        stacked = cp.zeros((len(arrs), length), dtype=cp.uint8)  # a missing chunk stays zeros
        for i, a in enumerate(arrs):
            if a is not None:
                stacked[i] = a
        p = cp.empty(length, dtype=cp.uint8)
        q = cp.empty(length, dtype=cp.uint8)
        _pq_kernel()(stacked, len(arrs), length, p, q)
        return p, q

    def _mul(self, c: int, arr: Array) -> Array:
        return self._cp.take(_device_table(c), arr)

    def _ixor(self, acc: Array, arr: Array) -> None:
        self._cp.bitwise_xor(acc, arr, out=acc)
