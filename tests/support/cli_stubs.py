"""The config files and stand-in protocol layers the `vsan serve` CLI tests run on: shared by
tests/unit/test_cli_main.py and tests/integration/test_cli_main_serve.py (its fixtures `files` and `stubbed`
reach every test through tests/conftest.py's pytest_plugins)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from openvsan.node import node as node_mod

GOOD = """
[node]
name = "n1"
workers = 1   # the stand-in servers replace the node's own in this process: no worker processes

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
