"""A transport that keeps what is written to it: the initiators' connection tests read their PDUs from it."""

from __future__ import annotations

import asyncio
from typing import Any


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.sent = bytearray()
        self.aborted = False

    def writelines(self, data: Any) -> None:
        for d in data:
            self.sent += d

    def write(self, data: Any) -> None:
        self.sent += data

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted

    def take(self) -> bytes:
        """What was sent since the last take()."""
        out = bytes(self.sent)
        self.sent.clear()
        return out
