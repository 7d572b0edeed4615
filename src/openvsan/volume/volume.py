"""Volume: the handle a LUN, an NVMe namespace or an NBD export holds (DESIGN.md: the volume stack).

It carries the volume's identity (name, UUID and what derives from it: NAA, EUI-64, NGUID, serial) and its
stack (layers over a device or pool), checks bounds and alignment once for every layer below, and lets the
stack change under the frontends: `swap()` holds new I/O, drains what is in flight and switches; `resize()`
grows (or shrinks) the device and tells the frontends, which report it (unit attention, NVMe AEN).

The fast path stays as short as the device's own: `read_now` / `write_now` are the top of the stack's bound
methods (or a decline when the stack has none), swapped with the stack; frontends call them after their
protocol's admit() has checked the range."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import uuid as uuidlib
from collections.abc import AsyncIterator, Awaitable, Callable
from time import perf_counter_ns
from typing import Any

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import BlockDevice, Buffer, WriteDone
from openvsan.block.errors import Busy, OutOfRange
from openvsan.block.layer import Layer, stack_of
from openvsan.volume.meter import IoMeter, metered_read_now, metered_write_now

log = logging.getLogger("openvsan.volume")

# what changed, for the frontends: "resized" (num_blocks), "stack" (capabilities may differ)
VolumeListener = Callable[[str], None]

SWAP_DRAIN_TIMEOUT = 30.0   # seconds a swap waits for in-flight I/O before it gives up (nothing changes)


def _decline_read(lba: int, blocks: int) -> None:
    return None


def _decline_write(lba: int, data: Buffer) -> bool:
    return False


def _decline_soon(lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
    return False


class Volume:
    def __init__(self, stack: BlockDevice, *, name: str, uuid: uuidlib.UUID | None = None,
                 serial: str | None = None) -> None:
        self.name = name
        self.uuid = uuid or uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"openvsan:volume:{name}")
        self.serial = serial or self.uuid.hex[:16]
        self._listeners: list[VolumeListener] = []
        self._inflight = 0
        self._idle: asyncio.Event | None = None   # set when in-flight I/O reaches 0 while someone waits
        self._held: asyncio.Event | None = None   # while a swap drains: new I/O waits for it
        self.meter = IoMeter()                    # what initiators asked of it (volume/meter.py)
        self._install(stack)

    def _install(self, stack: BlockDevice) -> None:
        self.stack = stack
        self.block_size: int = stack.block_size
        self.num_blocks: int = stack.num_blocks
        self.capabilities: Capabilities = stack.capabilities
        self._open_fast_path()

    def _open_fast_path(self) -> None:
        caps = self.capabilities
        # counted and timed (volume/meter.py) when the stack has a fast path; a decline costs nothing more
        self.read_now: Callable[[int, int], Buffer | None] = (
            metered_read_now(self.stack.read_now, self.meter.read, self.block_size)  # type: ignore[attr-defined]
            if caps.sync_read else _decline_read)
        self.write_now: Callable[[int, Buffer], bool] = (
            metered_write_now(self.stack.write_now, self.meter.write)  # type: ignore[attr-defined]
            if caps.sync_write else _decline_write)
        self.write_soon: Callable[[int, Buffer, bool, WriteDone], bool] = (
            self._write_soon if getattr(self.stack, "write_soon", _decline_soon) is not _decline_soon
            else _decline_soon)

    # ---- identity (stable for as long as the volume keeps its uuid)

    @property
    def nguid(self) -> bytes:
        """NVMe NGUID (Identify Namespace bytes 104-119): the uuid itself."""
        return self.uuid.bytes

    @property
    def eui64(self) -> bytes:
        # derived, not a prefix of the NGUID, so the two identifiers never look alike
        return hashlib.sha256(b"eui64:" + self.uuid.bytes).digest()[:8]

    @property
    def naa(self) -> bytes:
        """SCSI NAA IEEE Registered Extended designator (VPD page 83h)."""
        from openvsan.protocol.scsi.inquiry import naa6
        return naa6(self.uuid)

    @property
    def size(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def layers(self) -> list[BlockDevice]:
        """The stack from the top down, its bottom device last."""
        return stack_of(self.stack)

    @property
    def device(self) -> BlockDevice:
        """The device (or pool) at the bottom of the stack."""
        return self.layers[-1]

    # ---- who wants to know of changes

    def listen(self, fn: VolumeListener) -> Callable[[], None]:
        """Call fn(what) after each change; returns the call that stops it (a LUN or namespace going away)."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def _changed(self, what: str) -> None:
        for fn in list(self._listeners):
            try:
                fn(what)
            except Exception:
                log.exception("volume %s: a listener failed on %s", self.name, what)

    # ---- I/O: bounds and alignment are checked here, once, for every layer below

    def _check(self, lba: int, blocks: int) -> None:
        if lba < 0 or blocks < 0 or lba + blocks > self.num_blocks:
            raise OutOfRange(f"volume {self.name}: lba {lba} + {blocks} blocks beyond {self.num_blocks}")

    def _blocks_of(self, data: Buffer) -> int:
        n = memoryview(data).nbytes
        if n % self.block_size:
            raise ValueError(f"write of {n} bytes is not a multiple of the block size {self.block_size}")
        return n // self.block_size

    async def _enter(self, lba: int = 0, blocks: int = 0) -> None:
        self._check(lba, blocks)
        if self._held is not None:
            while self._held is not None:
                await self._held.wait()
            self._check(lba, blocks)   # again: the stack it waited for may be smaller (swap, resize)
        self._inflight += 1

    def _leave(self) -> None:
        self._inflight -= 1
        if not self._inflight and self._idle is not None:
            self._idle.set()

    async def read(self, lba: int, blocks: int) -> Buffer:
        await self._enter(lba, blocks)
        try:
            t = perf_counter_ns()
            out = await self.stack.read(lba, blocks)
            self.meter.read.add(blocks * self.block_size, perf_counter_ns() - t)
            return out
        finally:
            self._leave()

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        blocks = self._blocks_of(data)
        await self._enter(lba, blocks)
        try:
            t = perf_counter_ns()
            await self.stack.write(lba, data, fua=fua)
            self.meter.write.add(blocks * self.block_size, perf_counter_ns() - t)
        finally:
            self._leave()

    def _write_soon(self, lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
        """write()'s fast path for a stack that offers write_soon (block/device.py WriteSoon): counted in flight
        and metered as write() is, with no coroutine; False (nothing done) where the stack declines. The
        caller has checked the range. While a change drains I/O it is _decline_soon, as write_now is."""
        t = perf_counter_ns()
        n = len(data)
        meter = self.meter.write

        def finished(e: BaseException | None) -> None:
            self._leave()
            if e is None:
                meter.add(n, perf_counter_ns() - t)
            done(e)

        self._inflight += 1
        if self.stack.write_soon(lba, data, fua, finished):  # type: ignore[attr-defined]
            return True
        self._leave()
        return False

    def open_window(self, lba: int, blocks: int) -> memoryview | None:
        """The device's own memory for a write of `blocks` at `lba` to be received into (block/device.py
        WriteWindow), or None: no window (the stack has none, or a change is draining I/O); then the write
        comes with its data as usual. An open window counts as I/O in flight until close_window(), so the
        stack and the size stay as they are under it. The caller has checked the range."""
        if self._held is not None or not self.capabilities.write_window:
            return None
        self._check(lba, blocks)
        t = perf_counter_ns()
        view: memoryview | None = self.stack.write_window(lba, blocks)  # type: ignore[attr-defined]
        if view is not None:
            self._inflight += 1
            # counted as written now: the stack's part is done (the payload lands there as it is received)
            self.meter.write.add(blocks * self.block_size, perf_counter_ns() - t)
        return view

    def close_window(self) -> None:
        """The data of a window open_window() gave has all arrived (the write is done), or never will (the
        connection is gone: the blocks are part written, as a torn write leaves them)."""
        self._leave()

    async def flush(self) -> None:
        await self._enter()
        try:
            t = perf_counter_ns()
            await self.stack.flush()
            self.meter.other.add(0, perf_counter_ns() - t)
        finally:
            self._leave()

    async def unmap(self, lba: int, blocks: int) -> None:
        await self._enter(lba, blocks)
        try:
            t = perf_counter_ns()
            await self.stack.unmap(lba, blocks)
            self.meter.other.add(0, perf_counter_ns() - t)   # no data moves: bytes count data moved
        finally:
            self._leave()

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        await self._enter(lba, blocks)
        try:
            t = perf_counter_ns()
            await self.stack.write_zeroes(lba, blocks)
            self.meter.other.add(0, perf_counter_ns() - t)
        finally:
            self._leave()

    async def lba_status(self, lba: int, blocks: int) -> object:
        """Mapped/unmapped extents (only when capabilities.extents)."""
        await self._enter(lba, blocks)
        try:
            return await self.stack.lba_status(lba, blocks)  # type: ignore[attr-defined]
        finally:
            self._leave()

    # ---- changes while serving

    @contextlib.asynccontextmanager
    async def _quiesced(self, timeout: float) -> AsyncIterator[None]:
        """New I/O (and the fast path) waits, in-flight I/O finishes; then the body runs alone. Busy if the
        drain takes longer than `timeout`: then nothing has changed and I/O goes on."""
        while self._held is not None:     # one change at a time
            await self._held.wait()
        held = self._held = asyncio.Event()
        self.read_now, self.write_now, self.write_soon = _decline_read, _decline_write, _decline_soon
        try:
            if self._inflight:
                self._idle = asyncio.Event()
                try:
                    await asyncio.wait_for(self._idle.wait(), timeout)
                except TimeoutError:
                    raise Busy(f"volume {self.name}: {self._inflight} I/O still in flight after {timeout:g} s; "
                               "nothing was changed") from None
                finally:
                    self._idle = None
            yield
        finally:
            self._held = None
            self._open_fast_path()
            held.set()

    async def swap(self, new_stack: BlockDevice, *, timeout: float = SWAP_DRAIN_TIMEOUT) -> BlockDevice:
        """Put `new_stack` in place of the stack; returns the old one (the caller closes what it no longer
        needs). In-flight I/O finishes on the old stack, I/O that arrives meanwhile waits and runs on the new
        one: no initiator sees an error, only a short wait."""
        if new_stack.block_size != self.block_size:
            raise ValueError(f"volume {self.name}: a stack of {new_stack.block_size}-byte blocks cannot replace "
                             f"one of {self.block_size}-byte blocks")
        async with self._quiesced(timeout):
            old = self.stack
            self._install(new_stack)
        self._changed("stack")
        if self.num_blocks != old.num_blocks:
            self._changed("resized")
        return old

    async def resize(self, num_blocks: int, *, timeout: float = SWAP_DRAIN_TIMEOUT) -> None:
        """Grow (or shrink) the device under the stack; the frontends report the new capacity."""
        if num_blocks <= 0:
            raise ValueError(f"volume {self.name}: a size of {num_blocks} blocks")
        if num_blocks == self.num_blocks:
            return
        if not self.capabilities.resizable:
            raise ValueError(f"volume {self.name}: its device ({type(self.device).__name__}) cannot be resized")
        async with self._quiesced(timeout):
            await self.stack.resize(num_blocks)  # type: ignore[attr-defined]
            self.num_blocks = self.stack.num_blocks
        self._changed("resized")

    async def change_contents(self, change: Callable[[], Awaitable[None]], *,
                              timeout: float = SWAP_DRAIN_TIMEOUT) -> None:
        """Run `change` alone (in-flight I/O drained, new I/O waiting): the data under the volume changes as a
        whole, as a rollback to a snapshot does. The size is read again after it; the frontends hear
        "contents" (and "resized" if the size changed)."""
        async with self._quiesced(timeout):
            before = self.num_blocks
            # what the stack holds in memory goes to the device first (a compressed volume's write cache, and its
            # cleaner, which would otherwise write it over the changed data)
            await self.write_back()
            await change()
            for layer in reversed(self.layers[:-1]):   # layers that keep state of the data (compress) read it anew
                reload = getattr(layer, "reload", None)
                if reload is not None:
                    await reload()
            self.num_blocks = self.stack.num_blocks
        self._changed("contents")
        if self.num_blocks != before:
            self._changed("resized")

    async def write_back(self) -> None:
        """What layers of the stack hold in memory (a compressed volume's write cache) written to the device below
        them now (not flushed): a snapshot or a change of the data below sees every write completed before."""
        for layer in self.layers[:-1]:
            fn = getattr(layer, "write_back", None)
            if fn is not None:
                await fn()

    def notify(self, what: str) -> None:
        """Tell the frontends of a change below the volume they report (e.g. "thin-threshold")."""
        self._changed(what)

    async def close(self) -> None:
        """Close the layers of the stack, top first; the device at the bottom is its owner's to close."""
        for dev in self.layers[:-1]:
            if isinstance(dev, Layer):
                await dev.close()

    def to_config(self) -> dict[str, Any]:
        """The volume's stack as data: its layers' configs, bottom first (volume/registry.py replays them)."""
        from openvsan.volume.registry import stack_config
        return {"name": self.name, "uuid": str(self.uuid), "layers": stack_config(self.stack)}

    def __repr__(self) -> str:
        return f"Volume({self.name!r}, {' > '.join(type(d).__name__ for d in self.layers)}, {self.size} bytes)"
