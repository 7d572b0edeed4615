"""FaultDevice's injected latency on the real clock: concurrent requests wait together, not in a queue."""

from __future__ import annotations

import asyncio
import time

from openvsan.block import FaultDevice, RamDevice


def run(coro):
    return asyncio.run(coro)


def make(**kw) -> tuple[RamDevice, FaultDevice]:
    ram = RamDevice(64)
    return ram, FaultDevice(ram, **kw)


def test_latency() -> None:
    async def go() -> None:
        _, dev = make(latency=0.05)
        t = time.monotonic()
        await asyncio.gather(dev.read(0, 1), dev.read(1, 1), dev.read(2, 1))
        elapsed = time.monotonic() - t
        assert 0.045 <= elapsed < 0.5  # concurrent requests wait together, not in a queue

    run(go())
