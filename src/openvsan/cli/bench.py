"""`vsan bench TARGET`: a fio/DiskSpd-class benchmark through our own initiators (docs/benchmarks.md).

`--target URL --target URL ...` names the paths of one volume (a replicated volume's nodes): the run goes
through a MultipathDevice (initiator/multipath.py) and follows ALUA/ANA state and failover.

Exit 0 when every run finished without an I/O error or a --verify mismatch, 1 otherwise, 2 for a bad
command line.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

EXIT_FAILED = 1
EXIT_USAGE = 2


def _fail(message: str, code: int) -> typer.Exit:
    sys.stderr.write(f"vsan bench: {message}\n")
    sys.stderr.flush()
    return typer.Exit(code)


class _ProgressLine:
    """The live line on stderr (a TTY only): rate since the last update, mean latency so far."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.last: tuple[float, int, int] = (0.0, 0, 0)

    def __call__(self, p: Any) -> None:
        t0, ops0, bytes0 = self.last
        dt = p.elapsed - t0
        if dt <= 0:
            return
        self.last = (p.elapsed, p.ops, p.bytes)
        iops = (p.ops - ops0) / dt
        mbps = (p.bytes - bytes0) / dt / 1e6
        err = f"  errors {p.errors}" if p.errors else ""
        sys.stderr.write(f"\r\x1b[K{self.label}  {p.elapsed:5.1f}s  {iops:9.0f} IOPS  {mbps:8.1f} MB/s  "
                         f"mean {p.lat_mean_ns / 1000:8.1f} µs{err}")
        sys.stderr.flush()

    @staticmethod
    def clear() -> None:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()


def bench(
    targets: Annotated[list[str] | None, typer.Argument(
        help="iscsi://HOST[:PORT]/IQN/LUN, nvme+tcp://HOST[:PORT]/NQN/NSID, nbd://HOST[:PORT]/EXPORT, or a file "
             "or block device path. Several only with --compare.", show_default=False)] = None,
    paths: Annotated[list[str] | None, typer.Option(
        "--target", "--path", help="One path of a multipath volume (iscsi:// or nvme+tcp://), repeated for each "
                                   "path: I/O follows ALUA/ANA and failover. Counts as one target.",
        show_default=False)] = None,
    no_path_retry: Annotated[float, typer.Option(
        help="With --target: seconds I/O is held while no path serves it, then fails.")] = 30.0,
    profile: Annotated[str | None, typer.Option(
        "--profile", "-p", help="4k-randread, 4k-randwrite, 4k-70-30, 4k-90-10, 4k-50-50, 64k-randread, "
                                "64k-randwrite, 1m-seqread, 1m-seqwrite, 2m-seqread, 2m-seqwrite, or a suite: "
                                "storagereview, diskspd. Default: --rw/--bs/--threads/--qd.")] = None,
    rw: Annotated[str | None, typer.Option(help="randread, randwrite, randrw, read, write, rw (fio's words).")] = None,
    bs: Annotated[str | None, typer.Option(help="Request size: 4k, 64k, 1m ... (default 4k).")] = None,
    threads: Annotated[int | None, typer.Option(
        "--threads", "-t", help="Workers; more than one: a process each, with its own connection(s). Default: "
                                "the queue depth shared out over the cores this process may use (taskset), up "
                                "to 8, at least 4 requests each; --threads 1 keeps one.")] = None,
    qd: Annotated[int | None, typer.Option("--qd", "-q", help="Requests each worker keeps in flight (with "
                                                               "--threads; without, in all).")] = None,
    mix: Annotated[int | None, typer.Option(help="% reads of randrw/rw (fio's rwmixread); 70 = 70/30.")] = None,
    duration: Annotated[float, typer.Option("--duration", "-d", help="Measured seconds per run.")] = 10.0,
    warmup: Annotated[float, typer.Option(help="Seconds run, but not measured, before each run.")] = 1.0,
    precondition: Annotated[bool, typer.Option(
        "--precondition", help="Fill the device once (1 MiB sequential writes) before the run.")] = False,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Write blocks that carry their LBA and a generation; check every read, and read back "
                         "everything written at the end. A mismatch names the LBA and exits 1.")] = False,
    rate: Annotated[float | None, typer.Option(help="Limit to this many requests/s in all (split over workers).")]
    = None,
    size: Annotated[str | None, typer.Option(
        help="Use only the first SIZE bytes of the target (e.g. 1g); creates a missing file of that size.")]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON document (schema_version 1) instead of "
                                                         "the table.")] = False,
    report: Annotated[Path | None, typer.Option(
        help="Write PNG plots, index.html and results.json into this directory (needs openvsan[bench]).")]
    = None,
    target_pid: Annotated[int | None, typer.Option(
        help="PID of a local vsan serve: report its CPU % (with its worker processes) over each measured "
             "phase, from /proc.")] = None,
    compare: Annotated[bool, typer.Option(
        "--compare", help="Run the same job(s) on each TARGET, interleaved, and print ratios to the first.")]
    = False,
    rounds: Annotated[int, typer.Option(help="Rounds of each job per target (with --compare: the median).")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the random offsets and mix.")] = 0,
) -> None:
    """Benchmark TARGET: IOPS, MB/s, latency percentiles and CPU, as a table, JSON or an HTML report."""
    from openvsan.bench.engine import Plan
    from openvsan.bench.profiles import ProfileError, parse_size, resolve, spread
    from openvsan.bench.report import document, print_tables
    from openvsan.bench.runner import BenchError, RunResult, run
    from openvsan.block.errors import BlockError
    from openvsan.initiator.url import UrlError

    targets = list(targets or [])
    if paths:
        if any(" " in p or not p.lower().startswith(("iscsi://", "nvme+tcp://", "nvme-tcp://")) for p in paths):
            raise _fail("--target takes iscsi:// or nvme+tcp:// URLs, one path of the volume each", EXIT_USAGE)
        targets.append(" ".join(paths))   # one target: open_url makes a MultipathDevice of it
    if not targets:
        raise _fail("give a TARGET, or --target URL once for each path of one volume", EXIT_USAGE)
    if len(targets) > 1 and not compare:
        raise _fail("several targets need --compare", EXIT_USAGE)
    if no_path_retry < 0:
        raise _fail("--no-path-retry must not be negative", EXIT_USAGE)
    if duration <= 0 or warmup < 0 or rounds < 1 or (rate is not None and rate <= 0):
        raise _fail("--duration and --rate must be positive, --warmup not negative, --rounds at least 1",
                    EXIT_USAGE)
    try:
        jobs = resolve(profile, rw=rw, bs=bs, threads=threads, qd=qd, mix=mix)
        if threads is None:
            # one target's load over several processes and cores where this process may use them
            cores = len(os.sched_getaffinity(0))
            jobs = [spread(j, cores) for j in jobs]
        size_b = parse_size(size) if size else None
    except ProfileError as e:
        raise _fail(str(e), EXIT_USAGE) from None
    options = {"duration": duration, "warmup": warmup, "precondition": precondition, "verify": verify,
               "rate": rate, "size": size_b, "rounds": rounds, "seed": seed, "profile": profile}
    # a pipe or log file gets the whole table on one line per row, not folded to 80 columns
    out_tty = (sys.stderr if as_json else sys.stdout).isatty()
    console = Console(stderr=as_json, width=None if out_tty else 200)
    live = sys.stderr.isatty()
    runs: list[RunResult] = []
    for job in jobs:
        for rnd in range(rounds):
            for target in targets:  # interleaved: T1 T2 T1 T2 ..., so drift hits every target alike
                plan = Plan(target, job, warmup=warmup, duration=duration, verify=verify,
                            precondition=precondition and rnd == 0,
                            rate=None if rate is None else rate / job.threads, size=size_b, seed=seed + rnd,
                            options={"no_path_retry": no_path_retry} if len(target.split()) > 1 else {})
                progress = _ProgressLine(f"{job.name} {target}") if live else None
                try:
                    res = run(plan, target_pid=target_pid, on_progress=progress)
                except (BenchError, BlockError, UrlError, OSError, ValueError) as e:
                    if progress:
                        progress.clear()
                    raise _fail(f"{job.name} on {target}: {e}", EXIT_FAILED) from None
                finally:
                    if progress:
                        progress.clear()
                runs.append(replace(res, round=rnd))
    doc = document(runs, options, [r for r in dict.fromkeys(x.target for x in runs)] if compare else None)
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        print_tables(doc, console)
    if report is not None:
        from openvsan.bench.plots import ReportError, write_report
        try:
            files = write_report(doc, report)
        except ReportError as e:
            raise _fail(str(e), EXIT_FAILED) from None
        console.print(f"report: {report / 'index.html'} ({len(files)} files)")
    if any(r["errors"]["io"] or r["errors"]["verify"] for r in doc["runs"]):
        raise typer.Exit(EXIT_FAILED)
