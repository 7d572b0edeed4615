"""--report DIR: PNG plots (IOPS and latency over time, the latency histogram) and an index.html that shows
them beside the numbers. matplotlib is the optional extra `bench` (pip install 'openvsan[bench]')."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any


class ReportError(RuntimeError):
    pass


def _slug(run: dict[str, Any], i: int) -> str:
    return f"run{i:02d}-{run['job']['name']}".replace("/", "_")


def write_report(doc: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display: files only
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ReportError(f"--report needs matplotlib: pip install 'openvsan[bench]' ({e})") from e
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    sections = []
    for i, run in enumerate(doc["runs"]):
        slug = _slug(run, i)
        label = f"{run['job']['name']} on {run['target']}"
        ts = run["timeseries"]
        t = [p["t"] for p in ts]

        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot(t, [p["iops"] for p in ts], marker="o")
        ax.set(xlabel="seconds", ylabel="IOPS", title=f"IOPS: {label}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        iops_png = out / f"{slug}-iops.png"
        fig.tight_layout()
        fig.savefig(iops_png, dpi=100)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(8, 3.5))
        for key, name in (("lat_mean_us", "mean"), ("lat_p99_us", "p99"), ("lat_max_us", "max")):
            ax.plot(t, [p[key] for p in ts], marker=".", label=name)
        ax.set(xlabel="seconds", ylabel="latency (µs)", title=f"latency: {label}")
        ax.set_yscale("log")
        ax.legend()
        ax.grid(alpha=0.3)
        lat_png = out / f"{slug}-latency.png"
        fig.tight_layout()
        fig.savefig(lat_png, dpi=100)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(8, 3.5))
        h = run["histogram_us"]
        if h:
            ax.bar([lo for lo, _, _ in h], [c for _, _, c in h], width=[hi - lo for lo, hi, _ in h], align="edge")
            ax.set_xscale("log")
        ax.set(xlabel="latency (µs)", ylabel="requests", title=f"latency histogram: {label}")
        ax.grid(alpha=0.3)
        hist_png = out / f"{slug}-histogram.png"
        fig.tight_layout()
        fig.savefig(hist_png, dpi=100)
        plt.close(fig)
        written += [iops_png, lat_png, hist_png]

        tot = run["total"]
        lat = tot["latency_us"]
        rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in (
            ("IOPS", tot["iops"]), ("MB/s", tot["mbps"]), *((f"latency {k} (µs)", v) for k, v in lat.items()),
            ("CPU bench %", run["cpu"]["bench_pct"]), ("CPU target %", run["cpu"]["target_pct"]),
            ("I/O errors", run["errors"]["io"]), ("verify mismatches", run["errors"]["verify"])))
        imgs = "".join(f'<img src="{p.name}" alt="{p.stem}">' for p in (iops_png, lat_png, hist_png))
        sections.append(f"<section><h2>{html.escape(label)}</h2><p>{html.escape(json.dumps(run['job']))}</p>"
                        f"<table>{rows}</table>{imgs}</section>")
    page = out / "index.html"
    page.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>vsan bench</title><style>"
        "body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} th,td{padding:2px 8px;"
        "text-align:left;border-bottom:1px solid #ddd} img{display:block;margin:1em 0}</style></head><body>"
        f"<h1>vsan bench</h1><p>{html.escape(doc['started'])}, openvsan {html.escape(doc['version'])}, "
        f"host {html.escape(doc['host']['hostname'])}</p>" + "".join(sections) + "</body></html>\n")
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    return [*written, page, out / "results.json"]
