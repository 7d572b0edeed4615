"""Adaptive busy polling (frontend/busypoll.py): windows open on arrival, stretch while commands keep coming,
close when they stop, back off after windows that caught nothing, and end at once when another task wants
the core. Most tests count context switches with a stand-in that reports none, so a loaded test machine
does not end their windows early; one test puts a real competitor on the same core."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from openvsan.frontend.busypoll import MAX_BACKOFF, BusyPoll
from openvsan.frontend.portals import BatchedConnection, PortalServer

WINDOW_US = 50_000   # long enough that a loaded test machine's scheduling delays cannot close a window early


def quiet(window_us: int) -> BusyPoll:
    """A poller on a core nobody else wants: the context switch count never moves."""
    return BusyPoll(window_us, switches=lambda: 0)


async def until_closed(p: BusyPoll) -> int:
    """Let the window run out; returns how many loop turns that took."""
    turns = 0
    while p._spinning:
        await asyncio.sleep(0)
        turns += 1
    return turns


def test_window_polls_then_closes() -> None:
    async def go() -> None:
        p = quiet(WINDOW_US)
        t0 = time.monotonic()
        p.arrived()
        assert p.windows == 1
        turns = await until_closed(p)
        # the loop kept turning (zero-timeout polls) for the whole window instead of sleeping
        assert time.monotonic() - t0 >= WINDOW_US / 1e6
        assert turns > 10
        assert p.wasted == 1 and p.stats()["windows"] == 1 and p.polled_ns >= WINDOW_US * 1000

    asyncio.run(go())


def test_arrivals_stretch_the_window_and_reset_the_backoff() -> None:
    async def go() -> None:
        p = quiet(WINDOW_US)
        p.arrived()
        await until_closed(p)
        assert p.wasted == 1 and p._skip == 1
        p.arrived()                  # skipped: the last window caught nothing
        assert p.windows == 1 and not p._spinning
        p.arrived()
        assert p.windows == 2 and p._spinning
        t0 = time.monotonic()
        for _ in range(5):           # a command every fifth of a window keeps it open
            await asyncio.sleep(WINDOW_US / 5e6)
            p.arrived()
        assert p._spinning and p.windows == 2
        await until_closed(p)
        assert time.monotonic() - t0 >= 1.9 * WINDOW_US / 1e6
        assert p.wasted == 1 and p._skip == 0    # a useful window: the next arrival polls again
        p.arrived()
        assert p.windows == 3
        await until_closed(p)

    asyncio.run(go())


def test_backoff_doubles_up_to_the_cap() -> None:
    async def go() -> None:
        p = quiet(1)
        skips = []
        for _ in range(10):
            while not p._spinning:
                p.arrived()
            await until_closed(p)
            skips.append(p._skip)
        assert skips == [1, 2, 4, 8, 16, 32, 64, 64, 64, 64]
        assert MAX_BACKOFF == 64 and p.wasted == 10
        assert p.windows == 10    # sparse traffic: ten windows for 1+2+...+64+64+64 arrivals

    asyncio.run(go())


def test_other_work_runs_while_polling() -> None:
    async def go() -> None:
        p = quiet(WINDOW_US)
        p.arrived()
        done = []
        asyncio.get_running_loop().call_later(0.001, done.append, "timer")
        reader, writer = await asyncio.open_connection(*server.getsockname())
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        await asyncio.sleep(0.002)
        assert done == ["timer"] and p._spinning
        writer.close()
        await until_closed(p)

    server = socket.create_server(("127.0.0.1", 0))

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(await r.readexactly(4))

    async def main() -> None:
        srv = await asyncio.start_server(echo, sock=server)
        async with srv:
            await go()

    asyncio.run(main())


def test_a_context_switch_ends_the_window_as_wasted() -> None:
    async def go() -> None:
        switches = [0]
        p = BusyPoll(1_000_000, switches=lambda: switches[0])     # a 1 s window
        p.arrived()
        for _ in range(100):
            await asyncio.sleep(0)
        assert p._spinning
        p.arrived()                   # useful so far
        switches[0] += 1              # another task took the core for a moment
        t0 = time.monotonic()
        await until_closed(p)
        assert time.monotonic() - t0 < 0.5
        assert (p.wasted, p.contended, p._skip) == (1, 1, 1)

    asyncio.run(go())


CONTENDED = textwrap.dedent("""
    import asyncio, os, time
    from openvsan.frontend.busypoll import BusyPoll

    async def main():
        p = BusyPoll(200_000)        # 0.2 s windows: long enough to be preempted in
        for _ in range(5):
            while not p._spinning:
                p.arrived()
            while p._spinning:
                await asyncio.sleep(0)
        print(p.windows, p.contended)

    os.sched_setaffinity(0, {CPU})
    asyncio.run(main())
""")


def test_a_competitor_on_the_same_core_stops_the_polling() -> None:
    """A real CPU-bound process pinned to the poller's core: every window notices it and ends."""
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.2)
        out = subprocess.run([sys.executable, "-c", CONTENDED.replace("{CPU}", f"{{{cpu}}}")],
                             capture_output=True, text=True, timeout=60, check=True).stdout.split()
    finally:
        hog.kill()
        hog.wait()
    windows, contended = map(int, out)
    assert windows == 5 and contended == 5


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="poll window must be positive"):
        BusyPoll(0)


class Echo(BatchedConnection):
    def received(self, data: bytes) -> None:
        self.send_buffers([data])


class EchoServer(PortalServer):
    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    def portals(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", self.port)]

    def make_connection(self, portal: tuple[str, int]) -> BatchedConnection:
        c = Echo()
        self.connections.add(c)
        return c


def test_accepted_connections_share_the_servers_poller() -> None:
    async def go() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        srv = EchoServer(port)
        srv.busy_poll = quiet(WINDOW_US)
        await srv.start()
        try:
            for _ in range(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"hello")
                assert await reader.readexactly(5) == b"hello"
                writer.close()
            assert [c.busy_poll for c in srv.connections] == [srv.busy_poll] * 2
            assert srv.busy_poll.windows >= 1     # a receive opened a window
            await until_closed(srv.busy_poll)
        finally:
            await srv.stop()

    asyncio.run(go())
