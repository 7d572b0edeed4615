"""`vsan pool` online: the commands through the control socket of a node running in this process (its protocol
servers are stand-ins; the pools and the socket are real), and what they say when no node is running."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
from pool_node import NodeThread, pool_config
from typer.testing import CliRunner

from openvsan.cli.main import app
from openvsan.node.control import ControlError, NotRunning, call
from openvsan.node.node import NodeError

runner = CliRunner()
MiB = 1 << 20


def vsan(*args: object) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(r: Any, code: int) -> str:
    assert r.exit_code == code, r.output
    text = r.stderr if hasattr(r, "stderr") else r.output
    lines = [x for x in text.splitlines() if x.startswith("vsan: ")]
    assert len(lines) == 1, text
    return lines[0]


def status(data: Path) -> dict[str, Any]:
    r = vsan("pool", "status", "pool0", "--json", "--data-dir", data)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def wait_optimal(data: Path, timeout: float = 20) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + timeout
    while True:
        st = status(data)
        if st["state"] == "optimal" or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


@pytest.mark.parametrize("cmd", [["list"], ["status", "pool0"], ["scrub", "pool0"], ["fail", "pool0", "1"],
                                 ["replace", "pool0", "1", "d9"], ["add-spare", "pool0", "d9"]])
def test_online_commands_without_serve(tmp_path: Path, cmd: list[str]) -> None:
    line = one_line_error(vsan("pool", *cmd, "--data-dir", tmp_path), 1)
    assert "no vsan serve is running" in line
    (tmp_path / "control.sock").write_bytes(b"")  # a file left behind by a serve that was killed
    assert "nothing answers" in one_line_error(vsan("pool", *cmd, "--data-dir", tmp_path), 1)


def test_online_commands(tmp_path: Path) -> None:
    data = tmp_path / "data"
    cfg = pool_config(tmp_path)
    node = NodeThread(data, cfg).start()
    try:
        sock = data / "control.sock"
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600 and stat.S_ISSOCK(sock.stat().st_mode)
        r = vsan("pool", "list", "--json", "--data-dir", data)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout) == [{"name": "pool0", "level": 5, "state": "optimal", "size": 3 * 2 * MiB,
                                         "members": 4, "spares": 0, "volume": "vol0", "rebuild_progress": None,
                                         "resync_progress": None}]
        assert "pool0" in vsan("pool", "list", "--data-dir", data).stdout
        st = status(data)
        assert [m["device"] for m in st["members"]] == ["d0", "d1", "d2", "d3"]
        assert st["state"] == "optimal" and st["level"] == 5 and st["chunk_size"] == 16 * 1024
        text = vsan("pool", "status", "pool0", "--data-dir", data).stdout
        assert "optimal" in text and "d3" in text
        # write something through the pool, as an initiator would
        pool = node.node.pools["pool0"].pool
        payload = bytes(range(256)) * 2 * 1024 * 6  # 3 MiB
        node.run(pool.write(0, payload))

        r = vsan("pool", "fail", "pool0", "d1", "--data-dir", data)
        assert r.exit_code == 0 and "degraded" in r.stdout, r.output
        assert [m["state"] for m in status(data)["members"]] == ["active", "failed", "active", "active"]
        assert "already failed" in one_line_error(vsan("pool", "fail", "pool0", "1", "--data-dir", data), 1)
        line = one_line_error(vsan("pool", "fail", "pool0", "2", "--data-dir", data), 1)
        assert "more than RAID 5 tolerates (1)" in line
        assert "no member 'd9'" in one_line_error(vsan("pool", "fail", "pool0", "d9", "--data-dir", data), 1)
        assert "no pool 'nope'" in one_line_error(vsan("pool", "status", "nope", "--data-dir", data), 1)

        # replace: devices in use, unknown, active slots are refused with one line
        for dev, expect in (("raw", "belongs to volume other"), ("d2", "already in pool pool0"),
                            ("d9", "unknown device 'd9'"), (f"file:{tmp_path / 'd0.img'}", "is device d0")):
            assert expect in one_line_error(vsan("pool", "replace", "pool0", "1", dev, "--data-dir", data), 1)
        assert "is active; fail it first (vsan pool fail)" in one_line_error(
            vsan("pool", "replace", "pool0", "2", "d4", "--data-dir", data), 1)
        small = f"file:{tmp_path / 'small.img'}:1MiB"
        assert "fewer than the" in one_line_error(vsan("pool", "replace", "pool0", "1", small, "--data-dir", data), 1)
        r = vsan("pool", "replace", "pool0", "1", f"file:{tmp_path / 'new.img'}:3MiB", "--data-dir", data)
        assert r.exit_code == 0, r.output
        st = wait_optimal(data)
        assert st["state"] == "optimal" and st["members"][1]["device"] == f"file:{tmp_path / 'new.img'}:3MiB"
        # a hot spare, then a member fails: the spare takes over and is rebuilt
        r = vsan("pool", "add-spare", "pool0", "d4", "--data-dir", data)
        assert r.exit_code == 0, r.output
        assert status(data)["spares"] == ["d4"]
        assert vsan("pool", "fail", "pool0", "0", "--data-dir", data).exit_code == 0
        st = wait_optimal(data)
        assert st["state"] == "optimal" and st["members"][0]["device"] == "d4" and st["spares"] == []
        # every member's data was rebuilt: lose another one and read it all back
        assert vsan("pool", "fail", "pool0", "3", "--data-dir", data).exit_code == 0
        assert bytes(node.run(pool.read(0, len(payload) // 512))) == payload
        r = vsan("pool", "scrub", "pool0", "--json", "--data-dir", data)
        assert r.exit_code == 0 and json.loads(r.stdout)["mismatches"] == 0, r.output
        r = vsan("pool", "scrub", "pool0", "--no-repair", "--data-dir", data)
        assert r.exit_code == 0 and "0 inconsistent" in r.stdout, r.output
        # bad requests over the raw socket get one line too
        with pytest.raises(ControlError, match="unknown command 'pool.grow'"):
            call(data, "pool.grow", name="pool0")
        with pytest.raises(ControlError, match="index must be a member slot number"):
            call(data, "pool.replace", name="pool0", index="x", device="d5")
    finally:
        node.close()
    assert not (data / "control.sock").exists()
    with pytest.raises(NotRunning):
        call(data, "pool.list")

    # the next start finds the member that came in at run time (file:...), and the pool is as it was left
    node = NodeThread(data, cfg).start()
    try:
        st = status(data)
        assert [m["device"] for m in st["members"]] == ["d4", f"file:{tmp_path / 'new.img'}:3MiB", "d2", "d3"]
        # the failed member is present again: the pool does not trust it, it rebuilds it
        assert [m["state"] for m in st["members"]][:3] == ["active", "active", "active"]
        assert st["members"][3]["state"] in ("rebuilding", "active")
        assert wait_optimal(data)["state"] == "optimal"
        pool = node.node.pools["pool0"].pool
        assert bytes(node.run(pool.read(0, len(payload) // 512))) == payload
    finally:
        node.close()


def test_serve_refuses_a_pool_beyond_tolerance_and_mixed_sizes(tmp_path: Path) -> None:
    cfg = pool_config(tmp_path, level="raid5", members=3, extra=0)
    node = NodeThread(tmp_path / "data", cfg).start()
    node.close()
    for i in (1, 2):
        (tmp_path / f"d{i}.img").unlink()  # two of three members gone: created blank again, so left out
    node = NodeThread(tmp_path / "data", cfg)
    with pytest.raises(NodeError, match=r"pool pool0: members .* cannot be used; RAID 5 of 3 members "
                                        r"tolerates 1 lost \(refusing to start\)"):
        node.start()
    # a member smaller than the others is found when the pool is created
    cfg = pool_config(tmp_path / "b", level="raid1", members=2, extra=0)
    (tmp_path / "b").mkdir()
    cfg["devices"][1]["size"] = "2MiB"
    node = NodeThread(tmp_path / "b" / "data", cfg)
    with pytest.raises(NodeError, match=r"pool pool0: d1 is 1 MiB smaller than d0"):
        node.start()


def test_long_data_dir_path(tmp_path: Path) -> None:
    data = tmp_path / ("x" * 60) / ("y" * 60) / "data"
    assert len(str(data / "control.sock")) > 108
    node = NodeThread(data, pool_config(tmp_path, level="raid1", members=2, extra=0)).start()
    try:
        assert status(data)["state"] == "optimal"
    finally:
        node.close()


def test_rebuild_rate_limit_and_speed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    cfg = pool_config(tmp_path, level="raid1", members=2, extra=1)
    cfg["pools"][0]["rebuild_rate"] = "1MiB"  # 2 MiB of member data: a rebuild of about 2 s
    node = NodeThread(data, cfg).start()
    try:
        assert node.node.pools["pool0"].pool.rebuild_rate == 1 << 20
        assert vsan("pool", "fail", "pool0", "1", "--data-dir", data).exit_code == 0
        assert vsan("pool", "replace", "pool0", "1", "d2", "--data-dir", data).exit_code == 0
        import time

        time.sleep(1.3)
        st = status(data)
        assert st["state"] == "rebuilding" and 20 < st["rebuild_progress"] < 95, st
        assert st["members"][1]["state"] == "rebuilding" and st["rebuild_rate_limit"] == 1 << 20
        assert 0.5 * MiB < st["rebuild_speed"] < 1.6 * MiB, st
        text = vsan("pool", "status", "pool0", "--data-dir", data).stdout
        assert "rebuilding" in text and "(limit 1.0 MiB/s)" in text and " at " in text
        assert "rebuild" in vsan("pool", "list", "--data-dir", data).stdout
        assert wait_optimal(data)["state"] == "optimal"
    finally:
        node.close()
