"""The NBD initiator's transmission phase with a fake transport: requests as bytes out, simple replies in as
bytes (whole, or cut anywhere), the fast paths (read_soon / write_soon) against read() / write()."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_transport import FakeTransport

from openvsan.block.errors import DeviceFailed, MediumError, NoSpace
from openvsan.initiator.nbd import Export, NbdConnection, NbdInitiator, NbdUrl
from openvsan.protocol.nbd.wire import REQUEST, SIMPLE_REPLY, SIMPLE_REPLY_MAGIC, Errno, TransmissionFlag

FLAGS = TransmissionFlag.HAS_FLAGS | TransmissionFlag.SEND_FUA | TransmissionFlag.SEND_FLUSH


def initiator() -> tuple[NbdInitiator, NbdConnection, FakeTransport]:
    conn = NbdConnection("nbd://test:10809/disk0")
    wire = FakeTransport()
    conn.connection_made(wire)
    conn._handshaking = False
    return NbdInitiator(NbdUrl("test", 10809, "disk0"), [conn], Export(1 << 24, FLAGS, 512)), conn, wire


def requests(raw: bytes) -> list[tuple[int, int, int, int, int, bytes]]:
    """(flags, type, cookie, offset, length, payload) of each request in raw."""
    out, pos = [], 0
    while pos < len(raw):
        _, flags, cmd, cookie, offset, length = REQUEST.unpack_from(raw, pos)
        pos += REQUEST.size
        payload = raw[pos:pos + length] if cmd == 1 else b""
        pos += len(payload)
        out.append((flags, cmd, cookie, offset, length, payload))
    return out


def reply(cookie: int, err: int = 0, payload: bytes = b"") -> bytes:
    return SIMPLE_REPLY.pack(SIMPLE_REPLY_MAGIC, err, cookie) + payload


def test_the_fast_paths_send_what_read_and_write_send() -> None:
    """write_soon and read_soon put on the wire the request write() and read() put there (but the cookie), and
    complete with the same results."""
    async def main() -> None:
        nbd, conn, wire = initiator()
        data = bytes(range(256)) * 16
        got: list[Any] = []
        assert nbd.write_soon(8, data, True, got.append)
        assert nbd.read_soon(8, 8, lambda d, e: got.append((bytes(d) if d is not None else None, e)))
        await asyncio.sleep(0)
        fast = requests(wire.take())
        w = asyncio.ensure_future(nbd.write(8, data, fua=True))
        r = asyncio.ensure_future(nbd.read(8, 8))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        normal = requests(wire.take())
        assert [(f, c, o, n, p) for f, c, _, o, n, p in fast] == [(f, c, o, n, p) for f, c, _, o, n, p in normal]
        assert fast[0][:2] == (1, 1) and fast[0][3:5] == (8 * 512, 4096) and fast[1][1] == 0
        conn.data_received(b"".join(reply(c[2], 0, data if c[1] == 0 else b"") for c in fast + normal))
        assert got == [None, (data, None)]
        await w
        assert bytes(await r) == data

    asyncio.run(main())


@pytest.mark.parametrize("cut", [None, 1, 5, 17])
def test_replies_cut_anywhere_answer_as_whole_ones(cut: int | None) -> None:
    """Replies to reads, writes and an error, in one receive or cut into pieces of `cut` bytes: each request
    gets its payload or its typed error, once."""
    async def main() -> None:
        nbd, conn, wire = initiator()
        got: dict[int, Any] = {}
        for i in range(6):
            if i % 3 == 2:
                assert nbd.write_soon(i * 8, bytes([i]) * 4096, False, lambda e, i=i: got.__setitem__(i, e))
            else:
                assert nbd.read_soon(i * 8, 8, lambda d, e, i=i: got.__setitem__(
                    i, bytes(d) if d is not None else e))
        await asyncio.sleep(0)
        sent = requests(wire.take())
        stream = b""
        for i, (_, cmd, cookie, _, n, _) in enumerate(sent):
            if i == 3:
                stream += reply(cookie, Errno.EIO)
            elif i == 5:
                stream += reply(cookie, Errno.ENOSPC)
            else:
                stream += reply(cookie, 0, bytes([i + 1]) * n if cmd == 0 else b"")
        if cut is None:
            conn.data_received(stream)
        else:
            for k in range(0, len(stream), cut):
                conn.data_received(stream[k:k + cut])
        assert got[0] == b"\x01" * 4096 and got[1] == b"\x02" * 4096 and got[2] is None
        assert isinstance(got[3], MediumError) and got[4] == b"\x05" * 4096 and isinstance(got[5], NoSpace)
        assert not conn.pending and not wire.aborted

    asyncio.run(main())


def test_a_reply_to_no_request_drops_the_connection_and_fails_the_rest() -> None:
    async def main() -> None:
        nbd, conn, wire = initiator()
        got: list[Any] = []
        assert nbd.read_soon(0, 8, lambda d, e: got.append(e))
        await asyncio.sleep(0)
        conn.data_received(reply(999))
        assert wire.aborted and len(got) == 1 and isinstance(got[0], DeviceFailed)
        assert not nbd.read_soon(0, 8, lambda d, e: None)           # a dead connection takes no fast request
        with pytest.raises(DeviceFailed):
            await nbd.read(0, 8)

    asyncio.run(main())


def test_the_fast_paths_decline_what_they_cannot_send() -> None:
    async def main() -> None:
        nbd, _, wire = initiator()
        done: Any = lambda *a: None
        assert not nbd.read_soon(0, 0, done) and not nbd.read_soon(nbd.num_blocks, 1, done)
        assert not nbd.write_soon(0, b"x" * 100, False, done)       # not whole blocks
        ro = Export(1 << 24, FLAGS | TransmissionFlag.READ_ONLY, 512)
        nbd2 = NbdInitiator(nbd.url, nbd.conns, ro)
        assert not nbd2.write_soon(0, bytes(512), False, done)
        no_fua = NbdInitiator(nbd.url, nbd.conns, Export(1 << 24, TransmissionFlag.HAS_FLAGS, 512))
        assert not no_fua.write_soon(0, bytes(512), True, done)     # write() writes, then flushes
        await asyncio.sleep(0)
        assert not wire.sent

    asyncio.run(main())
