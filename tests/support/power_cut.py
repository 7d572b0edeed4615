"""A device that loses power: FaultDevice with a volatile cache whose crash writes back `survive` of what it
held (blocks chosen by `rng`), for the power-cut tests of the thin volume group and the compression layer."""

from __future__ import annotations

import random

from openvsan.block import FaultDevice
from openvsan.block.device import BlockDevice, Buffer, check_range


class PowerCut(FaultDevice):
    """crash_after_writes cuts the power with `survive` of the cache written back, blocks chosen by `rng`.

    With `sync`, it has the fast path of the RAM device inside (read_now, write_now), so that the stack's own fast
    paths run over it: a write_now is durable at once (as a FUA write, it replaces what the cache held for its
    blocks), counts as a write (a cut can come right after it), and declines once the power is gone."""

    def __init__(self, inner: BlockDevice, survive: float, rng: random.Random, *, sync: bool = False) -> None:
        super().__init__(inner, volatile_cache=True)
        self.survive, self.rng = survive, rng
        if sync:
            self.capabilities = self.capabilities.but(sync_read=True, sync_write=True)
            self.read_now = self._read_now          # type: ignore[method-assign]
            self.write_now = self._write_now        # type: ignore[method-assign]

    def _read_now(self, lba: int, blocks: int) -> Buffer | None:
        if self.crashed or self.failed or self.rules:
            return None
        check_range(self, lba, blocks)
        self.reads += 1
        data = bytearray(self.inner.read_now(lba, blocks))  # type: ignore[attr-defined]
        bs = self.block_size
        for i in range(blocks):
            cached = self.pending.get(lba + i)
            if cached is not None:
                data[i * bs:(i + 1) * bs] = cached
        return bytes(data)

    def _write_now(self, lba: int, data: Buffer) -> bool:
        if self.crashed or self.failed or self.rules:
            return False
        view = memoryview(data).cast("B")
        blocks = len(view) // self.block_size
        check_range(self, lba, blocks)
        if not self.inner.write_now(lba, view):  # type: ignore[attr-defined]
            return False
        for i in range(blocks):
            self.pending.pop(lba + i, None)
        self._count_write()
        return True

    def crash(self, *, survive: float | None = None, rng: random.Random | None = None) -> None:
        super().crash(survive=self.survive if survive is None else survive, rng=rng or self.rng)
