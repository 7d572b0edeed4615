"""The node's Store (node/store.py) over each StateStore: SQLite in the data dir and a real etcd (the `store`
fixture of conftest.py). import_config / load round-trip through either, identities stay put, two clients
of one state see each other's imports, expect_revision catches a writer that got in first, and no secret
reaches the key-value store."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from openvsan.node.config import parse_config
from openvsan.node.store import StateConflict, Store

if TYPE_CHECKING:
    from conftest import StoreMaker

_spaces = itertools.count()


@pytest.fixture
def store(durable_store: StoreMaker) -> StoreMaker:
    """The node's Store runs over a durable StateStore: SQLite or etcd, not the memory one."""
    return durable_store
SECRETS = ("twelve+chars", "DHHC-1:01:5vxYBh5q8aC18ZmEQ1U/rZHUSIsXL0hdWYJ43Cx7n7THwj6G:")


def node_store(maker: StoreMaker, space: str) -> Store:
    if maker.kind == "sqlite":
        return Store.open(maker.tmp / space)
    assert maker.etcd is not None
    return Store.etcd([maker.etcd.endpoint], maker.tmp / space, prefix=f"/node-store-{space}")


def config(volumes: tuple[str, ...] = ("disk0", "disk1")) -> Any:
    return parse_config({
        "node": {"name": "n1"},
        "devices": [{"name": f"r-{v}", "type": "ram", "size": "1MiB"} for v in volumes],
        "volumes": [{"name": v, "device": f"r-{v}", "qos": {"read_iops_limit": 100}} for v in volumes],
        "iscsi": {"targets": [{"iqn": "iqn.2026-11.org.openvsan:t0", "portals": ["127.0.0.1:3260"],
                               "luns": [{"lun": i, "volume": v} for i, v in enumerate(volumes)],
                               "chap": {"user": "alice", "secret": SECRETS[0]}}]},
        "nvme": {"portals": ["127.0.0.1:4420"], "subsystems": [
            {"nqn": "nqn.2026-11.org.openvsan:s0", "namespaces": [{"nsid": 1, "volume": volumes[0]}],
             "allowed_hosts": ["nqn.2014-08.org.nvmexpress:uuid:1"],
             "hosts": [{"nqn": "nqn.2014-08.org.nvmexpress:uuid:1", "dhchap_secret": SECRETS[1]}]}]},
    })


def raw_values(maker: StoreMaker, space: str) -> str:
    """Every key and value the backend holds for this node, as text."""
    async def read() -> str:
        if maker.kind == "sqlite":
            from openvsan.node.statestore import SqliteStateStore

            kv: Any = SqliteStateStore(maker.tmp / space / "state-kv.db")
        else:
            from openvsan.cluster.etcd import EtcdStateStore

            assert maker.etcd is not None
            kv = EtcdStateStore([maker.etcd.endpoint], prefix=f"/node-store-{space}")
        try:
            return json.dumps({e.key: e.value for e in await kv.list("/")})
        finally:
            await kv.close()

    return asyncio.run(read())


def test_round_trip(store: StoreMaker) -> None:
    space = f"s{next(_spaces)}"
    cfg = config()
    with node_store(store, space) as s:
        rev = s.import_config(cfg)
        assert s.load().config == cfg and s.revision() == rev
        first = s.identities()
        s.import_config(config(("disk1",)))
        s.import_config(cfg)
    with node_store(store, space) as s:
        state = s.load()
    assert state.config == cfg and state.identities == first
    text = raw_values(store, space)
    assert '"/volumes/disk0"' in text and '"alice"' in text
    for secret in SECRETS:
        assert secret not in text
    assert SECRETS[0] in (store.tmp / space / "secrets.json").read_text()


def test_two_clients_and_expect_revision(store: StoreMaker) -> None:
    space = f"s{next(_spaces)}"
    with node_store(store, space) as a, node_store(store, space) as b:
        rev = a.import_config(config())
        state = b.load()
        assert state.revision == rev
        assert b.import_config(config(("disk1",)), expect_revision=state.revision) > rev
        with pytest.raises(StateConflict, match=f"changed since revision {rev}"):
            a.import_config(config(("disk0",)), expect_revision=rev)   # planned against what b replaced
        assert [v.name for v in a.load().config.volumes] == ["disk1"]
        a.set_pool_runtime_devices("p0", ["file:/x:1MiB"])
        assert b.pool_runtime_devices("p0") == ("file:/x:1MiB",)


def test_a_forgotten_volume_gets_a_new_identity(store: StoreMaker, tmp_path: Path) -> None:
    space = f"s{next(_spaces)}"
    with node_store(store, space) as s:
        s.import_config(config())
        old = s.identities()["disk0"]
        s.import_config(config(("disk1",)), forget=("disk0",))
        assert "disk0" not in s.identities()
        s.import_config(config())
        assert s.identities()["disk0"] != old
