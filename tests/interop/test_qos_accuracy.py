"""QoS accuracy with real clients (issue 11): fio's nbd engine and libiscsi's `iscsi-perf`, at QoS limits of
100, 1,000 and 5,000 IOPS and 10 and 100 MB/s, measure a rate within ±5 % of the limit over 10 s; a burst
allows its configured excess for its configured time, then the sustained limit holds; a limit changed
mid-run with `vsan qos set` is the rate one second after the command returned.

One `vsan serve` for the whole module, with a RAM volume of its own for every case (so no case inherits
another's bucket levels): the fio cases over NBD exports, the iscsi-perf cases over LUNs of one target, and
an unlimited volume (LUN 0, NBD export `plain`) for the readiness probe and, when a case misses its limit
from below, a short unthrottled run that shows what this machine reaches with that client and shape.
The limits are given in the TOML file (`qos = {...}` on [[volumes]]), by the total (`iops_limit`) and the
read (`read_iops_limit`) knobs alike: a read takes from both. About two and a half minutes of wall time."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vsan_harness import IQN, TEST_INITIATOR, VSAN, VsanServer, free_port, require_tools, run

pytestmark = pytest.mark.interop

SECONDS = 10          # the window: a rate measured over 10 s
TOLERANCE = 0.05      # the issue's ±5 %
KiB, MiB = 1 << 10, 1 << 20
TICK = 0.05           # volume/qos.py TICK: a bucket holds one tick of its rate (what an idle volume may start with)


@dataclass(frozen=True)
class Case:
    client: str                   # "fio" (nbd engine) or "iscsi-perf"
    knobs: dict[str, int]         # the volume's qos table
    bs: int                       # request bytes
    qd: int
    rand: bool
    metric: str                   # "iops" or "bps"
    limit: float                  # what the rate must come within TOLERANCE of

    @property
    def volume(self) -> str:
        unit = f"{self.limit:g}iops" if self.metric == "iops" else f"{self.limit / 1e6:g}MBps"
        return f"{'fio' if self.client == 'fio' else 'perf'}-{unit}"


def iops(client: str, limit: int, knob: str) -> Case:
    return Case(client, {knob: limit}, 4 * KiB, 32, True, "iops", limit)


def mbps(client: str, mb: int, knob: str, bs: int) -> Case:
    return Case(client, {knob: mb * 1_000_000}, bs, 8, False, "bps", mb * 1e6)


# 4K random reads at QD32 for the IOPS limits; sequential reads at QD8 for the MB/s limits, 128 KiB at 10 MB/s
# (76 commands a second: one command is 1.3 % of a second) and 1 MiB at 100 MB/s (95 a second)
CASES = [
    *(iops(c, n, k) for c in ("fio", "iscsi-perf") for n, k in
      ((100, "iops_limit"), (1000, "read_iops_limit"), (5000, "iops_limit"))),
    *(mbps(c, n, k, bs) for c in ("fio", "iscsi-perf") for n, k, bs in
      ((10, "read_bps_limit", 128 * KiB), (100, "bps_limit", MiB))),
]

# burst: the sustained bucket holds (burst - limit) x burst_seconds = 4,000 operations more than one tick's
BURST = {"iops_limit": 1000, "iops_burst": 3000, "iops_burst_seconds": 2}
# mid-run changes: 1,000, then 3,000, then 500
CHANGE = {"iops_limit": 1000}
CHANGE_STEPS = (3000, 500)

VOLUME_SIZE = "32MiB"         # reads of a RAM volume: its size only bounds the LBAs


def config(server: VsanServer) -> str:
    vols: list[tuple[str, dict[str, int]]] = [("plain", {})]
    vols += [(c.volume, c.knobs) for c in CASES]
    vols += [("burst", BURST), ("change", CHANGE)]
    lines = ["# written by tests/interop/test_qos_accuracy.py", "[node]", 'name = "qos-accuracy"', ""]
    for name, knobs in vols:
        lines += ["[[devices]]", f'name = "{name}"', 'type = "ram"', f'size = "{VOLUME_SIZE}"', "block_size = 512", ""]
        lines += ["[[volumes]]", f'name = "{name}"', f'device = "{name}"']
        if knobs:
            lines.append("qos = { " + ", ".join(f"{k} = {v}" for k, v in knobs.items()) + " }")
        lines.append("")
    luns = [("plain", 0)] + [(c.volume, i + 1) for i, c in enumerate(c for c in CASES if c.client == "iscsi-perf")]
    lines += ["[iscsi]", f'portals = ["127.0.0.1:{server.port}"]', "", "[[iscsi.targets]]", f'iqn = "{IQN}"',
              "luns = [" + ", ".join(f'{{ lun = {n}, volume = "{v}" }}' for v, n in luns) + "]", ""]
    lines += ["[nbd]", f'portals = ["127.0.0.1:{server.nbd_port}"]', ""]
    for name, _ in vols:
        if not name.startswith("perf-"):
            lines += ["[[nbd.exports]]", f'name = "{name}"', f'volume = "{name}"', ""]
    return "\n".join(lines)


def lun_of(volume: str) -> int:
    perf = [c.volume for c in CASES if c.client == "iscsi-perf"]
    return 0 if volume == "plain" else perf.index(volume) + 1


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VsanServer]:
    require_tools("fio", "iscsi-perf", "iscsi-readcapacity16")
    server = VsanServer(tmp_path_factory.mktemp("qos-accuracy"), free_port())
    server.config.write_text(config(server))
    server.start()
    try:
        yield server
    finally:
        server.cleanup()            # SIGTERM, exit 0 and no Traceback in its log, or the module fails


# ------------------------------------------------------------------ clients

def fio_argv(server: VsanServer, volume: str, bs: int, qd: int, rand: bool, seconds: float, out: Path,
             log: Path | None = None) -> list[str]:
    argv = ["fio", f"--name={volume}", "--ioengine=nbd", f"--uri={server.nbd_url(volume)}",
            f"--rw={'randread' if rand else 'read'}", f"--bs={bs}", f"--iodepth={qd}", f"--size={VOLUME_SIZE}",
            "--time_based", f"--runtime={seconds:g}", "--output-format=json", f"--output={out}"]
    if log is not None:
        # no log_avg_msec: one line per completed command, stamped in Unix-epoch milliseconds (the same clock
        # as time.time() here), so any window can be counted, aligned to when `vsan qos set` returned
        argv += [f"--write_iops_log={log}", "--log_unix_epoch=1"]
    return argv


def fio_result(out: Path) -> dict[str, Any]:
    text = out.read_text()
    job: dict[str, Any] = json.loads(text[text.index("{"):])["jobs"][0]
    assert job["error"] == 0, f"fio reported error {job['error']}: {text[-2000:]}"
    read: dict[str, Any] = job["read"]
    return {"iops": float(read["iops"]), "bps": float(read["bw_bytes"]), "ios": int(read["total_ios"]),
            "runtime_s": read["runtime"] / 1000}


def fio(server: VsanServer, volume: str, bs: int, qd: int, rand: bool, seconds: float, out: Path) -> dict[str, Any]:
    run(fio_argv(server, volume, bs, qd, rand, seconds, out), timeout=seconds + 60)
    return fio_result(out)


PERF_LINE = re.compile(r"iops current (\d+)")
PERF_AVERAGE = re.compile(r"^iops average (\d+)", re.MULTILINE)


def iscsi_perf(server: VsanServer, volume: str, bs: int, qd: int, rand: bool, seconds: int) -> dict[str, Any]:
    argv = ["iscsi-perf", "-i", TEST_INITIATOR, "-m", str(qd), "-b", str(bs // 512), "-t", str(seconds),
            *(["-r"] if rand else []), server.url(lun_of(volume))]
    out = run(argv, timeout=seconds + 60).stdout.replace("\r", "\n")
    # the last "iops average" line stands alone: the whole run's operations over its time
    found = PERF_AVERAGE.findall(out)
    assert found, f"no 'iops average' line from {' '.join(argv)}:\n{out[-2000:]}"
    n = float(found[-1])
    return {"iops": n, "bps": n * bs, "per_second": [int(x) for x in PERF_LINE.findall(out)]}


def measure(server: VsanServer, case: Case, volume: str, seconds: int, out: Path) -> dict[str, Any]:
    if case.client == "fio":
        return fio(server, volume, case.bs, case.qd, case.rand, seconds, out)
    return iscsi_perf(server, volume, case.bs, case.qd, case.rand, seconds)


def vsan_qos_set(server: VsanServer, volume: str, *flags: str) -> tuple[float, float]:
    """`vsan qos set` on the running node: (time it started, time it returned), by time.time()."""
    t0 = time.time()
    p = subprocess.run([str(VSAN), "qos", "set", volume, *flags, "--data-dir", str(server.data_dir)],
                       capture_output=True, text=True, timeout=60, check=False)
    t1 = time.time()
    if p.returncode != 0:
        pytest.fail(f"vsan qos set {volume} {' '.join(flags)}: exit {p.returncode}\n{p.stdout}{p.stderr}", pytrace=False)
    return t0, t1


def completions(log: Path) -> list[float]:
    """Completion times (seconds, Unix epoch) from a fio iops log with one line per command."""
    files = sorted(log.parent.glob(f"{log.name}_iops*.log"))
    assert files, f"fio wrote no iops log {log}_iops*.log"
    times = [int(line.split(",", 1)[0]) / 1000 for f in files for line in f.read_text().splitlines() if line.strip()]
    assert times, f"{files}: empty"
    return sorted(times)


def count(times: Sequence[float], start: float, end: float) -> int:
    import bisect

    return bisect.bisect_left(times, end) - bisect.bisect_left(times, start)


def profile(times: Sequence[float], t0: float, step: float = 0.5) -> str:
    """The rate in each `step` seconds from t0, for a failure message."""
    out, t = [], t0
    while t < times[-1]:
        out.append(f"{t - t0:4.1f}s {count(times, t, t + step) / step:6.0f}")
        t += step
    return "; ".join(out)


def within(measured: float, want: float, tolerance: float = TOLERANCE) -> bool:
    return abs(measured - want) <= tolerance * want


# -------------------------------------------------------------------- tests

@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.client}-{c.volume.split('-', 1)[1]}")
def test_rate_over_10s_is_within_5_percent_of_the_limit(node: VsanServer, case: Case, tmp_path: Path) -> None:
    got = measure(node, case, case.volume, SECONDS, tmp_path / "fio.json")
    rate = got[case.metric]
    unit = "IOPS" if case.metric == "iops" else "B/s"
    shape = f"{case.bs // KiB} KiB {'random' if case.rand else 'sequential'} reads at QD{case.qd}"
    print(f"{case.client} {shape} {case.knobs}: {rate:,.0f} {unit} over {SECONDS} s "
          f"({rate / case.limit - 1:+.2%} of the limit); {got}")
    if rate < case.limit * (1 - TOLERANCE):
        # below the limit: throttled too hard, or the machine cannot go that fast with this client; say which
        reach = measure(node, case, "plain", 3, tmp_path / "reach.json")
        pytest.fail(f"{case.client}, {shape}, {case.knobs}: {rate:,.0f} {unit} over {SECONDS} s, more than "
                    f"{TOLERANCE:.0%} below the limit {case.limit:,.0f}; unthrottled, this machine reaches "
                    f"{reach[case.metric]:,.0f} {unit} with this client and shape"
                    + (" (so the limit is out of reach here, not the QoS layer's fault)"
                       if reach[case.metric] < case.limit * (1 + TOLERANCE) else "")
                    + f"; {got}", pytrace=False)
    assert within(rate, case.limit), (
        f"{case.client}, {shape}, {case.knobs}: {rate:,.0f} {unit} over {SECONDS} s, over the limit "
        f"{case.limit:,.0f} by more than {TOLERANCE:.0%}; {got}")


def ideal(t: float, limit: float, burst: float, seconds: float) -> float:
    """Commands a backlogged client completes in its first t seconds on a volume idle long before (both buckets
    full), by volume/qos.py's semantics: the burst bucket (rate `burst`, one tick deep) and the sustained one
    (rate `limit`, one tick deep plus the excess (burst - limit) x burst_seconds)."""
    return min(burst * (t + TICK), limit * (t + TICK) + (burst - limit) * seconds)


def test_a_burst_allows_its_excess_for_its_time_then_the_limit_holds(node: VsanServer, tmp_path: Path) -> None:
    """limit 1,000, burst 3,000 for 2 s: a client at QD32 (able to go far faster) runs at 3,000 while the
    excess lasts, 4,000 operations, which at a net drain of 2,000/s is 1.95 s after the one-tick depths are
    counted, then at 1,000. Each second's count must be within ±5 % of ideal() (the issue's tolerance; the
    seconds are counted from fio's first completion, and a 1 s window at 3,000/s is 3,000 commands, so
    neither clock skew nor counting adds more than a few tenths of a per cent), and the burst must end within
    0.2 s of 1.95 s (four 50 ms ticks: the scheduling granularity, with room for a loaded machine)."""
    limit, burst, secs = BURST["iops_limit"], BURST["iops_burst"], BURST["iops_burst_seconds"]
    run(fio_argv(node, "burst", 4 * KiB, 32, True, 7, tmp_path / "fio.json", tmp_path / "burst"), timeout=70)
    fio_result(tmp_path / "fio.json")
    times = completions(tmp_path / "burst")
    t0 = times[0]
    got = [count(times, t0 + k, t0 + k + 1) for k in range(6)]
    # the first second also holds the one-tick depth the buckets start with
    want = [ideal(k + 1, limit, burst, secs) - (ideal(k, limit, burst, secs) if k else 0) for k in range(6)]
    shown = f"per second {got}, ideal {[round(w) for w in want]}; every 0.5 s: {profile(times, t0)}"
    print(shown)
    assert all(within(g, w) for g, w in zip(got, want, strict=True)), shown
    # when the burst ended: the first 100 ms after which the rate stays nearer the limit than the burst
    tenths = [count(times, t0 + i / 10, t0 + (i + 1) / 10) * 10 for i in range(60)]
    ended = next((i / 10 for i in range(60) if all(r < (limit + burst) / 2 for r in tenths[i:i + 5])), 6.0)
    crossing = secs - TICK          # where ideal()'s two terms meet
    assert abs(ended - crossing) <= 4 * TICK + 0.01, f"the burst ended after {ended:.1f} s, want {crossing:.2f} s; {shown}"
    excess = count(times, t0, t0 + 6) - limit * 6
    assert within(excess, ideal(6, limit, burst, secs) - limit * 6, 0.1), f"excess {excess} operations; {shown}"


def test_a_limit_changed_mid_run_is_the_rate_within_one_second(node: VsanServer, tmp_path: Path) -> None:
    """fio at QD32 on a volume limited to 1,000 IOPS; after 3 s `vsan qos set --iops-limit 3000`, 2 s after
    it returned `--iops-limit 500`. The node makes the change before the command returns, so one second after
    the return is at least one second after the change: the rate over the second after that is within ±5 %
    of the new limit, with no reconnect and no error in fio. The command's own run (a Python process: over a
    second of start-up on a loaded machine) is shown in the message, not counted against the layer."""
    fio_proc = subprocess.Popen(fio_argv(node, "change", 4 * KiB, 32, True, 15, tmp_path / "fio.json",
                                         tmp_path / "change"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3)
        changes = []
        for n in CHANGE_STEPS:
            changes.append((n, *vsan_qos_set(node, "change", "--iops-limit", str(n))))
            time.sleep(max(0.0, changes[-1][2] + 2.2 - time.time()))
    finally:
        out, _ = fio_proc.communicate(timeout=60)
    assert fio_proc.returncode == 0, out
    fio_result(tmp_path / "fio.json")
    times = completions(tmp_path / "change")
    t0 = times[0]
    shown = (f"changes (limit, started, returned) at {[(n, round(a - t0, 2), round(b - t0, 2)) for n, a, b in changes]} "
             f"s after fio's first completion; every 0.5 s: {profile(times, t0)}")
    print(shown)
    before = count(times, changes[0][1] - 2, changes[0][1]) / 2
    assert within(before, CHANGE["iops_limit"]), f"before any change: {before:.0f} IOPS; {shown}"
    assert times[-1] >= changes[-1][2] + 2, f"fio ended before the last window: `vsan qos set` too slow? {shown}"
    for n, _, done in changes:
        after = count(times, done + 1, done + 2)
        assert within(after, n), f"one second after the limit became {n}: {after} IOPS; {shown}"
