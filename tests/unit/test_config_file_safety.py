"""Files a config names, judged before anything starts: device files that are symlinks, someone else's or
writable by others (preflight), ${data_dir} paths, and a config file holding secrets that others may read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from openvsan.cli.main import app
from openvsan.node.config import ConfigError, load_config, parse_config, preflight

runner = CliRunner()

FILE_DEVICE = """
[node]
name = "n1"
{node}

[[devices]]
name = "d0"
type = "file"
path = "{path}"
size = "1MiB"

[[volumes]]
name = "disk0"
device = "d0"

[iscsi]
portals = ["127.0.0.1:3260"]

[[iscsi.targets]]
iqn = "iqn.2026-11.org.openvsan:disk0"
luns = [{{ lun = 0, volume = "disk0" }}]
{chap}
"""


def write(tmp_path: Path, path: str, *, node: str = "", chap: str = "", mode: int = 0o600) -> Path:
    cfg = tmp_path / "vsan.toml"
    cfg.write_text(FILE_DEVICE.format(path=path, node=node, chap=chap))
    cfg.chmod(mode)
    return cfg


def test_preflight_refuses_a_symlinked_device_file(tmp_path: Path) -> None:
    real = tmp_path / "real.img"
    real.write_bytes(bytes(4096))
    (tmp_path / "link.img").symlink_to(real)
    cfg = load_config(write(tmp_path, str(tmp_path / "link.img")))
    with pytest.raises(ConfigError, match=r"devices\[0\]\.path: .*link\.img is a symbolic link"):
        preflight(cfg)
    # trusting foreign files does not make a link safe either
    cfg = load_config(write(tmp_path, str(tmp_path / "link.img"), node="trust_foreign_files = true"))
    with pytest.raises(ConfigError, match="is a symbolic link"):
        preflight(cfg)


def test_preflight_refuses_a_file_others_may_write_unless_trusted(tmp_path: Path) -> None:
    img = tmp_path / "d0.img"
    img.write_bytes(bytes(4096))
    img.chmod(0o666)
    r = runner.invoke(app, ["config", "check", str(write(tmp_path, str(img)))])
    assert r.exit_code == 2
    line = r.stderr.strip()
    assert "\n" not in line and "d0.img is writable by group or others (mode 0666)" in line
    assert "chmod go-w" in line and "trust_foreign_files = true" in line
    preflight(load_config(write(tmp_path, str(img), node="trust_foreign_files = true")))


def test_preflight_refuses_a_file_another_user_owns(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("must run as root: chown a file to uid 65534 (CI runs as root)", pytrace=False)
    img = tmp_path / "d0.img"
    img.write_bytes(bytes(4096))
    img.chmod(0o600)
    os.chown(img, 65534, 65534)
    with pytest.raises(ConfigError, match="is owned by uid 65534, not by the serving user"):
        preflight(load_config(write(tmp_path, str(img))))


def test_data_dir_paths(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "${data_dir}/d0.img"), data_dir=tmp_path / "state")
    assert cfg.device("d0").path == tmp_path / "state" / "d0.img"
    preflight(cfg, data_dir=tmp_path / "state")   # serve makes the data dir: it need not be there yet
    # without --data-dir: [node].data_dir
    cfg = load_config(write(tmp_path, "${data_dir}/d0.img", node='data_dir = "/srv/vsan"'))
    assert cfg.device("d0").path == Path("/srv/vsan/d0.img")
    for bad in ("${data_dir}", "${data_dir}x.img", "disks/${data_dir}/d0.img"):
        with pytest.raises(ConfigError, match=r"devices\[0\]\.path: .*\$\{data_dir\}"):
            parse_config({"devices": [{"name": "d0", "type": "file", "path": bad, "size": 4096}]})


def test_config_check_warns_of_secrets_others_may_read(tmp_path: Path) -> None:
    chap = 'chap = { user = "alice", secret = "horse-battery1" }'
    img = str(tmp_path / "d0.img")
    cfg = write(tmp_path, img, chap=chap, mode=0o644)
    r = runner.invoke(app, ["config", "check", str(cfg)])
    assert r.exit_code == 0, r.output
    want = f"warning: {cfg} is readable by others and holds secrets; chmod 600 {cfg}"
    assert want in r.stderr.splitlines(), r.stderr
    assert "horse-battery1" not in r.output
    cfg.chmod(0o600)
    assert "warning" not in runner.invoke(app, ["config", "check", str(cfg)]).stderr
    # no secrets in it: readable by all is fine
    cfg = write(tmp_path, img, mode=0o644)
    assert "holds secrets" not in runner.invoke(app, ["config", "check", str(cfg)]).stderr
