"""Received bytes for the sans-IO PDU readers (iSCSI, NVMe/TCP both ways): spans from the front of a stream."""

from __future__ import annotations

from collections import deque

Buffer = bytes | bytearray | memoryview


class RecvBuffer:
    """Received chunks, read from the front as contiguous spans, the way every PDU reader here needs them.

    A span that lies inside one chunk is a view of it: no copy, whatever the chunk size. Only a span that
    crosses chunks is joined, and then exactly its bytes are copied, never the rest of the chunk it ends in
    (joining whole chunks would copy every byte of a stream whose PDUs straddle its reads)."""

    __slots__ = ("_chunks", "size")

    def __init__(self) -> None:
        self._chunks: deque[memoryview] = deque()
        self.size = 0  # bytes held

    def append(self, data: Buffer) -> None:
        if len(data):
            self._chunks.append(memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data))
            self.size += len(data)

    def peek(self, n: int) -> memoryview | None:
        """The first n bytes as one view (joined only if they cross chunks), or None while fewer are held."""
        if n > self.size:
            return None
        if not n:
            return memoryview(b"")
        chunks = self._chunks
        first = chunks[0]
        if n <= len(first):
            return first[:n]
        parts = []
        need = n
        while need:
            c = chunks.popleft()
            if len(c) <= need:
                parts.append(c)
                need -= len(c)
            else:
                parts.append(c[:need])
                chunks.appendleft(c[need:])
                need = 0
        joined = memoryview(b"".join(parts))
        chunks.appendleft(joined)
        return joined

    def consume(self, n: int) -> None:
        """Drop the first n bytes (at most size)."""
        self.size -= n
        chunks = self._chunks
        while n:
            c = chunks[0]
            if len(c) <= n:
                chunks.popleft()
                n -= len(c)
            else:
                chunks[0] = c[n:]
                return
