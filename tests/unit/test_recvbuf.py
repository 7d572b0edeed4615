"""RecvBuffer: spans from the front of a received stream; a span inside one chunk is a view of it (no copy),
one that crosses chunks is joined with exactly its own bytes."""

from __future__ import annotations

import random

import pytest

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


def test_a_short_tail_of_a_large_chunk_is_copied_not_pinned() -> None:
    """A 48-byte tail held of a 256 KiB receive would keep all 256 KiB alive (issue 10: with many
    connections that pins GiBs): below a quarter of a chunk over 16 KiB, the held part is copied."""
    chunk = bytes(range(256)) * 1024            # 256 KiB, what uvloop hands up at most
    b = RecvBuffer()
    b.append(chunk)
    b.consume(len(chunk) - 48)
    b.compact()             # what a reader calls once it has consumed what it could of a receive
    v = b.peek(48)
    assert v is not None and bytes(v) == chunk[-48:] and v.obj is not chunk and len(v.obj) == 48
    # a view of the end of a large receive, appended (what the PDU readers hand over), likewise
    b = RecvBuffer()
    b.append(memoryview(chunk)[-100:])
    v = b.peek(100)
    assert v is not None and bytes(v) == chunk[-100:] and len(v.obj) == 100
    # a join that leaves a short tail of a large chunk behind
    b = RecvBuffer()
    b.append(b"x" * 10)
    b.append(chunk)
    v = b.peek(10 + len(chunk) - 30)
    assert v is not None
    b.consume(10 + len(chunk) - 30)
    b.compact()
    v = b.peek(30)
    assert v is not None and bytes(v) == chunk[-30:] and len(v.obj) == 30


def test_a_large_part_of_a_chunk_stays_a_view() -> None:
    chunk = bytes(256 * 1024)
    b = RecvBuffer()
    b.append(chunk)
    b.consume(1000)
    b.compact()
    v = b.peek(b.size)
    assert v is not None and v.obj is chunk       # most of the chunk is still wanted: no copy
    b.consume(b.size - 64 * 1024 - 1)
    b.compact()
    v = b.peek(b.size)
    assert v is not None and v.obj is chunk       # exactly a quarter and one byte: still a view
    small = bytes(16 * 1024)
    b = RecvBuffer()
    b.append(small)
    b.consume(len(small) - 8)
    b.compact()
    v = b.peek(8)
    assert v is not None and v.obj is small       # a chunk this small is not worth copying from


def test_the_pdu_readers_leave_no_pin_on_a_receive() -> None:
    """A 256 KiB receive of whole PDUs and the first bytes of the next: what the iSCSI and NVMe/TCP readers
    keep for the next receive is a copy of those bytes, not a view that keeps the 256 KiB alive."""
    from openvsan.protocol.iscsi.framing import PduReader as IscsiReader
    from openvsan.protocol.nvme_tcp.pdu import CH
    from openvsan.protocol.nvme_tcp.queue import TcpQueue

    nop = bytearray(48)
    nop[0], nop[1] = 0x40, 0x80
    nop[5:8] = (4096).to_bytes(3, "big")
    pdu = bytes(nop) + bytes(4096)
    n = (256 * 1024) // len(pdu)
    for held_before in (False, True):
        r = IscsiReader()
        if held_before:
            r.receive_data(pdu[:10])
            chunk = pdu[10:] + pdu * (n - 1) + pdu[:100]
        else:
            chunk = pdu * n + pdu[:100]
        assert len(r.receive_data(chunk)) == n
        assert r.buffered == 100
        assert all(len(c.obj) < 16384 for c in r._buf._chunks)
    q = TcpQueue()
    icreq = CH.pack(0, 0, 128, 0, 128) + bytes(120)
    capsule = CH.pack(4, 0, 72, 72, 72 + 4096) + bytes(64 + 4096)
    chunk = icreq + capsule * ((256 * 1024) // len(capsule)) + capsule[:50]
    q.receive_data(chunk)
    assert q.reader.buffered == 50 and all(len(c.obj) < 16384 for c in q.reader._buf._chunks)


def test_copy_into_reads_across_chunks_without_joining_and_contiguous_says_where_peek_would_copy() -> None:
    b = RecvBuffer()
    for part in (b"abcd", b"efgh", b"ijklmnop"):
        b.append(part)
    assert b.contiguous(4) and not b.contiguous(5)
    out = bytearray(9)
    b.copy_into(2, memoryview(out))
    assert bytes(out) == b"cdefghijk"
    assert b.size == 16 and bytes(b.peek(4)) == b"abcd"    # nothing consumed, nothing joined
    assert b.contiguous(4)
    with pytest.raises(ValueError):
        b.copy_into(10, memoryview(bytearray(7)))
