"""`vsan serve` in process with stand-in protocol servers; the node's control socket is real."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from openvsan.cli.main import app
from openvsan.node import node as node_mod
from openvsan.node.store import Store

runner = CliRunner()

GOOD = """
[node]
name = "n1"

[[devices]]
name = "ram0"
type = "ram"
size = "1MiB"

[[volumes]]
name = "disk0"
device = "ram0"

[iscsi]
portals = ["127.0.0.1:3260"]

[[iscsi.targets]]
iqn = "iqn.2026-11.org.openvsan:disk0"
luns = [{ lun = 0, volume = "disk0" }]
"""

BAD = GOOD.replace('volume = "disk0" }', 'volume = "disk9" }')


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, Path]:
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(GOOD)
    bad.write_text(BAD)
    return good, bad, tmp_path / "data"


class StubServer:
    """Starts, then asks the process to stop: the whole serve path runs once, end to end."""

    last: StubServer | None = None

    def __init__(self, targets: list[Any], fail: OSError | None = None) -> None:
        self.targets, self.fail, self.events = targets, fail, []
        StubServer.last = self

    async def start(self) -> None:
        if self.fail:
            raise self.fail
        self.events.append("start")
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)

    async def stop(self) -> None:
        self.events.append("stop")


class StubScsi:
    def __init__(self, name: str, luns: dict[int, Any]) -> None:
        self.luns = luns

    async def flush_all(self) -> None:
        pass


def stub_factories(server: Any = StubServer) -> node_mod.Factories:
    return node_mod.Factories(lambda dev, **kw: (dev, kw), StubScsi, lambda **kw: type("T", (), kw)(),
                              lambda u, s: (u, s), server)


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_mod.Factories, "default", classmethod(lambda cls: stub_factories()))


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
