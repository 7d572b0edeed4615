"""One deadline for every command in flight on a connection, kept by one timer, not one per command.

A command unanswered for `timeout` seconds means the connection is no good: the watchdog drops it, every
command on it fails with ConnectionLost, and the callers' retry loops reconnect and send them again. A
per-command `asyncio.wait_for` does the same at several microseconds and a timer handle per command; this
costs a clock read per command and a scan per tick.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

log = logging.getLogger("openvsan.initiator")


class CommandWatchdog:
    def __init__(self, name: str, timeout: float, started: Callable[[], Iterable[float]],
                 expire: Callable[[], None]) -> None:
        """started(): the loop.time() at which each command now in flight was sent; expire(): drop the
        connection (its connection_lost fails the commands)."""
        self.name = name
        self.timeout = timeout
        self._started = started
        self._expire = expire
        self._timer: asyncio.TimerHandle | None = None
        self._tick = max(0.05, min(1.0, timeout / 4))

    def start(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._tick, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        oldest = min(self._started(), default=None)
        if oldest is not None and loop.time() - oldest > self.timeout:
            log.warning("%s: a command unanswered for %.0f s; reconnecting", self.name, loop.time() - oldest)
            self._timer = None
            self._expire()
            return
        self._timer = loop.call_later(self._tick, self._check)
