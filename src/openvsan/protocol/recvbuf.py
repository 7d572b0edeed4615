"""Received bytes for the sans-IO PDU readers (iSCSI, NVMe/TCP both ways): spans from the front of a stream."""

from __future__ import annotations

from collections import deque

Buffer = bytes | bytearray | memoryview

# A view keeps the whole object it looks into alive: a 48-byte tail of a 256 KiB receive (uvloop hands up to
# that much at once) would pin all of it, and a thousand idle connections would pin a quarter of a GiB. A
# part held of a chunk larger than PIN_MIN_CHUNK is copied when it is less than 1/PIN_RATIO of that chunk.
PIN_MIN_CHUNK = 16384
PIN_RATIO = 4


def _unpinned(view: memoryview) -> memoryview:
    """`view` itself, or a copy of its bytes when holding it would pin a much larger chunk."""
    base = view.obj
    size = len(base) if isinstance(base, (bytes, bytearray)) else view.nbytes
    if size > PIN_MIN_CHUNK and len(view) * PIN_RATIO < size:
        return memoryview(bytes(view))
    return view


class RecvBuffer:
    """Received chunks, read from the front as contiguous spans, the way every PDU reader here needs them.

    A span that lies inside one chunk is a view of it: no copy, whatever the chunk size. Only a span that
    crosses chunks is joined, and then exactly its bytes are copied, never the rest of the chunk it ends in
    (joining whole chunks would copy every byte of a stream whose PDUs straddle its reads). What stays held
    of a large chunk is copied when it is a small part of it (_unpinned), so a held tail never pins the
    whole receive: append and peek see to it, and a reader calls compact() once it has consumed what it
    could of a receive (not in consume, which runs once per PDU)."""

    __slots__ = ("_chunks", "size")

    def __init__(self) -> None:
        self._chunks: deque[memoryview] = deque()
        self.size = 0  # bytes held

    def append(self, data: Buffer) -> None:
        if len(data):
            if isinstance(data, bytes):
                self._chunks.append(memoryview(data))
            else:
                self._chunks.append(_unpinned(memoryview(data).cast("B")))
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
                chunks.appendleft(_unpinned(c[need:]))
                need = 0
        joined = memoryview(b"".join(parts))
        chunks.appendleft(joined)
        return joined

    def contiguous(self, n: int) -> bool:
        """Whether the first n bytes (n <= size) lie in one received chunk: peek(n) would copy nothing."""
        return not n or n <= len(self._chunks[0])

    def copy_into(self, start: int, target: memoryview) -> None:
        """Copy len(target) bytes from `start` on (start + len(target) <= size) into `target`, chunk by chunk,
        joining nothing; nothing is consumed."""
        n = len(target)
        pos = 0
        for c in self._chunks:
            if pos == n:
                return
            if start >= len(c):
                start -= len(c)
                continue
            take = min(len(c) - start, n - pos)
            target[pos:pos + take] = c[start:start + take]
            pos += take
            start = 0
        if pos != n:
            raise ValueError(f"copy_into: {n} bytes asked, {pos} held from there")

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

    def take(self) -> bytes:
        """Everything held, as one bytes object; the buffer is empty afterwards."""
        out = b"".join(self._chunks)
        self._chunks.clear()
        self.size = 0
        return out

    def compact(self) -> None:
        """Copy out what is held of a large chunk where it is a small part of it (see _unpinned). Only the
        first chunk can be such a part (consume trims it); the others are whole receives or were checked
        by append and peek. O(1), so a peer trickling bytes costs no walk over what is held."""
        chunks = self._chunks
        if chunks:
            chunks[0] = _unpinned(chunks[0])
