"""`vsan serve` in process with stand-in protocol servers; the node's control socket is real."""

from __future__ import annotations

import hashlib
from pathlib import Path

from cli_stubs import (  # its fixtures (files, stubbed): tests/conftest.py
    GOOD,
    StubServer,
)
from typer.testing import CliRunner

from openvsan.cli.main import app
from openvsan.node.store import Store

runner = CliRunner()

def test_serve_bad_config_leaves_state_untouched(files: tuple[Path, Path, Path], stubbed: None) -> None:
    good, bad, data = files
    r = runner.invoke(app, ["serve", "--config", str(good), "--data-dir", str(data)])
    assert r.exit_code == 0, r.output
    db = data / "state-kv.db"
    before = (hashlib.sha256(db.read_bytes()).hexdigest(), db.stat().st_mtime_ns)
    r = runner.invoke(app, ["serve", "--config", str(bad), "--data-dir", str(data)])
    assert r.exit_code == 2
    assert (hashlib.sha256(db.read_bytes()).hexdigest(), db.stat().st_mtime_ns) == before
    assert sorted(p.name for p in data.iterdir()) == ["pr", "secrets.json", "serve.lock", "state-kv.db"]


def test_serve_runs_and_stops_cleanly(files: tuple[Path, Path, Path], stubbed: None) -> None:
    good, _, data = files
    r = runner.invoke(app, ["serve", "--config", str(good), "--data-dir", str(data), "--log-level", "debug"])
    assert r.exit_code == 0, r.output
    assert StubServer.last is not None and StubServer.last.events == ["start", "stop"]
    assert "INFO  node: serving iqn.2026-11.org.openvsan:disk0 LUN 0 (disk0, 1.0 MiB) on 127.0.0.1:3260" in r.stderr
    assert "SIGTERM: shutting down" in r.stderr and "stopped" in r.stderr
    with Store.open(data) as s:
        first = s.identities()
    runner.invoke(app, ["serve", "--config", str(good), "--data-dir", str(data)])
    with Store.open(data) as s:
        assert s.identities() == first  # stable across restarts


def test_serve_uses_config_data_dir(tmp_path: Path, stubbed: None) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(GOOD.replace('name = "n1"', 'name = "n1"\ndata_dir = "state-here"'))
    r = runner.invoke(app, ["serve", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "state-here" / "state-kv.db").exists()
