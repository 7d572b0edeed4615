"""`vsan initiator` against a port that refuses: exit 1, one line."""

from __future__ import annotations

import socket

from typer.testing import CliRunner

from openvsan.cli.main import app

runner = CliRunner()


def test_unreachable_target_fails_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        r = runner.invoke(app, ["initiator", "read", f"iscsi://127.0.0.1:{port}/iqn.2026-11.x:y/0", "0", "1"])
    assert r.exit_code == 1 and "cannot connect" in r.output
