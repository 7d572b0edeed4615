"""The --json document: schema_version 1 as docs/benchmarks.md ("vsan bench") documents it, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from openvsan.bench.engine import Plan
from openvsan.bench.profiles import custom_job
from openvsan.bench.report import SCHEMA_VERSION, document
from openvsan.bench.runner import run_in_process
from openvsan.block import RamDevice
from openvsan.cli.main import app

SIDE = {"ops": int, "bytes": int, "iops": float, "mbps": float,
        "latency_us": {k: float for k in ("mean", "min", "p50", "p90", "p99", "p99.9", "max")}}
RUN = {
    "target": str, "round": int, "elapsed_s": float,
    "job": {"name": str, "pattern": str, "bs": int, "write_pct": int, "threads": int, "qd": int, "rw": str},
    "device": {"block_size": int, "num_blocks": int},
    "read": SIDE, "write": SIDE, "total": SIDE,
    "cpu": {"bench_pct": float, "target_pct": (float, type(None))},
    "errors": {"io": int, "verify": int, "first": list},
    "timeseries": list, "histogram_us": list,
}
DOC = {"schema_version": int, "tool": str, "version": str, "started": str, "host": {"hostname": str, "python": str},
       "options": dict, "runs": list, "compare": (list, type(None))}
POINT = {"t": float, "iops": float, "mbps": float, "lat_mean_us": float, "lat_p99_us": float, "lat_max_us": float}


def conforms(value: Any, schema: Any, where: str = "$") -> None:
    if isinstance(schema, dict):
        assert isinstance(value, dict), where
        assert set(value) == set(schema), f"{where}: keys {sorted(value)} != {sorted(schema)}"
        for k, sub in schema.items():
            conforms(value[k], sub, f"{where}.{k}")
    elif schema is float:
        assert isinstance(value, (int, float)) and not isinstance(value, bool), where
    else:
        assert isinstance(value, schema), f"{where}: {type(value).__name__}"


def test_document_schema() -> None:
    plan = Plan("ram", custom_job("randrw", "4k", qd=4, mix=70), duration=0.4)
    res = run_in_process(RamDevice(4096), plan)
    doc = json.loads(json.dumps(document([res], {"duration": 0.4}, ["ram"])))
    assert doc["schema_version"] == SCHEMA_VERSION == 1
    conforms(doc, DOC)
    (run,) = doc["runs"]
    conforms(run, RUN, "$.runs[0]")
    for p in run["timeseries"]:
        conforms(p, POINT, "$.runs[0].timeseries[]")
    assert len(run["timeseries"]) >= 1
    assert run["read"]["ops"] + run["write"]["ops"] == run["total"]["ops"] > 0
    assert sum(c for _, _, c in run["histogram_us"]) == run["total"]["ops"]
    lat = run["total"]["latency_us"]
    assert lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
    assert 0.5 < run["read"]["ops"] / run["total"]["ops"] < 0.9  # 70 % reads, roughly
    (cmp,) = doc["compare"]
    assert cmp["targets"][0]["ratio"]["iops"] == 1.0


def test_cli_json_on_a_file(tmp_path: Path) -> None:
    img = tmp_path / "disk.img"
    r = CliRunner().invoke(app, ["bench", str(img), "--size", "4m", "--rw", "randwrite", "--qd", "4", "-d", "0.5",
                                 "--warmup", "0", "--json", "--verify"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    conforms(doc, DOC)
    assert img.stat().st_size == 4 << 20 and doc["runs"][0]["write"]["ops"] > 0


def test_cli_usage_errors(tmp_path: Path) -> None:
    img = str(tmp_path / "d.img")
    for argv in (["bench", img, "-p", "nope"], ["bench", img, img], ["bench", img, "--duration", "0"]):
        r = CliRunner().invoke(app, argv)
        assert r.exit_code == 2, (argv, r.output)


def test_cli_missing_file_fails_with_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", str(tmp_path / "absent.img"), "-d", "0.2"])
    assert r.exit_code == 1 and "absent.img" in r.stderr
