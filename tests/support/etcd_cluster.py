"""A real multi-member etcd cluster for fault tests, and a StateStore client that runs inside a namespace.

`EtcdCluster(workdir, ["e1", "e2", "e3"], lab=lab)` runs one `etcd` (Debian etcd-server 3.4) per name, each
inside the Lab namespace of that name, on its Lab address (client port 2379, peer 2380), data in
workdir/<name>; without a lab the members run on 127.0.0.1 ports of their own. start() returns when every
member reports healthy (`GET /health`: {"health":"true"} once it has a leader); kill(name) is SIGKILL,
stop(name) SIGTERM, restart(name) starts it again on its data dir and waits for it.

The test process lives in the root namespace and cannot reach a Lab address, so a store client in a Lab is a
child process: `StoreAgent(lab, "c1", cluster.endpoints)` runs this file as `agent` inside namespace c1, with
an EtcdStateStore on those endpoints, and forwards calls to it (one JSON line each way; each call runs as its
own task there, so a hung one does not hold up the next). A call that fails raises AgentError with the
store's exception name in `.kind` ("StoreUnavailable", "Conflict", "LeaseExpired", ...). Watches stream
their events back as they come.

Timings: the cluster runs with a 50 ms heartbeat and a 500 ms election timeout, so a member cut off from the
others notices it has no leader within about a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from openvsan.cluster.etcd_process import ETCD_PACKAGE, EtcdMissing, free_ports

CLIENT_PORT, PEER_PORT = 2379, 2380
HEARTBEAT_MS, ELECTION_MS = 50, 500

if __name__ != "__main__":
    from netns import Lab


class EtcdMember:
    def __init__(self, name: str, host: str, client_port: int, peer_port: int, data_dir: Path) -> None:
        self.name, self.host, self.client_port, self.peer_port = name, host, client_port, peer_port
        self.data_dir = data_dir
        self.log_path = data_dir.parent / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


class EtcdCluster:
    def __init__(self, workdir: Path, names: Sequence[str], *, lab: Lab | None = None) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdMissing(f"etcd not found on PATH: apt-get install -y {ETCD_PACKAGE}")
        self.binary = binary
        self.lab = lab
        self.workdir = Path(workdir)
        self.token = f"ovsan-{os.getpid()}-{time.monotonic_ns()}"
        self.members: dict[str, EtcdMember] = {}
        for name in names:
            if lab is None:
                client, peer = free_ports(2)
                host = "127.0.0.1"
            else:
                client, peer, host = CLIENT_PORT, PEER_PORT, lab.addr[name]
            self.members[name] = EtcdMember(name, host, client, peer, self.workdir / name)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members.values()]

    def endpoint(self, name: str) -> str:
        return self.members[name].endpoint

    def _argv(self, m: EtcdMember) -> list[str]:
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members.values())
        return [
            self.binary,
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", m.client_url,
            "--advertise-client-urls", m.client_url,
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", initial,
            "--initial-cluster-state", "new",  # ignored once the data dir holds a member: a restart rejoins
            "--initial-cluster-token", self.token,
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
            "--logger", "zap",
            "--log-level", "warn",
        ]  # fmt: skip

    def _launch(self, name: str) -> None:
        m = self.members[name]
        m.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(m.data_dir, 0o700)  # etcd warns about (3.5: refuses) a data dir others can read
        with open(m.log_path, "ab") as log:
            if self.lab is None:
                m.proc = subprocess.Popen(self._argv(m), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            else:
                m.proc = self.lab.popen(name, self._argv(m), stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, names: Sequence[str] | None = None, timeout: float = 20.0) -> None:
        """Until each member in `names` (default: all) answers /health true."""
        for name in names or list(self.members):
            m = self.members[name]
            assert m.proc is not None
            argv = [sys.executable, __file__, "health", m.client_url, str(timeout)]
            if self.lab is None:
                proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout + 10)
            else:
                proc = self.lab.run(name, argv, check=False, timeout=timeout + 10)
            if proc.returncode != 0:
                state = "exited" if m.proc.poll() is not None else "running"
                raise RuntimeError(
                    f"etcd member {name} ({state}) not healthy on {m.client_url}: {proc.stdout.strip()}\n"
                    f"log: {m.log_tail()}"
                )

    def start(self) -> Self:
        """Launch the members not running (`with EtcdCluster(...)` starts them; a second start() launches
        nothing twice: a second etcd on a member's ports and data dir would fail, and its dead process would
        take the place of the live one, which kill() and close() then never reach)."""
        try:
            for name, m in self.members.items():
                if m.proc is None or m.proc.poll() is not None:
                    self._launch(name)
            self.wait_healthy()
        except BaseException:
            self.close()
            raise
        return self

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.members[name].proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(timeout=15)

    def stop(self, name: str) -> None:
        self.kill(name, signal.SIGTERM)

    def restart(self, name: str, *, wait: bool = True) -> None:
        self.kill(name)
        self._launch(name)
        if wait:
            self.wait_healthy([name])

    def close(self) -> None:
        for name in self.members:
            self.kill(name)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# -- a StateStore client in a namespace --


class AgentError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        self.kind, self.message = kind, message
        super().__init__(f"{kind}: {message}")


class StoreAgent:
    """An EtcdStateStore in a child process inside `ns`. call(op, ...) -> the result; ops: get, put, delete,
    list, revision, grant (-> lease id), refresh, revoke, watch (-> watch id; events via events(id))."""

    def __init__(
        self, lab: Lab, ns: str, endpoints: Sequence[str], *, prefix: str = "/fault", timeout: float = 2.0
    ) -> None:
        config = json.dumps({"endpoints": list(endpoints), "prefix": prefix, "timeout": timeout})
        self.ns = ns
        self.proc = lab.popen(
            ns, [sys.executable, __file__, "agent", config], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._events: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"agent {ns}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._lock:
                if "watch" in msg:
                    self._events.setdefault(msg["watch"], queue.Queue()).put(msg)
                else:
                    self._replies.setdefault(msg["id"], queue.Queue()).put(msg)
        with self._lock:  # the agent is gone: wake every waiter
            for q in [*self._replies.values(), *self._events.values()]:
                q.put({"error": "AgentExited", "message": f"agent in {self.ns} exited"})

    def send(self, op: str, **args: Any) -> int:
        """Start a call without waiting; result(id) collects it."""
        rid = next(self._ids)
        with self._lock:
            self._replies.setdefault(rid, queue.Queue())
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"id": rid, "op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        return rid

    def result(self, rid: int, timeout: float = 30) -> Any:
        try:
            msg = self._replies[rid].get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"agent in {self.ns}: no answer to call {rid} in {timeout:g}s") from None
        if "error" in msg:
            raise AgentError(msg["error"], msg["message"])
        return msg.get("result")

    def call(self, op: str, *, timeout: float = 30, **args: Any) -> Any:
        return self.result(self.send(op, **args), timeout)

    def timed(self, op: str, *, timeout: float = 30, **args: Any) -> tuple[Any, float]:
        t0 = time.monotonic()
        return self.call(op, timeout=timeout, **args), time.monotonic() - t0

    def events(self, watch_id: int, n: int, timeout: float = 20) -> list[dict[str, Any]]:
        """The next n events (or the error that ended the watch, as {"error": ...}) of a watch."""
        with self._lock:
            q = self._events.setdefault(watch_id, queue.Queue())
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            try:
                msg = q.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise TimeoutError(f"watch {watch_id} in {self.ns}: {len(out)} of {n} events in {timeout:g}s") from None
            out.append(msg)
            if "error" in msg:
                break
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # the agent closes its store and exits on EOF
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


# -- the child side --


def _health(url: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                body = r.read()
                if json.loads(body).get("health") == "true":
                    return 0
                last = body.decode(errors="replace")
        except (OSError, ValueError) as e:
            last = str(e)
        time.sleep(0.05)
    print(f"not healthy after {timeout:g}s: {last}")
    return 1


async def _agent(config: dict[str, Any]) -> None:
    from openvsan.cluster.etcd import EtcdStateStore
    from openvsan.node.statestore import Conflict, Event, Lease

    store = EtcdStateStore(config["endpoints"], prefix=config["prefix"], timeout=config["timeout"])
    leases: dict[int, Lease] = {}
    watches: dict[int, asyncio.Task[None]] = {}
    tasks: set[asyncio.Task[None]] = set()
    out = sys.stdout

    def emit(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    def event_json(ev: Event) -> dict[str, Any]:
        e = ev.entry
        return {"kind": ev.kind, "key": e.key, "value": e.value, "revision": ev.revision, "version": e.version}

    async def follow(wid: int, prefix: str, start: int | None) -> None:
        try:
            async for ev in store.watch(prefix, start_revision=start):
                emit({"watch": wid, **event_json(ev)})
        except Exception as e:  # noqa: BLE001  (reported to the test, which decides)
            emit({"watch": wid, "error": type(e).__name__, "message": str(e)})

    async def handle(msg: dict[str, Any]) -> None:
        rid, op = msg["id"], msg["op"]
        try:
            result: Any = None
            if op == "get":
                entry = await store.get(msg["key"])
                result = None if entry is None else {"value": entry.value, "revision": entry.revision}
            elif op == "put":
                lease = leases[msg["lease"]] if msg.get("lease") else None
                result = await store.put(msg["key"], msg["value"], expect=msg.get("expect"), lease=lease)
            elif op == "delete":
                result = await store.delete(msg["key"], expect=msg.get("expect"))
            elif op == "list":
                result = [e.key for e in await store.list(msg["prefix"])]
            elif op == "revision":
                result = await store.revision()
            elif op == "endpoint":
                result = store.endpoint
            elif op == "grant":
                lease = await store.grant_lease(msg["ttl"])
                leases[lease.id] = lease
                result = lease.id
            elif op == "refresh":
                result = await leases[msg["lease"]].refresh()
            elif op == "revoke":
                await leases[msg["lease"]].revoke()
            elif op == "watch":
                wid = rid
                watches[wid] = asyncio.create_task(follow(wid, msg["prefix"], msg.get("start_revision")))
                result = wid
            else:
                raise ValueError(f"unknown op {op!r}")
            emit({"id": rid, "result": result})
        except Conflict as e:
            emit({"id": rid, "error": "Conflict", "message": str(e), "actual": e.actual})
        except Exception as e:  # noqa: BLE001  (every failure goes back to the test)
            emit({"id": rid, "error": type(e).__name__, "message": str(e)})

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        task = asyncio.create_task(handle(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for t in [*watches.values(), *tasks]:
        t.cancel()
    await asyncio.gather(*watches.values(), *tasks, return_exceptions=True)
    await store.close()


if __name__ == "__main__":
    if sys.argv[1] == "health":
        sys.exit(_health(sys.argv[2], float(sys.argv[3])))
    elif sys.argv[1] == "agent":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        asyncio.run(_agent(json.loads(sys.argv[2])))
