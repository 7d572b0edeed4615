"""`vsan health` on a serving node (node/health.py): a node with a healthy RAID 5 pool is healthy (exit 0); a
member failed with `vsan pool fail` makes it critical (exit 2), naming the pool, why it matters and what to do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pool_node import NodeThread, pool_config
from typer.testing import CliRunner

from openvsan.cli.main import app

runner = CliRunner()


def health(data_dir: Path) -> tuple[int, Any]:
    r = runner.invoke(app, ["health", "--json", "--data-dir", str(data_dir)])
    return r.exit_code, json.loads(r.stdout)


def test_a_failed_member_turns_a_healthy_node_critical(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    node = NodeThread(data, pool_config(tmp_path, "raid5", members=3, extra=0)).start()
    try:
        code, r = health(data)
        assert (code, r) == (0, {"status": "healthy", "findings": []})
        fail = runner.invoke(app, ["pool", "fail", "pool0", "1", "--data-dir", str(data)])
        assert fail.exit_code == 0, fail.output
        code, r = health(data)
        assert code == 2 and r["status"] == "critical"
        f = r["findings"][0]
        assert f["object"] == "pool pool0" and "degraded" in f["what"] and "vsan pool replace pool0" in f["action"]
        text = runner.invoke(app, ["health", "--data-dir", str(data)])
        assert text.exit_code == 2 and "node health: critical" in text.stdout and "why:" in text.stdout
    finally:
        node.close()
