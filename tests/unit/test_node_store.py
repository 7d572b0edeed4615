"""The SQLite store: desired state round trip, stable identities, transactions, schema versions."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from openvsan.node.config import parse_config
from openvsan.node.store import SCHEMA_VERSION, Store, StoreError


def config(volumes: tuple[str, ...] = ("disk0", "disk1"), poll_us: int = 50, **target: object):
    t = {"iqn": "iqn.2026-11.org.openvsan:t0",
         "luns": [{"lun": i, "volume": v} for i, v in enumerate(volumes)], **target}
    return parse_config({
        "node": {"name": "n1", "poll_us": poll_us},
        "devices": [{"name": f"dev-{v}", "type": "ram", "size": "1MiB"} for v in volumes]
        + [{"name": "f0", "type": "file", "path": "/tmp/x.img", "size": "4MiB", "direct": True, "block_size": 4096}],
        "volumes": [{"name": v, "device": f"dev-{v}", "read_only": v.endswith("1")} for v in volumes],
        "iscsi": {"portals": ["127.0.0.1:3260", "[::1]:3260"], "targets": [t]},
    })


def test_round_trip(tmp_path: Path) -> None:
    cfg = config(allowed_initiators=["iqn.1993-08.org.debian:01:b", "iqn.1993-08.org.debian:01:a"],
                 chap={"user": "alice", "secret": "twelve+chars"},
                 mutual_chap={"user": "tgt", "secret": "another+secret"},
                 advertised_portals=["192.0.2.1:3260"], alias="zero", portal_group_tag=7)
    with Store.open(tmp_path / "data") as s:
        s.import_config(cfg)
        assert s.load().config == cfg
        assert s.schema_version() == SCHEMA_VERSION
    # and from a fresh process's point of view
    with Store.open(tmp_path / "data") as s:
        state = s.load()
    assert state.config == cfg
    assert set(state.identities) == {"disk0", "disk1"}
    db = tmp_path / "data" / "state.db"
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700


def test_poll_window_round_trip(tmp_path: Path) -> None:
    with Store.open(tmp_path / "data") as s:
        for window in (0, 7, 50):
            s.import_config(config(poll_us=window))
            assert s.load().config.node.poll_us == window


def test_no_acl_differs_from_empty_acl(tmp_path: Path) -> None:
    with Store.open(tmp_path) as s:
        s.import_config(config())
        assert s.load().config.targets[0].allowed_initiators is None
        s.import_config(config(allowed_initiators=[]))
        assert s.load().config.targets[0].allowed_initiators == ()


def test_identities_stable_and_kept_by_name(tmp_path: Path) -> None:
    with Store.open(tmp_path) as s:
        s.import_config(config(("disk0", "disk1")))
        first = s.identities()
    assert first["disk0"].uuid != first["disk1"].uuid
    assert first["disk0"].serial == first["disk0"].uuid.hex and first["disk0"].serial.isascii()
    with Store.open(tmp_path) as s:
        s.import_config(config(("disk1",)))  # disk0 leaves the config ...
        assert s.load().config.volumes[0].name == "disk1"
        s.import_config(config(("disk0", "disk1", "disk2")))  # ... and comes back
        again = s.identities()
    assert again["disk0"] == first["disk0"] and again["disk1"] == first["disk1"]
    assert again["disk2"] not in first.values()


def test_config_wins_over_stored_state(tmp_path: Path) -> None:
    with Store.open(tmp_path) as s:
        s.import_config(config(("a", "b", "c"), chap={"user": "u", "secret": "twelve+chars"}))
        s.import_config(config(("a",)))
        state = s.load().config
    assert [v.name for v in state.volumes] == ["a"]
    assert state.targets[0].chap is None
    assert [x.lun for x in state.targets[0].luns] == [0]


def test_failed_import_changes_nothing(tmp_path: Path) -> None:
    with Store.open(tmp_path) as s:
        s.import_config(config(("a",)))
        before = s.load()
        bad = config(("a", "b"))
        # a config that breaks a constraint half way: b's LUN names a volume the store does not get
        broken = type(bad)(bad.node, bad.devices, bad.volumes[:1], bad.targets)
        with pytest.raises(sqlite3.IntegrityError):
            s.import_config(broken)
        assert s.load() == before


def test_newer_schema_refused(tmp_path: Path) -> None:
    with Store.open(tmp_path):
        pass
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute("UPDATE schema_version SET version = 99")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer openvsan"):
        Store.open(tmp_path)


def test_not_a_database(tmp_path: Path) -> None:
    (tmp_path / "state.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="cannot use the state database"):
        Store.open(tmp_path)


def test_nvme_and_nbd_round_trip(tmp_path: Path) -> None:
    cfg = parse_config({
        "devices": [{"name": "r0", "type": "ram", "size": "1MiB"}, {"name": "r1", "type": "ram", "size": "1MiB"}],
        "volumes": [{"name": "disk0", "device": "r0"}, {"name": "disk1", "device": "r1", "read_only": True}],
        "nvme": {"portals": ["127.0.0.1:4420", "[::1]:4420"], "subsystems": [
            {"nqn": "nqn.2026-11.org.openvsan:a", "namespaces": [{"nsid": 1, "volume": "disk0"},
                                                                 {"nsid": 7, "volume": "disk1"}],
             "allowed_hosts": ["nqn.2014-08.org.nvmexpress:uuid:0c9a1d3e-1234-4567-89ab-0123456789ab"],
             "advertised_portals": ["192.0.2.1:4420"], "serial": "S1", "model": "m"},
            {"nqn": "nqn.2026-11.org.openvsan:b", "namespaces": [{"nsid": 1, "volume": "disk0"}],
             "portals": ["127.0.0.1:4421"], "allowed_hosts": []}]},
        "nbd": {"portals": ["127.0.0.1:10809"], "exports": [
            {"name": "disk0", "volume": "disk0", "description": "zero"},
            {"name": "disk1-ro", "volume": "disk1", "read_only": True, "portals": ["127.0.0.1:10810"]}]},
    })
    with Store.open(tmp_path) as s:
        s.import_config(cfg)
        assert s.load().config == cfg
        # an [nvme] section with nothing in it is kept apart from no section at all
        s.import_config(parse_config({"nvme": {"portals": ["127.0.0.1:4420"]}}))
        state = s.load().config
        assert state.nvme is not None and state.nvme.subsystems == () and state.nbd_exports == ()
        s.import_config(parse_config({}))
        assert s.load().config.nvme is None


def test_version_1_database_is_migrated(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version VALUES (1)")
    from openvsan.node.store import _MIGRATIONS
    db.executescript(_MIGRATIONS[0])
    db.commit()
    db.close()
    with Store(tmp_path / "state.db") as s:
        assert s.schema_version() == SCHEMA_VERSION == 5
        s.import_config(config())
        assert s.load().config.nbd_exports == ()


def hardened(cfg):
    """`cfg` with every issue-10 field away from its default (built directly: each field has parse tests)."""
    import dataclasses as dc

    from openvsan.node.config import HostAuthSpec, NbdExportSpec, NbdTlsSpec, NvmeSpec, SubsystemSpec
    from openvsan.node.values import Portal

    node = dc.replace(cfg.node, max_connections=100, max_unauthenticated=10, max_unauthenticated_per_source=3,
                      trust_foreign_files=True, auth_delay_max=2.5, auth_lockout_failures=4,
                      auth_lockout_seconds=60)
    hosts = (HostAuthSpec("nqn.2014-08.org.nvmexpress:uuid:1", "DHHC-1:00:aaaa:", "DHHC-1:00:bbbb:"),
             HostAuthSpec("nqn.2014-08.org.nvmexpress:uuid:2", "DHHC-1:01:cccc:"))
    sub = SubsystemSpec("nqn.2026-11.org.openvsan:s0", (), (Portal("127.0.0.1", 4420),), allowed_hosts=(),
                        hosts=hosts, dhchap_hashes=("sha512",), dhchap_dhgroups=("ffdhe4096", "null"),
                        allow_unauthenticated=True)
    nbd = NbdExportSpec("e0", "disk0", (Portal("127.0.0.1", 10809),), tls="require", allow_unauthenticated=True)
    targets = tuple(dc.replace(t, allow_unauthenticated=True) for t in cfg.targets)
    return dc.replace(cfg, node=node, targets=targets, nvme=NvmeSpec((Portal("127.0.0.1", 4420),), (sub,)),
                      nbd_exports=(nbd,), nbd_tls=NbdTlsSpec(Path("/etc/x/cert.pem"), Path("/etc/x/key.pem"),
                                                             Path("/etc/x/ca.pem"), True))


def test_hardening_fields_round_trip(tmp_path: Path) -> None:
    cfg = hardened(config(chap={"user": "alice", "secret": "twelve+chars"},
                          mutual_chap={"user": "tgt", "secret": "another+secret"}))
    with Store.open(tmp_path / "data") as s:
        s.import_config(cfg)
    with Store.open(tmp_path / "data") as s:
        assert s.load().config == cfg


def test_secrets_live_apart_from_the_state(tmp_path: Path) -> None:
    cfg = hardened(config(chap={"user": "alice", "secret": "twelve+chars"},
                          mutual_chap={"user": "tgt", "secret": "another+secret"}))
    with Store.open(tmp_path / "data") as s:
        s.import_config(cfg)
    dump = "\n".join(sqlite3.connect(tmp_path / "data" / "state.db").iterdump())
    for secret in ("twelve+chars", "another+secret", "DHHC-1:00:aaaa:", "DHHC-1:00:bbbb:", "DHHC-1:01:cccc:"):
        assert secret not in dump
    assert "alice" in dump  # the user name is state, not a secret
    secrets = tmp_path / "data" / "secrets.json"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    text = secrets.read_text()
    assert "twelve+chars" in text and "DHHC-1:00:bbbb:" in text
    # a secrets file others can read is refused, not used
    secrets.chmod(0o644)
    with Store.open(tmp_path / "data") as s, pytest.raises(StoreError, match="readable by others"):
        s.load()
    # one that lost a secret names what is missing
    secrets.write_text('{"version": 1, "chap": {}}')
    secrets.chmod(0o600)
    with Store.open(tmp_path / "data") as s, pytest.raises(StoreError, match="CHAP secret of iqn.2026-11.org.openvsan:t0"):
        s.load()
    # an import writes it again
    with Store.open(tmp_path / "data") as s:
        s.import_config(cfg)
        assert s.load().config == cfg


def test_version_3_database_loses_its_secrets_but_keeps_its_users(tmp_path: Path) -> None:
    from openvsan.node.store import _MIGRATIONS
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version VALUES (3)")
    for script in _MIGRATIONS[:3]:
        db.executescript(script)
    db.execute("INSERT INTO targets VALUES ('iqn.2026-11.org.openvsan:t0', 0, NULL, 1, 1)")
    db.execute("INSERT INTO chap_users VALUES ('iqn.2026-11.org.openvsan:t0', 'initiator', 'alice', 'twelve+chars')")
    db.commit()
    db.close()
    with Store(tmp_path / "state.db") as s:
        assert s.schema_version() == 5
    dump = "\n".join(sqlite3.connect(tmp_path / "state.db").iterdump())
    assert "twelve+chars" not in dump and "alice" in dump
    assert b"twelve+chars" not in (tmp_path / "state.db").read_bytes()   # nor in the file's free pages
