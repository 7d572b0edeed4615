"""`vsan bench --report`'s page (bench/plots.py) in the console's look: the profile in words, one table per
operation with units and sensible digits, no raw JSON and no "None", and compared targets side by side on one
chart (runs on simulated time: FakeClock)."""

from __future__ import annotations

import json
from pathlib import Path

from fake_clock import FakeClock, Slow

from openvsan.bench.engine import Plan
from openvsan.bench.plots import count, describe_job, latency, write_report
from openvsan.bench.profiles import custom_job
from openvsan.bench.report import document
from openvsan.bench.runner import run_in_process
from openvsan.block import RamDevice


def run(name: str, delay: float) -> object:
    clock = FakeClock()
    plan = Plan(name, custom_job("randrw", "4k", qd=4, mix=70), duration=2.5)
    return run_in_process(Slow(RamDevice(4096), clock, delay), plan, clock=clock.ns, sleep=clock.sleep)  # type: ignore[arg-type]


def test_the_page_says_the_profile_in_words_and_compares_on_one_chart(tmp_path: Path) -> None:
    doc = json.loads(json.dumps(document([run("a", 0.01), run("b", 0.02)], {"duration": 2.5, "warmup": 0.5},
                                         ["a", "b"])))
    written = write_report(doc, tmp_path)
    page = (tmp_path / "index.html").read_text()
    assert "4 KiB random reads and writes (70 % reads), 1 worker keeping 4 requests in flight" in page
    assert "2.5 s measured per run after 0.5 s of warm-up" in page
    assert "None" not in page and '{"name"' not in page and "845.417" not in page
    assert page.count("<h3>read</h3>") == 2 and page.count("<h3>read and write</h3>") == 2
    assert " ms</td>" in page and "the target's not measured" in page
    assert "Compared: 4k-randrw" in page and "compare00-4k-randrw.png" in page
    assert (tmp_path / "compare00-4k-randrw.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "console.css").read_text().startswith("/* The console's look")
    assert all(p.exists() for p in written)


def test_numbers_have_units_and_sensible_digits() -> None:
    assert [count(x) for x in (812.4, 9999, 97_512, 1_234_567)] == ["812", "9,999", "97.5K", "1.23M"]
    assert [latency(x) for x in (12.34, 845.417, 1250, 2_000_000, None)] == ["12.3 µs", "845 µs", "1.25 ms",
                                                                             "2.0 s", "-"]
    job = {"pattern": "seq", "write_pct": 100, "bs": 1 << 20, "threads": 2, "qd": 8}
    assert describe_job(job) == "1 MiB sequential writes, 2 workers keeping 8 requests in flight each"
