"""--report DIR: PNG plots (IOPS and latency over time, the latency histogram) and an index.html that shows
them beside the numbers. matplotlib is the optional extra `bench` (pip install 'openvsan[bench]')."""

from __future__ import annotations

import json
import shutil
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

        sections.append({"label": label, "profile": describe_job(run["job"]), "run": run,
                         "sides": _sides(run), "images": [x.name for x in (iops_png, lat_png, hist_png)]})
    compares = []
    for i, c in enumerate(doc.get("compare") or []):
        png = out / f"compare{i:02d}-{c['job']}.png".replace("/", "_")
        _compare_chart(plt, c, png)
        written.append(png)
        compares.append({"c": c, "image": png.name})
    page = out / "index.html"
    page.write_text(_render(doc, sections, compares))
    shutil.copyfile(CONSOLE_CSS, out / "console.css")
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    return [*written, page, out / "console.css", out / "results.json"]


# ---- the page: the console's look (web/static/console.css), the profile in words, numbers with units

CONSOLE_CSS = Path(__file__).parents[1] / "web" / "static" / "console.css"
_SIZES = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def size_words(n: int) -> str:
    for unit, name in _SIZES:
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} bytes"


def count(x: float) -> str:
    """IOPS and the like: 97.5K, 1.20M, 812."""
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}K" if x >= 1e4 else f"{x:,.0f}"


def latency(us: float | None) -> str:
    """845 µs, 12.3 µs, 1.25 ms, 2.0 s."""
    if us is None:
        return "-"
    if us >= 1e6:
        return f"{us / 1e6:.1f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.0f} µs" if us >= 100 else f"{us:.1f} µs"


def rate(mbps: float) -> str:
    return f"{mbps:,.0f} MB/s" if mbps >= 100 else f"{mbps:.1f} MB/s"


def describe_job(job: dict[str, Any]) -> str:
    """The profile in words: "4 KiB random reads, 1 worker keeping 32 requests in flight"."""
    pattern = "random" if job["pattern"] == "rand" else "sequential"
    w = job["write_pct"]
    what = ("reads" if w == 0 else "writes" if w == 100 else f"reads and writes ({100 - w} % reads)")
    workers = f"{job['threads']} worker{'s' if job['threads'] != 1 else ''}"
    each = " each" if job["threads"] != 1 else ""
    return f"{size_words(job['bs'])} {pattern} {what}, {workers} keeping {job['qd']} request" \
           f"{'s' if job['qd'] != 1 else ''} in flight{each}"


def _sides(run: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    sides = [(s, run[s]) for s in ("read", "write") if run[s]["ops"]]
    if len(sides) > 1:
        sides.append(("read and write", run["total"]))
    return sides or [("total", run["total"])]


def _compare_chart(plt: Any, c: dict[str, Any], png: Path) -> None:
    """Every target of one compared job side by side: IOPS, and p99 latency, one bar each."""
    names = [row["target"] for row in c["targets"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.barh(names, [row["iops"] for row in c["targets"]], color="#2f6fdf")
    a.set(xlabel="IOPS (median of rounds)", title=f"{c['job']}: IOPS")
    b.barh(names, [row["p99_us"] for row in c["targets"]], color="#df7d2f")
    b.set(xlabel="p99 latency (µs)", title="p99 latency (lower is better)")
    b.set_yticks([])
    for ax in (a, b):
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _render(doc: dict[str, Any], sections: list[dict[str, Any]], compares: list[dict[str, Any]]) -> str:
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    env = Environment(loader=FileSystemLoader(str(Path(__file__).parents[1] / "web" / "templates")),
                      autoescape=select_autoescape(["html"]))
    env.filters.update(count=count, latency=latency, rate=rate)
    opts = doc.get("options", {})
    return env.get_template("bench_report.html").render(doc=doc, sections=sections, compares=compares, opts=opts)
