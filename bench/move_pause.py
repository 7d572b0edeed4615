#!/usr/bin/env python3
"""What a client sees while its volume moves between the worker processes of `vsan serve --workers 2`
(`vsan workers move`, issue 13): fio's nbd engine, 4K random writes at QD16 on a RAM volume, once with the
volume still and once moved from worker to worker every MOVE_EVERY seconds; IOPS, completion latency p99,
p99.99 and max, and the moves' own time as the supervisor logs it. Several rounds, interleaved, medians.

    python3 bench/move_pause.py [--rounds N] [--seconds S] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _common import VSAN, BenchError, Target, fio_job, fio_nbd_job, free_port, make_workdir, median, require_tools

MOVE_EVERY = 0.5


def config(work: Path, port: int) -> Path:
    path = work / "vsan.toml"
    path.write_text("\n".join([
        "[node]", 'name = "moves"', "workers = 2", "",
        "[[devices]]", 'name = "d0"', 'type = "ram"', 'size = "256MiB"', "",
        "[[devices]]", 'name = "d1"', 'type = "ram"', 'size = "256MiB"', "",
        "[[volumes]]", 'name = "v0"', 'device = "d0"', "", "[[volumes]]", 'name = "v1"', 'device = "d1"', "",
        "[nbd]", f'portals = ["127.0.0.1:{port}"]', "",
        "[[nbd.exports]]", 'name = "v0"', 'volume = "v0"', "", "[[nbd.exports]]", 'name = "v1"', 'volume = "v1"', "",
    ]))
    path.chmod(0o600)
    return path


def owner(data_dir: Path) -> int:
    rows = json.loads(subprocess.run([str(VSAN), "workers", "--data-dir", str(data_dir), "--json"], check=True,
                                     capture_output=True, text=True, timeout=30).stdout)
    return next(int(r["worker"]) for r in rows if "v0" in r["volumes"])


def run_fio(job: Path, seconds: float, data_dir: Path | None) -> tuple[dict[str, Any], int]:
    stop = threading.Event()
    moves = [0]

    def mover() -> None:
        while not stop.wait(MOVE_EVERY):
            assert data_dir is not None
            subprocess.run([str(VSAN), "workers", "move", "v0", "--to", str(1 - owner(data_dir)), "--data-dir",
                            str(data_dir)], check=True, capture_output=True, timeout=60)
            moves[0] += 1

    t = threading.Thread(target=mover) if data_dir is not None else None
    if t is not None:
        t.start()
    try:
        out = subprocess.run(["fio", str(job), f"--runtime={seconds}", "--time_based", "--output-format=json"],
                             check=False, capture_output=True, text=True, timeout=seconds + 120).stdout
    finally:
        stop.set()
        if t is not None:
            t.join()
    return fio_job(out, "v0"), moves[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    require_tools("fio")
    work = make_workdir("move-pause")
    port = free_port()
    data_dir = work / "data"
    target = Target("vsan", [str(VSAN), "serve", "--config", str(config(work, port)), "--data-dir", str(data_dir)],
                    work)
    target.start()
    try:
        deadline = time.monotonic() + 60
        while "serving with 2 worker processes" not in target.log.read_text(errors="replace"):
            target.check_alive()
            if time.monotonic() > deadline:
                raise BenchError(f"vsan serve not up:\n{target.log_tail()}")
            time.sleep(0.1)
        job = fio_nbd_job(work, "moves", f"nbd://127.0.0.1:{port}/v0",
                          ["rw=randwrite", "bs=4k", "iodepth=16", "size=256M", "lat_percentiles=1",
                           "percentile_list=99:99.99"])
        rows: dict[str, dict[str, list[float]]] = {"still": {}, "moving": {}}
        for _ in range(args.rounds):
            for case in ("still", "moving"):
                got, moves = run_fio(job, args.seconds, data_dir if case == "moving" else None)
                w = got["write"]
                pct = w["clat_ns"]["percentile"]
                for key, value in (("iops", w["iops"]), ("p99_ms", pct["99.000000"] / 1e6),
                                   ("p9999_ms", pct["99.990000"] / 1e6), ("max_ms", w["clat_ns"]["max"] / 1e6),
                                   ("moves", moves)):
                    rows[case].setdefault(key, []).append(float(value))
        took = [float(x) for x in re.findall(r"connection\(s\) in ([\d.]+) s", target.log.read_text())]
        result = {case: {k: median(v) for k, v in r.items()} for case, r in rows.items()}
        result["move_seconds"] = {"median": median(took), "max": max(took), "count": len(took)} if took else {}
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.write_text(json.dumps({"rows": rows, "result": result}, indent=2))
        return 0
    finally:
        target.stop()


if __name__ == "__main__":
    sys.exit(main())
