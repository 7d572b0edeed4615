"""A real `vsan serve --workers N` for tests: N file-backed volumes, each exported as an iSCSI target, an NVMe
subsystem and an NBD export on shared portals (free ports), so that connections land on any worker and
the hand-off (frontend/handoff.py) is exercised. Used by tests/interop/test_workers.py and
tests/fault/test_workers_kill9.py."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from vsan_harness import VSAN, free_port

BS = 512


def iqn(v: str) -> str:
    return f"iqn.2026-12.org.openvsan.test:{v}"


def nqn(v: str) -> str:
    return f"nqn.2026-12.org.openvsan.test:{v}"


@dataclass
class WorkerNode:
    workdir: Path
    workers: int = 2
    volumes: tuple[str, ...] = ("v0", "v1")
    size_mib: int = 8
    backing: str = "file"          # or "ram": memory the supervisor keeps across a worker's restart
    node_extra: tuple[str, ...] = ()   # more [node] lines, e.g. 'worker_balance_interval = 10'
    nbd_extra: tuple[str, ...] = ()    # more [nbd] lines, e.g. 'tls = { cert = ..., key = ... }'
    compression: str = ""              # each volume carved from its device, compressed so ("lz4"), 4 KiB clusters
    proc: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ports = {"iscsi": free_port(), "nvme": free_port(), "nbd": free_port()}
        self.config = self.workdir / "vsan.toml"
        self.data_dir = self.workdir / "data"
        self.log = self.workdir / "vsan.log"
        lines = ["[node]", 'name = "workers"', f"workers = {self.workers}", *self.node_extra, ""]
        for v in self.volumes:
            where = [f'path = "{self.image(v)}"'] if self.backing == "file" else []
            if self.compression:
                lines += ["[[devices]]", f'name = "d{v}"', f'type = "{self.backing}"', *where,
                          f'size = "{2 * self.size_mib + 16}MiB"', 'cluster = "4KiB"', "", "[[volumes]]",
                          f'name = "{v}"', f'device = "d{v}"', f'size = "{self.size_mib}MiB"',
                          f'compression = "{self.compression}"', ""]
                continue
            lines += ["[[devices]]", f'name = "d{v}"', f'type = "{self.backing}"', *where,
                      f'size = "{self.size_mib}MiB"', "", "[[volumes]]", f'name = "{v}"', f'device = "d{v}"', ""]
        lines += ["[iscsi]", f'portals = ["127.0.0.1:{self.ports["iscsi"]}"]', ""]
        for v in self.volumes:
            lines += ["[[iscsi.targets]]", f'iqn = "{iqn(v)}"', f'luns = [{{ lun = 0, volume = "{v}" }}]', ""]
        lines += ["[nvme]", f'portals = ["127.0.0.1:{self.ports["nvme"]}"]', ""]
        for v in self.volumes:
            lines += ["[[nvme.subsystems]]", f'nqn = "{nqn(v)}"', f'namespaces = [{{ nsid = 1, volume = "{v}" }}]', ""]
        lines += ["[nbd]", f'portals = ["127.0.0.1:{self.ports["nbd"]}"]', *self.nbd_extra, ""]
        for v in self.volumes:
            lines += ["[[nbd.exports]]", f'name = "{v}"', f'volume = "{v}"', ""]
        self.config.write_text("\n".join(lines))
        self.config.chmod(0o600)

    def image(self, v: str) -> Path:
        return self.workdir / f"{v}.img"

    def url(self, proto: str, v: str) -> str:
        if proto == "iscsi":
            return f"iscsi://127.0.0.1:{self.ports['iscsi']}/{iqn(v)}/0"
        if proto == "nvme":
            return f"nvme+tcp://127.0.0.1:{self.ports['nvme']}/{nqn(v)}/1"
        return f"nbd://127.0.0.1:{self.ports['nbd']}/{v}"

    def start(self, timeout: float = 60.0) -> WorkerNode:
        seen = len(self.log_text())   # a restart appends to the log: look at what this start writes
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([str(VSAN), "serve", "--config", str(self.config), "--data-dir",
                                          str(self.data_dir), "--log-level", "debug"],
                                         stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while f"serving with {self.workers} worker processes" not in self.log_text()[seen:]:
            if self.proc.poll() is not None:
                raise AssertionError(f"vsan serve exited {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"vsan serve not serving after {timeout:g} s:\n{self.log_text()[-4000:]}")
            time.sleep(0.05)
        return self

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def workers_report(self) -> list[dict[str, object]]:
        out = subprocess.run([str(VSAN), "workers", "--data-dir", str(self.data_dir), "--json"],
                             capture_output=True, text=True, timeout=30, check=True)
        rows: list[dict[str, object]] = json.loads(out.stdout)
        return rows

    def owner(self, v: str) -> dict[str, object]:
        return next(r for r in self.workers_report() if v in r["volumes"])  # type: ignore[operator]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"vsan serve did not stop within {timeout:g} s:\n{self.log_text()[-4000:]}")
        rc = self.proc.returncode
        self.proc = None
        return rc
