"""What a run reports: the JSON document (schema in docs/benchmarks.md, "vsan bench"), the rich table and
the compare ratios. Plots and the HTML page are in plots.py (matplotlib is an optional extra)."""

from __future__ import annotations

import platform
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from openvsan import __version__
from openvsan.bench.engine import INTERVAL
from openvsan.bench.histogram import Histogram
from openvsan.bench.runner import RunResult

SCHEMA_VERSION = 1
PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))


def latency_us(h: Histogram) -> dict[str, float]:
    d = {"mean": h.mean / 1000, "min": h.min / 1000}
    for name, p in PERCENTILES:
        d[name] = h.percentile(p) / 1000
    d["max"] = h.max / 1000
    return {k: round(v, 3) for k, v in d.items()}


def _side(h: Histogram, nbytes: int, elapsed: float) -> dict[str, Any]:
    return {"ops": h.count, "bytes": nbytes, "iops": round(h.count / elapsed, 1) if elapsed else 0.0,
            "mbps": round(nbytes / elapsed / 1e6, 2) if elapsed else 0.0, "latency_us": latency_us(h)}


def run_to_dict(r: RunResult) -> dict[str, Any]:
    w = r.result
    elapsed = w.elapsed
    both = Histogram().merge(w.read).merge(w.write)
    series = []
    for i, iv in enumerate(w.intervals):
        span = min(INTERVAL, elapsed - i * INTERVAL)
        if span <= INTERVAL / 10:
            continue  # the sliver after the last whole interval says nothing about the rate
        n = iv.reads + iv.writes
        series.append({"t": round((i + 1) * INTERVAL, 3), "iops": round(n / span, 1),
                       "mbps": round(iv.bytes / span / 1e6, 2), "lat_mean_us": round(iv.lat.mean / 1000, 3),
                       "lat_p99_us": round(iv.lat.percentile(99) / 1000, 3),
                       "lat_max_us": round(iv.lat.max / 1000, 3)})
    return {
        "target": r.target,
        "job": r.job.to_dict(),
        "round": r.round,
        "device": {"block_size": w.block_size, "num_blocks": w.num_blocks},
        "elapsed_s": round(elapsed, 4),
        "read": _side(w.read, w.read_bytes, elapsed),
        "write": _side(w.write, w.write_bytes, elapsed),
        "total": _side(both, w.read_bytes + w.write_bytes, elapsed),
        "cpu": {"bench_pct": round(r.bench_cpu_pct, 1),
                "target_pct": None if r.target_cpu_pct is None else round(r.target_cpu_pct, 1)},
        "errors": {"io": w.io_errors, "verify": w.mismatches, "first": w.problems},
        "timeseries": series,
        "histogram_us": [[lo / 1000, hi / 1000, c] for lo, hi, c in both.buckets()],
    }


def compare_rows(runs: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    """Per job: each target's median over rounds, as a ratio to the first target."""
    out = []
    jobs = list(dict.fromkeys(r["job"]["name"] for r in runs))
    for job in jobs:
        med: dict[str, dict[str, float]] = {}
        for t in targets:
            mine = [r for r in runs if r["job"]["name"] == job and r["target"] == t]
            if not mine:
                continue
            med[t] = {"iops": _median([r["total"]["iops"] for r in mine]),
                      "mbps": _median([r["total"]["mbps"] for r in mine]),
                      "p99_us": _median([r["total"]["latency_us"]["p99"] for r in mine]),
                      "rounds": len(mine)}
        base = med.get(targets[0])
        rows = []
        for t, m in med.items():
            ratio = {k: (round(m[k] / base[k], 3) if base and base[k] else None) for k in ("iops", "mbps", "p99_us")}
            rows.append({"target": t, **m, "ratio": ratio})
        out.append({"job": job, "baseline": targets[0], "targets": rows})
    return out


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def document(runs: list[RunResult], options: dict[str, Any], compare: list[str] | None = None) -> dict[str, Any]:
    rs = [run_to_dict(r) for r in runs]
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "vsan bench",
        "version": __version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"hostname": platform.node(), "python": platform.python_version()},
        "options": options,
        "runs": rs,
        "compare": compare_rows(rs, compare) if compare else None,
    }


def _fmt_lat(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} µs" if us >= 100 else f"{us:.1f} µs"


def _fmt_iops(x: float) -> str:
    return f"{x / 1000:.1f}K" if x >= 10000 else f"{x:.0f}"


def print_tables(doc: dict[str, Any], console: Console) -> None:
    t = Table(title="vsan bench", title_justify="left")
    for col in ("target", "job", "op", "IOPS", "MB/s", "mean", "p50", "p90", "p99", "p99.9", "max", "CPU"):
        t.add_column(col, justify="right" if col not in ("target", "job", "op") else "left",
                     overflow="fold", no_wrap=col != "target")
    for r in doc["runs"]:
        sides = [s for s in ("read", "write") if r[s]["ops"]]
        if len(sides) > 1:
            sides.append("total")
        cpu = f"{r['cpu']['bench_pct']:.0f} %"
        if r["cpu"]["target_pct"] is not None:
            cpu += f" / target {r['cpu']['target_pct']:.0f} %"
        for i, s in enumerate(sides):
            d = r[s]
            lat = d["latency_us"]
            t.add_row(r["target"] if i == 0 else "", r["job"]["name"] if i == 0 else "", s, _fmt_iops(d["iops"]),
                      f"{d['mbps']:.1f}", *(_fmt_lat(lat[k]) for k in ("mean", "p50", "p90", "p99", "p99.9", "max")),
                      cpu if i == 0 else "")
    console.print(t)
    for r in doc["runs"]:
        e = r["errors"]
        if e["io"] or e["verify"]:
            console.print(f"[bold red]{r['target']} {r['job']['name']}: {e['io']} I/O error(s), "
                          f"{e['verify']} verify mismatch(es)[/]")
            for p in e["first"]:
                console.print(f"  {p['kind']}: {p['message']}", soft_wrap=True)
    for c in doc.get("compare") or []:
        ct = Table(title=f"compare: {c['job']} (ratio to {c['baseline']})", title_justify="left")
        for col in ("target", "rounds", "IOPS", "MB/s", "p99", "IOPS ×", "MB/s ×", "p99 ×"):
            ct.add_column(col, justify="left" if col == "target" else "right", overflow="fold")
        for row in c["targets"]:
            ratio = row["ratio"]
            ct.add_row(row["target"], str(row["rounds"]), _fmt_iops(row["iops"]), f"{row['mbps']:.1f}",
                       _fmt_lat(row["p99_us"]), *(f"{ratio[k]:.2f}" if ratio[k] is not None else "-"
                                                  for k in ("iops", "mbps", "p99_us")))
        console.print(ct)
