"""Sending on asyncio transports the way every openvsan connection does (targets and initiators alike)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

Buffer = bytes | bytearray | memoryview


class WriteBatcher:
    """Buffers handed over in one event-loop turn leave in one `transport.writelines` (one sendmsg), not one
    system call per PDU. Set `transport` once connected and back to None once lost: nothing is sent then."""

    __slots__ = ("_out", "_pending", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.WriteTransport | None = None
        self._out: list[Buffer] = []
        self._pending = False

    def send(self, parts: Sequence[Buffer]) -> None:
        self._out.extend(parts)
        if not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._pending = False
        out, self._out = self._out, []
        t = self.transport
        if out and t is not None and not t.is_closing():
            t.writelines(out)
