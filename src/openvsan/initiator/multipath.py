"""`MultipathDevice`: one volume reached through several paths, following ALUA and ANA states and failover.

A replicated volume is exported by every replica node with one identity (DESIGN.md "Replication and
failover"): each node's iSCSI target port or NVMe controller is a path to the same disk. The primary's path
reports ALUA active/optimized (SPC-4 5.15) or ANA optimized (NVMe Base 2.0 §8.1); the others standby,
non-optimized or inaccessible, and refuse I/O with a path error. Like dm-multipath with `prio alua` and
Linux native NVMe multipath, this device:

- checks at open that every path is the same volume (VPD 83h NAA designator; Identify Namespace NGUID and
  EUI-64) and refuses a path of another volume;
- learns each path's state (REPORT TARGET PORT GROUPS and the path's relative target port from VPD 83h;
  the ANA log page and the group holding the namespace), again after every path error, on ASYMMETRIC ACCESS
  STATE CHANGED, and every `check_interval` seconds (multipathd's path checker; our initiators keep no
  Asynchronous Event Request outstanding);
- sends each command to an optimized path (round-robin), else to a non-optimized one;
- on a path error (connection lost and not restored at once, NOT READY 04h/0Ah-0Ch, NVMe SCT 3h) sends the
  command again on another path. While no path is usable the command is held, not failed, for up to
  `no_path_retry` seconds from its first path error (dm-multipath's queue_if_no_path, bounded): a failover
  looks like a pause. A command that failed was not acknowledged, so sending it again is safe; for a write,
  the same data to the same blocks is idempotent, whether or not the failed path had written it;
- reconnects lost paths in the background (each check probes them again).

Errors of the volume itself (medium error, out of range, read only, reservation conflict) go back to the
caller at once: another path would give the same answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol, TypeVar, runtime_checkable

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import BlockDevice, Buffer
from openvsan.block.errors import BlockError, DeviceFailed
from openvsan.initiator.iscsi_conn import ConnectionLost

log = logging.getLogger("openvsan.initiator.multipath")
T = TypeVar("T")

NO_PATH_RETRY = 30.0    # seconds a command is held while no path serves it
CHECK_INTERVAL = 1.0    # seconds between two checks of every path's state
RETRY_INTERVAL = 0.1    # seconds between two looks for a usable path while a command is held
PATH_TIMEOUT = 10.0     # a command unanswered this long on a path drops its connection (path options)
ASC_ASYMMETRIC_ACCESS_STATE_CHANGED = 0x2A06


class PathState(IntEnum):
    """A path's state, best first. SCSI: ALUA access states (SPC-4 6.36); NVMe: ANA states (Base 2.0 §8.1.3):
    inaccessible is STANDBY, persistent loss UNAVAILABLE, change TRANSITIONING. FAILED: not reachable."""

    OPTIMIZED = 0
    NON_OPTIMIZED = 1
    STANDBY = 2
    TRANSITIONING = 3
    UNAVAILABLE = 4
    FAILED = 5
    REFUSED = 6       # another volume, or another geometry: never used

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @property
    def usable(self) -> bool:
        return self <= PathState.NON_OPTIMIZED


@runtime_checkable
class PathProber(Protocol):
    """What the multipath device asks of a path besides I/O."""

    async def identity(self) -> bytes: ...        # same bytes, same volume

    async def state(self) -> PathState: ...       # asks the target now


def _path_error_types() -> tuple[type[BaseException], ...]:
    from openvsan.initiator.nvme_tcp import AnaPathError
    from openvsan.initiator.scsi import PathNotAccessible
    return (PathNotAccessible, AnaPathError, DeviceFailed, ConnectionLost, OSError, TimeoutError)


def state_of_error(e: BaseException) -> PathState:
    """What a path error says of the path until its state is read again."""
    from openvsan.initiator.nvme_tcp import AnaPathError
    from openvsan.initiator.scsi import PathNotAccessible
    from openvsan.protocol.scsi import sense as S
    if isinstance(e, PathNotAccessible):
        return {S.ASC_LU_NOT_ACCESSIBLE_TRANSITION: PathState.TRANSITIONING,
                S.ASC_LU_NOT_ACCESSIBLE_STANDBY: PathState.STANDBY}.get(e.asc, PathState.UNAVAILABLE)
    if isinstance(e, AnaPathError):
        return {0x01: PathState.UNAVAILABLE, 0x02: PathState.STANDBY}.get(e.status & 0xFF, PathState.TRANSITIONING)
    return PathState.FAILED


# --- probers of our initiators -----------------------------------------------------------------------

# SPC-4 6.36 ASYMMETRIC ACCESS STATE -> ours (Eh offline: unavailable)
_ALUA = {0x0: PathState.OPTIMIZED, 0x1: PathState.NON_OPTIMIZED, 0x2: PathState.STANDBY,
         0x3: PathState.UNAVAILABLE, 0xE: PathState.UNAVAILABLE, 0xF: PathState.TRANSITIONING}
# Base 2.0 §5.16.1.12 Figure 231 ANA State -> ours
_ANA = {0x1: PathState.OPTIMIZED, 0x2: PathState.NON_OPTIMIZED, 0x3: PathState.STANDBY,
        0x4: PathState.UNAVAILABLE, 0xF: PathState.TRANSITIONING}


class ScsiProber:
    """An iSCSI path: the LU's NAA designator; the state of the target port group holding this path's
    relative target port in REPORT TARGET PORT GROUPS (what Linux scsi_dh_alua checks)."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self.relative_port: int | None = None
        self.port_group: int | None = None

    async def identity(self) -> bytes:
        from openvsan.initiator import scsi as X
        ident = X.DeviceIdentification.parse(bytes(await self.dev.command(X.inquiry(0x83, 1024), read_len=1024)))
        if not ident.naa:
            raise DeviceFailed(f"{self.dev.url}: no NAA designator in VPD page 83h: cannot tell which volume")
        self.relative_port, self.port_group = ident.relative_port, ident.port_group
        return b"naa:" + ident.naa

    async def state(self) -> PathState:
        from openvsan.initiator import scsi as X
        inq = self.dev.inquiry
        if inq is None or not inq.tpgs:
            await self.dev.command(X.test_unit_ready())   # no ALUA: active/optimized while it answers
            return PathState.OPTIMIZED
        groups = X.port_groups(bytes(await self.dev.command(X.report_target_port_groups(4096), read_len=4096)))
        for g in groups:
            if self.relative_port is not None and self.relative_port in g.ports:
                return _ALUA.get(g.state, PathState.UNAVAILABLE)
        for g in groups:
            if g.id == self.port_group:
                return _ALUA.get(g.state, PathState.UNAVAILABLE)
        return PathState.UNAVAILABLE   # a port in no group serves no I/O (SPC-4 5.15.2.1)

    def watch(self, notify: Callable[[], None]) -> None:
        def attention(asc: int) -> None:
            if asc == ASC_ASYMMETRIC_ACCESS_STATE_CHANGED:
                notify()
        for s in self.dev.sessions:
            s.on_attention = attention


class NvmeProber:
    """An NVMe/TCP path: the namespace's NGUID and EUI-64; the ANA state of the group holding the NSID in
    this controller's ANA log page (what Linux nvme_update_ana_state reads)."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev

    async def identity(self) -> bytes:
        ns = self.dev.ns
        if ns is None or not any(ns.nguid + ns.eui64):
            raise DeviceFailed(f"{self.dev.url}: the namespace has neither NGUID nor EUI-64: cannot tell which "
                               "volume")
        return b"nguid:" + bytes(ns.nguid) + bytes(ns.eui64)

    async def state(self) -> PathState:
        a = self.dev.assoc
        ns = self.dev.ns
        if a is None or a.dead or a.ctrl is None or not a.ctrl.ana:
            await self.dev.ensure_connected()
            a = self.dev.assoc
        if a is None or a.ctrl is None or not a.ctrl.ana:
            return PathState.OPTIMIZED    # no ANA reporting: optimized while it answers
        _, groups = await self.dev.ana_log()
        for gid, (st, nsids) in groups.items():
            if self.dev.nsid in nsids or (not nsids and ns is not None and gid == ns.anagrpid):
                return _ANA.get(st, PathState.UNAVAILABLE)
        return PathState.UNAVAILABLE


def prober_for(dev: Any) -> PathProber:
    from openvsan.initiator.iscsi import IscsiInitiator
    from openvsan.initiator.nvme_tcp import NvmeTcpInitiator
    if isinstance(dev, IscsiInitiator):
        return ScsiProber(dev)
    if isinstance(dev, NvmeTcpInitiator):
        return NvmeProber(dev)
    if isinstance(dev, PathProber):
        return dev
    raise DeviceFailed(f"{type(dev).__name__}: not a path multipath can follow (iSCSI or NVMe/TCP)")


# --- the device --------------------------------------------------------------------------------------

@dataclass(eq=False)
class Path:
    """One path: its device (None until it could be opened), what it served and how it stands."""

    name: str
    device: BlockDevice | None = None
    opener: Callable[[], Awaitable[BlockDevice]] | None = None   # opens it (again, in the background)
    prober: PathProber | None = None
    state: PathState = PathState.FAILED
    commands: int = 0
    errors: int = 0
    last_error: str = ""
    verified: bool = False

    def stats(self) -> dict[str, Any]:
        return {"path": self.name, "state": self.state.label, "commands": self.commands, "errors": self.errors,
                "last_error": self.last_error}


ChangeFn = Callable[[Path, PathState, PathState], None]


class MultipathDevice:
    """A BlockDevice over N paths to one volume (see the module's text)."""

    block_size: int
    num_blocks: int

    def __init__(self, paths: Sequence[Path], *, no_path_retry: float = NO_PATH_RETRY,
                 check_interval: float = CHECK_INTERVAL, retry_interval: float = RETRY_INTERVAL,
                 on_change: ChangeFn | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if not paths:
            raise ValueError("multipath needs at least one path")
        if no_path_retry < 0 or check_interval <= 0 or retry_interval <= 0:
            raise ValueError("no_path_retry must not be negative, check_interval and retry_interval positive")
        self.paths = list(paths)
        self.no_path_retry, self.check_interval, self.retry_interval = no_path_retry, check_interval, retry_interval
        self.on_change = on_change
        self.clock, self.sleep = clock, sleep
        self.identity = b""
        self.block_size = 0
        self.num_blocks = 0
        self.capabilities = Capabilities(volatile_cache=True)
        self.max_io_blocks = 0
        self.held = 0          # commands waiting for a usable path now
        self.retries = 0       # commands sent again on another path
        self.closed = False
        self._rr = 0
        self._probes: dict[Path, asyncio.Task[None]] = {}
        self._checker: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._path_errors = _path_error_types()

    @property
    def name(self) -> str:
        return " ".join(p.name for p in self.paths)

    # ---------------------------------------------------------------------------------- bring-up
    async def open(self) -> None:
        """Verify every opened path is the volume (refuse the lot on a mismatch), read their states, start
        the checker. A path not opened yet is tried again in the background."""
        try:
            for p in self.paths:
                if p.device is not None:
                    await self._verify(p, at_open=True)
            if self.identity == b"":
                raise DeviceFailed(f"{self.name}: no path could be opened")
            await asyncio.gather(*(self._probe_once(p) for p in self.paths))
        except BaseException:
            await self.close()
            raise
        self._checker = asyncio.get_running_loop().create_task(self._check_loop(), name="multipath-checker")

    async def _verify(self, p: Path, *, at_open: bool) -> bool:
        dev = p.device
        assert dev is not None
        if p.prober is None:
            p.prober = prober_for(dev)
        ident = await p.prober.identity()
        if not self.identity:
            self.identity, self.block_size, self.num_blocks = ident, dev.block_size, dev.num_blocks
            self.max_io_blocks = getattr(dev, "max_io_blocks", 0)
        elif ident != self.identity or (dev.block_size, dev.num_blocks) != (self.block_size, self.num_blocks):
            what = ("another volume" if ident != self.identity else
                    f"{dev.num_blocks} blocks of {dev.block_size} bytes, not {self.num_blocks} of {self.block_size}")
            msg = f"path {p.name} is {what} than path {self._first_name()}: refused"
            if at_open:
                raise DeviceFailed(msg)
            log.warning("%s", msg)
            p.last_error = msg
            self._set(p, PathState.REFUSED)
            return False
        other = getattr(dev, "max_io_blocks", 0)
        if other:
            self.max_io_blocks = min(self.max_io_blocks or other, other)
        watch = getattr(p.prober, "watch", None)
        if watch is not None:
            watch(self.probe_all)
        p.verified = True
        return True

    def _first_name(self) -> str:
        return next((p.name for p in self.paths if p.verified), "?")

    # ---------------------------------------------------------------------------------- states
    def _set(self, p: Path, st: PathState) -> None:
        old = p.state
        if old == st or old == PathState.REFUSED:
            return
        p.state = st
        log.info("path %s: %s -> %s", p.name, old.label, st.label)
        if self.on_change is not None and self._checker is not None:   # not the first states, at open
            self.on_change(p, old, st)
        ev, self._wake = self._wake, asyncio.Event()
        ev.set()

    async def _probe_once(self, p: Path) -> None:
        """Read one path's state; open (and verify) it first if it never was."""
        if p.state == PathState.REFUSED or self.closed:
            return
        try:
            if p.device is None:
                if p.opener is None:
                    return
                p.device = await p.opener()
            if not p.verified and not await self._verify(p, at_open=False):
                return
            assert p.prober is not None
            st = await p.prober.state()
        except asyncio.CancelledError:
            raise
        except (BlockError, ConnectionLost, OSError, TimeoutError) as e:
            p.last_error = str(e) or type(e).__name__
            self._set(p, state_of_error(e))
            return
        self._set(p, st)

    def probe_all(self) -> None:
        """Read every path's state again, in the background (one probe per path at a time)."""
        if self.closed:
            return
        for p in self.paths:
            t = self._probes.get(p)
            if t is None or t.done():
                self._probes[p] = asyncio.get_running_loop().create_task(self._probe_once(p))

    async def _check_loop(self) -> None:
        while not self.closed:
            await self.sleep(self.check_interval)
            self.probe_all()

    def _pick(self) -> Path | None:
        best = [p for p in self.paths if p.state == PathState.OPTIMIZED and p.device is not None]
        if not best:
            best = [p for p in self.paths if p.state == PathState.NON_OPTIMIZED and p.device is not None]
        if not best:
            return None
        self._rr += 1
        return best[self._rr % len(best)]

    async def _wait(self) -> None:
        """Until a path changes state or retry_interval passes (no real clock: on self.sleep)."""
        changed = asyncio.ensure_future(self._wake.wait())
        nap = asyncio.ensure_future(self.sleep(self.retry_interval))
        try:
            await asyncio.wait((changed, nap), return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            nap.cancel()

    async def _run(self, op: Callable[[BlockDevice], Awaitable[T]], what: str) -> T:
        """One command on a usable path, sent again on another after a path error, held while none is."""
        if self.closed:
            raise DeviceFailed(f"{self.name}: closed")
        since: float | None = None     # the command's first path error or wait
        failures = 0
        while True:
            p = self._pick()
            if p is None or failures > len(self.paths):
                if since is None:
                    since = self.clock()
                elif self.clock() - since >= self.no_path_retry:
                    raise DeviceFailed(f"{what}: no usable path for {self.no_path_retry:g} s: " + "; ".join(
                        f"{q.name} {q.state.label}" + (f" ({q.last_error})" if q.last_error else "")
                        for q in self.paths))
                self.held += 1
                try:
                    if p is None:
                        self.probe_all()
                        await self._wait()
                    else:
                        # paths that claim to serve keep refusing: pace the tries, do not spin
                        await self.sleep(self.retry_interval)
                        failures = 0
                finally:
                    self.held -= 1
                if self.closed:
                    raise DeviceFailed(f"{self.name}: closed")
                continue
            dev = p.device
            assert dev is not None
            p.commands += 1
            try:
                return await op(dev)
            except self._path_errors as e:
                p.errors += 1
                p.last_error = str(e) or type(e).__name__
                if since is None:
                    since = self.clock()
                failures += 1
                self.retries += 1
                if p.state.usable:
                    self._set(p, state_of_error(e))
                    self.probe_all()

    # ---------------------------------------------------------------------------------- BlockDevice
    async def read(self, lba: int, blocks: int) -> Buffer:
        return await self._run(lambda d: d.read(lba, blocks), f"read of {blocks} blocks at {lba}")

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        await self._run(lambda d: d.write(lba, data, fua=fua), f"write at {lba}")

    async def flush(self) -> None:
        # the path's target makes durable what it acknowledged; a replicated volume's primary flushes
        # every in-sync replica (DESIGN.md: the ack rule), so one path's flush covers the volume
        await self._run(lambda d: d.flush(), "flush")

    async def unmap(self, lba: int, blocks: int) -> None:
        await self._run(lambda d: d.unmap(lba, blocks), f"unmap at {lba}")

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        await self._run(lambda d: d.write_zeroes(lba, blocks), f"write zeroes at {lba}")

    async def close(self) -> None:
        self.closed = True
        tasks = [t for t in (self._checker, *self._probes.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._wake.set()
        await asyncio.gather(*(p.device.close() for p in self.paths if p.device is not None),
                             return_exceptions=True)

    def to_config(self) -> dict[str, Any]:
        return {"type": "multipath", "paths": [p.device.to_config() if p.device is not None else {"url": p.name}
                                               for p in self.paths], "no_path_retry": self.no_path_retry}

    # ---------------------------------------------------------------------------------- extras
    def stats(self) -> list[dict[str, Any]]:
        return [p.stats() for p in self.paths]


# --- from URLs ---------------------------------------------------------------------------------------

def split_urls(urls: str | Sequence[str]) -> list[str]:
    """The URLs of one volume: a list, or one string with the URLs apart by spaces (what a bench plan holds)."""
    items = urls.split() if isinstance(urls, str) else [u for x in urls for u in x.split()]
    return list(dict.fromkeys(items))


def path_options(scheme: str, options: dict[str, Any]) -> dict[str, Any]:
    """A path's own initiator options: it fails fast (one reconnect attempt, a shorter command timeout) and
    leaves waiting and trying elsewhere to the multipath device."""
    out = dict(options)
    out.setdefault("reconnect_timeout", 0.0)
    out.setdefault("command_timeout", PATH_TIMEOUT)
    out.setdefault("connect_timeout", min(PATH_TIMEOUT, 5.0))
    if scheme == "nvme+tcp":
        out.setdefault("path_retry", False)
    return out


async def open_paths(urls: str | Sequence[str], *, no_path_retry: float = NO_PATH_RETRY,
                     check_interval: float = CHECK_INTERVAL, on_change: ChangeFn | None = None,
                     **options: Any) -> MultipathDevice:
    """Several iscsi:// or nvme+tcp:// URLs of one volume → an open MultipathDevice. Paths that cannot be
    opened now are tried again in the background; at least one must open."""
    from openvsan.initiator import open_url
    from openvsan.initiator.url import UrlError, parse_url

    items = split_urls(urls)
    if not items:
        raise UrlError("multipath: no URL given")
    if any(u.lower().startswith("nbd://") for u in items):
        raise UrlError("multipath: nbd:// has no volume identity or path state; use iscsi:// or nvme+tcp:// paths")
    parsed = [parse_url(u) for u in items]
    schemes = {u.scheme for u in parsed}
    if len(schemes) > 1:
        raise UrlError("multipath: one volume's paths must all be iscsi:// or all nvme+tcp://")
    for u in parsed:
        if u.name is None:
            what = "/IQN/LUN" if u.iscsi else "/NQN/NSID"
            raise UrlError(f"{u.redacted()}: a path must name the volume ({u.scheme}://HOST[:PORT]{what})")
    opts = path_options(parsed[0].scheme, options)

    def opener(url: str) -> Callable[[], Awaitable[BlockDevice]]:
        return lambda: open_url(url, **opts)

    paths = [Path(u.redacted(), opener=opener(url)) for url, u in zip(items, parsed, strict=True)]
    opened = await asyncio.gather(*(p.opener() for p in paths if p.opener is not None), return_exceptions=True)
    for p, r in zip(paths, opened, strict=True):
        if isinstance(r, BaseException):
            if not isinstance(r, (BlockError, OSError, TimeoutError, ConnectionLost)):
                for q in paths:
                    if q.device is not None:
                        await q.device.close()
                raise r
            p.last_error = str(r) or type(r).__name__
        else:
            p.device = r
    if all(p.device is None for p in paths):
        raise DeviceFailed("multipath: no path could be opened: " + "; ".join(f"{p.name}: {p.last_error}"
                                                                             for p in paths))
    dev = MultipathDevice(paths, no_path_retry=no_path_retry, check_interval=check_interval, on_change=on_change)
    await dev.open()
    return dev


__all__ = ["MultipathDevice", "NvmeProber", "Path", "PathProber", "PathState", "ScsiProber", "open_paths",
           "split_urls"]
