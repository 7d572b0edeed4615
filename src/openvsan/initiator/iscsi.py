"""`IscsiInitiator`: a remote iSCSI LUN as a `BlockDevice`, and SendTargets discovery.

Several sessions (`queues=N`, each its own ISID and TCP connection, as Linux and VMware do multipath) carry
the commands; each keeps at most `queue_depth` commands out and never more than the target's MaxCmdSN
allows. A dropped connection is logged in again (same ISID, TSIH 0: the target reinstates the session,
RFC 7143 §6.3.5) and the commands that were out are sent again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import Buffer, ReadDone, WriteDone, check_range
from openvsan.block.errors import BlockError, DeviceFailed
from openvsan.initiator import scsi as X
from openvsan.initiator.iscsi_conn import Answer, Completion, ConnectionLost, IscsiConnection
from openvsan.initiator.url import TargetUrl, UrlError, parse_url
from openvsan.netio import Slots
from openvsan.protocol.iscsi.initiator_login import LoginConfig, LoginError
from openvsan.protocol.iscsi.pdu import encode_lun
from openvsan.protocol.scsi import sense as S

log = logging.getLogger("openvsan.initiator.iscsi")
MAX_IO_BYTES = 4 << 20  # split larger requests: targets commonly cap a command at a few MiB (VPD B0)


def default_initiator_name() -> str:
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname().lower()) or "host"
    return f"iqn.2026-11.org.openvsan:initiator.{host}"


@dataclass
class IscsiOptions:
    initiator_name: str = ""
    chap: tuple[str, str] | None = None
    mutual_chap: tuple[str, str] | None = None
    header_digest: bool = False
    data_digest: bool = False
    queues: int = 1
    queue_depth: int = 32
    command_timeout: float = 30.0     # a command unanswered this long: drop the connection, send it again
    reconnect_timeout: float = 60.0   # give up (DeviceFailed) after trying to log in again this long
    connect_timeout: float = 10.0

    @classmethod
    def from_url(cls, u: TargetUrl) -> IscsiOptions:
        mutual = None
        if "target_user" in u.options:
            mutual = (u.options["target_user"], u.options.get("target_password", ""))
        return cls(
            initiator_name=u.options.get("initiator", ""),
            chap=(u.user, u.secret or "") if u.user is not None else None,
            mutual_chap=mutual,
            header_digest=u.opt_bool("header_digest"),
            data_digest=u.opt_bool("data_digest"),
            queues=u.opt_int("queues", 1, 1, 64),
            queue_depth=u.opt_int("queue_depth", 32, 1, 4096),
        )


class IscsiSession:
    """One session = one connection (MaxConnections=1), logged in again after it drops."""

    def __init__(self, host: str, port: int, target: str | None, opts: IscsiOptions, qualifier: int) -> None:
        self.host, self.port, self.target, self.opts = host, port, target, opts
        # RFC 7143 §11.12.5: ISID type 10b (random): B and C random, D our queue number
        self.isid = bytes((0x80,)) + os.urandom(3) + qualifier.to_bytes(2, "big")
        self.conn: IscsiConnection | None = None
        self._connecting = asyncio.Lock()
        self._slots = Slots(opts.queue_depth)
        self.inflight = 0
        self.logins = 0
        self.closed = False
        # told the ASC/ASCQ of each unit attention before the command is sent again (a multipath device
        # re-reads the path states on ASYMMETRIC ACCESS STATE CHANGED, SPC-4 5.15.2.6)
        self.on_attention: Callable[[int], None] | None = None

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port} {self.target or 'discovery'} isid {self.isid.hex()}"

    async def connect(self) -> IscsiConnection:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: IscsiConnection(self.name, self.opts.command_timeout), self.host,
                                   self.port),
            self.opts.connect_timeout)
        cfg = LoginConfig(initiator_name=self.opts.initiator_name or default_initiator_name(),
                          target_name=self.target, isid=self.isid, chap=self.opts.chap,
                          mutual_chap=self.opts.mutual_chap, header_digest=self.opts.header_digest,
                          data_digest=self.opts.data_digest)
        try:
            await asyncio.wait_for(conn.login(cfg), self.opts.connect_timeout)
        except BaseException:
            conn.abort()
            raise
        self.conn = conn
        return conn

    async def ensure(self) -> IscsiConnection:
        conn = self.conn
        if conn is not None and conn.alive:
            return conn
        async with self._connecting:
            if self.conn is not None and self.conn.alive:
                return self.conn
            if self.closed:
                raise DeviceFailed(f"{self.name}: closed")
            deadline = time.monotonic() + self.opts.reconnect_timeout
            delay = 0.1
            while True:
                try:
                    conn = await self.connect()
                    self.logins += 1
                    if self.logins > 1:
                        log.info("%s: logged in again", self.name)
                    return conn
                except LoginError as e:
                    if e.status[0] != 3:  # only a target error (class 3, §11.13.5) may pass if we wait
                        raise DeviceFailed(f"{self.name}: login failed: {e}") from e
                    err: Exception = e
                except (TimeoutError, OSError, ConnectionLost) as e:
                    err = e
                if self.logins == 0:  # never logged in: a wrong address or a target that is down
                    raise DeviceFailed(f"{self.name}: cannot connect: {err}") from err
                if time.monotonic() + delay > deadline:
                    raise DeviceFailed(f"{self.name}: cannot reconnect: {err}") from err
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def execute(self, cdb: bytes, lun: bytes, *, read_len: int = 0, data: Buffer | None = None,
                      retries: int = 8) -> Completion:
        """Run one command to a final status, across reconnects; retries unit attentions and busy."""
        # acquire/release rather than `async with`: two coroutine calls less per command (vsan bench is
        # bound by this client's CPU)
        await self._slots.acquire()
        self.inflight += 1
        try:
            attempt = 0
            while True:
                conn = self.conn
                if conn is None or not conn.alive:
                    conn = await self.ensure()
                try:
                    if not conn.window_open():
                        await conn.wait_window()
                    if conn.paused:
                        await conn.drain()
                    # the connection's watchdog drops it when a command goes unanswered too long
                    done = await conn.command(cdb, lun, read_len=read_len, data=data)
                except ConnectionLost as e:
                    log.info("%s: %s; sending the command again", self.name, e)
                    continue
                if done.status != S.GOOD and X.retryable(done.status, done.sense) and attempt < retries:
                    attempt += 1
                    if self.on_attention is not None and done.status == S.CHECK_CONDITION:
                        key, asc, _ = X.sense_key_asc(done.sense)
                        if key == S.UNIT_ATTENTION:
                            self.on_attention(asc)
                    if done.status != S.CHECK_CONDITION:
                        await asyncio.sleep(0.01 * attempt)
                    continue
                return done
        finally:
            self.inflight -= 1
            self._slots.release()

    def execute_soon(self, cdb: bytes, lun: bytes, read_len: int, data: Buffer | None, then: Answer) -> bool:
        """One command sent now, with no coroutine (read_soon, write_soon: they must not wait), where execute()
        would send it at once: logged in, the command window open, the transport not asking us to wait, a
        slot free. `then(completion, None)` once answered (any status: no retry here), `then(None, exc)` once
        the connection is lost, the slot given back first. False: nothing sent (execute() waits, retries,
        reconnects)."""
        conn = self.conn
        if conn is None or not conn.alive or not conn.window_open() or conn.paused:
            return False
        slots = self._slots
        if not slots.try_acquire():
            return False

        def answered(c: Completion | None, e: BaseException | None) -> None:
            self.inflight -= 1
            slots.put_back()
            then(c, e)

        try:
            conn.command_then(cdb, lun, read_len, data, answered)
        except ConnectionLost:
            slots.release()
            return False
        self.inflight += 1
        return True

    async def close(self) -> None:
        self.closed = True
        if self.conn is not None:
            await self.conn.logout()
            self.conn = None


class IscsiInitiator:
    """A LUN of a remote iSCSI target as a BlockDevice (SBC-4 commands over RFC 7143)."""

    block_size: int
    num_blocks: int

    def __init__(self, host: str, port: int, target: str, lun: int = 0, opts: IscsiOptions | None = None,
                 url: str = "") -> None:
        self.host, self.port, self.target, self.lun = host, port, target, lun
        self.opts = opts or IscsiOptions()
        self.url = url or f"iscsi://{host}:{port}/{target}/{lun}"
        self._lun = encode_lun(lun)
        self.sessions = [IscsiSession(host, port, target, self.opts, i) for i in range(self.opts.queues)]
        self.block_size = 512
        self.num_blocks = 0
        self.capabilities = Capabilities(volatile_cache=True)  # the remote end may cache writes until flush
        self.inquiry: X.Inquiry | None = None
        self.capacity: X.Capacity | None = None
        self.limits = X.BlockLimits()
        self.provisioning = X.Provisioning()
        self.max_io_blocks = 0

    @classmethod
    async def open_url(cls, url: str, **overrides: Any) -> IscsiInitiator:
        u = parse_url(url)
        if not u.iscsi or u.name is None:
            raise UrlError(f"{u.redacted()}: want iscsi://HOST[:PORT]/IQN/LUN")
        opts = IscsiOptions.from_url(u)
        for k, v in overrides.items():
            setattr(opts, k, v)
        dev = cls(u.host, u.port, u.name, u.unit or 0, opts, url)
        await dev.open()
        return dev

    async def open(self) -> None:
        """Log in every session, then learn the LU: INQUIRY, READ CAPACITY(16), VPD B0/B2 (SBC-4 6.6)."""
        try:
            await asyncio.gather(*(s.ensure() for s in self.sessions))
            inq = await self.command(X.inquiry(alloc=96), read_len=96)
            self.inquiry = X.Inquiry.parse(bytes(inq))
            if self.inquiry.peripheral_type != 0:
                raise DeviceFailed(f"{self.url}: LUN {self.lun} is not a disk (peripheral type "
                                   f"{self.inquiry.peripheral_type:#x})")
            cap = X.Capacity.parse(bytes(await self.command(X.read_capacity_16(), read_len=32)))
            self.capacity, self.block_size, self.num_blocks = cap, cap.block_size, cap.num_blocks
            pages = X.vpd_pages(bytes(await self.command(X.inquiry(0x00, 255), read_len=255)))
            if 0xB0 in pages:
                self.limits = X.BlockLimits.parse(bytes(await self.command(X.inquiry(0xB0, 64), read_len=64)))
            if 0xB2 in pages:
                self.provisioning = X.Provisioning.parse(bytes(await self.command(X.inquiry(0xB2, 8), read_len=8)))
        except BaseException:
            await self.close()
            raise
        cap_blocks = MAX_IO_BYTES // self.block_size
        if self.limits.max_transfer:
            cap_blocks = min(cap_blocks, self.limits.max_transfer)
        self.max_io_blocks = max(1, cap_blocks)

    # ------------------------------------------------------------------------------- plumbing
    def _session(self) -> IscsiSession:
        sessions = self.sessions
        return sessions[0] if len(sessions) == 1 else min(sessions, key=lambda s: s.inflight)

    async def execute(self, cdb: bytes, *, read_len: int = 0, data: Buffer | None = None) -> Completion:
        return await self._session().execute(cdb, self._lun, read_len=read_len, data=data)

    async def command(self, cdb: bytes, *, read_len: int = 0, data: Buffer | None = None,
                      write: bool = False) -> Buffer:
        """Run a command; a status other than GOOD becomes the typed block error."""
        # straight to the session, not through execute(): one coroutine call less per command (vsan bench is
        # bound by this client's CPU)
        done = await self._session().execute(cdb, self._lun, read_len=read_len, data=data)
        e = self._failure(done, cdb[0], write or data is not None)
        if e is not None:
            raise e
        return done.data

    def _chunks(self, lba: int, blocks: int, cap: int) -> list[tuple[int, int]]:
        return [(lba + i, min(cap, blocks - i)) for i in range(0, blocks, cap)]

    # ------------------------------------------------------------------------------ BlockDevice
    async def read(self, lba: int, blocks: int) -> Buffer:
        check_range(self, lba, blocks)
        if blocks == 0:
            return b""
        bs = self.block_size
        if blocks <= self.max_io_blocks:
            data = await self.command(X.read_16(lba, blocks), read_len=blocks * bs)
            self._check_len(data, blocks)
            return data
        out = bytearray(blocks * bs)

        async def part(a: int, n: int) -> None:
            d = await self.command(X.read_16(a, n), read_len=n * bs)
            self._check_len(d, n)
            out[(a - lba) * bs:(a - lba + n) * bs] = d

        await asyncio.gather(*(part(a, n) for a, n in self._chunks(lba, blocks, self.max_io_blocks)))
        return out

    def read_soon(self, lba: int, blocks: int, done: ReadDone) -> bool:
        """read()'s fast path (block/device.py ReadSoon) for one command: READ(16) sent now on the least busy
        session where it can go at once (IscsiSession.execute_soon); done(data, None) once read with GOOD,
        done(None, exc) for any other status (the error read() raises, unit attentions included: no retry) or
        a lost connection. False: not sent."""
        if blocks <= 0 or blocks > self.max_io_blocks or lba < 0 or lba + blocks > self.num_blocks:
            return False
        n = blocks * self.block_size
        cdb = X.read_16(lba, blocks)

        def then(c: Completion | None, e: BaseException | None) -> None:
            if c is not None:
                e = self._failure(c, cdb[0], False)
                if e is None and len(c.data) != n:
                    e = self._short(c.data, blocks)
            done(None if e is not None or c is None else c.data, e)

        return self._session().execute_soon(cdb, self._lun, n, None, then)

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
        """write()'s fast path (block/device.py WriteSoon) for one command: WRITE(16) with its data (immediate,
        unsolicited or on R2T as the session negotiated) sent now where it can go at once; done(None) once
        written with GOOD, done(exc) otherwise (no retry). False: not sent."""
        mv = memoryview(data).cast("B")
        bs = self.block_size
        blocks = len(mv) // bs
        if not blocks or len(mv) % bs or blocks > self.max_io_blocks or lba < 0 or lba + blocks > self.num_blocks:
            return False
        cdb = X.write_16(lba, blocks, fua=fua)
        return self._session().execute_soon(cdb, self._lun, 0, mv, lambda c, e: done(
            e if c is None else self._failure(c, cdb[0], True)))

    def _failure(self, c: Completion, opcode: int, write: bool) -> BlockError | None:
        """The typed block error of a status other than GOOD (command() raises the same), else None."""
        if c.status == S.GOOD:
            return None
        return X.status_error(c.status, c.sense, write=write, what=f"{self.url} opcode {opcode:#04x}")

    def _short(self, data: Buffer, blocks: int) -> DeviceFailed:
        return DeviceFailed(f"{self.url}: read returned {len(data)} bytes, want {blocks * self.block_size}")

    def _check_len(self, data: Buffer, blocks: int) -> None:
        if len(data) != blocks * self.block_size:
            raise self._short(data, blocks)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        bs = self.block_size
        if len(data) % bs:
            raise ValueError(f"write of {len(data)} bytes is not a whole number of {bs}-byte blocks")
        blocks = len(data) // bs
        check_range(self, lba, blocks)
        if blocks == 0:
            return
        mv = memoryview(data).cast("B")
        await asyncio.gather(*(self.command(X.write_16(a, n, fua=fua), data=mv[(a - lba) * bs:(a - lba + n) * bs])
                               for a, n in self._chunks(lba, blocks, self.max_io_blocks)))

    async def flush(self) -> None:
        # SYNCHRONIZE CACHE on one session makes every completed write durable, whichever session carried it
        await self.command(X.synchronize_cache_16())

    async def unmap(self, lba: int, blocks: int) -> None:
        check_range(self, lba, blocks)
        if blocks == 0:
            return
        if not self.provisioning.lbpu:
            return  # unmap is a hint; a target without UNMAP keeps the data
        cap = self.limits.max_unmap_lbas or 0xFFFFFFFF
        ranges = self._chunks(lba, blocks, cap)
        per = self.limits.max_unmap_descriptors or 256
        for i in range(0, len(ranges), per):
            cdb, param = X.unmap(ranges[i:i + per])
            await self.command(cdb, data=param, write=True)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        check_range(self, lba, blocks)
        if blocks == 0:
            return
        bs = self.block_size
        zero = bytes(bs)
        # WRITE SAME(16) with UNMAP only where unmapped blocks read as zeroes (LBPRZ, SBC-4 4.7.4.5)
        unmap = bool(self.provisioning.lbpws and self.capacity and self.capacity.lbprz)
        cap = self.limits.max_write_same or 0xFFFF
        try:
            await asyncio.gather(*(self.command(X.write_same_16(a, n, unmap=unmap), data=zero, write=True)
                                   for a, n in self._chunks(lba, blocks, cap)))
        except X.ScsiCommandError as e:
            if e.key != S.ILLEGAL_REQUEST:
                raise
            # no WRITE SAME here: write the zeroes
            buf = bytes(min(blocks, self.max_io_blocks) * bs)
            for a, n in self._chunks(lba, blocks, self.max_io_blocks):
                await self.write(a, memoryview(buf)[:n * bs])

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sessions), return_exceptions=True)

    def to_config(self) -> dict[str, Any]:
        return {"type": "iscsi", "url": self.url, "queues": self.opts.queues, "queue_depth": self.opts.queue_depth}

    # ------------------------------------------------------------------------------- extras
    async def cut_connections(self) -> None:
        """Abort every TCP connection (tests of reconnect): in-flight commands are sent again."""
        for s in self.sessions:
            if s.conn is not None:
                s.conn.abort()

    @property
    def reconnects(self) -> int:
        return sum(max(0, s.logins - 1) for s in self.sessions)


async def discover(url: str, *, opts: IscsiOptions | None = None) -> list[tuple[str, list[str]]]:
    """SendTargets=All in a discovery session (RFC 7143 §13.21, Appendix C): [(IQN, [addr:port,tpgt]), ...]."""
    u = parse_url(url)
    if not u.iscsi:
        raise UrlError(f"{u.redacted()}: discovery URL must be iscsi://HOST[:PORT]")
    o = opts or IscsiOptions.from_url(u)
    s = IscsiSession(u.host, u.port, None, o, 0)
    try:
        conn = await s.connect()
    except LoginError as e:
        raise DeviceFailed(f"{u.redacted()}: discovery login failed: {e}") from e
    try:
        pairs = await asyncio.wait_for(conn.text([("SendTargets", "All")]), o.connect_timeout)
    finally:
        await conn.logout()
    out: list[tuple[str, list[str]]] = []
    for k, v in pairs:
        if k == "TargetName":
            out.append((v, []))
        elif k == "TargetAddress" and out:
            out[-1][1].append(v)
    return out


__all__ = ["BlockError", "IscsiInitiator", "IscsiOptions", "IscsiSession", "discover"]
