"""Sending on asyncio transports the way every openvsan connection does (targets and initiators alike)."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any, TypeVar

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")
JOIN_MAX = 16384   # a send of two parts, the last up to this size, is joined into one buffer
# A batch that reaches this many parts (about as many commands or answers) leaves at once, the rest of the turn
# following at its end: the peer starts on the first ones while these are still being made. Without it a
# client at queue depth 32 and its target work in turn, each waiting for the other's whole batch (vsan bench
# against openvsan, 4 KiB reads QD 32 on one core each: iSCSI 56K -> 75K IOPS, NVMe/TCP 46-57K -> 84-105K,
# docs/benchmarks.md). A connection handling one receive (holding) still answers it in one send.
FLUSH_PARTS = 16


class WriteBatcher:
    """Buffers handed over in one event-loop turn leave in one `transport.writelines` (one sendmsg), not one
    system call per PDU. Set `transport` once connected and back to None once lost: nothing is sent then."""

    __slots__ = ("_loop", "_out", "_pending", "holding", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.WriteTransport | None = None
        self._out: list[Buffer] = []
        self._pending = False
        # the loop, found once: asyncio.get_running_loop() makes a getpid() system call each time (CPython 3.11)
        self._loop: asyncio.AbstractEventLoop | None = None
        # set while a connection handles what one read brought; it calls flush() itself at the end, so
        # answers made at once leave in that turn (one loop iteration less of latency at queue depth 1)
        self.holding = False

    def send(self, parts: Sequence[Buffer]) -> None:
        out = self._out
        out.extend(parts)
        if self.holding:
            return
        if len(out) >= FLUSH_PARTS:
            self._write()          # a flush already scheduled sends what comes after
        elif not self._pending:
            self._pending = True
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self.flush)

    def flush(self) -> None:
        self._pending = False
        self._write()

    def _write(self) -> None:
        out, self._out = self._out, []
        t = self.transport
        if out and t is not None and not t.is_closing():
            if len(out) <= 2 and len(out[-1]) <= JOIN_MAX:
                # one small PDU (a header, maybe a 4 KiB payload): one buffer takes uvloop's plain write()
                t.write(out[0] if len(out) == 1 else b"".join(out))
            else:
                t.writelines(out)


@types.coroutine
def resume(coro: Coroutine[Any, Any, T], yielded: Any) -> Generator[Any, Any, T]:
    """Drive the rest of a coroutine that has already run up to its first suspension, inside a Task: hand the
    Task what the coroutine yielded (the future it waits on), and pass results and exceptions back in."""
    while True:
        try:
            value = yield yielded
        except BaseException as e:  # noqa: BLE001 - cancellation too: the coroutine decides what to do with it
            try:
                yielded = coro.throw(e)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
        else:
            try:
                yielded = coro.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]


def start_inline(coro: Coroutine[Any, Any, T]) -> Generator[Any, Any, T] | T:
    """Run coro now, in the caller's turn, up to its first suspension, like start_eagerly; what is left is not
    a Task but an awaitable that the caller's own task drives (`await left`). For commands sent now whose
    answers the caller waits for anyway, one after the other (the mirror's peers): no Task, and no hop from
    a Task to the caller when the answer comes. Returns the coroutine's result when it never suspended.
    The caller must await or close() what it gets; an exception before the first suspension propagates."""
    try:
        first = coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    return resume(coro, first)


def start_eagerly(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run coro now, in the caller's turn of the event loop; only if it suspends does a Task carry on with it.

    A command whose device answers at once (RAM, a cache hit) then costs no Task at all: Python 3.11 has no
    eager task factory. Code that needs asyncio.current_task() must not run before the first suspension.
    Returns the Task, or None when the coroutine finished without suspending (its exceptions propagate)."""
    try:
        first = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(resume(coro, first))


Done = Callable[[BaseException | None], None]
_carried: set[asyncio.Task[None]] = set()   # start_then's Tasks, held until they end (the loop keeps weak refs)


def start_then(coro: Coroutine[Any, Any, None], done: Done) -> None:
    """Run coro as start_eagerly does (in the caller's turn, a Task only if it suspends) and call done(None)
    when it ends, or done(exception) when it fails: at once if it never suspended, else from its Task. For
    a fast path (a device's write_soon) that hands its uncommon ends to the normal path's coroutine."""
    try:
        task = start_eagerly(coro)
    except Exception as e:  # noqa: BLE001 - reported to the caller's callback, as a failure from the Task is
        done(e)
        return
    if task is None:
        done(None)
        return

    _carried.add(task)

    def ended(t: asyncio.Task[None]) -> None:
        _carried.discard(t)
        done(asyncio.CancelledError() if t.cancelled() else t.exception())

    task.add_done_callback(ended)


class Slots(asyncio.Semaphore):
    """An initiator's free command slots (an NVMe/TCP queue's, an iSCSI session's): acquire() waits for one;
    try_acquire() takes one only if it is free now (read_soon / write_soon, which must not wait)."""

    def try_acquire(self) -> bool:
        if self._value <= 0 or self._waiters:
            return False
        self._value -= 1        # what acquire() does when nothing waits and a slot is free (CPython 3.11-3.13)
        return True

    def put_back(self) -> None:
        """release(), without its two calls when nothing waits (then all it does is this)."""
        if self._waiters:
            self.release()
        else:
            self._value += 1

