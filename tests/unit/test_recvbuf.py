"""RecvBuffer: spans from the front of a received stream; a span inside one chunk is a view of it (no copy),
one that crosses chunks is joined with exactly its own bytes."""

from __future__ import annotations

import random

from openvsan.protocol.recvbuf import RecvBuffer


def test_a_span_inside_one_chunk_is_a_view_of_it() -> None:
    chunk = bytes(range(200))
    b = RecvBuffer()
    b.append(chunk)
    v = b.peek(48)
    assert v is not None and v.obj is chunk and bytes(v) == chunk[:48]
    b.consume(48)
    v = b.peek(100)
    assert v is not None and v.obj is chunk and bytes(v) == chunk[48:148]
    assert b.peek(153) is None and b.size == 152


def test_a_span_across_chunks_copies_only_its_bytes() -> None:
    a, c = b"a" * 100, b"c" * 100_000
    b = RecvBuffer()
    b.append(a)
    b.append(c)
    v = b.peek(150)
    assert v is not None and bytes(v) == a + c[:50] and len(v.obj) == 150   # not the 100 KB chunk
    b.consume(150)
    v = b.peek(1000)
    assert v is not None and v.obj is c    # the rest is read from the original chunk again
    b.consume(b.size)
    assert b.size == 0 and b.peek(1) is None


def test_random_splits_read_back_the_stream() -> None:
    rnd = random.Random(5)
    for _ in range(200):
        stream = rnd.randbytes(rnd.randrange(1, 3000))
        cuts = sorted(rnd.sample(range(1, len(stream)), min(len(stream) - 1, rnd.randrange(0, 20))))
        pieces = [stream[x:y] for x, y in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        b = RecvBuffer()
        got = bytearray()
        for piece in pieces:
            b.append(bytearray(piece) if rnd.random() < 0.2 else piece)
            while True:
                n = rnd.randrange(1, 300)
                v = b.peek(n)
                if v is None:
                    break
                got += v
                b.consume(n)
        got += b.peek(b.size) or b""
        assert bytes(got) == stream
