"""The node's desired state in SQLite (`<data_dir>/state.db`), and each volume's stable identity.

`vsan serve` imports a validated config here in one transaction (the config file wins over what was
stored), then assembles the node from what the store holds. A volume's uuid and serial are made once, the
first time its name is seen, and kept for good: SCSI NAA/T10 ids are derived from them, and an initiator
that sees a new id thinks it is looking at a new disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

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
STATE_DB = "state.db"
SECRETS = "secrets.json"   # beside state.db, mode 0600: every secret, so a dump of the state carries none

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
_NODE_KEYS = ("max_connections", "max_unauthenticated", "max_unauthenticated_per_source", "trust_foreign_files",
              "auth_delay_max", "auth_lockout_failures", "auth_lockout_seconds")


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
            # deleted rows and dropped tables are zeroed, so secrets a migration moved out leave no trace
            self._db.execute("PRAGMA secure_delete = ON")
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

    # --- secrets (secrets.json beside state.db) ---------------------------------------------------

    @property
    def secrets_path(self) -> Path:
        return self.path.with_name(SECRETS)

    def _write_secrets(self, cfg: NodeConfig) -> None:
        """Replace secrets.json with the config's secrets: a new 0600 file, synced, renamed over the old one."""
        doc = {
            "version": 1,
            "chap": {t.iqn: {role: c.secret for role, c in (("initiator", t.chap), ("target", t.mutual_chap)) if c}
                     for t in cfg.targets if t.chap or t.mutual_chap},
            "dhchap": {sub.nqn: {h.nqn: {"secret": h.dhchap_secret, "ctrl_secret": h.dhchap_ctrl_secret}
                                 for h in sub.hosts} for sub in cfg.subsystems if sub.hosts},
        }
        tmp = self.path.with_name(f".{SECRETS}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(doc, indent=1, sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.secrets_path)
        dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _read_secrets(self) -> dict[str, Any]:
        try:
            fd = os.open(self.secrets_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise StoreError(f"{self.secrets_path}: cannot read the secrets file: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_mode & 0o077 or st.st_uid != os.geteuid():
                raise StoreError(f"{self.secrets_path}: readable by others or not owned by this user; "
                                 f"chmod 600 {self.secrets_path} (or start from the config again)")
            try:
                doc = json.loads(f.read())
            except ValueError as e:
                raise StoreError(f"{self.secrets_path}: not a secrets file ({e}); serve with --config to "
                                 "write it again") from None
        return doc if isinstance(doc, dict) else {}

    def import_config(self, cfg: NodeConfig, *, identities: dict[str, VolumeIdentity] | None = None,
                      forget: tuple[str, ...] = ()) -> None:
        """Make `cfg` the desired state, all or nothing. Identities of known volume names are kept; a new
        volume takes the one in `identities` if given (the live node made it when it created the volume),
        else a new one; the names in `forget` lose theirs (volumes deleted: a volume made later under the
        same name is another disk, which an initiator must not take for this one). Secrets go to
        secrets.json first: a failure after that leaves the old state with secrets it may no longer use,
        never state that names a secret nobody wrote."""
        self._write_secrets(cfg)
        with self._transaction() as db:
            for name in forget:
                db.execute("DELETE FROM volume_identities WHERE name = ?", (name,))
            for name, ident in (identities or {}).items():
                db.execute("INSERT OR IGNORE INTO volume_identities VALUES (?, ?, ?, ?)",
                           (name, str(ident.uuid), ident.serial, datetime.now(UTC).isoformat(timespec="seconds")))
            for table in ("nbd_portals", "nbd_exports", "dhchap_hosts", "host_acls", "namespaces", "subsystem_portals", "subsystems",
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
                *((k, json.dumps(getattr(cfg.node, k))) for k in _NODE_KEYS),
                *((f"nbd_tls_{k}", json.dumps(str(v) if isinstance(v, Path) else v))
                  for k, v in (dataclasses.asdict(cfg.nbd_tls).items() if cfg.nbd_tls else ())),
            ])
            db.executemany("INSERT INTO devices VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [
                (d.name, i, d.type, d.size, d.block_size, _str(d.backing), _str(d.path), int(d.direct))
                for i, d in enumerate(cfg.devices)])
            db.executemany("INSERT INTO pools VALUES (?, ?, ?, ?, ?)", [
                (p.name, i, p.level, p.chunk, p.rebuild_rate) for i, p in enumerate(cfg.pools)])
            db.executemany("INSERT INTO pool_members VALUES (?, ?, ?, ?)", [
                (p.name, spare, j, d) for p in cfg.pools
                for spare, names in ((0, p.members), (1, p.spares)) for j, d in enumerate(names)])
            db.executemany("INSERT INTO volumes (name, position, device, pool, read_only, qos) "
                           "VALUES (?, ?, ?, ?, ?, ?)", [
                (v.name, i, v.device, v.pool, int(v.read_only), json.dumps(v.qos, sort_keys=True))
                for i, v in enumerate(cfg.volumes)])
            for v in cfg.volumes:
                self._ensure_identity(db, v.name)
            for i, t in enumerate(cfg.targets):
                db.execute("INSERT INTO targets VALUES (?, ?, ?, ?, ?, ?)",
                           (t.iqn, i, t.alias, t.portal_group_tag, int(t.allowed_initiators is None),
                            int(t.allow_unauthenticated)))
                db.executemany("INSERT INTO target_portals VALUES (?, ?, ?, ?, ?)",
                               [(t.iqn, 0, j, p.host, p.port) for j, p in enumerate(t.portals)]
                               + [(t.iqn, 1, j, p.host, p.port) for j, p in enumerate(t.advertised_portals)])
                db.executemany("INSERT INTO luns VALUES (?, ?, ?)", [(t.iqn, x.lun, x.volume) for x in t.luns])
                db.executemany("INSERT INTO acls VALUES (?, ?, ?)",
                               [(t.iqn, j, n) for j, n in enumerate(t.allowed_initiators or ())])
                for role, chap in (("initiator", t.chap), ("target", t.mutual_chap)):
                    if chap:
                        db.execute("INSERT INTO chap_users VALUES (?, ?, ?)", (t.iqn, role, chap.user))
            if cfg.nvme is not None:
                db.executemany("INSERT INTO nvme_portals VALUES (?, ?, ?)",
                               [(j, p.host, p.port) for j, p in enumerate(cfg.nvme.portals)])
            for i, sub in enumerate(cfg.subsystems):
                db.execute("INSERT INTO subsystems VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                           (sub.nqn, i, sub.serial, sub.model, int(sub.allowed_hosts is None),
                            int(sub.allow_unauthenticated), ",".join(sub.dhchap_hashes),
                            ",".join(sub.dhchap_dhgroups)))
                db.executemany("INSERT INTO dhchap_hosts VALUES (?, ?, ?, ?)",
                               [(sub.nqn, j, h.nqn, int(h.dhchap_ctrl_secret is not None))
                                for j, h in enumerate(sub.hosts)])
                db.executemany("INSERT INTO subsystem_portals VALUES (?, ?, ?, ?, ?)",
                               [(sub.nqn, 0, j, p.host, p.port) for j, p in enumerate(sub.portals)]
                               + [(sub.nqn, 1, j, p.host, p.port) for j, p in enumerate(sub.advertised_portals)])
                db.executemany("INSERT INTO namespaces VALUES (?, ?, ?)",
                               [(sub.nqn, n.nsid, n.volume) for n in sub.namespaces])
                db.executemany("INSERT INTO host_acls VALUES (?, ?, ?)",
                               [(sub.nqn, j, h) for j, h in enumerate(sub.allowed_hosts or ())])
            for i, e in enumerate(cfg.nbd_exports):
                db.execute("INSERT INTO nbd_exports VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (e.name, i, e.volume, int(e.read_only), e.description, e.tls,
                            int(e.allow_unauthenticated)))
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
        volumes = tuple(VolumeSpec(name, dev, bool(ro), pool=pool, qos=json.loads(qos))
                        for name, dev, pool, ro, qos in db.execute(
                            "SELECT name, device, pool, read_only, qos FROM volumes ORDER BY position"))
        secrets = self._read_secrets()
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
            chap = {role: ChapSpec(user, self._secret(secrets, ("chap", iqn, role), f"CHAP secret of {iqn}"))
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
        cfg = NodeConfig(settings, devices, volumes, tuple(targets),
                         source=Path(node["source"]) if node.get("source") else None,
                         nvme=self._load_nvme(secrets) if node.get("nvme") else None, nbd_exports=self._load_nbd(),
                         pools=self._load_pools(), nbd_tls=nbd_tls)
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

    def _secret(self, secrets: dict[str, Any], path: tuple[str, ...], what: str) -> str:
        value: Any = secrets
        for k in path:
            value = value.get(k) if isinstance(value, dict) else None
        if not isinstance(value, str):
            raise StoreError(f"{self.secrets_path}: the {what} is missing; serve with --config to write it again")
        return value

    def _load_nvme(self, secrets: dict[str, Any]) -> NvmeSpec:
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
                HostAuthSpec(host, self._secret(secrets, ("dhchap", nqn, host, "secret"), f"DH-HMAC-CHAP secret of "
                                                f"{host} for {nqn}"),
                             self._secret(secrets, ("dhchap", nqn, host, "ctrl_secret"), f"DH-HMAC-CHAP controller "
                                          f"secret of {host} for {nqn}") if bidirectional else None)
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


def _str(p: Path | None) -> str | None:
    return str(p) if p is not None else None
