"""`NvmeTcpInitiator`: a remote NVMe/TCP namespace as a `BlockDevice`, and discovery.

One association = an admin queue and `queues` I/O queues, each its own TCP connection (NVMe/TCP 1.0 §3.3).
Bring-up follows NVMe-oF 1.1 §3.3 and Base 2.0 §3.5.1: Connect (admin) → Property Get CAP → Property Set
CC.EN=1 → wait CSTS.RDY → Identify Controller → Set Features Number of Queues → Connect each I/O queue.
Keep Alive goes out on the admin queue every KATO/2. When any queue drops, the association is rebuilt and
the commands that were out are sent again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import Buffer, ReadDone, WriteDone, check_range
from openvsan.block.errors import BlockError, Busy, DeviceFailed, MediumError, NoSpace, OutOfRange, ReadOnly
from openvsan.initiator.iscsi_conn import ConnectionLost
from openvsan.initiator.nvme_conn import NvmeQueue, Result
from openvsan.initiator.url import TargetUrl, UrlError, parse_url
from openvsan.netio import Slots
from openvsan.protocol.nvme import auth as A
from openvsan.protocol.nvme import host_commands as C

log = logging.getLogger("openvsan.initiator.nvme")
ADMIN_QUEUE_SIZE = 32
AUTH_BUFFER = 4096     # AUTH_Receive AL: a challenge with an ffdhe8192 value is 1104 bytes
MAX_IO_BYTES = 4 << 20


class NvmeCommandError(BlockError):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class AnaPathError(Busy):
    """A path related status (Base 2.0 §4.6.1.2.4, SCT 3h): ANA persistent loss (01h), inaccessible (02h),
    transition (03h). The command did not run; another controller of the subsystem may serve it."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def default_hostnqn() -> str:
    """nqn.2014-08.org.nvmexpress:uuid:<uuid> (Base 2.0 §4.5), stable per machine name."""
    return f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid5(uuid.NAMESPACE_DNS, socket.gethostname())}"


def status_error(status: int, what: str) -> BlockError:
    """NVMe status (SCT/SC, Base 2.0 §4.6.1.2) → the typed block error (reverse of protocol/nvme/status.py)."""
    sct, sc = (status >> 8) & 7, status & 0xFF
    text = f"{what}: status SCT {sct:#x} SC {sc:#04x}"
    if sct == 0:
        if sc == 0x80:
            return OutOfRange(text)
        if sc == 0x20:
            return ReadOnly(text)
        if sc == 0x81:
            return NoSpace(text)
        if sc in (0x82, 0x22):
            return Busy(text)
        if sc == 0x06:
            return DeviceFailed(text)
    if sct == 2:
        return MediumError(text, write=sc == 0x80)
    if sct == 3 and sc in (0x01, 0x02, 0x03):
        return AnaPathError(text, status)
    return NvmeCommandError(text, status)


def retryable(status: int) -> bool:
    """Without DNR: namespace not ready, transient transport error, ANA inaccessible/transition."""
    if status & 0x4000:
        return False
    sct, sc = (status >> 8) & 7, status & 0xFF
    return (sct == 0 and sc in (0x82, 0x22, 0x07)) or (sct == 3 and sc in (0x02, 0x03))


@dataclass
class NvmeOptions:
    hostnqn: str = ""
    hostid: bytes = b""
    hdgst: bool = False
    ddgst: bool = False
    queues: int = 1
    queue_depth: int = 64
    kato_ms: int = 10000
    command_timeout: float = 30.0
    reconnect_timeout: float = 60.0
    connect_timeout: float = 10.0
    # False: a lost association is never connected again by this initiator (every later command fails);
    # the replication path's peer links reconnect themselves, taking the replica for their epoch first
    reconnect: bool = True
    # ask for I/O queues without SQ flow control (a read is then one C2HData PDU, no CapsuleResp); a
    # controller that refuses gets the queue connected again with it on
    sq_flow_off: bool = True
    # DH-HMAC-CHAP (NVMe Base 2.0 §8.13): the host's DHHC-1 secret, and the controller's for bidirectional
    # authentication; used where the Connect response asks for it (AUTHREQ.ATR), on every queue
    dhchap_secret: str = field(default="", repr=False)
    dhchap_ctrl_secret: str = field(default="", repr=False)
    # send a command refused with ANA inaccessible / transition again on this path (a lone path waits out
    # a transition); a multipath device turns it off and sends it on another path instead
    path_retry: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_url(cls, u: TargetUrl) -> NvmeOptions:
        return cls(hostnqn=u.options.get("hostnqn", ""), hdgst=u.opt_bool("hdgst"), ddgst=u.opt_bool("ddgst"),
                   queues=u.opt_int("queues", 1, 1, 64), queue_depth=u.opt_int("queue_depth", 64, 1, 1023),
                   kato_ms=u.opt_int("kato", 10, 0, 3600) * 1000,
                   sq_flow_off=not u.opt_bool("sqflow"))


class Association:
    """One controller: admin queue + I/O queues, all connected and enabled."""

    def __init__(self, host: str, port: int, subnqn: str, opts: NvmeOptions, io_queues: int) -> None:
        self.host, self.port, self.subnqn, self.opts = host, port, subnqn, opts
        self.io_queues = io_queues
        self.admin: NvmeQueue | None = None
        self.queues: list[NvmeQueue] = []
        self.cntlid = 0
        self.ctrl: C.IdentifyController | None = None
        self.in_capsule = 0
        self.dead = False
        self.slots: list[Slots] = []
        self.inflight: list[int] = []
        self._ka: asyncio.Task[None] | None = None
        self.keep_alive_paused = False

    @property
    def hostnqn(self) -> str:
        return self.opts.hostnqn or default_hostnqn()

    @property
    def hostid(self) -> bytes:
        return self.opts.hostid or uuid.uuid5(uuid.NAMESPACE_URL, self.hostnqn).bytes

    async def _queue(self, qid: int, sqsize: int) -> NvmeQueue:
        loop = asyncio.get_running_loop()
        name = f"{self.host}:{self.port} {self.subnqn} q{qid}"
        timeout = self.opts.command_timeout
        # asyncio.timeout rather than wait_for throughout: Python 3.11's wait_for lets a cancel go by when the
        # awaited thing completes in the same turn, and a cancelled connect must stop
        async with asyncio.timeout(self.opts.connect_timeout):
            _, q = await loop.create_connection(lambda: NvmeQueue(name, qid, timeout), self.host, self.port)
        q.on_lost = self._lost
        try:
            async with asyncio.timeout(self.opts.connect_timeout):
                await q.initialize(hdgst=self.opts.hdgst, ddgst=self.opts.ddgst)
            data = C.connect_data(self.hostid, 0xFFFF if qid == 0 else self.cntlid, self.subnqn, self.hostnqn)
            flow_off = qid > 0 and self.opts.sq_flow_off
            r = await self._wait(q.submit(lambda cid: C.connect(cid, qid, sqsize, self.opts.kato_ms,
                                                                sq_flow_off=flow_off), data=data, in_capsule=True))
            if r.status and flow_off:
                log.info("%s: SQ flow control cannot be disabled (status %#x); connecting with it on", name,
                         r.status)
                r = await self._wait(q.submit(lambda cid: C.connect(cid, qid, sqsize, self.opts.kato_ms),
                                              data=data, in_capsule=True))
            if r.status:
                raise DeviceFailed(f"{name}: Connect failed: {status_error(r.status, 'Connect')}")
            if qid == 0:
                self.cntlid = r.cqe.dw0 & 0xFFFF
            if r.cqe.dw0 & (A.CONNECT_ATR | A.CONNECT_ASCR):
                await self._authenticate(q, name, bool(r.cqe.dw0 & A.CONNECT_ASCR))
        except BaseException:
            q.on_lost = None
            q.abort()
            raise
        return q

    async def _authenticate(self, q: NvmeQueue, name: str, secure_channel: bool) -> None:
        """One DH-HMAC-CHAP transaction on a queue just connected (the Linux host's order of messages)."""
        if secure_channel:
            raise DeviceFailed(f"{name}: the controller asks for a secure channel (TLS), which this host lacks")
        if not self.opts.dhchap_secret:
            raise DeviceFailed(f"{name}: the controller asks for DH-HMAC-CHAP authentication; give the host's "
                               "DHHC-1 secret (dhchap_secret)")
        try:
            auth = A.HostAuth(self.hostnqn, self.subnqn, A.parse_secret(self.opts.dhchap_secret),
                              A.parse_secret(self.opts.dhchap_ctrl_secret) if self.opts.dhchap_ctrl_secret else None,
                              t_id=q.qid + 1)
        except A.SecretError as e:
            raise DeviceFailed(f"{name}: DH-HMAC-CHAP secret: {e}") from None

        async def auth_send(msg: bytes) -> None:
            r = await self._wait(q.submit(lambda cid: C.fabrics(A.FCTYPE_AUTH_SEND, cid, cdw10=A.AUTH_CDW10,
                                                                cdw11=len(msg), data_len=len(msg), in_capsule=True),
                                          data=msg, in_capsule=True))
            if r.status:
                raise DeviceFailed(f"{name}: {status_error(r.status, 'AUTH_Send')}")

        async def auth_receive() -> bytes:
            al = AUTH_BUFFER
            r = await self._wait(q.submit(lambda cid: C.fabrics(A.FCTYPE_AUTH_RECEIVE, cid, cdw10=A.AUTH_CDW10,
                                                                cdw11=al, data_len=al), read_len=al))
            if r.status:
                raise DeviceFailed(f"{name}: {status_error(r.status, 'AUTH_Receive')}")
            return bytes(r.data)

        try:
            await auth_send(auth.negotiate())
            await auth_send(auth.challenge(await auth_receive()))
            success2 = auth.success1(await auth_receive())
            if success2 is not None:
                await auth_send(success2)
        except A.AuthFailed as e:
            if auth.failure2 is not None:
                await auth_send(auth.failure2)
            raise DeviceFailed(f"{name}: DH-HMAC-CHAP failed: {e}") from None

    async def _wait(self, fut: asyncio.Future[Result]) -> Result:
        async with asyncio.timeout(self.opts.connect_timeout):
            return await fut

    async def admin_cmd(self, build: Any, *, read_len: int = 0, what: str = "admin command") -> Result:
        assert self.admin is not None
        fut = self.admin.submit(build, read_len=read_len)
        async with asyncio.timeout(self.opts.command_timeout):
            r = await fut
        if r.status:
            raise status_error(r.status, what)
        return r

    async def start(self) -> None:
        """NVMe-oF 1.1 §3.3 and Base 2.0 §3.5.1: connect, enable, identify, then the I/O queues."""
        try:
            self.admin = await self._queue(0, ADMIN_QUEUE_SIZE)
            cap_r = await self.admin_cmd(lambda cid: C.property_get(cid, C.PROP_CAP, eight=True), what="CAP")
            cap = cap_r.cqe.dw0 | (cap_r.cqe.dw1 << 32)
            mqes = (cap & 0xFFFF) + 1
            timeout = max(1.0, ((cap >> 24) & 0xFF) * 0.5)  # CAP.TO, 500 ms units
            await self.admin_cmd(lambda cid: C.property_set(cid, C.PROP_CC, C.CC_EN | C.CC_IO_QUEUE_ENTRY_SIZES),
                                 what="Property Set CC")
            deadline = time.monotonic() + timeout
            while True:
                csts = (await self.admin_cmd(lambda cid: C.property_get(cid, C.PROP_CSTS), what="CSTS")).cqe.dw0
                if csts & C.CSTS_CFS:
                    raise DeviceFailed(f"{self.host}:{self.port} {self.subnqn}: controller fatal status")
                if csts & C.CSTS_RDY:
                    break
                if time.monotonic() > deadline:
                    raise DeviceFailed(f"{self.host}:{self.port} {self.subnqn}: CSTS.RDY not set in {timeout}s")
                await asyncio.sleep(0.01)
            ident = await self.admin_cmd(lambda cid: C.identify(cid, C.CNS_CONTROLLER), read_len=C.IDENTIFY_LEN,
                                         what="Identify Controller")
            self.ctrl = C.IdentifyController.parse(bytes(ident.data))
            self.in_capsule = max(0, self.ctrl.ioccsz - 64) if self.ctrl.icdoff == 0 else 0
            if self.io_queues:
                r = await self.admin_cmd(lambda cid: C.number_of_queues(cid, self.io_queues),
                                         what="Set Features Number of Queues")
                granted = min(r.cqe.dw0 & 0xFFFF, r.cqe.dw0 >> 16) + 1
                n = min(self.io_queues, granted)
                depth = min(self.opts.queue_depth + 1, mqes, self.ctrl.maxcmd or 1024)
                self.queues = list(await asyncio.gather(*(self._queue(i + 1, depth) for i in range(n))))
                # at most SQSIZE-1 commands out: the SQ never overflows without SQHD tracking
                self.slots = [Slots(max(1, depth - 1)) for _ in self.queues]
                self.inflight = [0] * len(self.queues)
            if self.opts.kato_ms:
                self._ka = asyncio.get_running_loop().create_task(self._keep_alive())
        except BaseException:
            self.close_now()
            raise

    async def _keep_alive(self) -> None:
        """Base 2.0 §3.9: a Keep Alive within every KATO; we send one each KATO/2."""
        period = self.opts.kato_ms / 2000
        while not self.dead:
            await asyncio.sleep(period)
            if self.keep_alive_paused or self.dead:
                continue
            try:
                await self.admin_cmd(C.keep_alive, what="Keep Alive")
            except (ConnectionLost, BlockError, TimeoutError):
                return

    def _lost(self, q: NvmeQueue) -> None:
        if not self.dead:
            log.info("%s: connection lost; the association will be rebuilt", q.name)
        self.close_now()

    def close_now(self) -> None:
        """Abort every queue: commands out fail with ConnectionLost and are sent again on a new association."""
        self.dead = True
        if self._ka is not None and self._ka is not asyncio.current_task():
            self._ka.cancel()
        for q in [self.admin, *self.queues]:
            if q is not None:
                q.on_lost = None
                q.abort()

    async def shutdown(self) -> None:
        """Base 2.0 §3.6.2: CC.SHN normal shutdown, then close the connections."""
        try:
            if not self.dead and self.admin is not None and self.admin.alive:
                try:
                    async with asyncio.timeout(5):
                        await self.admin_cmd(lambda cid: C.property_set(
                            cid, C.PROP_CC, C.CC_EN | C.CC_SHN_NORMAL | C.CC_IO_QUEUE_ENTRY_SIZES), what="shutdown")
                except (ConnectionLost, BlockError, TimeoutError):
                    pass
        finally:        # cancelled while shutting down: the connections and the keep-alive end all the same
            self.dead = True
            if self._ka is not None:
                self._ka.cancel()
            for q in [*self.queues, self.admin]:
                if q is not None:
                    q.on_lost = None
                    q.close()


class NvmeTcpInitiator:
    """Namespace NSID of subsystem NQN at HOST:PORT, as a BlockDevice (NVM Command Set over NVMe/TCP)."""

    block_size: int
    num_blocks: int

    def __init__(self, host: str, port: int, subnqn: str, nsid: int = 1, opts: NvmeOptions | None = None,
                 url: str = "") -> None:
        self.host, self.port, self.subnqn, self.nsid = host, port, subnqn, nsid
        self.opts = opts or NvmeOptions()
        self.url = url or f"nvme+tcp://{host}:{port}/{subnqn}/{nsid}"
        self.assoc: Association | None = None
        self.associations = 0
        self._lock = asyncio.Lock()
        self.closed = False
        self.block_size = 512
        self.num_blocks = 0
        self.capabilities = Capabilities(volatile_cache=True)  # the remote end may cache writes until flush
        self.ns: C.IdentifyNamespace | None = None
        self.max_io_blocks = 1

    @classmethod
    async def open_url(cls, url: str, **overrides: Any) -> NvmeTcpInitiator:
        u = parse_url(url)
        if u.iscsi or u.name is None:
            raise UrlError(f"{u.redacted()}: want nvme+tcp://HOST[:PORT]/NQN/NSID")
        opts = NvmeOptions.from_url(u)
        for k, v in overrides.items():
            setattr(opts, k, v)
        dev = cls(u.host, u.port, u.name, u.unit if u.unit is not None else 1, opts, url)
        await dev.open()
        return dev

    async def open(self) -> None:
        try:
            a = await self._ensure()
            r = await a.admin_cmd(lambda cid: C.identify(cid, C.CNS_NAMESPACE, self.nsid), read_len=C.IDENTIFY_LEN,
                                  what="Identify Namespace")
            ns = C.IdentifyNamespace.parse(bytes(r.data))
            if ns.nsze == 0 or ns.block_size == 0:
                raise DeviceFailed(f"{self.url}: namespace {self.nsid} is not active")
            self.ns, self.block_size, self.num_blocks = ns, ns.block_size, ns.nsze
            assert a.ctrl is not None
            cap = MAX_IO_BYTES
            if a.ctrl.mdts:
                cap = min(cap, 4096 << a.ctrl.mdts)
            self.max_io_blocks = max(1, cap // self.block_size)
        except BaseException:
            await self.close()
            raise

    async def _ensure(self) -> Association:
        a = self.assoc
        if a is not None and not a.dead:
            return a
        async with self._lock:
            if self.assoc is not None and not self.assoc.dead:
                return self.assoc
            if self.closed:
                raise DeviceFailed(f"{self.url}: closed")
            if self.associations and not self.opts.reconnect:
                raise DeviceFailed(f"{self.url}: connection lost (this initiator does not reconnect)")
            deadline = time.monotonic() + self.opts.reconnect_timeout
            delay = 0.1
            while True:
                a = Association(self.host, self.port, self.subnqn, self.opts, self.opts.queues)
                try:
                    await a.start()
                    self.assoc = a
                    self.associations += 1
                    if self.associations > 1:
                        log.info("%s: connected again (controller %d)", self.url, a.cntlid)
                    return a
                except (OSError, TimeoutError, ConnectionLost, DeviceFailed) as e:
                    err: Exception = e
                if self.associations == 0 or isinstance(err, DeviceFailed):
                    raise DeviceFailed(f"{self.url}: cannot connect: {err}") from err
                if time.monotonic() + delay > deadline:
                    raise DeviceFailed(f"{self.url}: cannot reconnect: {err}") from err
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    @property
    def lost(self) -> bool:
        """The association dropped and this initiator will not connect it again (`opts.reconnect` off)."""
        a = self.assoc
        return not self.opts.reconnect and self.associations > 0 and (a is None or a.dead)

    @property
    def reconnects(self) -> int:
        return max(0, self.associations - 1)

    async def ensure_connected(self) -> None:
        """Connect the association again if it dropped (DeviceFailed once reconnect_timeout is spent)."""
        await self._ensure()

    async def io(self, build: Any, *, data: Buffer | None = None, read_len: int = 0, in_capsule: bool = False,
                 what: str = "I/O", retries: int = 8) -> Result:
        """One I/O command to completion on the least busy queue, across reconnects."""
        attempt = 0
        while True:
            a = self.assoc
            if a is None or a.dead:
                a = await self._ensure()
            i = 0 if len(a.queues) == 1 else min(range(len(a.queues)), key=a.inflight.__getitem__)
            q = a.queues[i]
            # acquire/release rather than `async with`: two coroutine calls less per command (vsan bench is
            # bound by this host's CPU), as the iSCSI session does
            slots = a.slots[i]
            await slots.acquire()
            a.inflight[i] += 1
            try:
                # the queue's watchdog drops it when a command goes unanswered too long
                r = await q.submit(build, data=data, read_len=read_len, in_capsule=in_capsule)
            except ConnectionLost:
                continue
            finally:
                a.inflight[i] -= 1
                slots.release()
            if (r.status and retryable(r.status) and attempt < retries
                    and (self.opts.path_retry or (r.status >> 8) & 7 != 3)):
                attempt += 1
                await asyncio.sleep(0.01 * attempt)
                continue
            if r.status:
                raise status_error(r.status, f"{self.url} {what}")
            return r

    def _chunks(self, lba: int, blocks: int, cap: int) -> list[tuple[int, int]]:
        return [(lba + i, min(cap, blocks - i)) for i in range(0, blocks, cap)]

    # ---------------------------------------------------------------------------------- BlockDevice
    async def read(self, lba: int, blocks: int) -> Buffer:
        check_range(self, lba, blocks)
        if blocks == 0:
            return b""
        bs = self.block_size
        if blocks <= self.max_io_blocks:
            r = await self.io(self._read_cmd(lba, blocks), read_len=blocks * bs, what="Read")
            return r.data
        out = bytearray(blocks * bs)

        async def part(a: int, n: int) -> None:
            r = await self.io(lambda cid: C.read(cid, self.nsid, a, n, n * bs), read_len=n * bs, what="Read")
            out[(a - lba) * bs:(a - lba + n) * bs] = r.data

        await asyncio.gather(*(part(a, n) for a, n in self._chunks(lba, blocks, self.max_io_blocks)))
        return out

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        bs = self.block_size
        if len(data) % bs:
            raise ValueError(f"write of {len(data)} bytes is not a whole number of {bs}-byte blocks")
        blocks = len(data) // bs
        check_range(self, lba, blocks)
        if blocks == 0:
            return
        mv = memoryview(data).cast("B")
        a = await self._ensure()
        if blocks <= self.max_io_blocks:        # one command: no task for it (the replication path's common case)
            inc = len(mv) <= a.in_capsule
            await self.io(lambda cid: C.write(cid, self.nsid, lba, blocks, blocks * bs, fua=fua, in_capsule=inc),
                          data=mv, in_capsule=inc, what="Write")
            return

        async def part(s: int, n: int) -> None:
            chunk = mv[(s - lba) * bs:(s - lba + n) * bs]
            inc = len(chunk) <= a.in_capsule  # NVMe/TCP 1.0 §3.3: in-capsule up to IOCCSZ, else R2T
            await self.io(lambda cid: C.write(cid, self.nsid, s, n, n * bs, fua=fua, in_capsule=inc), data=chunk,
                          in_capsule=inc, what="Write")

        await asyncio.gather(*(part(s, n) for s, n in self._chunks(lba, blocks, self.max_io_blocks)))

    def _read_cmd(self, lba: int, blocks: int) -> Callable[[int], bytes]:
        """The SQE builder of a Read of `blocks` at `lba` (read(); read_soon packs its capsule in one go)."""
        nsid, n = self.nsid, blocks * self.block_size
        return lambda cid: C.read(cid, nsid, lba, blocks, n)

    def _soon(self, a: Association | None, what: str, done: Callable[..., None], read: bool,
              send: Callable[..., None], *args: Any) -> bool:
        """One command sent now (read_soon, write_soon: they must not wait) on the least busy queue of a live
        association, if it has a command slot free: `send(queue, *args, answer)` sends it (a queue's
        submit_then or write_then). Once answered, its slot given back, `done(data, exc)` for a read,
        `done(exc)` for a write: exc None when it succeeded, else its failure (a status other than success as
        the command's error). False: nothing sent."""
        if a is None or a.dead:
            return False
        i = 0 if len(a.queues) == 1 else min(range(len(a.queues)), key=a.inflight.__getitem__)
        slots, inflight = a.slots[i], a.inflight
        if not slots.try_acquire():
            return False

        def answered(r: Result | None, e: BaseException | None) -> None:
            inflight[i] -= 1
            slots.put_back()
            if e is None:
                status = r.cqe.status & 0x7FFF  # type: ignore[union-attr]  # a result when no exception
                if status:
                    e = status_error(status, f"{self.url} {what}")
            if read:
                done(None if e is not None else r.data, e)  # type: ignore[union-attr]
            else:
                done(e)

        try:
            send(a.queues[i], *args, answered)
        except ConnectionLost:
            slots.release()
            return False
        inflight[i] += 1
        return True

    def read_soon(self, lba: int, blocks: int, done: ReadDone) -> bool:
        """read()'s fast path (block/device.py ReadSoon) for one command on a live association whose least busy
        queue has a slot free now: read()'s command, sent in this turn, no coroutine. done(data, None) once it
        is read; done(None, exc) on any failure, with no retry and no reconnect (the caller reads it again with
        read(), which does both). False: not sent."""
        if blocks <= 0 or blocks > self.max_io_blocks or lba < 0 or lba + blocks > self.num_blocks:
            return False
        return self._soon(self.assoc, "Read", done, True, NvmeQueue.read_then, self.nsid, lba, blocks,
                          blocks * self.block_size)

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
        """write()'s fast path (block/device.py WriteSoon) for one command with its data in the capsule, on a
        live association whose least busy queue has a slot free now: sent in this turn, no coroutine. done(None)
        when it succeeded; done(exc) on any failure, with no retry and no reconnect (the caller sends it again
        with write(), which does both). False: not sent."""
        a = self.assoc
        bs = self.block_size
        mv = memoryview(data).cast("B")
        n = len(mv)
        if a is None or not n or n % bs or n > a.in_capsule or n // bs > self.max_io_blocks:
            return False
        blocks = n // bs
        if lba < 0 or lba + blocks > self.num_blocks:
            return False
        return self._soon(a, "Write", done, False, NvmeQueue.write_then, self.nsid, lba, blocks, mv, fua)

    async def flush(self) -> None:
        await self.io(lambda cid: C.flush(cid, self.nsid), what="Flush")

    async def unmap(self, lba: int, blocks: int) -> None:
        check_range(self, lba, blocks)
        a = await self._ensure()
        if blocks == 0 or a.ctrl is None or not a.ctrl.dsm:
            return  # deallocation is a hint
        ranges = self._chunks(lba, blocks, 0xFFFFFFFF)
        for i in range(0, len(ranges), 256):  # §3.2.3: at most 256 ranges per command
            part = ranges[i:i + 256]
            inc = 16 * len(part) <= a.in_capsule
            _, data = C.dsm_deallocate(0, self.nsid, part, in_capsule=inc)
            await self.io(lambda cid, p=part, c=inc: C.dsm_deallocate(cid, self.nsid, p, in_capsule=c)[0],
                          data=data, in_capsule=inc, what="Dataset Management")

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        check_range(self, lba, blocks)
        if blocks == 0:
            return
        a = await self._ensure()
        if a.ctrl is not None and a.ctrl.write_zeroes:
            await asyncio.gather(*(self.io(lambda cid, s=s, n=n: C.write_zeroes(cid, self.nsid, s, n),
                                           what="Write Zeroes") for s, n in self._chunks(lba, blocks, 0x10000)))
            return
        zero = bytes(min(blocks, self.max_io_blocks) * self.block_size)
        for s, n in self._chunks(lba, blocks, self.max_io_blocks):
            await self.write(s, memoryview(zero)[:n * self.block_size])

    # ---------------------------------------------------------------------------------- reservations
    # (Base 2.0 §8.19): what a replicated volume's primary fences its replicas with (replication/fence.py)

    async def _data_cmd(self, build: Any, what: str) -> None:
        """A command with a few bytes of data in its capsule; `build(cid)` gives (SQE, data)."""
        _, data = build(0)
        await self.io(lambda cid: build(cid)[0], data=data, in_capsule=True, what=what, retries=0)

    async def reservation_register(self, nrkey: int, *, crkey: int = 0, action: int = 0, iekey: bool = False) -> None:
        await self._data_cmd(lambda cid: C.reservation_register(cid, self.nsid, action, crkey, nrkey, iekey=iekey),
                             "Reservation Register")

    async def reservation_acquire(self, crkey: int, rtype: int, *, action: int = 0, prkey: int = 0) -> None:
        await self._data_cmd(lambda cid: C.reservation_acquire(cid, self.nsid, action, rtype, crkey, prkey),
                             "Reservation Acquire")

    async def reservation_release(self, crkey: int, rtype: int, *, action: int = 0) -> None:
        await self._data_cmd(lambda cid: C.reservation_release(cid, self.nsid, action, rtype, crkey),
                             "Reservation Release")

    async def reservation_report(self, length: int = 4096) -> bytes:
        r = await self.io(lambda cid: C.reservation_report(cid, self.nsid, length), read_len=length,
                          what="Reservation Report", retries=0)
        return bytes(r.data)

    # ---------------------------------------------------------------------------------- ANA
    async def ana_log(self, size: int = 4096) -> tuple[int, dict[int, tuple[int, tuple[int, ...]]]]:
        """The ANA log page of this path's controller (Base 2.0 §5.16.1.12): its change count and, per ANA
        group, the state and the NSIDs in it."""
        a = await self._ensure()
        r = await a.admin_cmd(lambda cid: C.get_log_page(cid, C.LID_ANA, size), read_len=size, what="ANA log")
        return C.parse_ana_log(bytes(r.data))

    async def close(self) -> None:
        self.closed = True
        if self.assoc is not None:
            await self.assoc.shutdown()

    def to_config(self) -> dict[str, Any]:
        return {"type": "nvme-tcp", "url": self.url, "queues": self.opts.queues, "queue_depth": self.opts.queue_depth}

    # ---------------------------------------------------------------------------------- extras
    def cut_connections(self) -> None:
        """Abort every TCP connection (tests of reconnect)."""
        if self.assoc is not None:
            for q in [self.assoc.admin, *self.assoc.queues]:
                if q is not None:
                    q.abort()

    def describe(self) -> list[str]:
        a, ns = self.assoc, self.ns
        assert a is not None and a.ctrl is not None and ns is not None
        c = a.ctrl
        v = c.version
        return [
            f"subsystem:  {c.subnqn} at {self.host}:{self.port} (controller {a.cntlid})",
            f"model:      {c.model}", f"serial:     {c.serial}", f"firmware:   {c.firmware}",
            f"version:    NVMe {v >> 16}.{(v >> 8) & 0xFF}.{v & 0xFF}",
            (f"namespace:  {self.nsid}: {ns.nsze} blocks of {ns.block_size} bytes "
            f"({ns.nsze * ns.block_size / (1 << 30):.2f} GiB), NGUID {ns.nguid.hex()}"),
            (f"I/O:        {len(a.queues)} queue(s), max transfer "
            f"{'unlimited' if not c.mdts else 4096 << c.mdts} bytes, in-capsule {a.in_capsule} bytes"),
            (f"commands:   write zeroes {'yes' if c.write_zeroes else 'no'}, deallocate {'yes' if c.dsm else 'no'}, "
            f"volatile write cache {'yes' if c.vwc & 1 else 'no'}"),
        ]


async def discover(url: str, *, opts: NvmeOptions | None = None) -> list[tuple[str, list[str]]]:
    """The discovery log page (NVMe-oF 1.1 §5.3) of the discovery controller at HOST:PORT."""
    u = parse_url(url)
    if u.iscsi:
        raise UrlError(f"{u.redacted()}: want nvme+tcp://HOST[:PORT]")
    o = opts or NvmeOptions.from_url(u)
    o.kato_ms = 0
    a = Association(u.host, u.port, C.DISCOVERY_NQN, o, 0)
    try:
        await a.start()
    except (OSError, TimeoutError, ConnectionLost) as err:
        raise DeviceFailed(f"{u.redacted()}: cannot connect: {err}") from err
    try:
        head = await a.admin_cmd(lambda cid: C.get_log_page(cid, C.LID_DISCOVERY, 1024), read_len=1024,
                                 what="discovery log")
        _, numrec, _ = C.parse_discovery_log(bytes(head.data))
        size = 1024 * (numrec + 1)
        full = await a.admin_cmd(lambda cid: C.get_log_page(cid, C.LID_DISCOVERY, size), read_len=size,
                                 what="discovery log")
        _, _, entries = C.parse_discovery_log(bytes(full.data))
    finally:
        await a.shutdown()
    out: dict[str, list[str]] = {}
    for e in entries:
        host = f"[{e.traddr}]" if ":" in e.traddr else e.traddr
        out.setdefault(e.subnqn, []).append(f"{host}:{e.trsvcid}")
    return list(out.items())
