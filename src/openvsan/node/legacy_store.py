"""The node's desired state as openvsan up to issue 11 kept it: the relational SQLite `state.db` (schemas 1..5).

Read once, to migrate a data dir to the StateStore (node/store.py), never written again but by its own schema
upgrade: that runs in place first, as it always did (so CHAP secrets that schemas 1..3 kept in chap_users are
zeroed by SQLite's secure_delete before the file is kept as `state.db.migrated`). Secrets are not read here:
they are in secrets.json, which the migration leaves where it is; the specs read from here carry "" for them.
A released migration is never edited.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

from openvsan.node.specs import (
    DEFAULT_POLL_US,
    ChapSpec,
    DeviceSpec,
    HostAuthSpec,
    LunSpec,
    NamespaceSpec,
    NbdExportSpec,
    NbdTlsSpec,
    NodeConfig,
    NodeSettings,
    NvmeSpec,
    PoolSpec,
    SubsystemSpec,
    TargetSpec,
    VolumeSpec,
)
from openvsan.node.values import Portal

SCHEMA_VERSION = 5
LEGACY_STATE_DB = "state.db"

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
    # 4: hardening (issue 10). CHAP secrets leave state.db for secrets.json (the config, imported at every
    # start, puts them back); access policy per export; DH-HMAC-CHAP hosts (their secrets in secrets.json);
    # NBD TLS. Node settings beyond poll_us are keys of the node table.
    """
    CREATE TABLE chap_users_new (
        iqn TEXT NOT NULL REFERENCES targets (iqn) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('initiator', 'target')), user TEXT NOT NULL, PRIMARY KEY (iqn, role));
    INSERT INTO chap_users_new (iqn, role, user) SELECT iqn, role, user FROM chap_users;
    DROP TABLE chap_users;
    ALTER TABLE chap_users_new RENAME TO chap_users;
    ALTER TABLE targets ADD COLUMN allow_unauthenticated INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE subsystems ADD COLUMN allow_unauthenticated INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE subsystems ADD COLUMN dhchap_hashes TEXT NOT NULL DEFAULT 'sha256,sha384,sha512';
    ALTER TABLE subsystems ADD COLUMN dhchap_dhgroups TEXT NOT NULL
        DEFAULT 'null,ffdhe2048,ffdhe3072,ffdhe4096,ffdhe6144,ffdhe8192';
    CREATE TABLE dhchap_hosts (
        nqn TEXT NOT NULL REFERENCES subsystems (nqn) ON DELETE CASCADE, position INTEGER NOT NULL,
        host TEXT NOT NULL, bidirectional INTEGER NOT NULL, PRIMARY KEY (nqn, host));
    ALTER TABLE nbd_exports ADD COLUMN tls TEXT NOT NULL DEFAULT 'off' CHECK (tls IN ('off', 'optional', 'require'));
    ALTER TABLE nbd_exports ADD COLUMN allow_unauthenticated INTEGER NOT NULL DEFAULT 0;
    """,
    # 5: the live node (issue 11): a volume's QoS limits (JSON: the volume/qos.py knobs that are set)
    """
    ALTER TABLE volumes ADD COLUMN qos TEXT NOT NULL DEFAULT '{}';
    """,
]

# NodeSettings fields kept as keys of the node table (JSON values), beyond name, data_dir and poll_us
_NODE_KEYS = ("poll_max_us", "max_connections", "max_unauthenticated", "max_unauthenticated_per_source",
              "trust_foreign_files", "auth_delay_max", "auth_lockout_failures", "auth_lockout_seconds")


class LegacyStoreError(RuntimeError):
    """state.db cannot be read (newer schema, not a database, broken references); str() is one line."""


class LegacyStateDb:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.found_version = 0
        try:
            # autocommit mode: transactions are ours to open (BEGIN IMMEDIATE) and close
            self._db = sqlite3.connect(path, isolation_level=None)
            self._db.execute("PRAGMA synchronous = FULL")
            # deleted rows and dropped tables are zeroed, so secrets a migration moved out leave no trace
            self._db.execute("PRAGMA secure_delete = ON")
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise LegacyStoreError(f"{path}: cannot use the state database: {e}") from None

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
                self.found_version = version   # before the upgrade below
                if version > SCHEMA_VERSION:
                    raise LegacyStoreError(f"{self.path}: written by a newer openvsan (schema {version}, this one "
                                           f"knows {SCHEMA_VERSION}); upgrade openvsan or use another --data-dir")
                for script in _MIGRATIONS[version:]:
                    for statement in script.split(";\n"):
                        if statement.strip():
                            db.execute(statement)
                if db.execute("PRAGMA foreign_key_check").fetchone() is not None:
                    raise LegacyStoreError(f"{self.path}: the state database breaks its own references after "
                                           f"migrating from schema {version}; use another --data-dir")
                if not row:
                    db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
                elif version < SCHEMA_VERSION:
                    db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        finally:
            self._db.execute("PRAGMA foreign_keys = ON")

    def schema_version(self) -> int:
        return int(self._db.execute("SELECT version FROM schema_version").fetchone()[0])

    def holds_state(self) -> bool:
        """Whether a config was ever imported (a state.db that was only opened holds none)."""
        return any(self._db.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone()
                   for table in ("node", "devices", "volumes", "targets"))

    def identities(self) -> dict[str, tuple[uuid.UUID, str, str]]:
        """name -> (uuid, serial, created)"""
        return {name: (uuid.UUID(u), serial, created) for name, u, serial, created in self._db.execute(
            "SELECT name, uuid, serial, created FROM volume_identities")}

    def source(self) -> Path | None:
        row = self._db.execute("SELECT value FROM node WHERE key = 'source'").fetchone()
        return Path(row[0]) if row and row[0] else None

    def load(self) -> NodeConfig:
        """The stored config, secrets as "" (a bidirectional DH-HMAC-CHAP host: ctrl secret "" too)."""
        db = self._db
        node = dict(db.execute("SELECT key, value FROM node").fetchall())
        devices = tuple(
            DeviceSpec(name, kind, size, bs, Path(backing) if backing else None, Path(path) if path else None,
                       bool(direct))
            for name, kind, size, bs, backing, path, direct in db.execute(
                "SELECT name, type, size, block_size, backing, path, direct FROM devices ORDER BY position"))
        volumes = tuple(VolumeSpec(name, dev, bool(ro), pool=pool, qos=json.loads(qos))
                        for name, dev, pool, ro, qos in db.execute(
                            "SELECT name, device, pool, read_only, qos FROM volumes ORDER BY position"))
        targets = []
        for iqn, alias, tpgt, any_initiator, open_ in db.execute(
                "SELECT iqn, alias, portal_group_tag, any_initiator, allow_unauthenticated FROM targets "
                "ORDER BY position").fetchall():
            portals: dict[int, list[Portal]] = {0: [], 1: []}
            for adv, host, port in db.execute("SELECT advertised, host, port FROM target_portals WHERE iqn = ? "
                                              "ORDER BY advertised, position", (iqn,)):
                portals[adv].append(Portal(host, port))
            luns = tuple(LunSpec(lun, vol) for lun, vol in db.execute(
                "SELECT lun, volume FROM luns WHERE iqn = ? ORDER BY lun", (iqn,)))
            acl = tuple(n for (n,) in db.execute("SELECT initiator FROM acls WHERE iqn = ? ORDER BY position",
                                                 (iqn,)))
            chap = {role: ChapSpec(user, "")
                    for role, user in db.execute("SELECT role, user FROM chap_users WHERE iqn = ?", (iqn,))}
            targets.append(TargetSpec(iqn, luns, tuple(portals[0]), tuple(portals[1]),
                                      None if any_initiator else acl, chap.get("initiator"), chap.get("target"),
                                      alias, tpgt, bool(open_)))
        extra = {k: json.loads(node[k]) for k in _NODE_KEYS if k in node}
        settings = NodeSettings(node.get("name", ""), Path(node["data_dir"]) if node.get("data_dir") else None,
                                int(node.get("poll_us", DEFAULT_POLL_US)), **extra)
        tls = {k.removeprefix("nbd_tls_"): json.loads(v) for k, v in node.items() if k.startswith("nbd_tls_")}
        nbd_tls = None
        if tls:
            nbd_tls = NbdTlsSpec(Path(tls["cert"]), Path(tls["key"]), Path(tls["ca"]) if tls.get("ca") else None,
                                 bool(tls.get("verify_client")))
        return NodeConfig(settings, devices, volumes, tuple(targets),
                         source=Path(node["source"]) if node.get("source") else None,
                         nvme=self._load_nvme() if node.get("nvme") else None, nbd_exports=self._load_nbd(),
                         pools=self._load_pools(), nbd_tls=nbd_tls)

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

    def pool_runtime_devices(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {}
        for pool, ref in self._db.execute("SELECT pool, ref FROM pool_runtime_devices ORDER BY pool, position"):
            out.setdefault(pool, []).append(ref)
        return {k: tuple(v) for k, v in out.items()}

    def _load_nvme(self) -> NvmeSpec:
        db = self._db
        portals = tuple(Portal(h, p) for h, p in db.execute("SELECT host, port FROM nvme_portals ORDER BY position"))
        subsystems = []
        for nqn, serial, model, any_host, open_, hashes, groups in db.execute(
                "SELECT nqn, serial, model, any_host, allow_unauthenticated, dhchap_hashes, dhchap_dhgroups "
                "FROM subsystems ORDER BY position").fetchall():
            sp: dict[int, list[Portal]] = {0: [], 1: []}
            for adv, host, port in db.execute("SELECT advertised, host, port FROM subsystem_portals WHERE nqn = ? "
                                              "ORDER BY advertised, position", (nqn,)):
                sp[adv].append(Portal(host, port))
            namespaces = tuple(NamespaceSpec(nsid, vol) for nsid, vol in db.execute(
                "SELECT nsid, volume FROM namespaces WHERE nqn = ? ORDER BY nsid", (nqn,)))
            hosts = tuple(h for (h,) in db.execute("SELECT host FROM host_acls WHERE nqn = ? ORDER BY position",
                                                   (nqn,)))
            auth = tuple(
                HostAuthSpec(host, "", "" if bidirectional else None)
                for host, bidirectional in db.execute(
                    "SELECT host, bidirectional FROM dhchap_hosts WHERE nqn = ? ORDER BY position", (nqn,)))
            subsystems.append(SubsystemSpec(nqn, namespaces, tuple(sp[0]), tuple(sp[1]),
                                            None if any_host else hosts, serial, model, auth,
                                            tuple(hashes.split(",")) if hashes else (),
                                            tuple(groups.split(",")) if groups else (), bool(open_)))
        return NvmeSpec(portals, tuple(subsystems))

    def _load_nbd(self) -> tuple[NbdExportSpec, ...]:
        db = self._db
        out = []
        for name, volume, ro, description, tls, open_ in db.execute(
                "SELECT name, volume, read_only, description, tls, allow_unauthenticated FROM nbd_exports "
                "ORDER BY position").fetchall():
            portals = tuple(Portal(h, p) for h, p in db.execute(
                "SELECT host, port FROM nbd_portals WHERE name = ? ORDER BY position", (name,)))
            out.append(NbdExportSpec(name, volume, portals, bool(ro), description, tls, bool(open_)))
        return tuple(out)


