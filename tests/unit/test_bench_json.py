"""The --json document: schema_version 1 as docs/benchmarks.md ("vsan bench") documents it (a run on simulated
time: FakeClock), and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

from bench_schema import DOC, POINT, RUN, conforms
from fake_clock import FakeClock, Slow
from typer.testing import CliRunner

from openvsan.bench.engine import Plan
from openvsan.bench.profiles import custom_job
from openvsan.bench.report import SCHEMA_VERSION, document
from openvsan.bench.runner import run_in_process
from openvsan.block import RamDevice
from openvsan.cli.main import app


def test_document_schema() -> None:
    clock = FakeClock()  # 2.5 s of 10 ms requests: three time-series points
    plan = Plan("ram", custom_job("randrw", "4k", qd=4, mix=70), duration=2.5)
    res = run_in_process(Slow(RamDevice(4096), clock, 0.01), plan, clock=clock.ns, sleep=clock.sleep)  # type: ignore[arg-type]
    doc = json.loads(json.dumps(document([res], {"duration": 2.5}, ["ram"])))
    assert doc["schema_version"] == SCHEMA_VERSION == 1
    conforms(doc, DOC)
    (run,) = doc["runs"]
    conforms(run, RUN, "$.runs[0]")
    for p in run["timeseries"]:
        conforms(p, POINT, "$.runs[0].timeseries[]")
    assert len(run["timeseries"]) in (3, 4)  # (the last requests may complete on the 2.5 s edge)
    assert run["read"]["ops"] + run["write"]["ops"] == run["total"]["ops"] > 0
    assert sum(c for _, _, c in run["histogram_us"]) == run["total"]["ops"]
    lat = run["total"]["latency_us"]
    assert lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
    assert 0.5 < run["read"]["ops"] / run["total"]["ops"] < 0.9  # 70 % reads, roughly
    (cmp,) = doc["compare"]
    assert cmp["targets"][0]["ratio"]["iops"] == 1.0


def test_cli_usage_errors(tmp_path: Path) -> None:
    img = str(tmp_path / "d.img")
    for argv in (["bench", img, "-p", "nope"], ["bench", img, img], ["bench", img, "--duration", "0"]):
        r = CliRunner().invoke(app, argv)
        assert r.exit_code == 2, (argv, r.output)


def test_cli_missing_file_fails_with_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", str(tmp_path / "absent.img"), "-d", "0.2"])
    assert r.exit_code == 1 and "absent.img" in r.stderr
