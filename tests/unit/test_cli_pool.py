"""`vsan pool`: the offline commands on temp member files, and what `vsan serve` refuses before it
opens anything; the online commands through a running node's control socket are in
tests/integration/test_cli_pool_online.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pool_node import NodeThread, pool_config
from typer.testing import CliRunner

from openvsan.cli.main import app
from openvsan.node.node import NodeError

runner = CliRunner()
MiB = 1 << 20


def vsan(*args: object) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def files(tmp_path: Path, n: int, size: int = 4 * MiB, prefix: str = "m") -> list[Path]:
    out = []
    for i in range(n):
        p = tmp_path / f"{prefix}{i}.img"
        p.write_bytes(b"")
        with p.open("r+b") as f:
            f.truncate(size)
        out.append(p)
    return out


def one_line_error(r: Any, code: int) -> str:
    assert r.exit_code == code, r.output
    text = r.stderr if hasattr(r, "stderr") else r.output
    lines = [x for x in text.splitlines() if x.startswith("vsan: ")]
    assert len(lines) == 1, text
    return lines[0]


# --- offline ---------------------------------------------------------------------------------------------------


def test_create_inspect_destroy(tmp_path: Path) -> None:
    m = files(tmp_path, 5)
    r = vsan("pool", "create", "--level", "raid5", "--chunk", "64KiB", "--name", "tank", "--spare", m[4], *m[:4])
    assert r.exit_code == 0, r.output
    assert "created pool tank" in r.output and "RAID 5 over 4 members and 1 spares" in r.output
    r = vsan("pool", "inspect", "--json", *m)
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [x["index"] for x in rows] == [0, 1, 2, 3, None]
    assert {x["pool"] for x in rows} == {"tank"} and len({x["pool_uuid"] for x in rows}) == 1
    assert all(x["level"] == 5 and x["chunk_size"] == 64 * 1024 and x["members"] == 4 for x in rows)
    assert [x["state"] for x in rows] == ["active"] * 4 + ["spare"]
    assert all(x["clean"] for x in rows[:4]) and rows[0]["event"] >= 1
    # the table names the same things
    r = vsan("pool", "inspect", *m[:2])
    assert "tank" in r.stdout and "RAID 5" in r.stdout and "0 of 4" in r.stdout
    # destroy asks for --yes and changes nothing without it
    r = vsan("pool", "destroy", *m)
    assert "add --yes" in one_line_error(r, 2)
    assert all(x["pool"] == "tank" for x in json.loads(vsan("pool", "inspect", "--json", *m).stdout))
    r = vsan("pool", "destroy", "--yes", *m)
    assert r.exit_code == 0, r.output
    assert r.stdout.count("erased") == 5
    assert all(x["pool"] is None for x in json.loads(vsan("pool", "inspect", "--json", *m).stdout))
    # and the files can make a new pool without --force
    assert vsan("pool", "create", "--level", "raid6", *m[:4]).exit_code == 0


@pytest.mark.parametrize("level, n, expect", [
    ("raid6", 3, "RAID 6 needs at least 4 members, 3 given"),
    ("raid5", 2, "RAID 5 needs at least 3 members, 2 given"),
    ("raid1", 1, "RAID 1 needs at least 2 members, 1 given"),
    ("raid10", 5, "RAID 10 needs an even number of members"),
    ("raid7", 4, "unknown RAID level 'raid7'"),
])
def test_create_impossible_levels(tmp_path: Path, level: str, n: int, expect: str) -> None:
    m = files(tmp_path, n)
    assert expect in one_line_error(vsan("pool", "create", "--level", level, *m), 2)
    assert all(x["pool"] is None for x in json.loads(vsan("pool", "inspect", "--json", *m).stdout))


def test_create_refuses_a_smaller_member(tmp_path: Path) -> None:
    m = files(tmp_path, 3) + files(tmp_path, 1, size=3 * MiB, prefix="small")
    line = one_line_error(vsan("pool", "create", "--level", "raid5", *m), 2)
    assert f"{m[3]} is 1 MiB smaller than {m[0]}" in line


def test_create_refuses_a_member_of_another_pool(tmp_path: Path) -> None:
    m = files(tmp_path, 5)
    assert vsan("pool", "create", "--level", "raid5", "--name", "a", *m[:3]).exit_code == 0
    line = one_line_error(vsan("pool", "create", "--level", "raid1", "--name", "b", m[3], m[2]), 2)
    assert f"{m[2]} already belongs to pool 'a'" in line and "--force" in line and "force=True" not in line
    # the spare path refuses it too, and the new pool's members are left as they were
    line = one_line_error(vsan("pool", "create", "--level", "raid1", "--name", "b", "--spare", m[1], m[3], m[4]), 2)
    assert "already belongs to pool 'a'" in line
    assert vsan("pool", "create", "--level", "raid1", "--name", "b", "--force", m[3], m[2]).exit_code == 0
    rows = json.loads(vsan("pool", "inspect", "--json", *m[:4]).stdout)
    assert [x["pool"] for x in rows] == ["a", "a", "b", "b"]


def test_create_files_and_bad_arguments(tmp_path: Path) -> None:
    new = [tmp_path / f"n{i}.img" for i in range(3)]
    assert "no such file" in one_line_error(vsan("pool", "create", "--level", "raid1", *new[:2]), 2)
    r = vsan("pool", "create", "--level", "raid1", "--size", "3MiB", *new[:2])
    assert r.exit_code == 0, r.output
    assert new[0].stat().st_size == 3 * MiB
    assert "power of two" in one_line_error(vsan("pool", "create", "--level", "raid0", "--chunk", "48KiB",
                                                 "--size", "3MiB", new[2]), 2)
    assert "named twice" in one_line_error(vsan("pool", "create", "--level", "raid1", new[0], new[0]), 2)
    assert "not a usable name" in one_line_error(vsan("pool", "create", "--level", "raid1", "--name", "a b",
                                                      *new[:2]), 2)


# --- online, without a serve -----------------------------------------------------------------------------------


# --- online, against a node in this process --------------------------------------------------------------------


def status(data: Path) -> dict[str, Any]:
    r = vsan("pool", "status", "pool0", "--json", "--data-dir", data)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_serve_refuses_another_pools_member(tmp_path: Path) -> None:
    cfg = pool_config(tmp_path, level="raid1", members=2, extra=0)
    # d1 carries a member of another pool, made offline
    other = files(tmp_path, 1, size=3 * MiB, prefix="o")
    (tmp_path / "d1.img").write_bytes(b"")
    with (tmp_path / "d1.img").open("r+b") as f:
        f.truncate(3 * MiB)
    assert vsan("pool", "create", "--level", "raid1", "--name", "tank", tmp_path / "d1.img", other[0]).exit_code == 0
    node = NodeThread(tmp_path / "data", cfg)
    with pytest.raises(NodeError, match=r"pool pool0: device d1 \(.*d1.img\) carries a member of another pool, "
                                        r"'tank' .* refusing to touch it"):
        node.start()
    rows = json.loads(vsan("pool", "inspect", "--json", tmp_path / "d1.img", tmp_path / "d0.img").stdout)
    assert rows[0]["pool"] == "tank" and rows[1]["pool"] is None  # nothing was written
