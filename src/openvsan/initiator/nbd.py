"""NBD client as a BlockDevice: nbd://HOST[:PORT]/EXPORT[?connections=N] (the NBD URI form of libnbd).

Fixed newstyle handshake and NBD_OPT_GO (proto.md "Newstyle negotiation"), then simple replies only: a
request is one header (plus the data of a WRITE), a reply one header (plus the data of a READ, whose length
the client already knows from the cookie). Several connections when the server sets CAN_MULTI_CONN (proto.md
"Transmission flags": then a FLUSH on any connection covers the writes of all of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import Buffer, ReadDone, WriteDone, check_range
from openvsan.block.errors import BlockError, DeviceFailed, MediumError, NoSpace, OutOfRange, ReadOnly
from openvsan.initiator.url import UrlError
from openvsan.netio import WriteBatcher
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
_REPLY_LEN = SIMPLE_REPLY.size
_READ, _WRITE = int(Cmd.READ), int(Cmd.WRITE)
# a request's answer: (payload, None); (None, the error number of an error reply); (None, the exception of a
# lost connection)
Reply = Callable[[Buffer | None, "BaseException | int | None"], None]


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


class NbdConnection(asyncio.Protocol):
    """One NBD connection: the handshake, then requests sent in batches (netio.WriteBatcher: what one turn of
    the event loop asks leaves in one send) and simple replies taken straight from each receive."""

    def __init__(self, what: str) -> None:
        self.what = what
        # cookie -> (then, read length): then(payload, None) once answered, then(None, error number) for an
        # error reply; a lost connection calls then(None, exception)
        self.pending: dict[int, tuple[Reply, int]] = {}
        self.cookies = itertools.count(1)
        self.dead: BaseException | None = None
        self.transport: asyncio.Transport | None = None
        self._batch = WriteBatcher()
        self._buf = bytearray()         # handshake bytes not yet read; a reply cut by the end of a receive
        self._handshaking = True
        self._waiter: asyncio.Future[None] | None = None
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @classmethod
    async def connect(cls, u: NbdUrl) -> tuple[NbdConnection, Export]:
        _, conn = await asyncio.get_running_loop().create_connection(lambda: cls(u.redacted()), u.host, u.port)
        try:
            export = await conn._handshake(u.export)
        except BaseException:
            conn.abort()
            raise
        return conn, export

    # ---- transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._batch.transport = self.transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._batch.transport = None
        self._die(exc or ConnectionResetError("closed by the server"))
        if not self._closed.done():
            self._closed.set_result(None)
        self._wake()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._handshaking:
            self._buf += data
            self._wake()
            return
        if self._buf:
            self._buf += data
            data, self._buf = bytes(self._buf), bytearray()
        self._replies(data)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _readexactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            if self.dead is not None:
                raise DeviceFailed(f"{self.what}: connection lost during the handshake ({self.dead})")
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    # ---- handshake
    async def _handshake(self, name: str) -> Export:
        # proto.md "Fixed newstyle negotiation": NBDMAGIC, IHAVEOPT, handshake flags
        magic, opt_magic, hflags = GREETING.unpack(await self._readexactly(GREETING.size))
        if magic != NBDMAGIC or opt_magic != IHAVEOPT or not hflags & HandshakeFlag.FIXED_NEWSTYLE:
            raise DeviceFailed(f"{self.what}: not a fixed-newstyle NBD server")
        cflags = ClientFlag.FIXED_NEWSTYLE | (ClientFlag.NO_ZEROES if hflags & HandshakeFlag.NO_ZEROES else 0)
        raw = name.encode()
        # proto.md NBD_OPT_GO: u32 name length, name, u16 count of info requests, u16 each
        data = U32.pack(len(raw)) + raw + U16.pack(1) + U16.pack(Info.BLOCK_SIZE)
        assert self.transport is not None
        self.transport.write(U32.pack(cflags) + OPTION.pack(IHAVEOPT, Opt.GO, len(data)) + data)
        export: Export | None = None
        block: tuple[int, int] | None = None
        while True:
            magic, opt, rep, length = OPTION_REPLY.unpack(await self._readexactly(OPTION_REPLY.size))
            body = await self._readexactly(length) if length else b""
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
        self._handshaking = False
        if self._buf:   # the server spoke before we asked: a reply to no request, which _replies refuses
            data, self._buf = bytes(self._buf), bytearray()
            self._replies(data)
        return export

    # ---- transmission
    def _replies(self, data: bytes) -> None:
        """proto.md "Simple reply message": each whole reply in `data` answers its request (a READ's payload a
        view of the receive); a reply cut by the end of the receive waits in _buf for the rest."""
        n = len(data)
        pos = 0
        pending = self.pending
        view: memoryview | None = None
        while n - pos >= _REPLY_LEN:
            magic, err, cookie = SIMPLE_REPLY.unpack_from(data, pos)
            if magic != SIMPLE_REPLY_MAGIC:
                self._fail(f"bad reply magic {magic:#x}")
                return
            got = pending.get(cookie)
            if got is None:
                self._fail(f"reply to unknown cookie {cookie}")
                return
            then, length = got
            end = pos + _REPLY_LEN + (0 if err else length)
            if end > n:
                break
            del pending[cookie]
            if err:
                then(None, err)
            elif length:
                if view is None:
                    view = memoryview(data)
                then(view[pos + _REPLY_LEN:end], None)
            else:
                then(b"", None)
            pos = end
            if self.dead is not None:
                return
        if pos < n:
            self._buf = bytearray(data[pos:])

    def _fail(self, why: str) -> None:
        self._die(DeviceFailed(f"{self.what}: {why}"))
        self.abort()

    def _die(self, e: BaseException) -> None:
        if self.dead is None:
            self.dead = e
        lost = DeviceFailed(f"{self.what}: connection lost ({e})")
        pending, self.pending = self.pending, {}
        for then, _ in pending.values():
            then(None, lost)

    def request_then(self, cmd: int, offset: int, length: int, flags: int, data: Buffer | None,
                     then: Reply) -> None:
        """Send one request now (its header and a WRITE's payload leave with the rest of this turn's):
        then(payload, None) once answered (b"" but for a READ), then(None, errno) for an error reply,
        then(None, exception) once the connection is lost."""
        if self.dead is not None:
            raise DeviceFailed(f"{self.what}: connection lost ({self.dead})")
        cookie = next(self.cookies)
        self.pending[cookie] = (then, length if cmd == _READ else 0)
        # proto.md "Request message": magic, command flags, type, cookie, offset, length (+ WRITE payload)
        hdr = REQUEST.pack(REQUEST_MAGIC, flags, cmd, cookie, offset, length)
        self._batch.send((hdr,) if data is None else (hdr, data))

    async def request(self, cmd: int, offset: int, length: int, *, flags: int = 0,
                      data: Buffer | None = None) -> Buffer:
        fut: asyncio.Future[Buffer] = asyncio.get_running_loop().create_future()

        def answered(payload: Buffer | None, e: BaseException | int | None) -> None:
            if fut.done():
                return
            if e is None:
                fut.set_result(payload if payload is not None else b"")
            else:
                fut.set_exception(_ErrnoReply(e) if isinstance(e, int) else e)
        self.request_then(cmd, offset, length, flags, data, answered)
        return await fut

    async def close(self) -> None:
        if self.dead is None and self.transport is not None:
            self._batch.flush()
            self.transport.write(REQUEST.pack(REQUEST_MAGIC, 0, Cmd.DISC, 0, 0, 0))  # proto.md NBD_CMD_DISC
            self.transport.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._closed), 5)


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
        self._read_only = self._flag(TransmissionFlag.READ_ONLY)
        self._fua = self._flag(TransmissionFlag.SEND_FUA)

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
            raise self._failure(e.err, cmd, lba) from None

    def _flag(self, f: TransmissionFlag) -> bool:
        return bool(self.export.flags & f)

    def read_soon(self, lba: int, blocks: int, done: ReadDone) -> bool:
        """read()'s fast path (block/device.py ReadSoon): one READ sent in this turn on a live connection,
        done(data, None) once read, done(None, exc) on an error reply (read()'s typed error) or a lost
        connection, with no retry. False: not sent."""
        if blocks <= 0 or blocks > self.max_io_blocks or lba < 0 or lba + blocks > self.num_blocks:
            return False
        conn = self._conn()
        if conn.dead is not None:
            return False
        bs = self.block_size

        def answered(data: Buffer | None, e: BaseException | int | None) -> None:
            if e is None:
                done(data, None)
            else:
                done(None, self._failure(e, _READ, lba))
        conn.request_then(_READ, lba * bs, blocks * bs, 0, None, answered)
        return True

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
        """write()'s fast path (block/device.py WriteSoon): one WRITE sent in this turn on a live connection
        (FUA only where the export takes it: else write() writes and flushes); done(None) once written,
        done(exc) otherwise, with no retry. False: not sent."""
        mv = memoryview(data).cast("B")
        bs = self.block_size
        blocks = len(mv) // bs
        if (self._read_only or (fua and not self._fua) or not blocks or len(mv) % bs
                or blocks > self.max_io_blocks or lba < 0 or lba + blocks > self.num_blocks):
            return False
        conn = self._conn()
        if conn.dead is not None:
            return False

        def answered(_: Buffer | None, e: BaseException | int | None) -> None:
            done(None if e is None else self._failure(e, _WRITE, lba))
        conn.request_then(_WRITE, lba * bs, len(mv), CmdFlag.FUA if fua else 0, mv, answered)
        return True

    def _failure(self, e: BaseException | int, cmd: int, lba: int) -> BaseException:
        """The typed block error of an error reply (an error number), as _do raises it; a lost connection's own."""
        if isinstance(e, int):
            return _error(e, f"{self.url.redacted()} {Cmd(cmd).name} LBA {lba}", lba, cmd != _READ)
        return e

    async def read(self, lba: int, blocks: int) -> Buffer:
        check_range(self, lba, blocks)
        if blocks <= self.max_io_blocks:
            return await self._do(Cmd.READ, lba, blocks) if blocks else b""
        parts = await asyncio.gather(*(self._do(Cmd.READ, a, min(self.max_io_blocks, lba + blocks - a))
                                       for a in range(lba, lba + blocks, self.max_io_blocks)))
        return b"".join(parts)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        if self._read_only:
            raise ReadOnly(f"{self.url.redacted()}: read-only export")
        view = memoryview(data).cast("B")
        bs = self.block_size
        if len(view) % bs:
            raise ValueError(f"write of {len(view)} bytes is not a multiple of the block size {bs}")
        blocks = len(view) // bs
        check_range(self, lba, blocks)
        flags = CmdFlag.FUA if fua and self._fua else 0
        step = self.max_io_blocks
        if blocks <= step:
            await self._do(Cmd.WRITE, lba, blocks, flags=flags, data=view)
        else:
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
