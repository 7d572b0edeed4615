"""[[pools]] in the node config: parsing, every error a config can make about a pool, and the store's round trip
(and the migration of a schema 2 state.db, before volumes could live on a pool)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from test_node_config import error  # one line, no newline, else the test fails

from openvsan.node.config import parse_config
from openvsan.node.legacy_store import _MIGRATIONS, SCHEMA_VERSION
from openvsan.node.specs import PoolSpec, VolumeSpec
from openvsan.node.store import Store, StoreError


def devices(n: int = 6, **over: Any) -> list[dict[str, Any]]:
    return [{"name": f"d{i}", "type": "ram", "size": "8MiB", **over} for i in range(n)]


def cfg(pools: list[dict[str, Any]] | None = None, volumes: list[dict[str, Any]] | None = None,
        devs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "devices": devices() if devs is None else devs,
        "pools": [{"name": "pool0", "level": "raid5", "members": ["d0", "d1", "d2", "d3"]}] if pools is None else pools,
        "volumes": [{"name": "vol0", "pool": "pool0"}] if volumes is None else volumes,
        "iscsi": {"portals": ["127.0.0.1:3260"],
                  "targets": [{"iqn": "iqn.2026-11.org.openvsan:vol0", "luns": [{"lun": 0, "volume": "vol0"}]}]},
    }


def pool(**kw: Any) -> dict[str, Any]:
    return {"name": "pool0", "level": "raid5", "members": ["d0", "d1", "d2", "d3"], **kw}


def test_pool_parsed() -> None:
    c = parse_config(cfg([pool(spares=["d4"], chunk="128KiB", rebuild_rate="200MiB/s")]))
    assert c.pools == (PoolSpec("pool0", "raid5", ("d0", "d1", "d2", "d3"), ("d4",), 128 * 1024, 200 << 20),)
    assert c.volumes == (VolumeSpec("vol0", None, False, pool="pool0"),)
    assert c.device_user("d4") == "pool pool0" and c.device_user("d5") is None
    # defaults: 64 KiB chunks, no rate limit, no spares; level names in any case
    p = parse_config(cfg([pool(level="RAID6")])).pools[0]
    assert (p.level, p.chunk, p.rebuild_rate, p.spares) == ("raid6", 64 * 1024, None, ())


@pytest.mark.parametrize("level, members", [("raid0", 1), ("raid1", 2), ("raid10", 4), ("raid5", 3), ("raid6", 4)])
def test_fewest_members(level: str, members: int) -> None:
    parse_config(cfg([pool(level=level, members=[f"d{i}" for i in range(members)])]))
    if members > 1:
        text = error(cfg([pool(level=level, members=[f"d{i}" for i in range(members - 1)])]))
        assert text.startswith(f"pools[0].members: {level} needs at least {members} members, {members - 1} given")


@pytest.mark.parametrize("data, expect", [
    (cfg([pool(level="raid7")]),
     'pools[0].level: unknown level "raid7"; use one of: raid0, raid1, raid10, raid5, raid6'),
    (cfg([pool(level="raid6", members=["d0", "d1", "d2"])]),
     "pools[0].members: raid6 needs at least 4 members, 3 given; add 1 more"),
    (cfg([pool(level="raid1", members=["d0"])]), "pools[0].members: raid1 needs at least 2 members, 1 given"),
    (cfg([pool(level="raid10", members=["d0", "d1", "d2"])]), "raid10 needs at least 4 members, 3 given"),
    (cfg([pool(level="raid10", members=["d0", "d1", "d2", "d3", "d4"])]),
     "pools[0].members: raid10 needs an even number of members (mirrored pairs), 5 given"),
    (cfg([pool(members=["d0", "d1", "d9"])]),
     'pools[0].members[2]: unknown device "d9"; define it under [[devices]] or use one of: d0, d1, d2, d3, d4, d5'),
    (cfg([pool(spares=["d9"])]), 'pools[0].spares[0]: unknown device "d9"'),
    (cfg([pool(members=["d0", "d1", "d1"])]), 'pools[0].members[2]: device "d1" is listed twice in this pool'),
    (cfg([pool(spares=["d3"])]), 'pools[0].spares[0]: device "d3" is already in this pool'),
    (cfg([pool(), pool(name="pool1", members=["d3", "d4", "d5"])]),
     'pools[1].members[0]: device "d3" is already in pool "pool0"; a device belongs to one pool'),
    (cfg([pool(spares=["d4"]), pool(name="pool1", level="raid1", members=["d5", "d4"])]),
     'pools[1].members[1]: device "d4" is already in pool "pool0"'),
    (cfg(volumes=[{"name": "vol0", "pool": "pool0"}, {"name": "raw", "device": "d2"}]),
     'volumes[1].device: device "d2" is in pool "pool0"; a volume on the pool names it: pool = "pool0"'),
    (cfg(volumes=[{"name": "vol0", "pool": "pool0", "device": "d5"}]),
     'volumes[0]: names both device "d5" and pool "pool0"; a volume lives on one of them: remove one'),
    (cfg(volumes=[{"name": "vol0", "pool": "pool9"}]),
     'volumes[0].pool: unknown pool "pool9"; define it under [[pools]] or use one of: pool0'),
    (cfg(volumes=[{"name": "vol0", "pool": "pool0"}, {"name": "vol1", "pool": "pool0"}]),
     'volumes[1].pool: pool "pool0" is already used by volume "vol0"'),
    (cfg(volumes=[{"name": "vol0"}]), "volumes[0].device: missing; name the device it lives on"),
    (cfg([pool(name="pool0"), pool(name="pool0", members=["d4", "d5"], level="raid1")]),
     'pools[1].name: a pool named "pool0" is already defined'),
    (cfg([pool(members="d0")]), 'pools[0].members: expected a list, found "d0"'),
    (cfg([pool(members=["d0", 1, "d2"])]), "pools[0].members[1]: expected a device name, found 1"),
    (cfg([{"name": "pool0", "level": "raid5"}]), "pools[0].members: missing; list its devices"),
    (cfg([{"name": "pool0", "members": ["d0", "d1", "d2"]}]), 'pools[0].level: missing; add level = "raid5"'),
    (cfg([pool(chunk="48KiB")]), "pools[0].chunk: 49152 bytes; use a power of two from 4KiB to 16MiB"),
    (cfg([pool(chunk="2KiB")]), "pools[0].chunk: 2048 bytes; use a power of two"),
    (cfg([pool(chunk="1 parsec")]), "pools[0].chunk: '1 parsec' is not a size"),
    (cfg([pool(rebuild_rate="fast")]), "pools[0].rebuild_rate: 'fast' is not a size"),
    (cfg([pool(level="raid0", members=["d0", "d1"], spares=["d2"])]),
     "pools[0].spares: raid0 has no redundancy to rebuild a spare from"),
    (cfg([pool(memebrs=["d0"])]), 'pools[0].memebrs: unknown key; did you mean "members"?'),
    (cfg(devs=devices(3) + [{"name": "d3", "type": "ram", "size": "8MiB", "block_size": 4096}]),
     'pools[0].members[3]: device "d3" has 4096-byte blocks, "d0" 512; a pool\'s devices have one block size'),
    (cfg(devs=devices(3) + [{"name": "d3", "type": "null", "size": "8MiB"}]),
     'pools[0].members[3]: device "d3" is a null device, which keeps nothing'),
    (cfg([pool(name="a b")]), "pools[0].name: 'a b' is not a usable name"),
    ({**cfg(), "pools": {"name": "pool0"}}, "pools: expected a list"),
])
def test_bad_pool_config(data: dict[str, Any], expect: str) -> None:
    assert expect in error(data)


def test_store_round_trip_and_runtime_devices(tmp_path: Path) -> None:
    c = parse_config(cfg([pool(spares=["d4"], rebuild_rate="1MiB"),
                          {"name": "m", "level": "raid1", "members": ["d5", "dx"]}],
                         volumes=[{"name": "vol0", "pool": "pool0"}, {"name": "vol1", "pool": "m", "read_only": True}],
                         devs=devices() + [{"name": "dx", "type": "ram", "size": "8MiB"}]))
    with Store.open(tmp_path) as s:
        s.import_config(c)
        assert s.load().config == c
        s.set_pool_runtime_devices("pool0", ["file:/tmp/x.img:8MiB", "dx", "dx"])
        s.import_config(c)  # an import keeps what running pools took in
        state = s.load()
    assert state.pool_devices == {"pool0": ("file:/tmp/x.img:8MiB", "dx")}
    with Store.open(tmp_path) as s:
        s.set_pool_runtime_devices("pool0", [])
        assert s.load().pool_devices == {}


def test_store_refuses_a_volume_on_no_pool(tmp_path: Path) -> None:
    c = parse_config(cfg())
    broken = type(c)(c.node, c.devices, (VolumeSpec("vol0", None, False, pool="nope"),), c.targets, pools=c.pools)
    with Store.open(tmp_path) as s, pytest.raises(StoreError, match=r'volumes\[0\].pool: unknown pool "nope"'):
        s.import_config(broken)


def test_schema_2_database_migrates_with_its_volumes(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute("PRAGMA foreign_keys = ON")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version VALUES (2)")
    db.executescript(_MIGRATIONS[0] + _MIGRATIONS[1])
    db.execute("INSERT INTO node VALUES ('name', 'n1')")
    db.execute("INSERT INTO devices VALUES ('r0', 0, 'ram', 1048576, 512, NULL, NULL, 0)")
    db.execute("INSERT INTO volumes VALUES ('disk0', 0, 'r0', 1)")
    db.execute("INSERT INTO targets VALUES ('iqn.2026-11.org.openvsan:t', 0, NULL, 1, 1)")
    db.execute("INSERT INTO luns VALUES ('iqn.2026-11.org.openvsan:t', 0, 'disk0')")
    db.commit()
    db.close()
    with Store.open(tmp_path) as s:
        state = s.load().config
        assert state.volumes == (VolumeSpec("disk0", "r0", True),)
        assert state.targets[0].luns[0].volume == "disk0"
        s.import_config(parse_config(cfg()))
        assert s.load().config.volumes[0].pool == "pool0"
    old = sqlite3.connect(tmp_path / "state.db.migrated")
    assert old.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,) == (5,)
    assert old.execute("SELECT pool FROM volumes").fetchall() == [(None,)]   # upgraded in place, then kept


def test_example_raid5_config(tmp_path: Path) -> None:
    from openvsan.node.config import load_config, preflight

    example = Path(__file__).resolve().parents[2] / "examples" / "raid5.toml"
    c = load_config(example, data_dir=tmp_path / "data")
    assert c.pools == (PoolSpec("pool0", "raid5", ("d0", "d1", "d2", "d3"), ("d4",), 64 * 1024, 200 << 20),)
    # the members live in the data dir (${data_dir}), never in a directory others may write to such as /tmp
    assert c.device("d0").path == tmp_path / "data" / "raid5-d0.img"
    preflight(c, data_dir=tmp_path / "data")   # the data dir is made by serve: not there yet is fine
    assert c.volume("vol0").pool == "pool0" and c.targets[0].luns[0].volume == "vol0"
