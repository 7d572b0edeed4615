"""The bench on the real clock (the unit tier runs it on simulated time, tests/unit/test_bench_engine.py):
--rate at 400 requests/s for half a second gets about 200; forked workers on a file merge their results; the
`vsan bench` CLI writes its JSON document."""

from __future__ import annotations

import json
from pathlib import Path

from bench_schema import DOC, conforms
from typer.testing import CliRunner

from openvsan.bench.engine import Plan, WorkerResult
from openvsan.bench.profiles import custom_job
from openvsan.bench.runner import run_in_process, run_processes
from openvsan.block import RamDevice
from openvsan.cli.main import app


def test_rate_limits_requests() -> None:
    plan = Plan("ram", custom_job("randread", "4k", qd=8), duration=0.5, rate=400)
    res = run_in_process(RamDevice(2048), plan).result
    assert 160 <= res.read.count <= 220, res.read.count


def test_processes_merge_their_results(tmp_path: Path) -> None:
    # Forked workers open the file themselves, and its requests run in threads,
    # which a simulated clock cannot wait for (it would jump while they are in flight). What is checked is the
    # processes' plumbing and the merge, not time.
    img = tmp_path / "d.img"
    img.write_bytes(bytes(8 << 20))
    plan = Plan(str(img), custom_job("randrw", "4k", threads=3, qd=2, mix=50), duration=0.2, verify=True)
    r = run_processes(plan)
    assert r.result.read.count > 0 and r.result.write.count > 0 and r.result.mismatches == 0
    assert r.bench_cpu_pct > 0
    w = WorkerResult.from_dict(r.result.to_dict())
    assert w.read.count == r.result.read.count and len(w.intervals) == len(r.result.intervals)


def test_cli_json_on_a_file(tmp_path: Path) -> None:
    # `vsan bench` takes no clock to inject, and a file's requests run in threads
    # (which a simulated clock cannot wait for). What is checked is the CLI's plumbing, not time.
    img = tmp_path / "disk.img"
    r = CliRunner().invoke(app, ["bench", str(img), "--size", "4m", "--rw", "randwrite", "--qd", "4", "-d", "0.1",
                                 "--warmup", "0", "--json", "--verify"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    conforms(doc, DOC)
    assert img.stat().st_size == 4 << 20 and doc["runs"][0]["write"]["ops"] > 0
