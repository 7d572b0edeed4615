"""The node's desired state in SQLite (`<data_dir>/state.db`), and each volume's stable identity.

`vsan serve` imports a validated config here in one transaction (the config file wins over what was
stored), then assembles the node from what the store holds. A volume's uuid and serial are made once, the
first time its name is seen, and kept for good: SCSI NAA/T10 ids are derived from them, and an initiator
that sees a new id thinks it is looking at a new disk.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

from openvsan.node.config import (
    DEFAULT_POLL_US,
    ChapSpec,
    DeviceSpec,
    LunSpec,
    NamespaceSpec,
    NbdExportSpec,
    NodeConfig,
    NodeSettings,
    NvmeSpec,
    PoolSpec,
    SubsystemSpec,
    TargetSpec,
    VolumeSpec,
)
from openvsan.node.values import Portal

SCHEMA_VERSION = 3
STATE_DB = "state.db"

# Each entry moves the schema from version i to i+1; a released migration is never edited.
_MIGRATIONS: list[str] = [
    """
    CREATE TABLE node (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE devices (
        name TEXT PRIMARY KEY, position INTEGER NOT NULL, type TEXT NOT NULL CHECK (type IN ('ram', 'file', 'null')),
        size INTEGER, block_size INTEGER NOT NULL, backing TEXT, path TEXT, direct INTEGER NOT NULL DEFAULT 0);
    CREATE TABLE volumes (
        name TEXT PRIMARY KEY, position INTEGER NOT NULL,
        device TEXT NOT NULL UNIQUE REFERENCES devices (name), read_only INTEGER NOT NULL DEFAULT 0);
    -- never deleted by an import: a name keeps its identity even while it is out of the config
    CREATE TABLE volume_identities (
        name TEXT PRIMARY KEY, uuid TEXT NOT NULL UNIQUE, serial TEXT NOT NULL UNIQUE, created TEXT NOT NULL);
    CREATE TABLE targets (
        iqn TEXT PRIMARY KEY, position INTEGER NOT NULL, alias TEXT, portal_group_tag INTEGER NOT NULL,
        any_initiator INTEGER NOT NULL);
    CREATE TABLE target_portals (
        iqn TEXT NOT NULL REFERENCES targets (iqn) ON DELETE CASCADE, advertised INTEGER NOT NULL,
        position INTEGER NOT NULL, host TEXT NOT NULL, port INTEGER NOT NULL,
        PRIMARY KEY (iqn, advertised, host, port));
    CREATE TABLE luns (
        iqn TEXT NOT NULL REFERENCES targets (iqn) ON DELETE CASCADE, lun INTEGER NOT NULL,
        volume TEXT NOT NULL REFERENCES volumes (name), PRIMARY KEY (iqn, lun));
    CREATE TABLE acls (
        iqn TEXT NOT NULL REFERENCES targets (iqn) ON DELETE CASCADE, position INTEGER NOT NULL,
        initiator TEXT NOT NULL, PRIMARY KEY (iqn, initiator));
    -- role 'initiator': the secret the initiator proves (CHAP), 'target': the one we prove back (mutual)
    CREATE TABLE chap_users (
        iqn TEXT NOT NULL REFERENCES targets (iqn) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('initiator', 'target')), user TEXT NOT NULL, secret TEXT NOT NULL,
        PRIMARY KEY (iqn, role));
    """,
    # 2: NVMe/TCP subsystems and NBD exports
    """
    CREATE TABLE nvme_portals (position INTEGER NOT NULL, host TEXT NOT NULL, port INTEGER NOT NULL,
        PRIMARY KEY (host, port));
    CREATE TABLE subsystems (
        nqn TEXT PRIMARY KEY, position INTEGER NOT NULL, serial TEXT NOT NULL, model TEXT NOT NULL,
        any_host INTEGER NOT NULL);
    CREATE TABLE subsystem_portals (
        nqn TEXT NOT NULL REFERENCES subsystems (nqn) ON DELETE CASCADE, advertised INTEGER NOT NULL,
        position INTEGER NOT NULL, host TEXT NOT NULL, port INTEGER NOT NULL,
        PRIMARY KEY (nqn, advertised, host, port));
    CREATE TABLE namespaces (
        nqn TEXT NOT NULL REFERENCES subsystems (nqn) ON DELETE CASCADE, nsid INTEGER NOT NULL,
        volume TEXT NOT NULL REFERENCES volumes (name), PRIMARY KEY (nqn, nsid));
    CREATE TABLE host_acls (
        nqn TEXT NOT NULL REFERENCES subsystems (nqn) ON DELETE CASCADE, position INTEGER NOT NULL,
        host TEXT NOT NULL, PRIMARY KEY (nqn, host));
    CREATE TABLE nbd_exports (
        name TEXT PRIMARY KEY, position INTEGER NOT NULL, volume TEXT NOT NULL REFERENCES volumes (name),
        read_only INTEGER NOT NULL, description TEXT NOT NULL);
    CREATE TABLE nbd_portals (
        name TEXT NOT NULL REFERENCES nbd_exports (name) ON DELETE CASCADE, position INTEGER NOT NULL,
        host TEXT NOT NULL, port INTEGER NOT NULL, PRIMARY KEY (name, host, port));
    """,
    # 3: pools, and volumes that live on a pool instead of a device. The volumes table is rebuilt (SQLite's
    # "making other kinds of table schema changes" procedure; _migrate turns foreign keys off around it).
    """
    CREATE TABLE pools (
        name TEXT PRIMARY KEY, position INTEGER NOT NULL,
        level TEXT NOT NULL CHECK (level IN ('raid0', 'raid1', 'raid10', 'raid5', 'raid6')),
        chunk INTEGER NOT NULL, rebuild_rate INTEGER);
    CREATE TABLE pool_members (
        pool TEXT NOT NULL REFERENCES pools (name) ON DELETE CASCADE, spare INTEGER NOT NULL,
        position INTEGER NOT NULL, device TEXT NOT NULL UNIQUE REFERENCES devices (name),
        PRIMARY KEY (pool, spare, position));
    -- devices a running pool took in by `vsan pool replace` or `add-spare`: a config device's name or
    -- file:PATH:SIZE. Not from the config, so an import keeps them (like volume_identities).
    CREATE TABLE pool_runtime_devices (
        pool TEXT NOT NULL, position INTEGER NOT NULL, ref TEXT NOT NULL, PRIMARY KEY (pool, ref));
    CREATE TABLE volumes_new (
        name TEXT PRIMARY KEY, position INTEGER NOT NULL,
        device TEXT UNIQUE REFERENCES devices (name), pool TEXT UNIQUE REFERENCES pools (name),
        read_only INTEGER NOT NULL DEFAULT 0, CHECK ((device IS NULL) <> (pool IS NULL)));
    INSERT INTO volumes_new (name, position, device, pool, read_only)
        SELECT name, position, device, NULL, read_only FROM volumes;
    DROP TABLE volumes;
    ALTER TABLE volumes_new RENAME TO volumes;
    """,
]


class StoreError(RuntimeError):
    """The state database cannot be used (newer schema, unreadable, corrupt)."""


@dataclass(frozen=True)
class VolumeIdentity:
    uuid: uuid.UUID
    serial: str  # VPD page 0x80 unit serial number


@dataclass(frozen=True)
class StoredState:
    config: NodeConfig
    identities: dict[str, VolumeIdentity]
    # pool name -> devices its members and spares include beyond the config's (Store.set_pool_runtime_devices)
    pool_devices: dict[str, tuple[str, ...]] = field(default_factory=dict)


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        fresh = not path.exists()
        try:
            # autocommit mode: transactions are ours to open (BEGIN IMMEDIATE) and close
            self._db = sqlite3.connect(path, isolation_level=None)
            if fresh:
                os.chmod(path, 0o600)  # CHAP secrets live here
            self._db.execute("PRAGMA synchronous = FULL")
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{path}: cannot use the state database: {e}") from None

    @classmethod
    def open(cls, data_dir: Path) -> Store:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return cls(data_dir / STATE_DB)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _migrate(self) -> None:
        # a migration may rebuild a table others reference (3: volumes), which SQLite only allows with foreign
        # keys off; they are checked before the migration commits, and on again after
        self._db.execute("PRAGMA foreign_keys = OFF")
        try:
            with self._transaction() as db:
                db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                row = db.execute("SELECT version FROM schema_version").fetchone()
                version = row[0] if row else 0
                if version > SCHEMA_VERSION:
                    raise StoreError(f"{self.path}: written by a newer openvsan (schema {version}, this one knows "
                                     f"{SCHEMA_VERSION}); upgrade openvsan or use another --data-dir")
                for script in _MIGRATIONS[version:]:
                    for statement in script.split(";\n"):
                        if statement.strip():
                            db.execute(statement)
                if db.execute("PRAGMA foreign_key_check").fetchone() is not None:
                    raise StoreError(f"{self.path}: the state database breaks its own references after migrating "
                                     f"from schema {version}; use another --data-dir")
                if not row:
                    db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
                elif version < SCHEMA_VERSION:
                    db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        finally:
            self._db.execute("PRAGMA foreign_keys = ON")

    def schema_version(self) -> int:
        return int(self._db.execute("SELECT version FROM schema_version").fetchone()[0])

    # --- writing --------------------------------------------------------------------------------

    def import_config(self, cfg: NodeConfig) -> None:
        """Make `cfg` the desired state, all or nothing. Identities of known volume names are kept."""
        with self._transaction() as db:
            for table in ("nbd_portals", "nbd_exports", "host_acls", "namespaces", "subsystem_portals", "subsystems",
                          "nvme_portals", "chap_users", "acls", "luns", "target_portals", "targets", "volumes",
                          "pool_members", "pools", "devices", "node"):
                db.execute(f"DELETE FROM {table}")
            db.executemany("INSERT INTO node VALUES (?, ?)", [
                ("name", cfg.node.name),
                ("data_dir", str(cfg.node.data_dir) if cfg.node.data_dir else ""),
                ("source", str(cfg.source) if cfg.source else ""),
                ("imported", datetime.now(UTC).isoformat(timespec="seconds")),
                ("nvme", "1" if cfg.nvme is not None else ""),
                ("poll_us", str(cfg.node.poll_us)),
            ])
            db.executemany("INSERT INTO devices VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [
                (d.name, i, d.type, d.size, d.block_size, _str(d.backing), _str(d.path), int(d.direct))
                for i, d in enumerate(cfg.devices)])
            db.executemany("INSERT INTO pools VALUES (?, ?, ?, ?, ?)", [
                (p.name, i, p.level, p.chunk, p.rebuild_rate) for i, p in enumerate(cfg.pools)])
            db.executemany("INSERT INTO pool_members VALUES (?, ?, ?, ?)", [
                (p.name, spare, j, d) for p in cfg.pools
                for spare, names in ((0, p.members), (1, p.spares)) for j, d in enumerate(names)])
            db.executemany("INSERT INTO volumes (name, position, device, pool, read_only) VALUES (?, ?, ?, ?, ?)", [
                (v.name, i, v.device, v.pool, int(v.read_only)) for i, v in enumerate(cfg.volumes)])
            for v in cfg.volumes:
                self._ensure_identity(db, v.name)
            for i, t in enumerate(cfg.targets):
                db.execute("INSERT INTO targets VALUES (?, ?, ?, ?, ?)",
                           (t.iqn, i, t.alias, t.portal_group_tag, int(t.allowed_initiators is None)))
                db.executemany("INSERT INTO target_portals VALUES (?, ?, ?, ?, ?)",
                               [(t.iqn, 0, j, p.host, p.port) for j, p in enumerate(t.portals)]
                               + [(t.iqn, 1, j, p.host, p.port) for j, p in enumerate(t.advertised_portals)])
                db.executemany("INSERT INTO luns VALUES (?, ?, ?)", [(t.iqn, x.lun, x.volume) for x in t.luns])
                db.executemany("INSERT INTO acls VALUES (?, ?, ?)",
                               [(t.iqn, j, n) for j, n in enumerate(t.allowed_initiators or ())])
                for role, chap in (("initiator", t.chap), ("target", t.mutual_chap)):
                    if chap:
                        db.execute("INSERT INTO chap_users VALUES (?, ?, ?, ?)", (t.iqn, role, chap.user, chap.secret))
            if cfg.nvme is not None:
                db.executemany("INSERT INTO nvme_portals VALUES (?, ?, ?)",
                               [(j, p.host, p.port) for j, p in enumerate(cfg.nvme.portals)])
            for i, sub in enumerate(cfg.subsystems):
                db.execute("INSERT INTO subsystems VALUES (?, ?, ?, ?, ?)",
                           (sub.nqn, i, sub.serial, sub.model, int(sub.allowed_hosts is None)))
                db.executemany("INSERT INTO subsystem_portals VALUES (?, ?, ?, ?, ?)",
                               [(sub.nqn, 0, j, p.host, p.port) for j, p in enumerate(sub.portals)]
                               + [(sub.nqn, 1, j, p.host, p.port) for j, p in enumerate(sub.advertised_portals)])
                db.executemany("INSERT INTO namespaces VALUES (?, ?, ?)",
                               [(sub.nqn, n.nsid, n.volume) for n in sub.namespaces])
                db.executemany("INSERT INTO host_acls VALUES (?, ?, ?)",
                               [(sub.nqn, j, h) for j, h in enumerate(sub.allowed_hosts or ())])
            for i, e in enumerate(cfg.nbd_exports):
                db.execute("INSERT INTO nbd_exports VALUES (?, ?, ?, ?, ?)",
                           (e.name, i, e.volume, int(e.read_only), e.description))
                db.executemany("INSERT INTO nbd_portals VALUES (?, ?, ?, ?)",
                               [(e.name, j, p.host, p.port) for j, p in enumerate(e.portals)])

    @staticmethod
    def _ensure_identity(db: sqlite3.Connection, name: str) -> None:
        if db.execute("SELECT 1 FROM volume_identities WHERE name = ?", (name,)).fetchone():
            return
        u = uuid.uuid4()
        # the serial is the uuid's hex: unique, ASCII (SPC-4 7.8.16), and short enough for every initiator
        db.execute("INSERT INTO volume_identities VALUES (?, ?, ?, ?)",
                   (name, str(u), u.hex, datetime.now(UTC).isoformat(timespec="seconds")))

    # --- reading --------------------------------------------------------------------------------

    def identities(self) -> dict[str, VolumeIdentity]:
        return {name: VolumeIdentity(uuid.UUID(u), serial)
                for name, u, serial in self._db.execute("SELECT name, uuid, serial FROM volume_identities")}

    def load(self) -> StoredState:
        db = self._db
        node = dict(db.execute("SELECT key, value FROM node").fetchall())
        devices = tuple(
            DeviceSpec(name, kind, size, bs, Path(backing) if backing else None, Path(path) if path else None,
                       bool(direct))
            for name, kind, size, bs, backing, path, direct in db.execute(
                "SELECT name, type, size, block_size, backing, path, direct FROM devices ORDER BY position"))
        volumes = tuple(VolumeSpec(name, dev, bool(ro), pool=pool) for name, dev, pool, ro in db.execute(
            "SELECT name, device, pool, read_only FROM volumes ORDER BY position"))
        targets = []
        for iqn, alias, tpgt, any_initiator in db.execute(
                "SELECT iqn, alias, portal_group_tag, any_initiator FROM targets ORDER BY position").fetchall():
            portals: dict[int, list[Portal]] = {0: [], 1: []}
            for adv, host, port in db.execute("SELECT advertised, host, port FROM target_portals WHERE iqn = ? "
                                              "ORDER BY advertised, position", (iqn,)):
                portals[adv].append(Portal(host, port))
            luns = tuple(LunSpec(lun, vol) for lun, vol in db.execute(
                "SELECT lun, volume FROM luns WHERE iqn = ? ORDER BY lun", (iqn,)))
            acl = tuple(n for (n,) in db.execute("SELECT initiator FROM acls WHERE iqn = ? ORDER BY position",
                                                 (iqn,)))
            chap = {role: ChapSpec(user, secret) for role, user, secret in db.execute(
                "SELECT role, user, secret FROM chap_users WHERE iqn = ?", (iqn,))}
            targets.append(TargetSpec(iqn, luns, tuple(portals[0]), tuple(portals[1]),
                                      None if any_initiator else acl, chap.get("initiator"), chap.get("target"),
                                      alias, tpgt))
        settings = NodeSettings(node.get("name", ""), Path(node["data_dir"]) if node.get("data_dir") else None,
                                int(node.get("poll_us", DEFAULT_POLL_US)))
        cfg = NodeConfig(settings, devices, volumes, tuple(targets),
                         source=Path(node["source"]) if node.get("source") else None,
                         nvme=self._load_nvme() if node.get("nvme") else None, nbd_exports=self._load_nbd(),
                         pools=self._load_pools())
        runtime = {p.name: self.pool_runtime_devices(p.name) for p in cfg.pools}
        return StoredState(cfg, self.identities(), {k: v for k, v in runtime.items() if v})

    def _load_pools(self) -> tuple[PoolSpec, ...]:
        db = self._db
        out = []
        for name, level, chunk, rate in db.execute(
                "SELECT name, level, chunk, rebuild_rate FROM pools ORDER BY position").fetchall():
            devs: dict[int, list[str]] = {0: [], 1: []}
            for spare, device in db.execute("SELECT spare, device FROM pool_members WHERE pool = ? "
                                            "ORDER BY spare, position", (name,)):
                devs[spare].append(device)
            out.append(PoolSpec(name, level, tuple(devs[0]), tuple(devs[1]), chunk, rate))
        return tuple(out)

    # --- what running pools took in (not desired state: kept across imports) -----------------------

    def pool_runtime_devices(self, pool: str) -> tuple[str, ...]:
        return tuple(r for (r,) in self._db.execute(
            "SELECT ref FROM pool_runtime_devices WHERE pool = ? ORDER BY position", (pool,)))

    def set_pool_runtime_devices(self, pool: str, refs: tuple[str, ...] | list[str]) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM pool_runtime_devices WHERE pool = ?", (pool,))
            db.executemany("INSERT INTO pool_runtime_devices VALUES (?, ?, ?)",
                           [(pool, i, r) for i, r in enumerate(dict.fromkeys(refs))])

    def _load_nvme(self) -> NvmeSpec:
        db = self._db
        portals = tuple(Portal(h, p) for h, p in db.execute("SELECT host, port FROM nvme_portals ORDER BY position"))
        subsystems = []
        for nqn, serial, model, any_host in db.execute(
                "SELECT nqn, serial, model, any_host FROM subsystems ORDER BY position").fetchall():
            sp: dict[int, list[Portal]] = {0: [], 1: []}
            for adv, host, port in db.execute("SELECT advertised, host, port FROM subsystem_portals WHERE nqn = ? "
                                              "ORDER BY advertised, position", (nqn,)):
                sp[adv].append(Portal(host, port))
            namespaces = tuple(NamespaceSpec(nsid, vol) for nsid, vol in db.execute(
                "SELECT nsid, volume FROM namespaces WHERE nqn = ? ORDER BY nsid", (nqn,)))
            hosts = tuple(h for (h,) in db.execute("SELECT host FROM host_acls WHERE nqn = ? ORDER BY position",
                                                   (nqn,)))
            subsystems.append(SubsystemSpec(nqn, namespaces, tuple(sp[0]), tuple(sp[1]),
                                            None if any_host else hosts, serial, model))
        return NvmeSpec(portals, tuple(subsystems))

    def _load_nbd(self) -> tuple[NbdExportSpec, ...]:
        db = self._db
        out = []
        for name, volume, ro, description in db.execute(
                "SELECT name, volume, read_only, description FROM nbd_exports ORDER BY position").fetchall():
            portals = tuple(Portal(h, p) for h, p in db.execute(
                "SELECT host, port FROM nbd_portals WHERE name = ? ORDER BY position", (name,)))
            out.append(NbdExportSpec(name, volume, portals, bool(ro), description))
        return tuple(out)


def _str(p: Path | None) -> str | None:
    return str(p) if p is not None else None
