"""The control socket's shutdown (node/control.py): a client connected while the node stops, its handler
cancelled twice (stop() cancels it, then a second SIGTERM cancels the stop itself while the handler waits for
its socket to close), ends without an error reaching the loop's exception handler (which logs it with a
Traceback: the interop harness fails a server whose log holds one)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from openvsan.node.control import ControlServer


def test_a_client_cancelled_twice_while_the_node_stops_ends_quietly(tmp_path: Path) -> None:
    async def go() -> list[dict[str, Any]]:
        errors: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))

        async def handler(cmd: str, args: dict[str, Any]) -> Any:
            return None

        server = ControlServer(tmp_path / "control.sock", handler)
        await server.start()
        _reader, writer = await asyncio.open_unix_connection(str(tmp_path / "control.sock"))
        for _ in range(100):
            if server._clients:
                break
            await asyncio.sleep(0.01)
        assert server._clients
        stopping = asyncio.ensure_future(server.stop())
        for _ in range(3):            # the handler cancelled once, now waiting for its socket to close
            await asyncio.sleep(0)
        stopping.cancel()             # the second SIGTERM: the stop is not waited for
        await asyncio.sleep(0.1)
        writer.close()
        await asyncio.sleep(0.1)
        return errors

    assert asyncio.run(go()) == []
