"""A local, single-member etcd server as a child process: for tests, bench/ and (later) `vsan cluster` helpers.

It listens on 127.0.0.1 only, keeps its data in a directory of the caller's, and is killed by stop().
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Self

ETCD_PACKAGE = "etcd-server"  # Debian: ships /usr/bin/etcd


class EtcdMissing(RuntimeError):
    """No etcd binary on PATH; str() names the package that ships it."""


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdProcess:
    """`etcd` on a free 127.0.0.1 client/peer port pair, data in `data_dir`; `endpoint` is "127.0.0.1:PORT"."""

    def __init__(self, data_dir: Path, *, name: str = "vsan-test") -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdMissing(f"etcd not found on PATH: apt-get install -y {ETCD_PACKAGE}")
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.name = name
        self.client_port, self.peer_port = free_ports(2)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0) -> Self:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)  # etcd refuses (warns on) a data dir others can read
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--logger", "zap",
            "--log-level", "warn",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; log: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd not healthy on {client} after {timeout:.0f}s; log: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
