"""FaultDevice: wraps a device and misbehaves on purpose, so tests can check what the layers above promise.

It injects latency, errors on chosen LBA ranges, a failed device, bit rot, and power loss. Power loss is
modelled as a volatile write cache (`volatile_cache=True`): a plain write lands in a pending map that reads
see but the medium does not; `flush()` writes the pending map to the medium, a `fua=True` write goes to the
medium at once, and `crash()` throws the pending map away (optionally letting a random part of it reach the
medium first, since a real cache writes back in any order it likes).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Literal

from openvsan.block.device import BlockDevice, Buffer, check_range
from openvsan.block.errors import BlockError, DeviceFailed, MediumError


@dataclass
class FaultRule:
    lba: int
    blocks: int
    reads: bool
    writes: bool
    error: type[BlockError]
    times: int | None  # how many more requests it fails; None: every one

    def hits(self, lba: int, blocks: int, write: bool) -> int | None:
        """The first LBA of [lba, lba+blocks) this rule fails, or None."""
        if (self.writes if write else self.reads) and (self.times is None or self.times > 0):
            start, end = max(lba, self.lba), min(lba + blocks, self.lba + self.blocks)
            if start < end:
                return start
        return None


class FaultDevice:
    def __init__(self, inner: BlockDevice, *, latency: float = 0.0, volatile_cache: bool = False,
                 crash_after_writes: int | None = None, after_crash: Literal["fail", "drop"] = "fail",
                 name: str = "fault") -> None:
        self.inner = inner
        self.name = name
        self.block_size = inner.block_size
        self.num_blocks = inner.num_blocks
        self.latency = latency
        self.volatile_cache = volatile_cache
        self.crash_after_writes = crash_after_writes
        # after the crash point: "fail" raises DeviceFailed (nothing more is acknowledged, as if the
        # process died); "drop" acknowledges writes and loses them (a lying disk)
        self.after_crash = after_crash
        self.crashed = False
        self.failed = False
        self.rules: list[FaultRule] = []
        self.pending: dict[int, bytes] = {}  # lba -> block, written but not yet durable
        self.reads = self.writes = self.flushes = 0
        self._writeback_sync: dict[int, bytes] = {}
        # no fast path: every request goes where a fault can be injected
        self.capabilities = inner.capabilities.but(sync_read=False, sync_write=False, write_window=False,
                                                   volatile_cache=volatile_cache or inner.capabilities.volatile_cache,
                                                   resizable=False)

    # --- what a test sets up --------------------------------------------------------------------

    def fail(self, lba: int, blocks: int = 1, *, reads: bool = True, writes: bool = True,
             error: type[BlockError] = MediumError, times: int | None = None) -> FaultRule:
        rule = FaultRule(lba, blocks, reads, writes, error, times)
        self.rules.append(rule)
        return rule

    def fail_reads(self, lba: int, blocks: int = 1, **kw: Any) -> FaultRule:
        return self.fail(lba, blocks, reads=True, writes=False, **kw)

    def fail_writes(self, lba: int, blocks: int = 1, **kw: Any) -> FaultRule:
        return self.fail(lba, blocks, reads=False, writes=True, **kw)

    def fail_device(self) -> None:
        """Every request from now on raises DeviceFailed, as if the disk was pulled."""
        self.failed = True

    def clear_faults(self) -> None:
        self.rules.clear()
        self.failed = False

    def crash(self, *, survive: float = 0.0, rng: random.Random | None = None) -> None:
        """Power loss: unflushed writes are lost, except a random `survive` fraction of the pending blocks
        (chosen by `rng`) that the cache had already written back. Call `restart()` to power on again."""
        if survive > 0.0 and self.pending:
            rng = rng or random.Random()
            lucky = [lba for lba in self.pending if rng.random() < survive]
            self._writeback_sync = {lba: self.pending[lba] for lba in lucky}
        else:
            self._writeback_sync = {}
        self.pending.clear()
        self.crashed = True

    async def restart(self) -> None:
        """Power back on: what survived the crash is on the medium, the cache is empty."""
        await self._settle_crash()
        self.crashed = False

    async def corrupt(self, lba: int, *, bit: int = 0) -> None:
        """Flip one bit of a stored block (the medium and any cached copy), like silent bit rot."""
        check_range(self, lba, 1)
        await self._settle_crash()
        byte, mask = divmod(bit, 8)
        block = bytearray(await self.inner.read(lba, 1))
        block[byte] ^= 1 << mask
        await self.inner.write(lba, block)
        if lba in self.pending:
            cached = bytearray(self.pending[lba])
            cached[byte] ^= 1 << mask
            self.pending[lba] = bytes(cached)

    # --- internals ------------------------------------------------------------------------------

    async def _settle_crash(self) -> None:
        # blocks that crash() let survive reach the medium here, since crash() itself is not async
        survivors, self._writeback_sync = self._writeback_sync, {}
        for lba, block in sorted(survivors.items()):
            await self.inner.write(lba, block)

    async def _enter(self, lba: int, blocks: int, write: bool) -> bool:
        """Common gate of every request; False: drop it silently (crashed, after_crash="drop")."""
        if self.latency:
            await asyncio.sleep(self.latency)
        if self.failed:
            raise DeviceFailed(f"{self.name}: device failed (injected)")
        if self.crashed:
            if self.after_crash == "fail":
                raise DeviceFailed(f"{self.name}: device lost power (injected crash)")
            await self._settle_crash()
            if write:
                return False
        check_range(self, lba, blocks)
        for rule in self.rules:
            bad = rule.hits(lba, blocks, write)
            if bad is not None:
                if rule.times is not None:
                    rule.times -= 1
                if issubclass(rule.error, MediumError):
                    raise MediumError(f"{self.name}: injected {'write' if write else 'read'} error at lba {bad}",
                                      lba=bad, write=write)
                raise rule.error(f"{self.name}: injected error at lba {bad}")
        return True

    def _count_write(self) -> None:
        self.writes += 1
        if self.crash_after_writes is not None and self.writes >= self.crash_after_writes:
            self.crash_after_writes = None
            self.crash()

    # --- BlockDevice ----------------------------------------------------------------------------

    async def read(self, lba: int, blocks: int) -> Buffer:
        await self._enter(lba, blocks, write=False)
        self.reads += 1
        data = await self.inner.read(lba, blocks)
        if not self.pending:
            return data
        bs = self.block_size
        out: bytearray | None = None
        for i in range(blocks):
            cached = self.pending.get(lba + i)
            if cached is not None:
                if out is None:
                    out = bytearray(data)
                out[i * bs:(i + 1) * bs] = cached
        return data if out is None else out

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        bs = self.block_size
        view = memoryview(data).cast("B")
        if len(view) % bs:
            raise ValueError(f"write of {len(view)} bytes is not a multiple of the block size {bs}")
        blocks = len(view) // bs
        if not await self._enter(lba, blocks, write=True):
            return
        if self.volatile_cache and not fua:
            for i in range(blocks):
                self.pending[lba + i] = bytes(view[i * bs:(i + 1) * bs])
        else:
            # newer data replaces whatever the cache held for these blocks
            for i in range(blocks):
                self.pending.pop(lba + i, None)
            await self.inner.write(lba, view, fua=fua)
        self._count_write()

    async def flush(self) -> None:
        if not await self._enter(0, 0, write=True):
            return
        self.flushes += 1
        pending, self.pending = self.pending, {}
        for start, run in _runs(pending):
            await self.inner.write(start, run)
        await self.inner.flush()

    async def unmap(self, lba: int, blocks: int) -> None:
        await self._zero(lba, blocks, unmap=True)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        await self._zero(lba, blocks, unmap=False)

    async def _zero(self, lba: int, blocks: int, *, unmap: bool) -> None:
        if not await self._enter(lba, blocks, write=True):
            return
        if self.volatile_cache:
            zero = bytes(self.block_size)
            for i in range(blocks):
                self.pending[lba + i] = zero
        elif unmap:
            await self.inner.unmap(lba, blocks)
        else:
            await self.inner.write_zeroes(lba, blocks)
        self._count_write()

    async def close(self) -> None:
        await self.inner.close()

    @classmethod
    def from_config(cls, cfg: dict[str, Any], inner: BlockDevice) -> FaultDevice:
        """The wrapper only: faults are set up by the test, not by config."""
        return cls(inner, latency=cfg.get("latency", 0.0), volatile_cache=cfg.get("volatile_cache", False),
                   name=cfg.get("name", "fault"))

    def to_config(self) -> dict[str, Any]:
        return {"type": "fault", "name": self.name, "inner": self.inner.to_config(), "latency": self.latency,
                "volatile_cache": self.volatile_cache}


def _runs(blocks: dict[int, bytes]) -> list[tuple[int, bytes]]:
    """Pending blocks as (first lba, data) runs of consecutive LBAs, so a flush is a few large writes."""
    runs: list[tuple[int, bytes]] = []
    start = prev = -2
    parts: list[bytes] = []
    for lba in sorted(blocks):
        if lba != prev + 1 and parts:
            runs.append((start, b"".join(parts)))
            parts = []
        if not parts:
            start = lba
        parts.append(blocks[lba])
        prev = lba
    if parts:
        runs.append((start, b"".join(parts)))
    return runs
