"""`vsan serve --workers N`: the node's data plane spread over N worker processes, one per core.

The supervisor (this module's Supervisor, in the `vsan serve` process) keeps the control plane: the data dir
lock, the state store, the control socket. It places the node's volumes on workers (`place`), starts one
worker process per place (node/worker.py), each pinned to its core, and restarts a worker that dies.

A worker is a Node built from its part of the desired state (`part`): the volumes placed on it with their
devices or pools, and the iSCSI targets, NVMe subsystems and NBD exports that export them. It also knows
every other target, subsystem and export by name and by the worker that serves it (shells): all workers
listen on every portal (SO_REUSEPORT), answer discovery (SendTargets, the discovery log page, NBD_OPT_LIST)
for the whole node, and hand a connection that names what another worker serves to that worker
(frontend/handoff.py). What spans volumes stays in one process: a target's or subsystem's volumes are placed
together, so its sessions, controller IDs, reservations and ALUA/ANA state live where its LUNs do.

Changes while serving (vsan volume / export / qos / config apply) go through the supervisor: it plans as a
single-process node does, places what is new, and sends each worker its new part (worker.apply on the
worker's control socket, <data_dir>/worker-<i>.sock); `vsan pool` commands go to the worker of the pool.

A volume moves to another worker while serving (`vsan workers move`, Supervisor.move; and by itself when a
change exports volumes of two workers together): its NBD connections, iSCSI sessions and NVMe controllers
are suspended where they stand and go on in the other worker with their protocol state (node/node.py
worker.release, the frontends' suspend()/resumed()).

With NBD over TLS ([nbd] tls), worker 0 serves every NBD export (`pinned`): a TLS session cannot be handed
over, so a connection goes to worker 0 at NBD_OPT_STARTTLS, before the TLS handshake.

In a cluster, worker 0 is the node's member (its lease, the replication portal) and serves every replicated
volume (`pinned` too); `vsan volume status|move-primary|force-in-sync` reach it through the supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import fcntl
import json
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from openvsan.node.control import check_revision
from openvsan.node.specs import MAX_WORKERS, NodeConfig
from openvsan.node.store import StoredState
from openvsan.procstat import cpu_seconds

log = logging.getLogger("openvsan.node.workers")

READY_TIMEOUT = 120.0      # seconds a worker may take to open its devices and listen
RESTART_DELAYS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)   # after a worker that died young; reset once it lived 60 s
LIVED = 60.0


class WorkerSetupError(RuntimeError):
    """The node cannot run with workers as asked; str() is one line for the user."""


@dataclass(frozen=True)
class Placement:
    """Which worker serves each volume, iSCSI target, NVMe subsystem and NBD export of a node."""

    workers: int
    volumes: dict[str, int]
    targets: dict[str, int]
    subsystems: dict[str, int]
    nbd: dict[str, int]

    def of_worker(self, i: int) -> list[str]:
        return [v for v, w in self.volumes.items() if w == i]


def place(cfg: NodeConfig, n: int) -> Placement:
    """Place the volumes on n workers. Volumes that one target or subsystem exports together go together
    (a session reaches all of its LUNs or namespaces in one process); groups go, largest first, to the
    worker with the fewest volumes, the lowest index on a tie. The same config gives the same placement."""
    if n < 1:
        raise ValueError(f"{n} workers: at least 1")
    return _placed(cfg, n, {})


def _placed(cfg: NodeConfig, n: int, before: dict[str, int]) -> Placement:
    groups = list({id(g): g for g in _groups(cfg).values()}.values())   # config order
    tls = pinned(cfg, n)
    load = [0] * n
    for v, w in before.items():
        load[w] += 1
    volumes: dict[str, int] = {}
    for g in sorted(groups, key=lambda g: -len(g)):                      # stable: config order among equals
        was = {before[v] for v in g if v in before}
        if len(was) > 1:
            raise ValueError(f"volumes {', '.join(sorted(g))} would be exported together but are served by "
                             f"workers {', '.join(str(w) for w in sorted(was))}: move them to one worker first "
                             "(vsan workers move)")
        if tls & set(g) and was and was != {0}:
            raise ValueError(f"volumes {', '.join(sorted(g))} belong on worker 0 (NBD over TLS, or replicated): "
                             "move them to worker 0 first (vsan workers move)")
        w = 0 if tls & set(g) else was.pop() if was else min(range(n), key=lambda i: (load[i], i))
        for v in g:
            if v not in before:
                load[w] += 1
            volumes[v] = w
    return Placement(
        n, {v.name: volumes[v.name] for v in cfg.volumes},
        {t.iqn: volumes[t.luns[0].volume] if t.luns else 0 for t in cfg.targets},
        {s.nqn: volumes[s.namespaces[0].volume] if s.namespaces else 0 for s in cfg.subsystems},
        {e.name: volumes[e.volume] for e in cfg.nbd_exports})


def moved(where: Placement, cfg: NodeConfig, group: set[str], to: int) -> Placement:
    """`where` with the volumes of `group` (one group: _groups) and what exports them on worker `to`."""
    return Placement(
        where.workers, {v: to if v in group else w for v, w in where.volumes.items()},
        {t.iqn: to if any(x.volume in group for x in t.luns) else where.targets[t.iqn] for t in cfg.targets},
        {x.nqn: to if any(ns.volume in group for ns in x.namespaces) else where.subsystems[x.nqn]
         for x in cfg.subsystems},
        {e.name: to if e.volume in group else where.nbd[e.name] for e in cfg.nbd_exports})


def joins(desired: NodeConfig, now: NodeConfig, where: Placement) -> list[tuple[str, int]]:
    """The moves (a volume of each group of `now`, and the worker it goes to) after which `desired` can be
    placed: where a group of `desired` gathers volumes that two workers serve, they go to the worker that
    serves most of them (the lowest index on a tie)."""
    out: list[tuple[str, int]] = []
    groups_now = _groups(now)
    tls = pinned(desired, where.workers)
    seen: set[int] = set()
    for g in _groups(desired).values():
        if id(g) in seen:
            continue
        seen.add(id(g))
        on = [where.volumes[v] for v in g if v in where.volumes]
        if tls & set(g):
            to = 0          # NBD over TLS: worker 0 serves what has an NBD export
        elif len(set(on)) < 2:
            continue
        else:
            to = min(set(on), key=lambda w: (-on.count(w), w))
        moving: set[str] = set()
        for v in g:
            if v in where.volumes and where.volumes[v] != to and v not in moving:
                out.append((v, to))
                moving.update(groups_now[v])
    return out


# live commands (node/live.py) about a replicated volume, answered by the worker that serves it
REPLICATION_COMMANDS = ("volume.status", "volume.move_primary", "volume.force_in_sync", "cluster.status")
# what the worker that serves the volume answers (worker.live): its replication, and its LUKS2 keyslots (only the
# owner holds the volume key)
OWNER_COMMANDS = (*REPLICATION_COMMANDS, "volume.add_key", "volume.remove_key", "volume.lock", "volume.unlock")


@dataclass
class GroupLoad:
    """A group of volumes (what must share a worker), where it is, and its share of its worker's core."""

    volumes: list[str]
    worker: int
    load: float          # fraction of a core


BALANCE_GAP = 0.25       # busiest minus least busy worker, in cores, from which volumes move
BALANCE_GAIN = 0.10      # a move must lower the busier of its two workers by this much (cores)


def plan_balance(busy: dict[int, float], groups: list[GroupLoad], *, gap: float = BALANCE_GAP,
                 gain: float = BALANCE_GAIN, most: int = 8) -> list[tuple[GroupLoad, int]]:
    """The moves that even out the workers' load: repeatedly, the group of the busiest worker whose move to
    the least busy one lowers the busier of the two the most, while the two differ by `gap` cores and the
    move gains at least `gain`. Each group moves at most once. Pure: loads in, moves out."""
    loads = dict(busy)
    moved: set[int] = set()
    out: list[tuple[GroupLoad, int]] = []
    for _ in range(most):
        hi = max(loads, key=lambda w: (loads[w], -w))
        lo = min(loads, key=lambda w: (loads[w], w))
        if loads[hi] - loads[lo] < gap:
            break
        best: tuple[float, GroupLoad] | None = None
        for g in groups:
            if g.worker != hi or id(g) in moved or g.load <= 0:
                continue
            after = max(loads[hi] - g.load, loads[lo] + g.load)
            if best is None or after < best[0]:
                best = (after, g)
        if best is None or loads[hi] - best[0] < gain:
            break
        g = best[1]
        loads[hi] -= g.load
        loads[lo] += g.load
        moved.add(id(g))
        out.append((g, lo))
        g.worker = lo
    return out


def place_again(cfg: NodeConfig, before: Placement) -> Placement:
    """The placement of a changed config: volumes stay on the worker they are on; a new group goes, as at
    start, to the worker with the fewest volumes. Volumes on different workers that one target or subsystem
    would export together are refused (ValueError): Supervisor.apply moves them to one worker first (joins)."""
    names = {v.name for v in cfg.volumes}
    return _placed(cfg, before.workers, {v: w for v, w in before.volumes.items() if v in names})


def _groups(cfg: NodeConfig) -> dict[str, list[str]]:
    """Volume -> the list of the volumes that must share its worker (one list object per group)."""
    parent = {v.name: v.name for v in cfg.volumes}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    carved: dict[str, list[str]] = {}    # volumes carved from one device or pool: one process owns its group
    for v in cfg.volumes:
        if v.carved:
            carved.setdefault(f"{v.pool!r}/{v.device!r}", []).append(v.name)
    for names in [[lun.volume for lun in t.luns] for t in cfg.targets] + \
            [[ns.volume for ns in x.namespaces] for x in cfg.subsystems] + list(carved.values()):
        for a in names[1:]:
            ra, rb = find(a), find(names[0])
            if ra != rb:
                parent[ra] = rb
    lists: dict[str, list[str]] = {}
    for v in cfg.volumes:
        lists.setdefault(find(v.name), []).append(v.name)
    return {v.name: lists[find(v.name)] for v in cfg.volumes}


def placement_dict(p: Placement) -> dict[str, Any]:
    return dataclasses.asdict(p)


def placement_from(d: dict[str, Any]) -> Placement:
    return Placement(int(d["workers"]), dict(d["volumes"]), dict(d["targets"]), dict(d["subsystems"]),
                     dict(d["nbd"]))


def worker_socket_path(data_dir: Path, index: int) -> Path:
    """Worker `index`'s control socket: its supervisor's requests (worker.apply, .stats, .geometry, .pool)."""
    return data_dir / f"worker-{index}.sock"


class WorkerError(RuntimeError):
    """A worker's refusal or failure. `kind` is the refusal's class as the worker raised it (control.py
    error_kind: "not-found", "conflict", ...), so the supervisor's control socket and REST API answer it as
    the worker would have; a RuntimeError still, for the supervisor's own handling of a worker that fails."""

    def __init__(self, line: str, kind: str = "failed") -> None:
        super().__init__(line)
        self.kind = kind


async def worker_call(data_dir: Path, index: int, cmd: str, timeout: float = 120.0, **args: Any) -> Any:
    """One request to worker `index` (node/control.py's JSON lines); RuntimeError with its line when it
    refuses or cannot be reached."""
    from openvsan.node.control import KIND_STATUS, _reachable

    path = worker_socket_path(data_dir, index)
    try:
        async with asyncio.timeout(timeout):
            with _reachable(path) as where:
                reader, writer = await asyncio.open_unix_connection(where, limit=1 << 24)
            try:
                writer.write((json.dumps({"cmd": cmd, "args": args}, default=str) + "\n").encode())
                await writer.drain()
                line = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError) as e:
        raise RuntimeError(f"worker {index} did not answer ({e.strerror if isinstance(e, OSError) and e.strerror else e}"
                           "); it may be restarting: try again") from None
    if not line:
        raise RuntimeError(f"worker {index} closed its control connection without an answer")
    reply = json.loads(line)
    if not reply.get("ok"):
        # a refusal is the user's line as the worker said it; anything else says which worker failed
        kind = str(reply.get("kind", "failed"))
        raise WorkerError(("" if kind in KIND_STATUS else f"worker {index}: ") + str(reply.get("error")), kind)
    return reply.get("result")


def part(cfg: NodeConfig, where: Placement, i: int) -> NodeConfig:
    """Worker i's share of the desired state: its volumes, the devices and pools under them (a device no
    volume or pool uses goes to worker 0), what exports them, and its share of the connection caps."""
    mine = {v for v, w in where.volumes.items() if w == i}
    volumes = tuple(v for v in cfg.volumes if v.name in mine)
    pools = tuple(p for p in cfg.pools if any(v.pool == p.name for v in volumes))
    used = {v.device for v in volumes} | {d for p in pools for d in (*p.members, *p.spares)}
    devices = tuple(d for d in cfg.devices if d.name in used or (i == 0 and cfg.device_user(d.name) is None))
    n = where.workers
    s = cfg.node

    def share(cap: int) -> int:
        # worker i's share of a node-wide cap: the shares add up to the cap (each at least 1), so a flood
        # meets the node's limit whichever workers the kernel gives its connections to
        return max(1, cap // n + (1 if i < cap % n else 0))

    total = share(s.max_connections)
    unauth = min(total, share(s.max_unauthenticated))
    node = dataclasses.replace(s, max_connections=total, max_unauthenticated=unauth,
                               max_unauthenticated_per_source=min(unauth, share(s.max_unauthenticated_per_source)))
    nvme = None
    if cfg.nvme is not None:
        nvme = dataclasses.replace(cfg.nvme, subsystems=tuple(x for x in cfg.nvme.subsystems
                                                              if where.subsystems[x.nqn] == i))
    return dataclasses.replace(
        cfg, node=node, devices=devices, volumes=volumes, pools=pools,
        cluster=cfg.cluster if i == 0 else None,     # worker 0 is the node's member of the cluster (pinned)
        targets=tuple(t for t in cfg.targets if where.targets[t.iqn] == i), nvme=nvme,
        nbd_exports=tuple(e for e in cfg.nbd_exports if where.nbd[e.name] == i))


def pinned(cfg: NodeConfig, n: int) -> set[str]:
    """Volumes that worker 0 must serve, with the volumes exported together with them, when there are several
    workers: with NBD over TLS ([nbd] tls), every volume an NBD export serves (a TLS session cannot be handed
    over, and one may name any export: worker 0 runs them all, taking the connections at NBD_OPT_STARTTLS);
    in a cluster, every replicated volume (worker 0 is the node's member of the cluster: its lease, the
    replication portal, the replicas and their peers)."""
    if n < 2:
        return set()
    groups = _groups(cfg)
    out: set[str] = set()
    if cfg.nbd_tls is not None:
        out |= {v for e in cfg.nbd_exports for v in groups[e.volume]}
    if cfg.cluster is not None:
        out |= {v for vol in cfg.volumes if vol.replicated for v in groups[vol.name]}
    return out


def parse_cpus(text: str) -> list[int]:
    """"0,2,4-7" -> [0, 2, 4, 5, 6, 7]."""
    out: list[int] = []
    for piece in text.replace(" ", "").split(","):
        if not piece:
            continue
        lo, _, hi = piece.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"cpu list {text!r}: {piece!r} is not a number or a range like 4-7") from None
        if a < 0 or b < a:
            raise ValueError(f"cpu list {text!r}: {piece!r} is not a range like 4-7")
        out.extend(range(a, b + 1))
    if not out:
        raise ValueError(f"cpu list {text!r} names no cpu")
    return list(dict.fromkeys(out))


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def worker_count(setting: int | str, cpus: list[int]) -> int:
    """How many worker processes: `setting` ([node] workers or --workers), where "auto" is one per core of
    `cpus` (the cores the workers may use), at most MAX_WORKERS."""
    if setting == "auto":
        return max(1, min(len(set(cpus)), MAX_WORKERS))
    return int(setting)


@dataclass
class WorkerRole:
    """What a worker's Node needs to know beyond its own part: who it is, the whole desired state and its
    placement (to build shells of what the others serve), and the inboxes (frontend/handoff.py)."""

    index: int
    whole: NodeConfig
    placement: Placement
    exchange: Any = None      # frontend.handoff.Exchange, made in the worker process
    memfds: dict[str, int] = field(default_factory=dict)   # RAM device -> its memory, kept by the supervisor


@dataclass
class WorkerProc:
    index: int
    cpu: int | None
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    restarts: int = 0
    deaths_young: int = 0
    ready: bool = False
    watcher: asyncio.Task[None] | None = None
    last_exit: str = ""
    failure: str = ""        # the one line a worker that could not start said why with ("failed ...")
    spoke: asyncio.Event = field(default_factory=asyncio.Event)   # its first line (or end of output) was read
    terminated: bool = False   # it was sent the first SIGTERM (Supervisor.terminate)


WORKERS_LOCK = "workers.lock"
OLD_WORKERS_TIMEOUT = 60.0   # seconds a new supervisor waits for the workers of one that died to finish draining


def hold_workers_lock(data_dir: Path) -> int:
    """In a worker: a shared lock on <data_dir>/workers.lock, held until the process exits (its descriptor
    is never closed), so a supervisor started after one that died waits for its workers to be gone."""
    fd = os.open(data_dir / WORKERS_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


async def wait_for_old_workers(data_dir: Path) -> None:
    """Before starting workers: the workers of a supervisor that was killed get SIGTERM (PR_SET_PDEATHSIG)
    and drain for up to 30 s, still holding their devices; wait until none is left (their shared locks on
    workers.lock are gone), so two processes never serve one device file."""
    fd = os.open(data_dir / WORKERS_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + OLD_WORKERS_TIMEOUT
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise WorkerSetupError(f"worker processes of an earlier vsan serve still hold {data_dir} "
                                           f"after {OLD_WORKERS_TIMEOUT:.0f} s; stop them first") from None
                if not said:
                    log.info("waiting for the worker processes of an earlier vsan serve to finish")
                    said = True
                await asyncio.sleep(0.1)
    finally:
        os.close(fd)   # the lock goes with it


def _die_with_parent() -> None:
    """In the worker, before exec: SIGTERM when the supervisor dies (even by SIGKILL), so no worker is left
    serving a node whose supervisor is gone."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _exit_text(rc: int | None) -> str:
    if rc is None:
        return "running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


@dataclass
class Supervisor:
    """Runs the workers of one node and answers its control socket."""

    state: StoredState
    data_dir: Path
    workers: int
    cpus: list[int] | None = None            # worker i runs on cpus[i % len(cpus)]; None: not pinned
    log_level: str = "info"
    placement: Placement = field(init=False)
    procs: list[WorkerProc] = field(init=False)
    stopping: bool = False
    up: bool = False             # every worker served once: from now on one that dies is restarted

    def __post_init__(self) -> None:
        self.placement = place(self.state.config, self.workers)
        self.procs = [WorkerProc(i, self.cpus[i % len(self.cpus)] if self.cpus else None)
                      for i in range(self.workers)]
        self._pairs: list[Any] = []
        self._control: Any = None
        self._api: Any = None          # api/server.py ApiServer, beside the control socket
        self.events: Any = None        # node/events.py EventLog
        # RAM devices' memory (no backing file): made here and handed to the worker that serves them, so a
        # worker that dies and is started again finds the blocks its writes left (node/node.py memfd)
        self.memfds: dict[str, int] = {}
        self._keep_memfds(self.state.config)
        self.geometry: dict[str, list[int]] = {}   # volume -> [blocks, block size], from the workers
        self._applying = asyncio.Lock()
        self._balancer: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None

    async def run(self, stop: asyncio.Event, started: Callable[[], None] | None = None) -> None:
        from openvsan.api.server import ApiStartError, start_api
        from openvsan.frontend.handoff import inbox_pairs
        from openvsan.node.control import ControlServer, socket_path

        await wait_for_old_workers(self.data_dir)
        self._pairs = inbox_pairs(self.workers)
        self._stop = stop
        try:
            for w in self.procs:
                await self._spawn(w)
            await self._wait_ready(stop)
            if stop.is_set():
                return      # SIGTERM or SIGINT while starting: the workers stop as they would serving (below)
            self.up = True
            self._tell_geometry(range(self.workers))
            from openvsan.node.events import EventLog

            self.events = EventLog(self.data_dir)
            handler = self.events.wrap(self.control)
            self._control = ControlServer(socket_path(self.data_dir), handler)
            await self._control.start()
            self.events.watch(handler)
            try:
                self._api = await start_api(self.state.config, self.data_dir, handler)
            except ApiStartError as e:
                raise WorkerSetupError(str(e)) from None
            for w in self.procs:
                log.info("worker %d (pid %d%s): %s", w.index, w.proc.pid if w.proc else 0,
                         f", cpu {w.cpu}" if w.cpu is not None else "",
                         ", ".join(self.placement.of_worker(w.index)) or "no volumes")
            log.info("serving with %d worker processes", self.workers)
            interval = self.state.config.node.worker_balance_interval
            if interval:
                self._balancer = asyncio.get_running_loop().create_task(self._balance_now_and_then(interval))
                log.info("volumes are balanced over the workers by load every %g s", interval)
            if started is not None:
                started()
            await stop.wait()
        finally:
            await self.stop()

    def _keep_memfds(self, cfg: NodeConfig) -> None:
        """A memory file for each RAM device of `cfg` without a backing file; those of devices gone closed."""
        want = {d.name for d in cfg.devices if d.type == "ram" and d.backing is None}
        for name in [n for n in self.memfds if n not in want]:
            os.close(self.memfds.pop(name))
        for name in want - set(self.memfds):
            self.memfds[name] = os.memfd_create(f"openvsan-{name}", os.MFD_CLOEXEC)

    async def _spawn(self, w: WorkerProc) -> None:
        recv = [r.fileno() for r, _ in self._pairs]
        send = [s.fileno() for _, s in self._pairs]
        mine = {d.name for d in part(self.state.config, self.placement, w.index).devices}
        memfds = {name: fd for name, fd in self.memfds.items() if name in mine}
        args = {"index": w.index, "cpu": w.cpu, "state": self.state, "placement": self.placement,
                "data_dir": str(self.data_dir), "log_level": self.log_level, "inbox": recv[w.index], "send": send,
                "memfds": memfds}
        w.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "openvsan.node.worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, pass_fds=[*recv, *send, *memfds.values()], preexec_fn=_die_with_parent)
        assert w.proc.stdin is not None
        w.proc.stdin.write(pickle.dumps(args))
        w.proc.stdin.close()
        w.started = time.monotonic()
        w.ready = False
        w.failure = ""
        w.spoke = asyncio.Event()
        w.terminated = False
        w.watcher = asyncio.get_running_loop().create_task(self._watch(w, w.proc))

    async def _watch(self, w: WorkerProc, proc: asyncio.subprocess.Process) -> None:
        """Read the worker's "ready" line, then wait for it to exit; restart it unless the node is stopping."""
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        w.spoke.set()
        word, _, geometry = line.decode(errors="replace").strip().partition(" ")
        if word == "failed":
            with contextlib.suppress(ValueError):
                w.failure = str(json.loads(geometry))
        elif word == "ready":
            with contextlib.suppress(ValueError):
                self.geometry.update(json.loads(geometry or "{}"))
            w.ready = True
            if self.up:
                self._tell_geometry([w.index])
            if w.restarts:
                log.info("worker %d is serving again (pid %d): %s", w.index, proc.pid,
                         ", ".join(self.placement.of_worker(w.index)) or "no volumes")
        rc = await proc.wait()
        w.ready = False
        w.last_exit = _exit_text(rc)
        if rc == 0 and not self.stopping and self._stop is not None:
            # a worker ends cleanly only when told to: a signal to the process group (systemd, ^C, a test
            # harness) reaches it first, and the supervisor's own handler follows within moments
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 1.0)
        if self.stopping or not self.up or (self._stop is not None and self._stop.is_set()):
            return      # at start, a worker that cannot serve fails the node (_wait_ready says which)
        lived = time.monotonic() - w.started
        w.deaths_young = 0 if lived >= LIVED else w.deaths_young + 1
        delay = RESTART_DELAYS[min(w.deaths_young, len(RESTART_DELAYS)) - 1] if w.deaths_young else 0.0
        log.error("worker %d (pid %d) %s after %.1f s; restarting it%s (its volumes: %s)", w.index, proc.pid,
                  w.last_exit, lived, f" in {delay:g} s" if delay else "",
                  ", ".join(self.placement.of_worker(w.index)) or "none")
        if delay:
            await asyncio.sleep(delay)
        if self.stopping:
            return
        w.restarts += 1
        await self._spawn(w)

    def _tell_geometry(self, to: Any) -> None:
        """Tell workers the size of every NBD export (each knows only its own): NBD_OPT_INFO is then
        answered by whichever worker a client reached, and only NBD_OPT_GO is handed over."""
        from openvsan.frontend.handoff import tell

        nbd = {e.name: self.geometry[e.volume] for e in self.state.config.nbd_exports if e.volume in self.geometry}
        for i in to:
            try:
                tell(self._pairs[i][1], {"nbd": nbd})
            except OSError as e:
                log.warning("worker %d: could not tell it the NBD export sizes: %s", i, e)

    async def _wait_ready(self, stop: asyncio.Event) -> None:
        """Until every worker serves; return at once when the node is told to stop meanwhile."""
        deadline = time.monotonic() + READY_TIMEOUT
        while not all(w.ready for w in self.procs) and not stop.is_set():
            for w in self.procs:
                if w.proc is not None and w.proc.returncode is not None:
                    # a signal to the process group (systemd, a terminal's ^C) reaches the workers too, and
                    # one may be gone before the supervisor's own handler has run: not a failure to start
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0 if w.proc.returncode == 0 else 0.1)
                    if stop.is_set():
                        return
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(w.spoke.wait(), 5.0)
                    if w.failure:       # what it could not do, as one process would say it
                        raise WorkerSetupError(w.failure)
                    raise WorkerSetupError(f"worker {w.index} could not start ({_exit_text(w.proc.returncode)}); "
                                           "its log lines above say why")
            if time.monotonic() > deadline:
                raise WorkerSetupError(f"workers not serving after {READY_TIMEOUT:.0f} s")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Every worker drains, flushes and closes (SIGTERM); the supervisor waits for all of them."""
        self.stopping = True
        self.terminate()
        if self._balancer is not None:
            self._balancer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._balancer
        if self.events is not None:
            await self.events.stop()
        if self._api is not None:
            await self._api.stop()
            self._api = None
        if self._control is not None:
            await self._control.stop()
            self._control = None
        for w in self.procs:
            if w.proc is not None:
                rc = await w.proc.wait()
                if rc == -signal.SIGTERM:
                    log.info("worker %d: ended by SIGTERM while the node stopped", w.index)
                elif rc not in (0, None):
                    log.error("worker %d: %s", w.index, _exit_text(rc))
            if w.watcher is not None:
                w.watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await w.watcher
        for r, s in self._pairs:
            r.close()
            s.close()
        self._pairs = []

    def terminate(self) -> None:
        """The first SIGTERM to every worker, once: each stops accepting at once, drains and stops. Sent from
        the supervisor's signal handler itself, so the portals close as soon as one process would close them
        (a harness that starts the next node on the same port must not reach the workers of this one)."""
        for w in self.procs:
            if w.proc is not None and w.proc.returncode is None and not w.terminated:
                w.terminated = True
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)

    def interrupt(self) -> None:
        """SIGTERM to every worker: the first drains and stops it; a second (SIGTERM/SIGINT to vsan serve
        again) makes it stop waiting for commands in flight (it still flushes)."""
        for w in self.procs:
            if w.proc is not None and w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)

    # ---- control socket

    def report(self) -> list[dict[str, Any]]:
        return [{"worker": w.index, "pid": w.proc.pid if w.proc else None, "cpu": w.cpu, "serving": w.ready,
                 "restarts": w.restarts, "last_exit": w.last_exit or None,
                 "volumes": self.placement.of_worker(w.index),
                 "targets": [k for k, i in self.placement.targets.items() if i == w.index],
                 "subsystems": [k for k, i in self.placement.subsystems.items() if i == w.index],
                 "nbd_exports": [k for k, i in self.placement.nbd.items() if i == w.index]} for w in self.procs]

    async def control(self, cmd: str, args: dict[str, Any]) -> Any:
        """The node's control socket: `vsan workers`, and the live commands (node/live.py) as a single-process
        node answers them, with this supervisor in the node's place (state, apply, volume_stats); `vsan pool`
        commands go to the worker that serves the pool."""
        from openvsan.node import live
        from openvsan.node.control import RequestError

        if cmd == "workers.list":
            return self.report()
        if cmd == "node.metrics":     # every worker's volumes, one message each
            merged: dict[str, Any] = {"volumes": {}, "groups": {}}
            for w in self.procs:
                if w.ready:
                    part = await worker_call(self.data_dir, w.index, "worker.metrics") or {}
                    merged["volumes"].update(part.get("volumes", {}))
                    merged["groups"].update(part.get("groups", {}))
            from openvsan.node.plane import volume_identities

            merged["identities"] = volume_identities(self.state)
            return merged
        if cmd == "node.events":
            return self.events.since(int(args.get("after") or 0), int(args.get("limit") or 100))
        if cmd == "node.sessions":    # each worker's connections, named by worker
            out: list[dict[str, Any]] = []
            for w in self.procs:
                if w.ready:
                    out += [{**c, "worker": w.index}
                            for c in await worker_call(self.data_dir, w.index, "worker.sessions") or []]
            return out
        if cmd == "workers.move":
            return await self.move(str(args["volume"]), int(args["to"]))
        if cmd == "workers.balance":
            return await self.balance(float(args.get("seconds") or 2.0), dry_run=bool(args.get("dry_run")))
        if cmd.startswith("pool."):
            return await self._pool(cmd, args)
        if cmd.startswith("snapshot."):
            w = self.placement.volumes.get(str(args.get("volume")))
            if w is None:
                raise RequestError(f"no volume named {args.get('volume')!r} on this node")
            # a decouple copies clusters for as long as the volume is big
            return await worker_call(self.data_dir, w, "worker.snapshot", timeout=3600.0, command=cmd, args=args)
        if cmd == "cluster.status":     # the node's cluster membership and store are worker 0's
            if self.state.config.cluster is None:
                raise RequestError("this node is not in a cluster (its config has no [cluster] table)")
            return await worker_call(self.data_dir, 0, "worker.live", command=cmd, args=args)
        if cmd in OWNER_COMMANDS:
            # a replicated volume's role, switchover, forced sync: the worker that serves it (worker 0) answers
            w = self.placement.volumes.get(str(args.get("name")))
            if w is None:
                raise RequestError(f"no volume named {args.get('name')!r} on this node")
            return await worker_call(self.data_dir, w, "worker.live", command=cmd, args=args)
        handler = live.COMMANDS.get(cmd)
        if handler is None:
            raise RequestError(f"unknown command {cmd!r}")
        return await handler(cast(Any, self), args)

    # ---- what node/live.py asks of "the node"

    replication: Any = None      # the replicated volumes' role is worker 0's (REPLICATION_COMMANDS go there)

    async def volume_stats(self, name: str) -> dict[str, Any] | None:
        w = self.placement.volumes.get(name)
        if w is None:
            return None
        try:
            stats: dict[str, Any] | None = await worker_call(self.data_dir, w, "worker.stats", name=name)
        except RuntimeError as e:
            return {"worker": w, "stats_error": str(e)}
        return {"worker": w, **(stats or {})}

    async def apply(self, desired: NodeConfig, *, dry_run: bool = False, forget: tuple[str, ...] = (),
                    expect_revision: int | None = None) -> list[Any]:
        """Node.apply across the workers: plan as one node would (the same refusals), place what is new, have
        every worker apply its new part (and its shells of the others'), then store the whole. If a worker
        or the store fails, the workers done are sent their old part again, and nothing is stored."""
        import uuid

        from openvsan.node.control import Conflict, RequestError
        from openvsan.node.node import NodeError
        from openvsan.node.reconcile import plan
        from openvsan.node.store import VolumeIdentity, import_desired

        async with self._applying:
            check_revision(self.state.revision, expect_revision)
            changes = plan(self.state.config, desired)
            if dry_run or not changes:
                return changes
            for volume, to in joins(desired, self.state.config, self.placement):
                # volumes of two workers exported together from now on: one worker takes them all, first
                done_move = await self._move(volume, to)
                log.info("%s, to be exported with the others", done_move["message"])
            try:
                where = place_again(desired, self.placement)
            except ValueError as e:
                raise RequestError(str(e)) from None
            new_ids = {v.name: VolumeIdentity(u, u.hex) for v in desired.volumes
                       if v.name not in self.state.identities for u in [uuid.uuid4()]}
            before, before_where = self.state.config, self.placement

            send = self._send_part
            done: list[int] = []
            try:
                for w in range(self.workers):
                    await send(desired, where, w, new_ids, forget)
                    done.append(w)
                revision = await import_desired(self.data_dir, desired, identities=new_ids, forget=forget,
                                                expect_revision=self.state.revision)
            except Exception as e:
                for w in reversed(done):
                    try:
                        await send(before, before_where, w)
                    except Exception:
                        log.exception("worker %d: putting back its part failed", w)
                line = str(e) if str(e).endswith("nothing was changed") else f"{e}; nothing was changed"
                if isinstance(e, Conflict) or getattr(e, "kind", None) == "conflict":
                    raise Conflict(line) from e         # a worker's conflict stays one (the API's 409)
                if isinstance(e, ValueError) or getattr(e, "kind", None) in ("not-found", "stale", "refused"):
                    raise RequestError(line) from e     # a worker's refusal stays one (the API's 4xx)
                raise NodeError(line) from e
            identities = {k: v for k, v in {**self.state.identities, **new_ids}.items() if k not in forget}
            self.state = StoredState(desired, identities, self.state.pool_devices, revision)
            self.placement = where
            for name in [n for n in self.memfds if n not in {d.name for d in desired.devices}]:
                os.close(self.memfds.pop(name))
            await self._refresh_geometry()
            for c in changes:
                log.info("applied: %s", c)
            return changes

    async def _send_part(self, cfg: NodeConfig, at: Placement, w: int, ids: dict[str, Any] | None = None,
                         gone: tuple[str, ...] = (), cmd: str = "worker.apply", **extra: Any) -> Any:
        """Worker w's part of `cfg` placed `at`, the whole and the placement, to carry out (worker.apply) or to
        let volumes go (worker.release, with `extra`)."""
        from openvsan.node.render import config_document

        return await worker_call(self.data_dir, w, cmd, config=config_document(part(cfg, at, w)),
                                 whole=config_document(cfg), placement=placement_dict(at),
                                 identities={k: [str(i.uuid), i.serial] for k, i in (ids or {}).items()},
                                 forget=list(gone), **extra)

    async def move(self, volume: str, to: int) -> dict[str, Any]:
        """Move `volume`, with the volumes exported together with it (its group), to worker `to` while serving:
        the worker that serves them suspends their connections (they stop reading; what they started
        finishes), closes the volumes and hands each connection over with its state; `to` opens the volumes,
        and the connections, parked there meanwhile, go on (node/node.py worker.release). Clients see a pause,
        no error. The placement lives as long as this supervisor: a restart places the volumes afresh."""

        async with self._applying:
            return await self._move(volume, to)

    async def _move(self, volume: str, to: int) -> dict[str, Any]:
        from openvsan.frontend.handoff import tell
        from openvsan.node.control import RequestError
        from openvsan.node.node import NodeError

        cfg = self.state.config
        if volume not in self.placement.volumes:
            raise RequestError(f"no volume named {volume!r} on this node")
        if not 0 <= to < self.workers:
            raise RequestError(f"no worker {to}: this node has workers 0 to {self.workers - 1}")
        group = _groups(cfg)[volume]
        src = self.placement.volumes[volume]
        if to != 0 and pinned(cfg, self.workers) & set(group):
            raise RequestError(f"volume {volume} stays on worker 0: with NBD over TLS worker 0 serves every NBD "
                               "export, and in a cluster every replicated volume (and what is exported with them)")
        together = f" (with {', '.join(v for v in group if v != volume)}: exported together)" if len(group) > 1 else ""
        if src == to:
            return {"volumes": group, "from": src, "to": to, "connections": 0,
                    "message": f"volume {volume}{together} is on worker {to} already"}
        if not (self.procs[src].ready and self.procs[to].ready):
            raise RequestError(f"worker {src if not self.procs[src].ready else to} is not serving now (starting "
                               "or restarting); try again")
        where = moved(self.placement, cfg, set(group), to)
        before = self.placement
        t0 = time.monotonic()
        mine = {d.name for d in part(cfg, where, to).devices} - {d.name for d in part(cfg, before, to).devices}
        ram = sorted(n for n in mine if n in self.memfds)
        if ram:
            tell(self._pairs[to][1], {"memfds": ram}, [self.memfds[n] for n in ram])
        await worker_call(self.data_dir, to, "worker.expect", memfds=ram, volumes=group)
        try:
            released = await self._send_part(cfg, where, src, cmd="worker.release", volumes=group, to=to)
        except RuntimeError as e:
            await self._put_back(cfg, before, [to])
            raise RequestError(str(e).removeprefix(f"worker {src}: ")) from None
        luns, nvme = released.get("luns") or {}, released.get("nvme") or {}
        try:
            await self._send_part(cfg, where, to, unpark=True, luns=luns, nvme=nvme)
        except RuntimeError as e:
            # `to` could not open them: they go back where they were, with their connections (sent on
            # from `to`, where their exports are shells of `src` again)
            await self._put_back(cfg, before, [src, to], luns, nvme)
            raise NodeError(f"worker {to} could not take volumes {', '.join(group)} ({e}); they stay on worker "
                            f"{src}") from None
        self.placement = where
        for w in range(self.workers):
            if w not in (src, to):
                try:
                    await self._send_part(cfg, where, w)
                except RuntimeError as e:
                    log.error("worker %d: could not tell it volumes %s moved: %s (its connections for them "
                              "go to worker %d and on from there)", w, ", ".join(group), e, src)
        took = time.monotonic() - t0
        log.info("moved volume(s) %s from worker %d to worker %d with %d connection(s) in %.3f s", ", ".join(group),
                 src, to, released.get("connections", 0), took)
        return {"volumes": group, "from": src, "to": to, "connections": released.get("connections", 0),
                "closed": released.get("closed", 0), "seconds": round(took, 3),
                "message": f"volume {volume}{together} moved from worker {src} to worker {to}"}

    # ---- load: what each worker's core does, and each group's share of it

    async def sample_load(self, seconds: float) -> tuple[dict[int, float], list[GroupLoad]]:
        """Each worker's CPU use (cores) over `seconds`, and each group's share of it: its worker's use split
        by what the group's connections moved meanwhile (the kernel's TCP counters of each connection,
        TCP_INFO: segments and bytes; nothing is counted on the data path)."""
        groups = list({id(g): g for g in _groups(self.state.config).values()}.values())

        async def counters() -> tuple[dict[int, float], dict[int, list[float]]]:
            cpu: dict[int, float] = {}
            activity: dict[int, list[float]] = {}
            for w in self.procs:
                if w.proc is None or w.proc.returncode is not None or not w.ready:
                    continue
                mine = [g for g in groups if self.placement.volumes[g[0]] == w.index]
                try:
                    cpu[w.index] = cpu_seconds(w.proc.pid)
                    activity[w.index] = [float(x) for x in await worker_call(self.data_dir, w.index, "worker.load",
                                                                              groups=mine)]
                except (OSError, RuntimeError) as e:
                    log.info("worker %d: no load sample: %s", w.index, e)
            return cpu, activity

        cpu0, act0 = await counters()
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        cpu1, act1 = await counters()
        dt = max(time.monotonic() - t0, 1e-3)
        busy = {w: max(0.0, (cpu1[w] - cpu0[w]) / dt) for w in cpu1 if w in cpu0}
        out: list[GroupLoad] = []
        for w, cores in busy.items():
            mine = [g for g in groups if self.placement.volumes[g[0]] == w]
            a0, a1 = act0.get(w, []), act1.get(w, [])
            deltas = [max(0.0, y - x) for x, y in zip(a0, a1, strict=False)] if len(a0) == len(a1) == len(mine) \
                else [0.0] * len(mine)
            total = sum(deltas)
            for g, d in zip(mine, deltas, strict=True):
                out.append(GroupLoad(list(g), w, cores * d / total if total else 0.0))
        return busy, out

    async def balance(self, seconds: float = 2.0, *, dry_run: bool = False) -> dict[str, Any]:
        """Sample the load for `seconds`, then move the groups plan_balance() picks (`vsan workers balance`,
        and every [node] worker_balance_interval seconds when set)."""
        busy, groups = await self.sample_load(seconds)
        stay = pinned(self.state.config, self.workers)     # NBD over TLS: on worker 0, counted, never moved
        plan = plan_balance(busy, [GroupLoad(g.volumes, g.worker, 0.0 if stay & set(g.volumes) else g.load)
                                   for g in groups])
        done: list[dict[str, Any]] = []
        if not dry_run:
            async with self._applying:
                for g, to in plan:
                    try:
                        done.append(await self._move(g.volumes[0], to))
                    except (RuntimeError, ValueError, OSError) as e:   # NodeError, RequestError: their line
                        log.error("balance: moving %s to worker %d failed: %s", ", ".join(g.volumes), to, e)
                        break
        return {"workers": {str(w): round(b, 3) for w, b in sorted(busy.items())},
                "groups": [{"volumes": g.volumes, "worker": g.worker, "load": round(g.load, 3)} for g in groups],
                "plan": [{"volumes": g.volumes, "to": to, "load": round(g.load, 3)} for g, to in plan],
                "moved": done, "dry_run": dry_run}

    async def _balance_now_and_then(self, interval: float) -> None:
        while not self.stopping:
            await asyncio.sleep(interval)
            if self.stopping:
                return
            try:
                out = await self.balance(min(5.0, interval / 4))
                if out["moved"]:
                    log.info("balance: %s", "; ".join(m["message"] for m in out["moved"]))
            except Exception:
                log.exception("balance failed")

    async def _put_back(self, cfg: NodeConfig, at: Placement, workers: list[int],
                        luns: dict[str, Any] | None = None, nvme: dict[str, Any] | None = None) -> None:
        for w in workers:
            try:
                await self._send_part(cfg, at, w, unpark=True, luns=luns or {}, nvme=nvme or {})
            except RuntimeError:
                log.exception("worker %d: putting back its part failed", w)

    async def _refresh_geometry(self) -> None:
        for w in range(self.workers):
            try:
                self.geometry.update(await worker_call(self.data_dir, w, "worker.geometry"))
            except RuntimeError as e:
                log.warning("%s", e)
        self._tell_geometry(range(self.workers))

    async def _pool(self, cmd: str, args: dict[str, Any]) -> Any:
        """`vsan pool ...`: to the worker that serves the pool named (a pool is one volume's), or to every
        worker for pool.list."""
        from openvsan.node.control import NotFound

        if cmd == "pool.list":
            out: list[Any] = []
            for w in range(self.workers):
                out += await worker_call(self.data_dir, w, "worker.pool", command=cmd, args=args) or []
            return out
        name = args.get("name") or args.get("pool")
        owner = next((self.placement.volumes[v.name] for v in self.state.config.volumes if v.pool == name), None)
        if owner is None:
            known = ", ".join(v.pool for v in self.state.config.volumes if v.pool) or "none is configured"
            raise NotFound(f"no pool {name!r}; pools: {known}")     # as one process says it (node/pools.py)
        return await worker_call(self.data_dir, owner, "worker.pool", command=cmd, args=args)


def serve_workers(state: StoredState, data_dir: Path, workers: int, cpus: list[int] | None,
                  log_level: str) -> None:
    """`vsan serve` with workers > 1: run the supervisor until SIGTERM/SIGINT."""
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        sup = Supervisor(state, data_dir, workers, cpus, log_level)

        def on_signal(sig: signal.Signals) -> None:
            if not stop.is_set():
                log.info("%s: shutting down the workers", sig.name)
                stop.set()
                sup.terminate()
            else:
                log.warning("%s again: the workers stop waiting for in-flight commands", sig.name)
                sup.interrupt()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await sup.run(stop)
        finally:
            from openvsan.node.node import remove_signal_handlers

            remove_signal_handlers(loop, [signal.SIGTERM, signal.SIGINT])   # while the loop runs (see there)
        log.info("stopped")

    uvloop.run(main())
