"""The console's benchmark page: `vsan bench` run against one of the node's own exports (NBD first, then
NVMe/TCP, then iSCSI: the lightest of our initiators first), as a process of its own, with --report into
`<data_dir>/bench/<id>/`; the page lists the runs and links each report (bench/plots.py: the console's look).

A write profile overwrites the volume's data: the console asks for it to be said (`overwrite`). One run at a
time: a benchmark measures the node, two at once would measure each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from openvsan.bench.profiles import PROFILES

BENCH_PROFILES = ["4k-randread", "4k-randwrite", "4k-70-30", "64k-randread", "1m-seqread", "1m-seqwrite"]
MAX_SECONDS = 300
PREFERENCE = {"nbd": 0, "nvme": 1, "iscsi": 2}


def _url(e: dict[str, Any]) -> str:
    portal = e["portals"][0]
    if e["protocol"] == "nbd":
        return f"nbd://{portal}/{e['name']}"
    if e["protocol"] == "nvme":
        return f"nvme+tcp://{portal}/{e['name']}/{e['nsid']}"
    return f"iscsi://{portal}/{e['name']}/{e['lun']}"


def bench_targets(exports: list[dict[str, Any]]) -> dict[str, str]:
    """volume -> the URL of its export that a benchmark uses."""
    best: dict[str, dict[str, Any]] = {}
    for e in exports:
        if not e.get("portals"):
            continue
        have = best.get(e["volume"])
        if have is None or PREFERENCE[e["protocol"]] < PREFERENCE[have["protocol"]]:
            best[e["volume"]] = e
    return {v: _url(e).replace("0.0.0.0", "127.0.0.1") for v, e in sorted(best.items())}


class BenchRuns:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir / "bench"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, targets: dict[str, str], volume: str, profile: str, seconds: str, overwrite: bool) -> str:
        if volume not in targets:
            raise ValueError(f"volume {volume!r} has no export to measure through; export it first (volumes: "
                             f"{', '.join(targets) or 'none exported'})")
        if profile not in BENCH_PROFILES:
            raise ValueError(f"profile {profile!r}: use one of {', '.join(BENCH_PROFILES)}")
        try:
            duration = float(seconds)
        except ValueError:
            raise ValueError(f"seconds {seconds!r}: give a number of seconds") from None
        if not 1 <= duration <= MAX_SECONDS:
            raise ValueError(f"seconds: use 1 to {MAX_SECONDS}")
        if PROFILES[profile].write_pct and not overwrite:
            raise ValueError(f"{profile} writes over volume {volume}'s data: tick 'overwrite its data' to run it")
        if self._proc is not None and self._proc.poll() is None:
            raise ValueError("a benchmark is running; wait for it to end (two at once would measure each other)")
        run = time.strftime("%Y%m%d-%H%M%S")
        out = self.root / run
        out.mkdir(parents=True, exist_ok=True, mode=0o700)
        (out / "run.json").write_text(json.dumps({"id": run, "volume": volume, "target": targets[volume],
                                                  "profile": profile, "seconds": duration, "started": time.time()}))
        log = open(out / "bench.log", "wb")  # noqa: SIM115 - the child writes it; closed when it is reaped
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "openvsan.cli.main", "bench", targets[volume], "-p", profile, "-d", str(duration),
             "--warmup", "1", "--report", str(out / "report")], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        return run

    def report_file(self, run: str, name: str) -> Path | None:
        """A file of run `run`'s report, if there is one by that name (no path can leave the report)."""
        if not run.replace("-", "").isdigit() or "/" in name or name.startswith("."):
            return None
        path = self.root / run / "report" / name
        return path if path.is_file() else None

    def list(self) -> list[dict[str, Any]]:
        """The runs, newest first, each with its state and, when done, its headline figures."""
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None
        out = []
        for d in sorted(self.root.glob("*/run.json"), reverse=True)[:20]:
            meta = json.loads(d.read_text())
            results = d.parent / "report" / "results.json"
            if results.exists():
                run = json.loads(results.read_text())["runs"][0]
                meta.update(state="done", iops=run["total"]["iops"], mbps=run["total"]["mbps"],
                            p99_us=run["total"]["latency_us"]["p99"], report=f"/bench/runs/{meta['id']}/report/index.html")
            elif self._proc is not None and d.parent.name == meta["id"] and time.time() - meta["started"] < \
                    meta["seconds"] + 60:
                meta["state"] = "running"
            else:
                tail = (d.parent / "bench.log").read_text(errors="replace").strip().splitlines()[-1:]
                meta.update(state="failed", error=tail[0] if tail else "no output")
            out.append(meta)
        return out
