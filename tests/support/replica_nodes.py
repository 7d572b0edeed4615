"""Replica nodes for fault tests: `vsan serve` processes (real ones), each with its own data dir, ports and a
file device, in one cluster whose state is in a real etcd (tests/support/etcd_cluster.py).

    with EtcdCluster(tmp / "etcd", ["e1"]) as etcd:
        nodes = ReplicaCluster(tmp, etcd.endpoints, ["a", "b"])     # `vsan cluster init` done
        nodes.start_all(); p = nodes.wait_primary()
        nodes["a"].kill()                                            # SIGKILL
        nodes["a"].start()                                           # same data dir: it resyncs

`lab`: a netns Lab to run each node in its namespace (its addresses then are the Lab's), for link cuts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from openvsan.cluster.etcd_process import free_ports
from openvsan.initiator.nvme_tcp import NvmeTcpInitiator

VSAN = [sys.executable, "-m", "openvsan.cli.main"]
CLUSTER_ID = "ctest"
VOLUME = "v1"
IQN = "iqn.2026-12.org.openvsan.test:v1"
NQN = "nqn.2026-12.org.openvsan.test:v1"


def vsan(*args: str, timeout: float = 30, lab: Any = None, ns: str = "") -> subprocess.CompletedProcess[str]:
    """`vsan ARGS`; with `lab`, inside its namespace `ns` (an etcd that lives in the Lab is reached from there)."""
    if lab is not None:
        return lab.run(ns, [*VSAN, *args], check=False, timeout=timeout)  # type: ignore[no-any-return]
    return subprocess.run([*VSAN, *args], check=False, capture_output=True, text=True, timeout=timeout)


class ReplicaNode:
    def __init__(self, name: str, workdir: Path, etcd: Sequence[str], nodes: Sequence[str], *, size: str,
                 host: str = "127.0.0.1", lab: Any = None, lease_ttl: int = 3, suspend: float = 5.0,
                 ram: bool = False, ports: Sequence[int] = (), workers: int = 1, log_level: str = "",
                 carve: str = "", api: bool = False, device_lines: Sequence[str] = (),
                 volume_lines: Sequence[str] = ()) -> None:
        """`carve`: the volume is carved (thin) from the device at this size, beside others (volume/thin);
        else it is the whole device. `device_lines`, `volume_lines`: more TOML lines in the device's and the
        volume's tables (e.g. 'cluster = "4KiB"', 'compression = "lz4"'). `api`: an [api] table on a port of its own (api_url); else none (the
        node tries the default 127.0.0.1:8080, and one of several nodes on a host gets it)."""
        self.name, self.host, self.lab = name, host, lab
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.dir / "data"
        self.image = self.dir / "d0.img"
        self.config = self.dir / "vsan.toml"
        self.log = self.dir / "vsan.log"
        same = lab is None
        # on loopback every node needs ports of its own: picked together (free_ports), not one by one
        self.repl_port, self.iscsi_port, self.nvme_port = (ports or free_ports(3)) if same else (4430, 3260, 4420)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_level = log_level
        self.api_port = (free_ports(1)[0] if same else 8080) if api else None
        self.config.write_text("\n".join([
            "[node]", f'name = "{name}"', f'data_dir = "{self.data_dir}"', f"workers = {workers}", "",
            "[cluster]", f'id = "{CLUSTER_ID}"', f"etcd = {json.dumps(list(etcd))}",
            f'replication = "{host}:{self.repl_port}"', f"lease_ttl = {lease_ttl}", f"suspend_seconds = {suspend}", "",
            "[[devices]]", 'name = "d0"', *(['type = "ram"'] if ram else ['type = "file"', f'path = "{self.image}"']),
            f'size = "{size}"', *device_lines, "",
            "[[volumes]]", f'name = "{VOLUME}"', 'device = "d0"', *([f'size = "{carve}"'] if carve else []),
            f"replicas = {len(nodes)}",
            f"nodes = {json.dumps(list(nodes))}", *volume_lines, "",
            "[iscsi]", f'portals = ["{host}:{self.iscsi_port}"]', "",
            "[[iscsi.targets]]", f'iqn = "{IQN}"', f'luns = [{{ lun = 0, volume = "{VOLUME}" }}]', "",
            "[nvme]", f'portals = ["{host}:{self.nvme_port}"]', "",
            "[[nvme.subsystems]]", f'nqn = "{NQN}"', f'namespaces = [{{ nsid = 1, volume = "{VOLUME}" }}]', "",
            *(["[api]", f'listen = "{host}:{self.api_port}"', ""] if api else []),
        ]))

    @property
    def api_url(self) -> str:
        assert self.api_port is not None, "made without api=True"
        return f"http://{self.host}:{self.api_port}"

    def api_token(self, name: str, role: str = "admin") -> str:
        """A new API token of this node (`vsan token create`)."""
        r = vsan("token", "create", name, "--role", role, "--data-dir", str(self.data_dir), "--json")
        assert r.returncode == 0, r.stderr
        token: str = json.loads(r.stdout)["token"]
        return token

    @property
    def nvme_url(self) -> str:
        return f"nvme+tcp://{self.host}:{self.nvme_port}/{NQN}/1"

    @property
    def iscsi_url(self) -> str:
        return f"iscsi://{self.host}:{self.iscsi_port}/{IQN}/0"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is running"
        argv = [*VSAN, "serve", "--config", str(self.config), *(["--log-level", self.log_level] if self.log_level else [])]
        with open(self.log, "ab") as log:
            if self.lab is None:
                self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            else:
                self.proc = self.lab.popen(self.name, argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not (self.data_dir / "control.sock").exists() or self.status() is None:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not come up:\n{self.log_tail()}")
            time.sleep(0.2)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(30)

    def stop(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def status(self) -> dict[str, Any] | None:
        r = vsan("volume", "status", VOLUME, "--data-dir", str(self.data_dir), "--json", timeout=15)
        if r.returncode != 0:
            return None
        out: dict[str, Any] = json.loads(r.stdout)
        return out

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


class ReplicaCluster:
    def __init__(self, workdir: Path, etcd: Sequence[str], names: Sequence[str], *, size: str = "64MiB",
                 lab: Any = None, **kw: Any) -> None:
        self.etcd = list(etcd)
        self.lab, self._ns = lab, (names[0] if lab is not None else "")
        r = vsan("cluster", "init", "--id", CLUSTER_ID, "--etcd", ",".join(self.etcd), lab=lab, ns=self._ns)
        assert r.returncode == 0, r.stderr
        ports = free_ports(3 * len(names)) if lab is None else []
        self.nodes = {n: ReplicaNode(n, workdir, self.etcd, names, size=size, lab=lab,
                                     host=lab.addr[n] if lab is not None else "127.0.0.1",
                                     ports=ports[3 * i:3 * i + 3], **kw) for i, n in enumerate(names)}

    def __getitem__(self, name: str) -> ReplicaNode:
        return self.nodes[name]

    def start_all(self) -> None:
        for n in self.nodes.values():
            n.start()

    def stop_all(self) -> None:
        for n in self.nodes.values():
            n.stop()

    def cluster_status(self) -> dict[str, Any]:
        r = vsan("cluster", "status", "--etcd", ",".join(self.etcd), "--json", lab=self.lab, ns=self._ns)
        assert r.returncode == 0, r.stderr
        out: dict[str, Any] = json.loads(r.stdout)
        return out

    def wait_primary(self, *, not_: str | None = None, timeout: float = 30) -> str:
        """The node that serves as primary (its own status says so), other than `not_`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for n in self.nodes.values():
                if n.name != not_ and n.running():
                    s = n.status()
                    if s is not None and s.get("role") == "primary":
                        return n.name
            time.sleep(0.2)
        raise AssertionError("no primary came up:\n" + "\n".join(f"--- {n.name}\n{n.log_tail(1500)}"
                                                                  for n in self.nodes.values()))

    def wait_in_sync(self, timeout: float = 60) -> dict[str, Any]:
        """Until the primary says every replica is in sync and nothing is left to copy."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            for n in self.nodes.values():
                s = n.status() if n.running() else None
                if s is not None and s.get("role") == "primary":
                    last = s
                    peers = s.get("peers", {})
                    if (set(s["in_sync"]) == set(self.nodes) and peers
                            and all(p["connected"] and not p["dirty_regions"] for p in peers.values())):
                        return s
            time.sleep(0.3)
        raise AssertionError(f"replicas not in sync: {last}")

    def close(self) -> None:
        for n in self.nodes.values():
            if n.running():
                n.kill()


@contextlib.contextmanager
def two_nodes(tmp_path: Path, **kw: Any) -> Iterator[ReplicaCluster]:
    """Replica nodes a and b (`vsan serve` each) and a one-member etcd, started, with the primary connected to
    its peer and both in sync (a node elected before the other listens marks it out of sync at the first
    write, and a test that kills the primary then has no replica to fail over to); stopped after."""
    from etcd_cluster import EtcdCluster

    with EtcdCluster(tmp_path / "etcd", ["e1"]) as etcd:
        cluster = ReplicaCluster(tmp_path, etcd.endpoints, ["a", "b"], **kw)
        try:
            cluster.start_all()
            cluster.wait_primary()
            cluster.wait_in_sync()
            yield cluster
        finally:
            cluster.stop_all()
            cluster.close()


async def write_through(url: str, lbas: Sequence[int], data: Callable[[int], bytes], *, flush: bool,
                        deadline: float) -> None:
    """data(lba) written at each lba through `url` (our NVMe/TCP initiator), then a flush if asked; retried
    as a host retries a path while a failover completes, until `deadline`."""
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            dev = await NvmeTcpInitiator.open_url(url, command_timeout=3.0, reconnect_timeout=0.0,
                                                  connect_timeout=3.0)
        except Exception as e:  # noqa: BLE001 - not up yet
            last = e
            await asyncio.sleep(0.3)
            continue
        try:
            for lba in lbas:
                await dev.write(lba, data(lba))
            if flush:
                await dev.flush()
            return
        except Exception as e:  # noqa: BLE001 - this path refused it (standby): again
            last = e
            await asyncio.sleep(0.3)
        finally:
            await dev.close()
    raise AssertionError(f"writes through {url} not taken: {last}")


async def unflushed_then(url: str, lbas: Sequence[int], data: Callable[[int], bytes], then: Callable[[], Any]) -> Any:
    """data(lba) written at each lba through `url`, acknowledged and not flushed, then `then()` (in a thread)
    while the host is still connected: its disconnect (an NVMe shutdown) would flush the volume."""
    dev = await NvmeTcpInitiator.open_url(url, command_timeout=3.0, reconnect_timeout=0.0, connect_timeout=3.0)
    try:
        for lba in lbas:
            await dev.write(lba, data(lba))
        return await asyncio.to_thread(then)
    finally:
        await dev.close()
