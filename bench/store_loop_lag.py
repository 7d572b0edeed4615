"""How long storing the desired state holds up the event loop of `vsan serve` (node/store.py).

A ticker task on the loop sleeps 0.2 ms at a time and records the longest gap between its wake-ups, while
the loop stores a config of N volumes (each with a device and a LUN) again and again, each time with one
volume changed. Run three times: with nothing stored (the loop's own jitter on this machine), the way Node.apply stores (`await import_desired(...)`, on the writer thread) and,
for comparison, the old way (a synchronous Store call on the loop itself).

    .venv/bin/python bench/store_loop_lag.py [--volumes 64] [--imports 30] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from openvsan.node.config import parse_config
from openvsan.node.store import Store, import_desired


def config(n: int, changed: int) -> Any:
    return parse_config({
        "node": {"name": "bench"},
        "devices": [{"name": f"r{i}", "type": "ram", "size": "1MiB"} for i in range(n)],
        "volumes": [{"name": f"v{i}", "device": f"r{i}", "read_only": i == changed} for i in range(n)],
        "iscsi": {"targets": [{"iqn": "iqn.2026-11.org.openvsan:bench", "portals": ["127.0.0.1:3260"],
                               "luns": [{"lun": i, "volume": f"v{i}"} for i in range(n)]}]},
    })


async def measure(data: Path, n: int, imports: int, mode: str) -> tuple[float, float, list[float]]:
    gaps: list[float] = []
    stop = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.0002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    gaps.clear()
    took = []
    for k in range(imports):
        cfg = config(n, k % n)
        if mode == "idle":
            await asyncio.sleep(0.03)
            continue
        t0 = time.perf_counter()
        if mode == "writer":
            await import_desired(data, cfg)
        else:
            with Store.open(data) as s:
                s.import_config(cfg)
        took.append(time.perf_counter() - t0)
        await asyncio.sleep(0.001)   # the ticker runs between imports: a gap is what one import held up
    stop = True
    await task
    return max(gaps), statistics.median(gaps), took or [0.0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--volumes", type=int, default=64)
    ap.add_argument("--imports", type=int, default=30)
    ap.add_argument("--data-dir", type=Path, default=None, help="default: a new temporary dir (on /tmp)")
    args = ap.parse_args()
    base = args.data_dir or Path(tempfile.mkdtemp(prefix="store-lag-"))
    hows = {"idle": "nothing stored (the loop's own jitter)", "writer": "await import_desired (writer thread)",
            "on-loop": "Store.import_config on the loop"}
    for mode, how in hows.items():
        worst, median, took = asyncio.run(measure(base / mode, args.volumes, args.imports, mode))
        print(f"{how:40s} {args.volumes} volumes: loop gap max {worst * 1e3:6.2f} ms, median "
              f"{median * 1e3:5.2f} ms; one import {statistics.median(took) * 1e3:6.1f} ms (median)")


if __name__ == "__main__":
    main()
