"""NBD client as a BlockDevice: nbd://HOST[:PORT]/EXPORT[?connections=N] (the NBD URI form of libnbd).

Fixed newstyle handshake and NBD_OPT_GO (proto.md "Newstyle negotiation"), then simple replies only: a
request is one header (plus the data of a WRITE), a reply one header (plus the data of a READ, whose length
the client already knows from the cookie). Several connections when the server sets CAN_MULTI_CONN (proto.md
"Transmission flags": then a FLUSH on any connection covers the writes of all of them).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import Buffer, check_range
from openvsan.block.errors import BlockError, DeviceFailed, MediumError, NoSpace, OutOfRange, ReadOnly
from openvsan.initiator.url import UrlError
from openvsan.protocol.nbd.wire import (
    GREETING,
    IHAVEOPT,
    INFO_BLOCK_SIZE,
    INFO_EXPORT,
    NBDMAGIC,
    OPTION,
    OPTION_REPLY,
    OPTION_REPLY_MAGIC,
    REQUEST,
    REQUEST_MAGIC,
    SIMPLE_REPLY,
    SIMPLE_REPLY_MAGIC,
    U16,
    U32,
    ClientFlag,
    Cmd,
    CmdFlag,
    Errno,
    HandshakeFlag,
    Info,
    Opt,
    Rep,
    TransmissionFlag,
)

NBD_PORT = 10809
DEFAULT_MAX_PAYLOAD = 32 << 20  # proto.md "Block size constraints": 32 MiB when the server says nothing


@dataclass(frozen=True)
class NbdUrl:
    host: str
    port: int
    export: str
    connections: int = 1

    def redacted(self) -> str:
        return f"nbd://{self.host}:{self.port}/{self.export}"


def parse_nbd_url(url: str) -> NbdUrl:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "nbd":
        raise UrlError(f"{url!r}: want nbd://HOST[:PORT]/EXPORT")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    if netloc.startswith("["):
        host, _, tail = netloc[1:].partition("]")
        port_s = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port_s = netloc.partition(":")
    if not host:
        raise UrlError(f"{url!r}: no host")
    if port_s and not (port_s.isascii() and port_s.isdigit() and 0 < int(port_s) < 65536):
        raise UrlError(f"{url!r}: bad port {port_s!r}")
    opts = dict(parse_qsl(query))
    conns = opts.get("connections", "1")
    if not (conns.isdigit() and 1 <= int(conns) <= 64):
        raise UrlError(f"connections={conns}: want 1 to 64")
    return NbdUrl(host, int(port_s) if port_s else NBD_PORT, unquote(path), int(conns))


def _error(err: int, what: str, lba: int, write: bool) -> BlockError:
    # proto.md "Error values"
    if err == Errno.EIO:
        return MediumError(f"{what}: EIO", lba, write=write)
    if err == Errno.ENOSPC:
        return NoSpace(f"{what}: ENOSPC")
    if err == Errno.EPERM:
        return ReadOnly(f"{what}: EPERM")
    if err in (Errno.EINVAL, Errno.EOVERFLOW):
        return OutOfRange(f"{what}: error {err}")
    return DeviceFailed(f"{what}: error {err}")


@dataclass
class Export:
    size: int
    flags: int
    min_block: int = 1
    max_payload: int = DEFAULT_MAX_PAYLOAD


class NbdConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, what: str) -> None:
        self.reader, self.writer, self.what = reader, writer, what
        self.pending: dict[int, tuple[asyncio.Future[Buffer], int]] = {}  # cookie -> (future, read length)
        self.cookies = itertools.count(1)
        self.pump: asyncio.Task[None] | None = None
        self.dead: BaseException | None = None

    @classmethod
    async def connect(cls, u: NbdUrl) -> tuple[NbdConnection, Export]:
        reader, writer = await asyncio.open_connection(u.host, u.port)
        conn = cls(reader, writer, u.redacted())
        try:
            export = await conn._handshake(u.export)
        except BaseException:
            writer.close()
            raise
        conn.pump = asyncio.create_task(conn._replies())
        return conn, export

    async def _handshake(self, name: str) -> Export:
        # proto.md "Fixed newstyle negotiation": NBDMAGIC, IHAVEOPT, handshake flags
        magic, opt_magic, hflags = GREETING.unpack(await self.reader.readexactly(GREETING.size))
        if magic != NBDMAGIC or opt_magic != IHAVEOPT or not hflags & HandshakeFlag.FIXED_NEWSTYLE:
            raise DeviceFailed(f"{self.what}: not a fixed-newstyle NBD server")
        cflags = ClientFlag.FIXED_NEWSTYLE | (ClientFlag.NO_ZEROES if hflags & HandshakeFlag.NO_ZEROES else 0)
        raw = name.encode()
        # proto.md NBD_OPT_GO: u32 name length, name, u16 count of info requests, u16 each
        data = U32.pack(len(raw)) + raw + U16.pack(1) + U16.pack(Info.BLOCK_SIZE)
        self.writer.write(U32.pack(cflags) + OPTION.pack(IHAVEOPT, Opt.GO, len(data)) + data)
        export: Export | None = None
        block: tuple[int, int] | None = None
        while True:
            magic, opt, rep, length = OPTION_REPLY.unpack(await self.reader.readexactly(OPTION_REPLY.size))
            body = await self.reader.readexactly(length) if length else b""
            if magic != OPTION_REPLY_MAGIC or opt != Opt.GO:
                raise DeviceFailed(f"{self.what}: bad option reply")
            if rep == Rep.ACK:
                break
            if rep == Rep.INFO and len(body) >= 2:
                kind = U16.unpack_from(body)[0]
                if kind == Info.EXPORT and len(body) == INFO_EXPORT.size:
                    _, size, tflags = INFO_EXPORT.unpack(body)
                    export = Export(size, tflags)
                elif kind == Info.BLOCK_SIZE and len(body) == INFO_BLOCK_SIZE.size:
                    _, mn, _, mx = INFO_BLOCK_SIZE.unpack(body)
                    block = (mn, mx)
                continue
            if rep & (1 << 31):
                msg = body.decode(errors="replace")
                what = Rep(rep).name if rep in Rep._value2member_map_ else hex(rep)
                raise DeviceFailed(f"{self.what}: export {name!r}: {what} {msg}".rstrip())
        if export is None:
            raise DeviceFailed(f"{self.what}: NBD_OPT_GO ended without NBD_INFO_EXPORT")
        if block is not None:
            export.min_block, export.max_payload = block[0], block[1]
        return export

    async def _replies(self) -> None:
        try:
            while True:
                # proto.md "Simple reply message"
                magic, err, cookie = SIMPLE_REPLY.unpack(await self.reader.readexactly(SIMPLE_REPLY.size))
                if magic != SIMPLE_REPLY_MAGIC:
                    raise DeviceFailed(f"{self.what}: bad reply magic {magic:#x}")
                fut, length = self.pending.pop(cookie, (None, 0))
                if fut is None:
                    raise DeviceFailed(f"{self.what}: reply to unknown cookie {cookie}")
                data = await self.reader.readexactly(length) if length and not err else b""
                if not fut.done():
                    if err:
                        fut.set_exception(_ErrnoReply(err))
                    else:
                        fut.set_result(data)
        except (asyncio.IncompleteReadError, ConnectionError, DeviceFailed) as e:
            self._die(e)

    def _die(self, e: BaseException) -> None:
        self.dead = e
        for fut, _ in self.pending.values():
            if not fut.done():
                fut.set_exception(DeviceFailed(f"{self.what}: connection lost ({e})"))
        self.pending.clear()

    async def request(self, cmd: Cmd, offset: int, length: int, *, flags: int = 0,
                      data: Buffer | None = None) -> Buffer:
        if self.dead is not None:
            raise DeviceFailed(f"{self.what}: connection lost ({self.dead})")
        cookie = next(self.cookies)
        fut: asyncio.Future[Buffer] = asyncio.get_running_loop().create_future()
        self.pending[cookie] = (fut, length if cmd == Cmd.READ else 0)
        # proto.md "Request message": magic, command flags, type, cookie, offset, length (+ WRITE payload)
        hdr = REQUEST.pack(REQUEST_MAGIC, flags, cmd, cookie, offset, length)
        if data is None:
            self.writer.write(hdr)
        else:
            self.writer.writelines((hdr, data))
        return await fut

    async def close(self) -> None:
        if self.dead is None:
            try:
                self.writer.write(REQUEST.pack(REQUEST_MAGIC, 0, Cmd.DISC, 0, 0, 0))  # proto.md NBD_CMD_DISC
                await self.writer.drain()
            except ConnectionError:
                pass
        if self.pump:
            self.pump.cancel()
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


class _ErrnoReply(Exception):
    def __init__(self, err: int) -> None:
        super().__init__(err)
        self.err = err


class NbdInitiator:
    def __init__(self, url: NbdUrl, conns: list[NbdConnection], export: Export) -> None:
        self.url = url
        self.conns = conns
        self.export = export
        self.block_size = 512 if export.min_block <= 512 else 4096
        self.num_blocks = export.size // self.block_size
        self.capabilities = Capabilities(volatile_cache=True)  # the remote end may cache writes until flush
        self.max_io_blocks = max(1, min(export.max_payload, DEFAULT_MAX_PAYLOAD) // self.block_size)
        self._rr = itertools.cycle(range(len(conns)))

    @classmethod
    async def open_url(cls, url: str, **overrides: Any) -> NbdInitiator:
        u = parse_nbd_url(url)
        if "connections" in overrides:
            u = NbdUrl(u.host, u.port, u.export, int(overrides["connections"]))
        first, export = await NbdConnection.connect(u)
        conns = [first]
        try:
            if u.connections > 1 and export.flags & TransmissionFlag.CAN_MULTI_CONN:
                more = await asyncio.gather(*(NbdConnection.connect(u) for _ in range(u.connections - 1)))
                conns += [c for c, _ in more]
        except BaseException:
            await asyncio.gather(*(c.close() for c in conns))
            raise
        return cls(u, conns, export)

    def _conn(self) -> NbdConnection:
        if len(self.conns) == 1:
            return self.conns[0]
        return min(self.conns, key=lambda c: len(c.pending))

    async def _do(self, cmd: Cmd, lba: int, blocks: int, *, flags: int = 0, data: Buffer | None = None) -> Buffer:
        bs = self.block_size
        try:
            return await self._conn().request(cmd, lba * bs, blocks * bs, flags=flags, data=data)
        except _ErrnoReply as e:
            raise _error(e.err, f"{self.url.redacted()} {cmd.name} LBA {lba}", lba,
                         cmd != Cmd.READ) from None

    def _flag(self, f: TransmissionFlag) -> bool:
        return bool(self.export.flags & f)

    async def read(self, lba: int, blocks: int) -> Buffer:
        check_range(self, lba, blocks)
        if blocks <= self.max_io_blocks:
            return await self._do(Cmd.READ, lba, blocks) if blocks else b""
        parts = await asyncio.gather(*(self._do(Cmd.READ, a, min(self.max_io_blocks, lba + blocks - a))
                                       for a in range(lba, lba + blocks, self.max_io_blocks)))
        return b"".join(parts)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        if self._flag(TransmissionFlag.READ_ONLY):
            raise ReadOnly(f"{self.url.redacted()}: read-only export")
        view = memoryview(data).cast("B")
        bs = self.block_size
        if len(view) % bs:
            raise ValueError(f"write of {len(view)} bytes is not a multiple of the block size {bs}")
        blocks = len(view) // bs
        check_range(self, lba, blocks)
        flags = CmdFlag.FUA if fua and self._flag(TransmissionFlag.SEND_FUA) else 0
        step = self.max_io_blocks
        await asyncio.gather(*(self._do(Cmd.WRITE, a, min(step, lba + blocks - a), flags=flags,
                                        data=view[(a - lba) * bs:(a - lba + min(step, lba + blocks - a)) * bs])
                               for a in range(lba, lba + blocks, step)))
        if fua and not flags and self._flag(TransmissionFlag.SEND_FLUSH):
            await self.flush()

    async def flush(self) -> None:
        if self._flag(TransmissionFlag.SEND_FLUSH):
            await self._do(Cmd.FLUSH, 0, 0)

    async def unmap(self, lba: int, blocks: int) -> None:
        check_range(self, lba, blocks)
        if self._flag(TransmissionFlag.SEND_TRIM) and blocks:
            await self._do(Cmd.TRIM, lba, blocks)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        check_range(self, lba, blocks)
        if not blocks:
            return
        if self._flag(TransmissionFlag.SEND_WRITE_ZEROES):
            await self._do(Cmd.WRITE_ZEROES, lba, blocks)
            return
        step = self.max_io_blocks
        for a in range(lba, lba + blocks, step):
            n = min(step, lba + blocks - a)
            await self.write(a, bytes(n * self.block_size))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.conns), return_exceptions=True)

    def to_config(self) -> dict[str, Any]:
        return {"type": "nbd", "url": self.url.redacted(), "connections": len(self.conns)}
