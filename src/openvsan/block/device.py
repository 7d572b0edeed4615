"""The one interface every layer implements (DESIGN.md: everything is a block device)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from openvsan.block.capabilities import Capabilities
from openvsan.block.errors import OutOfRange

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class BlockDevice(Protocol):
    # read-only here, so that a Layer's properties (block/layer.py) satisfy it as well as plain attributes
    @property
    def block_size(self) -> int: ...  # logical block, 512 or 4096

    @property
    def num_blocks(self) -> int: ...

    @property
    def capabilities(self) -> Capabilities: ...  # what it can do besides this interface

    async def read(self, lba: int, blocks: int) -> Buffer: ...

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None: ...

    async def flush(self) -> None: ...  # everything acknowledged is durable

    async def unmap(self, lba: int, blocks: int) -> None: ...

    async def write_zeroes(self, lba: int, blocks: int) -> None: ...

    async def close(self) -> None: ...

    def to_config(self) -> dict[str, Any]: ...


def check_range(dev: BlockDevice, lba: int, blocks: int) -> None:
    """Bounds check, done once, at the volume (volume/volume.py; STYLE.md §2), not again in the layers."""
    if lba < 0 or blocks < 0 or lba + blocks > dev.num_blocks:
        raise OutOfRange(f"lba {lba} + {blocks} blocks beyond {dev.num_blocks}")


@runtime_checkable
class SyncRead(Protocol):
    """What a device with capabilities.sync_read offers besides BlockDevice: read_now is done
    in the caller's turn of the event loop, with no coroutine, or declines (None: use read()). Frontends use
    it for plain reads (no Task, no await). The caller has checked the range.

    read_now may lend a view of the device's own memory rather than a copy: it is for sending at once, and
    a write to the same blocks before the send is done shows through, as it may for any read that overlaps
    a write in flight (SAM-5 gives such commands no order). Keep a copy (bytes()) to hold on to it."""

    def read_now(self, lba: int, blocks: int) -> Buffer | None: ...


@runtime_checkable
class SyncWrite(Protocol):
    """What a device with capabilities.sync_write offers. write_now: a write done in the caller's turn, as durable on return as `write(..., fua=True)` would make
    it, or declined (False, nothing written: use write()). The caller has checked the range."""

    def write_now(self, lba: int, data: Buffer) -> bool: ...


WriteDone = Callable[[BaseException | None], None]
ReadDone = Callable[[Buffer | None, BaseException | None], None]


@runtime_checkable
class WriteSoon(Protocol):
    """A device whose write waits on others (a replicated volume's mirror: its peers) may offer write_soon,
    the fast path of such a write: started in the caller's turn with no coroutine or Task, as durable when
    done as `write(..., fua=fua)` makes it; `done(None)` is called once when it is, `done(exc)` once when
    it failed as write() would have raised exc (from a later turn, or at once). False: declined, nothing
    was written and `done` is never called (use write()). The caller has checked the range. No capability
    states it: a caller asks for the method (Volume.write_soon)."""

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool: ...


@runtime_checkable
class ReadSoon(Protocol):
    """A device whose reads wait on the network (an initiator) may offer read_soon, the fast path of a read for
    a caller that keeps no coroutine per request (vsan bench's lanes): sent in the caller's turn;
    `done(data, None)` is called once with what read() would have returned, `done(None, exc)` once when it
    failed, with no retry or reconnect (read() does those). False: declined, nothing sent and `done` is never
    called (use read()). The caller has checked the range."""

    def read_soon(self, lba: int, blocks: int, done: ReadDone) -> bool: ...


@runtime_checkable
class WriteWindow(Protocol):
    """What a device with capabilities.write_window (a RAM device) offers besides SyncWrite: write_window lends
    the device's own memory for `blocks` at `lba`, for a frontend to receive a large write's data straight
    into it (no buffer, no copy); once all of it has arrived the write is done, as durable as write_now's.
    Until then reads of those blocks may see part of it, as they may for any read that overlaps a write in
    flight, and a write whose data never all arrives (the connection lost) leaves the blocks part written,
    as a torn write of any device would: neither was acknowledged. The caller has checked the range and
    holds the volume's in-flight count while the window is open (Volume.open_window), so no change of the
    stack or size happens under it. Layers forward it only if they change no write (block/layer.py). It may
    decline (None): then the write comes with its data, as usual."""

    def write_window(self, lba: int, blocks: int) -> memoryview | None: ...
