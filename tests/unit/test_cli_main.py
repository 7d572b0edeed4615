"""The `vsan` command through typer's CliRunner; the node's protocol layers are stand-ins here."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_stubs import (  # its fixtures (files, stubbed): tests/conftest.py
    GOOD,
    StubServer,
    stub_factories,
)
from typer.testing import CliRunner

from openvsan import __version__
from openvsan.cli.main import app
from openvsan.node import node as node_mod
from openvsan.node.paths import default_data_dir

runner = CliRunner()

def test_version() -> None:
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"vsan (openvsan) {__version__}"


def test_config_check_ok(files: tuple[Path, Path, Path]) -> None:
    r = runner.invoke(app, ["config", "check", str(files[0])])
    assert r.exit_code == 0, r.output
    assert "valid config for node n1" in r.stdout and "disk0" in r.stdout and "127.0.0.1:3260" in r.stdout


POOLS = """
[node]
name = "n1"
""" + "".join(f"""
[[devices]]
name = "r{i}"
type = "ram"
size = "1MiB"
""" for i in range(8)) + """
[[pools]]
name = "pool0"
level = "raid5"
members = ["r0", "r1", "r2", "r3"]
spares = ["r4"]
chunk = "64KiB"

[[pools]]
name = "mirror"
level = "raid1"
members = ["r5", "r6"]
chunk = "128KiB"

[[volumes]]
name = "vol0"
pool = "pool0"

[[volumes]]
name = "vol1"
pool = "mirror"

[[volumes]]
name = "disk0"
device = "r7"

[iscsi]
portals = ["127.0.0.1:3260"]

[[iscsi.targets]]
iqn = "iqn.2026-11.org.openvsan:t0"
luns = [{ lun = 0, volume = "vol0" }, { lun = 1, volume = "disk0" }]

[nvme]
portals = ["127.0.0.1:4420"]

[[nvme.subsystems]]
nqn = "nqn.2026-11.org.openvsan:t0"
namespaces = [{ nsid = 1, volume = "vol1" }]

[nbd]
portals = ["127.0.0.1:10809"]

[[nbd.exports]]
name = "vol0"
volume = "vol0"
"""


def table_rows(text: str, title: str) -> list[list[str]]:
    """The body rows of the rich table printed under `title`, as lists of cell texts."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == title)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("│"):
            rows.append([cell.strip() for cell in line.strip().strip("│").split("│")])
        elif line.startswith("└"):
            break
    return rows


def test_config_check_lists_pools_and_volumes_on_them(tmp_path: Path) -> None:
    path = tmp_path / "pools.toml"
    path.write_text(POOLS)
    # wide enough that no cell folds onto a second line
    r = runner.invoke(app, ["config", "check", str(path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert table_rows(r.stdout, "pools") == [
        ["pool0", "raid5", "r0, r1, r2, r3", "r4", "64.0 KiB"],
        ["mirror", "raid1", "r5, r6", "none", "128.0 KiB"],
    ]
    assert [row[1:4] for row in table_rows(r.stdout, "iSCSI")] == [["0", "vol0", "pool:pool0"], ["1", "disk0", "r7"]]
    assert [row[1:4] for row in table_rows(r.stdout, "NVMe/TCP")] == [["1", "vol1", "pool:mirror"]]
    assert [row[:3] for row in table_rows(r.stdout, "NBD")] == [["vol0", "vol0", "pool:pool0"]]


def test_config_check_without_pools_prints_no_pool_table(files: tuple[Path, Path, Path]) -> None:
    r = runner.invoke(app, ["config", "check", str(files[0])], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "pools" not in [line.strip() for line in r.stdout.splitlines()]
    assert [row[1:4] for row in table_rows(r.stdout, "iSCSI")] == [["0", "disk0", "ram0"]]


def test_config_check_bad(files: tuple[Path, Path, Path]) -> None:
    r = runner.invoke(app, ["config", "check", str(files[1])])
    assert r.exit_code == 2
    assert r.stdout == ""
    assert r.stderr == ('vsan: config error: iscsi.targets[0].luns[0].volume: unknown volume "disk9"; '
                        "define it under [[volumes]] or use one of: disk0\n")


def test_config_check_missing_file(tmp_path: Path) -> None:
    r = runner.invoke(app, ["config", "check", str(tmp_path / "nope.toml")])
    assert r.exit_code == 2 and r.stderr.startswith("vsan: config error: ") and r.stderr.count("\n") == 1


def test_serve_bad_config_creates_nothing(files: tuple[Path, Path, Path]) -> None:
    _, bad, data = files
    r = runner.invoke(app, ["serve", "--config", str(bad), "--data-dir", str(data)])
    assert r.exit_code == 2
    assert r.stderr.startswith("vsan: config error: iscsi.targets[0].luns[0].volume") and r.stderr.count("\n") == 1
    assert not data.exists()


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / "openvsan"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_data_dir() == tmp_path / "home" / ".local" / "state" / "openvsan"


def test_serve_port_in_use_is_one_line(files: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    err = OSError(98, "error while attempting to bind on address ('127.0.0.1', 3260): address already in use")
    monkeypatch.setattr(node_mod.Factories, "default",
                        classmethod(lambda cls: stub_factories(lambda t: StubServer(t, fail=err))))
    good, _, data = files
    r = runner.invoke(app, ["serve", "--config", str(good), "--data-dir", str(data)])
    assert r.exit_code == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("vsan: ") and "127.0.0.1" in last and "3260" in last


def test_serve_bad_log_level(files: tuple[Path, Path, Path]) -> None:
    r = runner.invoke(app, ["serve", "--config", str(files[0]), "--log-level", "loud"])
    assert r.exit_code == 2 and "--log-level" in r.stderr


def test_serve_device_error(tmp_path: Path, stubbed: None) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(GOOD.replace('type = "ram"', f'type = "file"\npath = "{tmp_path}/dir/x.img"'))
    r = runner.invoke(app, ["serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d")])
    assert r.exit_code == 2 and "devices[0].path: the directory" in r.stderr
