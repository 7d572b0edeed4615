"""The asyncio NBD server: portals, connections, and block I/O for checked requests.

A Connection is an asyncio.Protocol that feeds received bytes to the sans-IO NbdServerConnection
(protocol/nbd) and runs the requests it yields on the export's BlockDevice, each in its own task, so
replies go out in completion order (proto.md "Transmission": replies need not be in request order).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import Sequence

from openvsan.block.device import SyncRead, SyncWrite
from openvsan.block.errors import (
    BlockError,
    MediumError,
    NoSpace,
    OutOfRange,
    ReadOnly,
)
from openvsan.netio import start_eagerly
from openvsan.protocol.nbd import (
    Close,
    Cmd,
    Disconnect,
    Errno,
    ExportInfo,
    NbdServerConnection,
    Negotiated,
    Request,
    Send,
)
from openvsan.protocol.nbd.events import DEFAULT_MAX_PAYLOAD, Buffer
from openvsan.target.config import NbdExportConfig
from openvsan.target.portals import BatchedConnection, PortalServer

log = logging.getLogger("openvsan.nbd")

HANDSHAKE_TIMEOUT = 30.0                 # a connection must reach the transmission phase within this time
MAX_INFLIGHT = 256                       # requests one connection may have running before we stop reading
MAX_INFLIGHT_BYTES = 128 * 1024 * 1024   # data (write payloads, read results) one connection may hold
ZERO_CHUNK = 1024 * 1024                 # NBD_CMD_FLAG_NO_HOLE writes real zeroes this much at a time
_ZEROES = bytes(ZERO_CHUNK)


def export_info(e: NbdExportConfig) -> ExportInfo:
    bs = e.device.block_size
    # proto.md "Size constraints": the device's block is the smallest unit we can write without a
    # read-modify-write, so it is the minimum block size we ask clients to keep to
    return ExportInfo(e.name, e.device.num_blocks * bs, min_block=bs, preferred_block=max(4096, bs),
                      max_payload=DEFAULT_MAX_PAYLOAD, read_only=e.read_only, description=e.description)


class NbdServer(PortalServer):
    kind = "NBD"

    def __init__(self, exports: Sequence[NbdExportConfig], *, handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        super().__init__()
        names = [e.name for e in exports]
        if len(set(names)) != len(names):
            raise ValueError(f"NBD export names must be unique: {names}")
        self.exports = {e.name: e for e in exports}
        self.handshake_timeout = handshake_timeout
        self.tasks: set[asyncio.Task[None]] = set()
        self._on_portal: dict[tuple[str, int], list[ExportInfo]] = {}

    def portals(self) -> list[tuple[str, int]]:
        seen: dict[tuple[str, int], None] = {}
        for e in self.exports.values():
            for host, port in e.portals:
                seen[(host, int(port))] = None
        return list(seen)

    def make_connection(self, portal: tuple[str, int]) -> Connection:
        return Connection(self, portal)

    def portal_note(self, portal: tuple[str, int]) -> str:
        self._on_portal[portal] = [export_info(e) for e in self.exports.values()
                                   if portal in [(h, int(p)) for h, p in e.portals]]
        return ", ".join(x.name for x in self._on_portal[portal])

    def before_drain(self) -> None:
        # requests still arriving get NBD_ESHUTDOWN while those in flight finish
        for c in list(self.connections):
            assert isinstance(c, Connection)
            c.conn.start_shutdown()

    def in_flight(self) -> list[asyncio.Future[None]]:
        return list(self.tasks)

    def exports_on(self, portal: tuple[str, int]) -> list[ExportInfo]:
        return self._on_portal.get(portal, [])


class Connection(BatchedConnection):
    """One TCP connection: the handshake, then the transmission phase on one export."""

    def __init__(self, server: NbdServer, portal: tuple[str, int]) -> None:
        super().__init__()
        self.server = server
        self.portal = portal
        self.conn = NbdServerConnection(server.exports_on(portal))
        self.export: NbdExportConfig | None = None
        self.inflight = 0
        self.inflight_bytes = 0
        self._disconnecting = False
        self._write_paused = False
        self._reading_paused = False
        self._timer: asyncio.TimerHandle | None = None
        # requests parsed but not started: one received chunk can hold thousands of 28-byte requests, each
        # asking for up to 32 MiB, so the budget is kept per request, not per chunk
        self._waiting: deque[Request] = deque()
        self._starting = False

    # --- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # TCP_NODELAY: proto.md "Protocol phases" asks both ends for it
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.server.connections.add(self)
        if self.server.closing:
            self.conn.start_shutdown()
        self._timer = asyncio.get_running_loop().call_later(self.server.handshake_timeout, self._handshake_expired)
        self.send([self.conn.greeting()])

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        # requests still running finish on the device (a write may be half done); their replies are dropped

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    def received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if self._closed:
                return
            if isinstance(event, Request):
                self._start(event)
            elif isinstance(event, Send):
                self.send(event.data)
            elif isinstance(event, Negotiated):
                self._negotiated(event)
            elif isinstance(event, Disconnect):
                self._disconnecting = True
                self._update_reading()
                self._maybe_finish()
            elif isinstance(event, Close):
                log.warning("%s: %s; closing the connection", self.peer, event.reason)
                self.close()

    # --- sending ----------------------------------------------------------------------------------
    def send(self, data: list[Buffer]) -> None:
        self.send_buffers(data)

    def _update_reading(self) -> None:
        if self._closed or self.transport is None:
            return
        pause = self._write_paused or self._disconnecting or bool(self._waiting) or self._over_budget()
        if pause and not self._reading_paused:
            self.transport.pause_reading()
        elif not pause and self._reading_paused:
            self.transport.resume_reading()
        self._reading_paused = pause

    def _over_budget(self) -> bool:
        return self.inflight >= MAX_INFLIGHT or self.inflight_bytes >= MAX_INFLIGHT_BYTES

    def _maybe_finish(self) -> None:
        if self._disconnecting and not self.inflight and not self._waiting:
            self.close()

    # --- handshake --------------------------------------------------------------------------------
    def _handshake_expired(self) -> None:
        if self.conn.session is None and not self._closed:
            log.warning("%s: NBD handshake not finished in %.0f s; dropping the connection", self.peer,
                        self.server.handshake_timeout)
            self.close()

    def _negotiated(self, ev: Negotiated) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.export = self.server.exports[ev.export.name]
        self.logged_in()
        log.info("%s: NBD export %s (%d bytes%s%s)", self.peer, ev.export.name, ev.export.size,
                 ", read-only" if ev.export.read_only else "", ", structured replies" if ev.structured else "")

    # --- requests ---------------------------------------------------------------------------------
    def _start(self, req: Request) -> None:
        if self._waiting or self._over_budget():
            self._waiting.append(req)
            self._update_reading()
            return
        self._run_now(req)

    def _start_waiting(self) -> None:
        if self._starting:
            return  # a request that completed at once, inside the loop below: the loop goes on
        self._starting = True
        try:
            while self._waiting and not self._over_budget() and not self._closed:
                self._run_now(self._waiting.popleft())
        finally:
            self._starting = False

    def _run_now(self, req: Request) -> None:
        if self.server.closing:
            # proto.md "Terminating the transmission phase": requests after shutdown began: NBD_ESHUTDOWN
            self.send(self.conn.reply_error(req, Errno.ESHUTDOWN, "the server is shutting down"))
            return
        if self._done_now(req):
            return
        size = req.length if req.cmd in (Cmd.READ, Cmd.WRITE) else 0
        self.inflight += 1
        self.inflight_bytes += size
        # a device that answers at once (RAM) completes the request here, with no Task (netio.start_eagerly)
        task = start_eagerly(self._execute(req, size))
        if task is not None:
            self.server.tasks.add(task)
            task.add_done_callback(self.server.tasks.discard)
        self._update_reading()

    def _done_now(self, req: Request) -> bool:
        """A read or write (checked already by the protocol layer) done at once by a device that can
        (block/device.py SyncRead / SyncWrite) and answered here; False: nothing was done, the request runs
        the normal way. A SyncWrite write is durable on return, so FUA needs nothing more."""
        assert self.export is not None
        dev = self.export.device
        bs = dev.block_size
        if not req.length or req.offset % bs or req.length % bs:
            return False
        if req.cmd == Cmd.READ and isinstance(dev, SyncRead):
            data = dev.read_now(req.offset // bs, req.length // bs)
            if data is None:
                return False
            self.send(self.conn.reply(req, data))
            if not isinstance(data, bytes):
                self._batch.flush()  # a lent view leaves before a later request of this read can write there
            return True
        if req.cmd == Cmd.WRITE and isinstance(dev, SyncWrite) and req.payload is not None:
            if not dev.write_now(req.offset // bs, req.payload):
                return False
            self.send(self.conn.reply(req))
            return True
        return False

    async def _execute(self, req: Request, size: int) -> None:
        try:
            out = await self._run(req)
        except BlockError as e:
            errno, offset = _errno(req, e, self.export)
            out = self.conn.reply_error(req, errno, f"{_cmd_name(req.cmd)}: {e}", offset)
        except Exception as e:  # one failing request must not take the connection down
            log.exception("%s: %s at offset %d failed", self.peer, _cmd_name(req.cmd), req.offset)
            out = self.conn.reply_error(req, Errno.EIO, f"{_cmd_name(req.cmd)}: internal error: {e}")
        finally:
            self.inflight -= 1
            self.inflight_bytes -= size
        self.send(out)
        self._start_waiting()
        self._update_reading()
        self._maybe_finish()

    async def _run(self, req: Request) -> list[Buffer]:
        assert self.export is not None
        dev = self.export.device
        bs = dev.block_size
        lba, blocks = req.offset // bs, req.length // bs
        cmd = req.cmd
        if cmd == Cmd.READ:
            data = await dev.read(lba, blocks) if blocks else b""
            return self.conn.reply(req, data)
        if cmd == Cmd.WRITE:
            assert req.payload is not None
            if blocks:
                await dev.write(lba, req.payload, fua=req.fua)
            elif req.fua:
                await dev.flush()
        elif cmd == Cmd.FLUSH:
            await dev.flush()
        elif cmd == Cmd.TRIM:
            if blocks:
                await dev.unmap(lba, blocks)
            if req.fua:
                await dev.flush()
        elif cmd == Cmd.WRITE_ZEROES:
            if req.no_hole:
                # proto.md NBD_CMD_FLAG_NO_HOLE: the range must end up provisioned, so write real zeroes
                # (write_zeroes may punch a hole)
                step = ZERO_CHUNK // bs
                for at in range(lba, lba + blocks, step):
                    n = min(step, lba + blocks - at)
                    await dev.write(at, memoryview(_ZEROES)[:n * bs])
            elif blocks:
                await dev.write_zeroes(lba, blocks)
            if req.fua:
                await dev.flush()
        elif cmd == Cmd.BLOCK_STATUS:
            # base:allocation: every block is reported allocated with unknown contents (status 0), which
            # proto.md allows ("a server MAY always safely report a status of 0 for any block")
            size = dev.num_blocks * bs
            n = req.length or min(size - req.offset, 4096)
            if n <= 0:
                return self.conn.reply_error(req, Errno.EINVAL, "NBD_CMD_BLOCK_STATUS at the end of the export")
            return self.conn.reply_block_status(req, [(n, 0)])
        # NBD_CMD_CACHE: a hint; every read already goes to the device, so there is nothing to warm
        return self.conn.reply(req)


def _cmd_name(cmd: int) -> str:
    try:
        return f"NBD_CMD_{Cmd(cmd).name}"
    except ValueError:
        return f"command {cmd}"


def _errno(req: Request, e: BlockError, export: NbdExportConfig | None) -> tuple[Errno, int | None]:
    """Block errors to proto.md "Error values" (one place, as the SCSI layer does for sense data)."""
    if isinstance(e, ReadOnly):
        return Errno.EPERM, None
    if isinstance(e, NoSpace):
        return Errno.ENOSPC, None
    if isinstance(e, OutOfRange):
        return (Errno.ENOSPC if req.cmd in (Cmd.WRITE, Cmd.WRITE_ZEROES) else Errno.EINVAL), None
    if isinstance(e, MediumError) and e.lba is not None and export is not None:
        # NBD_REPLY_TYPE_ERROR_OFFSET: the offset MUST lie within the request
        offset = e.lba * export.device.block_size
        if req.offset <= offset < req.offset + req.length:
            return Errno.EIO, offset
    # MediumError, DeviceFailed, Busy (NBD has no "try again") and anything newer
    return Errno.EIO, None
