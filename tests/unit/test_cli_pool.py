"""`vsan pool`: the offline commands on temp member files, and the online ones through the control socket of a
node running in this process (its protocol servers are stand-ins; the pools and the socket are real)."""

from __future__ import annotations

import asyncio
import json
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from openvsan.cli.main import app
from openvsan.node.config import parse_config
from openvsan.node.control import ControlError, NotRunning, call
from openvsan.node.node import Factories, Node, NodeError
from openvsan.node.store import Store

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


@pytest.mark.parametrize("cmd", [["list"], ["status", "pool0"], ["scrub", "pool0"], ["fail", "pool0", "1"],
                                 ["replace", "pool0", "1", "d9"], ["add-spare", "pool0", "d9"]])
def test_online_commands_without_serve(tmp_path: Path, cmd: list[str]) -> None:
    line = one_line_error(vsan("pool", *cmd, "--data-dir", tmp_path), 1)
    assert "no vsan serve is running" in line
    (tmp_path / "control.sock").write_bytes(b"")  # a file left behind by a serve that was killed
    assert "nothing answers" in one_line_error(vsan("pool", *cmd, "--data-dir", tmp_path), 1)


# --- online, against a node in this process --------------------------------------------------------------------


class StubServer:
    def __init__(self, targets: list[Any], **kw: Any) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def stub_factories() -> Factories:
    return Factories(lambda dev, **kw: dev, lambda n, luns: None, lambda **kw: None, lambda u, s: None, StubServer)


class NodeThread:
    """A Node serving in its own event loop thread, as `vsan serve` would, minus the protocol servers."""

    def __init__(self, data_dir: Path, config: dict[str, Any]) -> None:
        with Store.open(data_dir) as s:
            s.import_config(parse_config(config))
            state = s.load()
        self.node = Node(state, data_dir, factories=stub_factories())
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> NodeThread:
        try:
            self.run(self.node.start())
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        try:
            if self.node.control_server is not None or self.node.pools:
                self.run(self.node.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def pool_config(tmp_path: Path, level: str = "raid5", members: int = 4, extra: int = 2,
                spares: int = 0) -> dict[str, Any]:
    n = members + spares + extra
    devs = [{"name": f"d{i}", "type": "file", "path": str(tmp_path / f"d{i}.img"), "size": "3MiB"} for i in range(n)]
    devs.append({"name": "raw", "type": "ram", "size": "1MiB"})
    return {
        "node": {"name": "t"},
        "devices": devs,
        "pools": [{"name": "pool0", "level": level, "members": [f"d{i}" for i in range(members)],
                   "spares": [f"d{members + i}" for i in range(spares)], "chunk": "16KiB"}],
        "volumes": [{"name": "vol0", "pool": "pool0"}, {"name": "other", "device": "raw"}],
    }


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
