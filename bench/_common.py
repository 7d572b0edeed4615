"""What both comparison scripts share: tool checks, free ports, core pinning, targets started in their own
process group and always stopped, the CPU and peak memory a target's process group used, and the median table.

Standard library only, so anyone can run the scripts with the system python3 (the targets run from .venv).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO.parent / "shared" / "peers"
VSAN = REPO / ".venv" / "bin" / "vsan"
PROBE_IQN = "iqn.2026-11.org.openvsan.bench:probe"
CLIENT_IQN = "iqn.2026-11.org.openvsan.bench:client"

# A missing tool is named with the Debian package that provides it (the same words as .ci/run).
TOOL_PACKAGES = {
    "iscsi-perf": "libiscsi-bin",
    "iscsi-readcapacity16": "libiscsi-bin",
    "tgtd": "tgt",
    "tgtadm": "tgt",
    "taskset": "util-linux",
    "fio": "fio",
    "bash": "bash",
}


class BenchError(RuntimeError):
    """One line for the user: what went wrong and how to mend it."""


def require_tools(*names: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pkgs = sorted({TOOL_PACKAGES.get(n, "?") for n in missing})
        raise BenchError(f"missing {', '.join(missing)}: apt-get install {' '.join(pkgs)} (or `sudo bash .ci/run`)")
    if not VSAN.exists():
        raise BenchError(f"{VSAN} is missing: run `make install` in {REPO}")


_GIVEN: set[int] = set()     # ports free_port() handed out in this run


def free_port() -> int:
    """A loopback port free now and not handed out before in this run (a script takes several one after the
    other, and the kernel may hand one out again once the socket that found it is closed)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def pinning() -> tuple[list[str], list[str], bool]:
    """(target prefix, client prefix, pinned): targets on core 0 and clients on core 1, so neither steals the
    other's core; on a one-core machine (or without taskset) nothing is pinned and the report says so."""
    if (os.cpu_count() or 1) >= 2 and shutil.which("taskset"):
        return ["taskset", "-c", "0"], ["taskset", "-c", "1"], True
    return [], [], False


def run_script(name: str, tools: Sequence[str], measure: Callable[[], int], stopped: str) -> int:
    """A comparison script's main: SIGTERM as Ctrl-C, the tools checked, then `measure()`; a BenchError is
    one line and exit 1, an interrupt exit 130 (what it started is stopped by then: `stopped` says so)."""
    sigterm_as_interrupt()
    try:
        require_tools(*tools)
        return measure()
    except BenchError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted; {stopped}", file=sys.stderr)
        return 130


def sigterm_as_interrupt() -> None:
    """SIGTERM takes the same path as Ctrl-C, so the `finally` that stops the targets runs either way. SIGINT
    is set too: a shell starts a background job with SIGINT ignored, and Python keeps an inherited SIG_IGN."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


class Target:
    """A target process in its own session (process group): Ctrl-C in the terminal reaches the client, not the
    target, and stop() ends the target in its own clean way first, then kills whatever of the group is left."""

    def __init__(self, name: str, argv: Sequence[str], workdir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = workdir / f"{name}.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=None if self.env is None else {**os.environ, **self.env},
            )

    @property
    def pgid(self) -> int:
        assert self.proc is not None
        return self.proc.pid  # start_new_session: the leader's pid is the group id

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            rc = None if self.proc is None else self.proc.returncode
            raise BenchError(f"{self.name} exited ({rc}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20) -> int | None:
        """SIGTERM to the leader only (tgt-serve.sh traps it and deletes its target and LUN file; vsan serve
        drains and exits 0), then SIGKILL to anything of the group still alive. The leader's exit status, None
        when it had to be killed."""
        if self.proc is None:
            return None
        rc: int | None = None
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                rc = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"{self.name} did not exit within {timeout}s of SIGTERM: killed", file=sys.stderr)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.pgid, signal.SIGKILL)  # tgtd ignores SIGTERM; nothing of ours may outlive the run
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=5)
        return rc


def group_stats(pgid: int) -> list[tuple[str, list[bytes]]]:
    """(pid, the fields of /proc/PID/stat after the command name) of every live process in a process group."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name may hold spaces or parentheses: fields are counted after its last ')'
        fields = stat[stat.rindex(b")") + 2:].split()
        if int(fields[2]) == pgid:  # field 5, pgrp
            out.append((entry, fields))
    return out


def group_cpu_seconds(pgid: int) -> float:
    """user+system seconds of every live process in a process group (all threads included), from /proc."""
    ticks = sum(int(f[11]) + int(f[12]) for _, f in group_stats(pgid))  # fields 14, 15: utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_iscsi_ready(target: Target, url: str, timeout: float = 60) -> None:
    """Ready = a login and READ CAPACITY(16) from a real initiator succeed; a listening port is not enough."""
    deadline = time.monotonic() + timeout
    while True:
        target.check_alive()
        try:
            p = subprocess.run(["iscsi-readcapacity16", "-i", PROBE_IQN, url], check=False, capture_output=True,
                               timeout=5)
            if p.returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            raise BenchError(f"{target.name} did not serve {url} within {timeout}s:\n{target.log_tail()}")
        time.sleep(0.2)


def wait_port(target: Target, port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        target.check_alive()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(f"{target.name}: nothing listens on 127.0.0.1:{port} after {timeout}s") from None
            time.sleep(0.2)


def run_tool(argv: Sequence[str], timeout: float) -> str:
    """Run a client tool; its output on success, one BenchError with the command line and output otherwise."""
    try:
        p = subprocess.run(list(argv), check=False, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"timed out after {timeout:.0f}s: {' '.join(argv)}") from e
    if p.returncode != 0:
        raise BenchError(f"exit {p.returncode}: {' '.join(argv)}\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return p.stdout


def vsan_bench_iops(out: str) -> dict[str, float]:
    """IOPS, MB/s and p50/p99 latency of the first run of `vsan bench --json`."""
    doc = json.loads(out)
    run = doc["runs"][0]
    if run["errors"]["io"] or run["errors"]["verify"]:
        raise BenchError(f"vsan bench on {run['target']}: errors {run['errors']}")
    total = run["total"]
    return {"iops": total["iops"], "mbps": total["mbps"], "p50_us": total["latency_us"]["p50"],
            "p99_us": total["latency_us"]["p99"]}


def precondition(client: Sequence[str], url: str, timeout: float = 900) -> None:
    """Every block of the target written once (vsan bench --precondition: 1 MiB sequential writes, QD 8), so no
    measured run is the first to touch a page or block: a RAM device's first write to a page costs a page
    fault and a zeroed page (about 14 % of a replicated primary's CPU at 4K QD32 on a fresh 1 GiB RAM volume,
    py-spy), and a read of a never-written range reads a hole (SNIA's PTS preconditions a device before
    measuring it for the same reason)."""
    run_tool([*client, str(VSAN), "bench", url, "--rw", "write", "--bs", "1m", "--qd", "8", "-d", "0.2",
              "--warmup", "0", "--precondition", "--json"], timeout=timeout)


def record(results: dict[Any, dict[str, list[float]]], key: Any, figures: dict[str, float]) -> None:
    """Add one run's figures to the lists kept for `key` (a case and a target), for the medians."""
    slot = results.setdefault(key, {})
    for k, v in figures.items():
        slot.setdefault(k, []).append(v)


def fio_nbd_job(work: Path, name: str, uri: str, options: Sequence[str]) -> Path:
    """A job file for fio's nbd engine (on the command line fio splits --uri at its ':', as it does file
    names): work/fio-NAME.fio with `options` (rw=..., bs=..., ...)."""
    job = work / f"fio-{name}.fio"
    job.write_text("\n".join(["[job]", "ioengine=nbd", f"uri={uri}", *options, ""]))
    return job


def fio_job(out: str, what: str) -> dict[str, Any]:
    """The first job of `fio --output-format=json`'s document (the nbd engine prints "fio: connected to NBD
    server" on stdout before it); BenchError when there is none or the job failed."""
    if "{" not in out:
        raise BenchError(f"no JSON from fio on {what}:\n{out[-1000:]}")
    job: dict[str, Any] = json.loads(out[out.index("{"):])["jobs"][0]
    if job.get("error"):
        raise BenchError(f"fio on {what}: error {job['error']}")
    return job


def make_workdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def stop_all(targets: Sequence[Target], work: Path, ok: bool) -> None:
    """Stop every target; vsan serve must exit 0 after SIGTERM (a drained, clean stop). The work dir (logs,
    config, data dir) is removed after a clean run and kept, with its path printed, otherwise."""
    clean = ok
    for t in targets:
        rc = t.stop()
        if t.name.startswith("openvsan") and rc != 0:
            print(f"{t.name} exited {rc} after SIGTERM (want 0):\n{t.log_tail()}", file=sys.stderr)
            clean = False
        elif "Traceback" in t.log_tail(400):
            print(f"{t.name} logged a Traceback:\n{t.log_tail()}", file=sys.stderr)
            clean = False
    if clean:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs kept in {work}", file=sys.stderr)
    if ok and not clean:
        raise BenchError("a target did not stop cleanly")


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def fmt(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    if unit == "IOPS":
        return f"{x / 1000:.1f}K IOPS" if x >= 1000 else f"{x:.0f} IOPS"
    if unit == "MB/s":
        return f"{x:,.0f} MB/s"
    if unit == "us":
        return f"{x:.0f} µs"
    return f"{x:.3g} {unit}"


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A Markdown table, so the output pastes straight into docs/benchmarks.md."""
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def group_memory(pgid: int) -> tuple[int, int]:
    """(bytes resident beyond shared memory, bytes of shared memory) of a process group, from /proc/PID/status:
    RssAnon + RssFile is what the process itself holds; RssShmem is the RAM disks (memfd and /dev/shm)."""
    own = shm = 0
    for pid, _ in group_stats(pgid):
        try:
            with open(f"/proc/{pid}/status") as f:
                kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if ":" in line)
                       if k in ("RssAnon", "RssFile", "RssShmem")}
        except (OSError, ValueError):
            continue
        own += (kib.get("RssAnon", 0) + kib.get("RssFile", 0)) * 1024
        shm += kib.get("RssShmem", 0) * 1024
    return own, shm


class MemoryPeaks:
    """Samples the resident memory of target process groups in a thread, every `period` seconds, and keeps the
    peak of each (beyond shared memory: the RAM disks are not the process's own memory)."""

    def __init__(self, pgids: dict[str, int], period: float = 0.25) -> None:
        import threading

        self.pgids = pgids
        self.period = period
        self.peak = {name: 0 for name in pgids}
        self.peak_shm = {name: 0 for name in pgids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def doc(self) -> dict[str, dict[str, int]]:
        """The peaks for a result document: each group's resident memory beyond shared memory, and its shared."""
        return {name: {"rss_beyond_shm_bytes": self.peak[name], "shm_bytes": self.peak_shm[name]}
                for name in self.pgids}

    def _run(self) -> None:
        while True:
            for name, pgid in self.pgids.items():
                own, shm = group_memory(pgid)
                self.peak[name] = max(self.peak[name], own)
                self.peak_shm[name] = max(self.peak_shm[name], shm)
            if self._stop.wait(self.period):
                return


def host_info(pinned: bool) -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "pinned": pinned,
            "python": sys.version.split()[0]}
