"""The pool's members at run time: which device holds each slot, how far it is trusted, and member I/O that
reports a failing member by its index instead of by an exception from somewhere below.

A member I/O that raises `MediumError` or `DeviceFailed` becomes `MemberFaults({index: error})`; the level's
I/O code decides whether to retry (a read phase: nothing was written yet) or to carry on without the member (a
write phase), and reports the member to `fail`, which marks it failed durably before it returns.
"""

from __future__ import annotations

import asyncio
import uuid as uuidlib
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from openvsan.block.device import BlockDevice, Buffer
from openvsan.block.errors import DeviceFailed, MediumError
from openvsan.netio import resume
from openvsan.pool.superblock import MemberState

T = TypeVar("T")

# what a member may raise that means "this member is failing" rather than "the request was wrong"
MEMBER_FAULTS = (MediumError, DeviceFailed)


class MemberFaults(Exception):
    """Member index -> its error, and the device that raised it: by the time the fault is handled the slot
    may hold another device (a spare that took over), which must not be blamed."""

    def __init__(self, faults: dict[int, BaseException], devices: dict[int, BlockDevice | None]) -> None:
        super().__init__(", ".join(f"member {i}: {e}" for i, e in sorted(faults.items())))
        self.faults = faults
        self.devices = devices


@dataclass
class Member:
    index: int
    dev: BlockDevice | None
    uuid: uuidlib.UUID
    state: MemberState
    checkpoint: int = 0  # REBUILDING: rows below this one are in sync

    @property
    def name(self) -> str:
        if self.dev is None:
            return f"member{self.index} (missing)"
        return str(getattr(self.dev, "name", f"member{self.index}"))

    def valid(self, row: int) -> bool:
        return self.state is MemberState.ACTIVE or (self.state is MemberState.REBUILDING and row < self.checkpoint)

    def valid_rows(self, start: int, end: int) -> bool:
        """In sync for every row of [start, end)."""
        return self.state is MemberState.ACTIVE or (self.state is MemberState.REBUILDING and end <= self.checkpoint)

    def valid_until(self, rows: int) -> int:
        """The first row this member is not in sync for (rows when all are)."""
        if self.state is MemberState.ACTIVE:
            return rows
        return self.checkpoint if self.state is MemberState.REBUILDING else 0

    @property
    def present(self) -> bool:
        """Has a device that should receive writes and metadata."""
        return self.dev is not None and self.state in (MemberState.ACTIVE, MemberState.REBUILDING)


Fail = Callable[[MemberFaults], Awaitable[None]]


class MemberSet:
    def __init__(self, members: list[Member], data_offset: int, chunk_blocks: int, block_size: int,
                 fail: Fail) -> None:
        self.members = members
        self.data_offset = data_offset
        self.chunk_blocks = chunk_blocks
        self.block_size = block_size
        self.fail = fail
        self.optimal = True  # every member ACTIVE: the I/O paths may skip per-member checks (the Pool keeps it)

    def valid(self, m: int, row: int) -> bool:
        return self.optimal or self.members[m].valid(row)

    def _dev(self, m: int) -> BlockDevice:
        dev = self.members[m].dev
        if dev is None:
            raise MemberFaults({m: DeviceFailed(f"member {m} is missing")}, {m: None})
        return dev

    def lba(self, row: int, offset: int) -> int:
        """The member block of `offset` blocks into chunk row `row`."""
        return self.data_offset + row * self.chunk_blocks + offset

    async def read(self, m: int, row: int, offset: int, blocks: int) -> Buffer:
        """`blocks` blocks from `offset` blocks into chunk row `row` of member m (may run into later rows)."""
        dev = self._dev(m)
        try:
            return await dev.read(self.lba(row, offset), blocks)
        except MEMBER_FAULTS as e:
            raise MemberFaults({m: e}, {m: dev}) from e

    def read_now(self, m: int, row: int, offset: int, blocks: int) -> Buffer | None:
        """The same read done in the caller's turn (block/device.py SyncRead), or None: the member is missing,
        has no fast path, declines, or faults (read() then meets the fault and reports the member)."""
        dev = self.members[m].dev
        if dev is None or not dev.capabilities.sync_read:
            return None
        try:
            return dev.read_now(self.lba(row, offset), blocks)  # type: ignore[attr-defined,no-any-return]
        except MEMBER_FAULTS:
            return None

    async def write(self, m: int, row: int, offset: int, data: Buffer, fua: bool = False) -> None:
        dev = self._dev(m)
        try:
            await dev.write(self.lba(row, offset), data, fua=fua)
        except MEMBER_FAULTS as e:
            raise MemberFaults({m: e}, {m: dev}) from e

    def window(self, m: int, row: int, offset: int, blocks: int) -> memoryview | None:
        """The member's own memory for `blocks` from `offset` blocks into chunk row `row` (block/device.py
        WriteWindow: a RAM member), for parity to be computed straight into it; None: it has none."""
        dev = self.members[m].dev
        if dev is None or not dev.capabilities.write_window:
            return None
        return dev.write_window(self.lba(row, offset), blocks)  # type: ignore[attr-defined,no-any-return]

    def can_write_now(self, m: int) -> bool:
        dev = self.members[m].dev
        return dev is not None and dev.capabilities.sync_write

    def write_now(self, m: int, row: int, offset: int, data: Buffer) -> bool:
        """write() done in the caller's turn (block/device.py SyncWrite: as durable as FUA), or False: nothing
        written to this member (no fast path, declined, or a fault, which write() then meets and reports)."""
        dev = self.members[m].dev
        if dev is None or not dev.capabilities.sync_write:
            return False
        try:
            return bool(dev.write_now(self.lba(row, offset), data))  # type: ignore[attr-defined]
        except MEMBER_FAULTS:
            return False

    async def write_zeroes(self, m: int, row: int, offset: int, blocks: int) -> None:
        dev = self._dev(m)
        try:
            await dev.write_zeroes(self.lba(row, offset), blocks)
        except MEMBER_FAULTS as e:
            raise MemberFaults({m: e}, {m: dev}) from e

    async def raw(self, m: int, op: Callable[[BlockDevice], Awaitable[T]]) -> T:
        """Any other member request (header I/O, flush), with its faults reported the same way."""
        dev = self._dev(m)
        try:
            return await op(dev)
        except MEMBER_FAULTS as e:
            raise MemberFaults({m: e}, {m: dev}) from e

    @staticmethod
    async def gather(ops: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
        """Run member requests concurrently; after all have finished, raise one MemberFaults naming every member
        that failed (any other exception is a bug above and is raised as it is)."""
        if len(ops) == 1:
            return [await ops[0]]
        results: list[Any] = await eager_gather(ops)
        faults: dict[int, BaseException] = {}
        devices: dict[int, BlockDevice | None] = {}
        for r in results:
            if isinstance(r, MemberFaults):
                faults.update(r.faults)
                devices.update(r.devices)
            elif isinstance(r, BaseException):
                raise r
        if faults:
            raise MemberFaults(faults, devices)
        return results

    async def write_all(self, ops: Sequence[Coroutine[Any, Any, None]]) -> None:
        """A write phase: what failed is marked failed and the rest stands (the surviving members hold a
        consistent stripe); `fail` raises DeviceFailed when that leaves the pool without its data."""
        try:
            await self.gather(ops)
        except MemberFaults as e:
            await self.fail(e)


async def eager_gather(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T | BaseException]:
    """asyncio.gather(*coros, return_exceptions=True), but each coroutine first runs in the caller's turn, and only
    one that suspends gets a Task: a member that answers at once (RAM, a cache) costs no Task and no extra loop
    turn, which is most of a small request's cost (Python 3.11 has no eager task factory)."""
    results: list[Any] = [None] * len(coros)
    tasks: list[tuple[int, asyncio.Task[Any]]] = []
    loop = asyncio.get_running_loop()
    for i, coro in enumerate(coros):
        try:
            first = coro.send(None)
        except StopIteration as stop:
            results[i] = stop.value
        except Exception as e:  # noqa: BLE001 - reported like gather(return_exceptions=True) does
            results[i] = e
        except BaseException:
            # cancelled (or worse) while starting them: the rest never start, the started ones are cancelled
            for later in coros[i + 1:]:
                later.close()
            for _, t in tasks:
                t.cancel()
            raise
        else:
            tasks.append((i, loop.create_task(resume(coro, first))))
    if tasks:
        done = await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
        for (i, _), r in zip(tasks, done, strict=True):
            results[i] = r
    return results
