"""`vsan initiator`: argument and URL errors are one line and exit 2 (an unreachable target:
tests/integration/test_initiator_cli_connect.py)."""

from __future__ import annotations

from typer.testing import CliRunner

from openvsan.cli.main import app

runner = CliRunner()


def test_help_lists_the_commands() -> None:
    r = runner.invoke(app, ["initiator", "--help"])
    assert r.exit_code == 0
    for cmd in ("discover", "inquiry", "identify", "read", "write", "attach"):
        assert cmd in r.output


def test_bad_url_is_a_usage_error() -> None:
    r = runner.invoke(app, ["initiator", "read", "http://x/y/0", "0", "1"])
    assert r.exit_code == 2
    assert "want iscsi://" in r.output


def test_url_without_lun_is_a_usage_error() -> None:
    r = runner.invoke(app, ["initiator", "inquiry", "iscsi://127.0.0.1"])
    assert r.exit_code == 2 and "must name the volume" in r.output


def test_inquiry_of_nvme_url_points_to_identify() -> None:
    r = runner.invoke(app, ["initiator", "inquiry", "nvme+tcp://127.0.0.1/nqn.x:y/1"])
    assert r.exit_code == 2 and "identify" in r.output
