"""Busy polling (frontend/busypoll.py) with real sockets and a real competitor: timers and streams run while a
window polls, accepted connections share their server's poller, and a CPU hog pinned to the poller's core ends
every window (real context switches, real time: not a unit test)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time

from openvsan.frontend.busypoll import BusyPoll
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
