"""`vsan serve` as a real process with the real iSCSI server: start, port open, SIGTERM, exit 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CONFIG = """
[node]
name = "t"

[[devices]]
name = "ram0"
type = "ram"
size = "16MiB"

[[volumes]]
name = "disk0"
device = "ram0"

[iscsi]
portals = ["127.0.0.1:{port}"]

[[iscsi.targets]]
iqn = "iqn.2026-11.org.openvsan:disk0"
luns = [{{ lun = 0, volume = "disk0" }}]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vsan(*args: str, loop: str = "uvloop") -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "openvsan.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OPENVSAN_LOOP": loop})


def wait_for_port(proc: subprocess.Popen[str], port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"vsan serve exited with {proc.returncode} before listening:\n{err}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail("vsan serve did not open its portal in time")


@pytest.fixture
def config(tmp_path: Path) -> tuple[Path, int]:
    port = free_port()
    path = tmp_path / "node.toml"
    path.write_text(CONFIG.format(port=port))
    return path, port


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_serve_starts_and_stops_on_sigterm(config: tuple[Path, int], tmp_path: Path, loop: str) -> None:
    path, port = config
    proc = vsan("serve", "--config", str(path), "--data-dir", str(tmp_path / "data"), loop=loop)
    try:
        wait_for_port(proc, port)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert f"serving iqn.2026-11.org.openvsan:disk0 LUN 0 (disk0, 16.0 MiB) on 127.0.0.1:{port}" in err
    assert "stopped" in err
    assert "Traceback" not in err, err  # a connection (made by wait_for_port) must not upset the server
    assert (tmp_path / "data" / "state-kv.db").exists()


@pytest.mark.parametrize("workers", [["--workers", "1"], ["--workers", "2"], []])
def test_serve_port_in_use(config: tuple[Path, int], tmp_path: Path, workers: list[str]) -> None:
    """One process, two workers, and the default (one per core): the same one line, naming the portal."""
    path, port = config
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        proc = vsan("serve", "--config", str(path), "--data-dir", str(tmp_path / "data"), *workers)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    lines = [x for x in err.splitlines() if x.startswith("vsan: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "127.0.0.1" in lines[0] and str(port) in lines[0]


@pytest.mark.parametrize("delay", [0.0, 0.3, 0.8])
def test_sigterm_to_the_process_group_while_workers_start_is_a_clean_stop(config: tuple[Path, int], tmp_path: Path,
                                                                         delay: float) -> None:
    """systemd and a terminal's ^C signal the whole process group: a worker may stop (exit 0) before the
    supervisor's own handler has run, at any point of the start. That is a stop, not a worker that could not
    start: exit 0."""
    path, _ = config
    proc = subprocess.Popen([sys.executable, "-m", "openvsan.cli.main", "serve", "--config", str(path),
                             "--data-dir", str(tmp_path / "data"), "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stderr is not None
        first = []
        for line in proc.stderr:       # a worker's first line: the supervisor has its signal handlers
            first.append(line)
            if " w0 " in line or " w1 " in line:
                break
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        err = "".join(first) + err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert "could not start" not in err and "Traceback" not in err, err
