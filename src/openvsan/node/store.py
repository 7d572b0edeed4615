"""The node's desired state in a StateStore (node/statestore.py), each volume's stable identity, and secrets.

The store is SQLite in the data dir (`state-kv.db`, the embedded default: `Store.open(data_dir)`) or etcd for a
cluster (`Store.etcd(endpoints, secrets_dir)`). `vsan serve` imports a validated config here (the config file
wins over what was stored), then assembles the node from what the store holds; the live node stores each
change it applies (`import_desired`, off its event loop).

Layout: one object per key, so a cluster can watch and compare-and-swap one object. Values are the object's
part of node/render.py's config document (and its "position", so the config's order is kept):

    /desired                 {"format", "source", "imported"}: rewritten by every import that changes
                             anything, so its revision is the desired state's revision (If-Match)
    /node                    [node]
    /devices/<name>          [[devices]]            /pools/<name>  [[pools]]     /volumes/<name>  [[volumes]]
    /iscsi/targets/<iqn>     [[iscsi.targets]], chap and mutual_chap with their user only
    /nvme                    [nvme] less its subsystems (there when the section is)
    /nvme/subsystems/<nqn>   [[nvme.subsystems]], hosts as {"nqn", "bidirectional"}
    /nbd                     [nbd] less its exports
    /nbd/exports/<name>      [[nbd.exports]]
    /identities/<volume>     {"uuid", "serial", "created"}: kept by imports, dropped only by forget=
    /pool-devices/<pool>     {"refs"}: devices a running pool took in (`vsan pool replace`), kept by imports

A name's "/" and "%" are written %2F and %25 in its key. load() puts the document together again and parses
it with node/config.py parse_config, so what is stored is checked on the way out as it was on the way in.

Secrets (CHAP, mutual CHAP, DH-HMAC-CHAP) never enter the store: they are in `secrets.json` in the data dir
(0600), so a dump of the store carries none. A volume's uuid and serial are made once, the first time its name
is seen, and kept: SCSI NAA/T10 ids are derived from them, and an initiator that sees a new id thinks it is
looking at a new disk.

A data dir of an older openvsan (the relational `state.db`, node/legacy_store.py) is migrated when it is first
opened: everything it held goes into the store in one transaction, then it is renamed `state.db.migrated`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self, TypeVar

from openvsan.durable import replace_file, sync_dir
from openvsan.node import statestore
from openvsan.node.config import ConfigError, parse_config
from openvsan.node.legacy_store import LEGACY_STATE_DB, LegacyStateDb, LegacyStoreError
from openvsan.node.render import config_document
from openvsan.node.specs import NodeConfig, NodeSettings
from openvsan.node.statestore import STATE_DB_NAME, Conflict, Entry, SqliteStateStore, StateStore

log = logging.getLogger("openvsan.store")

T = TypeVar("T")

FORMAT_VERSION = 1      # of the layout above; a store written in a newer one is refused
STATE_DB = STATE_DB_NAME  # "state-kv.db", in the data dir
MIGRATED = "state.db.migrated"
SECRETS = "secrets.json"  # in the data dir, mode 0600: every secret, so a dump of the state carries none

DESIRED = "/desired"
_SINGLE = ("/node", "/nvme", "/nbd", "/cluster", "/api")
_LISTS = {"/devices/": "devices", "/pools/": "pools", "/volumes/": "volumes"}
_CHILDREN = ("/iscsi/targets/", "/nvme/subsystems/", "/nbd/exports/")
IDENTITIES = "/identities/"
POOL_DEVICES = "/pool-devices/"
_RETRIES = 20  # an import that lost a race re-reads and tries again (without expect_revision)


class StoreError(RuntimeError):
    """The desired state cannot be stored or read (newer format, unreadable, invalid); str() is one line."""


class StateConflict(StoreError, Conflict):
    """import_config(expect_revision=) found the desired state at another revision: someone changed it since."""

    def __init__(self, where: str, expected: int, actual: int) -> None:
        Conflict.__init__(self, DESIRED, expected, actual)
        text = (f"{where}: the desired state changed since revision {expected} (it is at revision {actual} now); "
                "read it again and retry")
        self.args = (text,)


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
    revision: int | None = None  # of the desired state it was read at (Store.revision); None: not known


def _seg(name: str) -> str:
    return name.replace("%", "%25").replace("/", "%2F")


def is_desired_key(key: str) -> bool:
    """Whether `key` holds part of the config (not an identity, not what a running pool took in)."""
    return key in _SINGLE or key.startswith((*_LISTS, *_CHILDREN))


def _secrets_doc(cfg: NodeConfig) -> dict[str, Any]:
    return {
        "version": 1,
        "chap": {t.iqn: {role: c.secret for role, c in (("initiator", t.chap), ("target", t.mutual_chap)) if c}
                 for t in cfg.targets if t.chap or t.mutual_chap},
        "dhchap": {sub.nqn: {h.nqn: {"secret": h.dhchap_secret, "ctrl_secret": h.dhchap_ctrl_secret}
                             for h in sub.hosts} for sub in cfg.subsystems if sub.hosts},
    }


def config_objects(cfg: NodeConfig) -> dict[str, dict[str, Any]]:
    """The keys and values that hold `cfg` (without its secrets and its source)."""
    doc = config_document(cfg)
    out: dict[str, dict[str, Any]] = {"/node": doc["node"]}
    for prefix, section in _LISTS.items():
        for i, part in enumerate(doc.get(section, ())):
            out[prefix + _seg(part["name"])] = {"position": i, **part}
    for i, t in enumerate(doc.get("iscsi", {}).get("targets", ())):
        t = {**t, **{k: {"user": t[k]["user"]} for k in ("chap", "mutual_chap") if k in t}}
        out["/iscsi/targets/" + _seg(t["iqn"])] = {"position": i, **t}
    if "nvme" in doc:
        nvme = dict(doc["nvme"])
        for i, (s, spec) in enumerate(zip(nvme.pop("subsystems"), cfg.subsystems, strict=True)):
            if "hosts" in s:
                s = {**s, "hosts": [{"nqn": h.nqn, "bidirectional": h.dhchap_ctrl_secret is not None}
                                    for h in spec.hosts]}
            out["/nvme/subsystems/" + _seg(s["nqn"])] = {"position": i, **s}
        out["/nvme"] = nvme
    if "nbd" in doc:
        nbd = dict(doc["nbd"])
        for i, e in enumerate(nbd.pop("exports")):
            out["/nbd/exports/" + _seg(e["name"])] = {"position": i, **e}
        out["/nbd"] = nbd
    if "cluster" in doc:
        out["/cluster"] = doc["cluster"]
    if "api" in doc:
        out["/api"] = doc["api"]
    # as the store gives them back (lists, not tuples), so a comparison with what is stored is exact
    normal: dict[str, dict[str, Any]] = json.loads(json.dumps(out))
    return normal


def config_from_objects(objects: Mapping[str, Mapping[str, Any]], secrets: Mapping[str, Any],
                        secret_of: Callable[[Mapping[str, Any], tuple[str, ...], str], str]) -> NodeConfig:
    """The inverse of config_objects: put the document together, with the secrets, and parse it. Raises
    ConfigError (the document is not a valid config), or KeyError/TypeError/ValueError (not our layout)."""

    def ordered(prefix: str) -> list[dict[str, Any]]:
        parts = sorted((v for k, v in objects.items() if k.startswith(prefix)), key=lambda v: int(v["position"]))
        return [{k: x for k, x in v.items() if k != "position"} for v in parts]

    doc: dict[str, Any] = {"node": dict(objects["/node"])}
    for prefix, section in _LISTS.items():
        if parts := ordered(prefix):
            doc[section] = parts
    if targets := ordered("/iscsi/targets/"):
        for t in targets:
            for role, k in (("initiator", "chap"), ("target", "mutual_chap")):
                if k in t:
                    t[k] = {"user": t[k]["user"],
                            "secret": secret_of(secrets, ("chap", t["iqn"], role), f"CHAP secret of {t['iqn']}")}
        doc["iscsi"] = {"targets": targets}
    subsystems = ordered("/nvme/subsystems/")
    if "/nvme" in objects or subsystems:
        for s in subsystems:
            if "hosts" in s:
                nqn = s["nqn"]
                s["hosts"] = [
                    {"nqn": h["nqn"],
                     "dhchap_secret": secret_of(secrets, ("dhchap", nqn, h["nqn"], "secret"),
                                                f"DH-HMAC-CHAP secret of {h['nqn']} for {nqn}"),
                     **({"dhchap_ctrl_secret": secret_of(secrets, ("dhchap", nqn, h["nqn"], "ctrl_secret"),
                                                         f"DH-HMAC-CHAP controller secret of {h['nqn']} for {nqn}")}
                        if h["bidirectional"] else {})}
                    for h in s["hosts"]]
        doc["nvme"] = {**objects.get("/nvme", {}), "subsystems": subsystems}
    exports = ordered("/nbd/exports/")
    if "/nbd" in objects or exports:
        doc["nbd"] = {**objects.get("/nbd", {}), "exports": exports}
    if "/cluster" in objects:
        doc["cluster"] = dict(objects["/cluster"])
    if "/api" in objects:
        doc["api"] = dict(objects["/api"])
    return parse_config(doc)


class _Loop:
    """A private event loop on a thread of its own: the StateStore API is async, Store's is sync, and a Store
    may be used from a thread that runs an event loop of its own (which this one then never touches)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="store-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class Store:
    """The desired state in `kv` (made by `open_kv` on the store's own loop), secrets in `secrets_dir`.
    Each call is synchronous: in an event loop that serves I/O use import_desired / record_pool_devices."""

    def __init__(self, open_kv: Callable[[], StateStore], secrets_dir: Path, *, where: str) -> None:
        self.secrets_dir = secrets_dir
        self.where = where
        self._loop = _Loop()

        async def make() -> StateStore:
            return open_kv()

        try:
            self._kv: StateStore = self._run(make())
        except BaseException:
            self._loop.close()
            raise

    @classmethod
    def open(cls, data_dir: Path) -> Store:
        """The data dir's SQLite store, made if need be (and an old state.db migrated into it)."""
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        _wait_for_writer()
        store = cls(lambda: SqliteStateStore.in_data_dir(data_dir), data_dir, where=str(data_dir / STATE_DB))
        try:
            store._migrate_legacy(data_dir / LEGACY_STATE_DB)
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def etcd(cls, endpoints: Sequence[str] | str, secrets_dir: Path, *, prefix: str = "/openvsan") -> Store:
        """The desired state in etcd under `prefix`; the secrets stay in this node's `secrets_dir`."""
        from openvsan.cluster.etcd import EtcdStateStore

        first = endpoints if isinstance(endpoints, str) else endpoints[0]
        return cls(lambda: EtcdStateStore(endpoints, prefix=prefix), secrets_dir, where=f"etcd at {first}{prefix}")

    @staticmethod
    def holds_state(data_dir: Path) -> bool:
        """Whether a node ran with this data dir (its store, or an old state.db to migrate, is there)."""
        return (data_dir / STATE_DB).exists() or (data_dir / LEGACY_STATE_DB).exists()

    def close(self) -> None:
        if self._loop.thread.is_alive():
            try:
                self._loop.run(self._kv.close())
            finally:
                self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self._loop.run(coro)
        except StoreError:
            raise
        except statestore.StoreError as e:
            raise StoreError(f"{self.where}: cannot use the state store: {e}") from None

    # --- the format -------------------------------------------------------------------------------

    def _check_format(self, desired: Entry | None) -> None:
        version = desired.value.get("format") if desired is not None else FORMAT_VERSION
        if not isinstance(version, int):
            raise StoreError(f"{self.where}: {DESIRED} has no format version; this is not openvsan's state")
        if version > FORMAT_VERSION:
            raise StoreError(f"{self.where}: written by a newer openvsan (format {version}, this one knows "
                             f"{FORMAT_VERSION}); upgrade openvsan or use another --data-dir")

    def format_version(self) -> int:
        desired = self._run(self._kv.get(DESIRED))
        self._check_format(desired)
        return int(desired.value["format"]) if desired is not None else FORMAT_VERSION

    def revision(self) -> int:
        """The desired state's revision: what import_config(expect_revision=) compares with; 0 when empty."""
        desired = self._run(self._kv.get(DESIRED))
        return desired.revision if desired is not None else 0

    # --- secrets (secrets.json in the data dir) --------------------------------------------------

    @property
    def secrets_path(self) -> Path:
        return self.secrets_dir / SECRETS

    def _write_secrets(self, cfg: NodeConfig) -> None:
        """Replace secrets.json with the config's secrets: a new 0600 file, synced, renamed over the old one."""
        self.secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        replace_file(self.secrets_path, json.dumps(_secrets_doc(cfg), indent=1, sort_keys=True).encode())

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

    def _secret(self, secrets: Mapping[str, Any], path: tuple[str, ...], what: str) -> str:
        value: Any = secrets
        for k in path:
            value = value.get(k) if isinstance(value, dict) else None
        if not isinstance(value, str):
            raise StoreError(f"{self.secrets_path}: the {what} is missing; serve with --config to write it again")
        return value

    # --- writing ----------------------------------------------------------------------------------

    def import_config(self, cfg: NodeConfig, *, identities: Mapping[str, VolumeIdentity] | None = None,
                      forget: Sequence[str] = (), expect_revision: int | None = None) -> int:
        """Make `cfg` the desired state, all or nothing (one transaction: puts of what is new or changed,
        deletes of what went); returns the desired state's revision. Identities of known volume names are
        kept; a new volume takes the one in `identities` if given (the live node made it when it created the
        volume), else a new one; the names in `forget` lose theirs (volumes deleted: a volume made later under
        the same name is another disk, which an initiator must not take for this one). `expect_revision`: the
        revision the caller read (Store.revision, StoredState.revision); StateConflict if it moved on.

        `cfg` is checked first: what is stored must parse back to it (a config that breaks its own references
        is a StoreError, and nothing is written). Secrets go to secrets.json before the transaction: a failure
        after that leaves the old state with secrets it may no longer use, never state that names a secret
        nobody wrote."""
        objects = config_objects(cfg)
        try:
            back = config_from_objects(objects, _secrets_doc(cfg), self._secret)
        except ConfigError as e:
            raise StoreError(f"{self.where}: cannot store this desired state: {e}") from None
        if back != cfg:
            wrong = next((f.name for f in dataclasses.fields(cfg)
                          if f.compare and getattr(back, f.name) != getattr(cfg, f.name)), "?")
            raise StoreError(f"{self.where}: cannot store this desired state: its {wrong} would not read back the "
                             "same (an openvsan bug: please report it)")
        return self._run(self._import(cfg, objects, dict(identities or {}), tuple(forget), expect_revision))

    async def _import(self, cfg: NodeConfig, objects: dict[str, dict[str, Any]],
                      identities: dict[str, VolumeIdentity], forget: tuple[str, ...],
                      expect_revision: int | None) -> int:
        secrets_written = False
        for _ in range(_RETRIES):
            current = {e.key: e for e in await self._kv.list("/")}
            desired = current.get(DESIRED)
            self._check_format(desired)
            at = desired.revision if desired is not None else 0
            if expect_revision is not None and expect_revision != at:
                raise StateConflict(self.where, expect_revision, at)
            if not secrets_written:
                self._write_secrets(cfg)  # on the store's own loop: no event loop that serves I/O waits here
                secrets_written = True
            puts = {k: v for k, v in objects.items() if k not in current or current[k].value != v}
            deletes = [k for k in current if is_desired_key(k) and k not in objects]
            source = str(cfg.source) if cfg.source is not None else None
            if puts or deletes or desired is None or desired.value.get("source") != source:
                puts[DESIRED] = {"format": FORMAT_VERSION, "source": source, "imported": _now()}
            compares = {DESIRED: at}
            names = [*identities, *(v.name for v in cfg.volumes)]
            for name in dict.fromkeys(names):
                key = IDENTITIES + _seg(name)
                if key in current and name not in forget:
                    continue
                compares[key] = current[key].revision if key in current else 0
                ident = identities.get(name) or _new_identity()
                puts[key] = {"uuid": str(ident.uuid), "serial": ident.serial, "created": _now()}
            deletes += [k for k in (IDENTITIES + _seg(n) for n in forget) if k in current and k not in puts]
            try:
                rev = await self._kv.txn(compares, puts, deletes)
            except Conflict as e:
                if expect_revision is not None and e.key == DESIRED:
                    raise StateConflict(self.where, expect_revision, e.actual) from None
                continue  # another writer got in between: read again
            return rev if DESIRED in puts else at
        raise StoreError(f"{self.where}: the desired state keeps changing under this import; try again")

    # --- reading ----------------------------------------------------------------------------------

    def identities(self) -> dict[str, VolumeIdentity]:
        return self._identities(self._run(self._kv.list(IDENTITIES)))

    def _identities(self, entries: list[Entry]) -> dict[str, VolumeIdentity]:
        out = {}
        for e in entries:
            name = e.key.removeprefix(IDENTITIES).replace("%2F", "/").replace("%25", "%")
            try:
                out[name] = VolumeIdentity(uuid.UUID(e.value["uuid"]), str(e.value["serial"]))
            except (KeyError, TypeError, ValueError):
                raise StoreError(f"{self.where}: {e.key} is not a volume identity; use another --data-dir") from None
        return out

    def load(self) -> StoredState:
        """The desired state, identities and pool devices, as of one revision. An empty store gives a config
        with nothing in it (and a node without a name)."""
        return self._run(self._load())

    async def _load(self) -> StoredState:
        entries = await self._kv.list("/")
        by_key = {e.key: e for e in entries}
        desired = by_key.get(DESIRED)
        self._check_format(desired)
        objects = {e.key: e.value for e in entries if is_desired_key(e.key)}
        if not objects:
            cfg = NodeConfig(NodeSettings(""))
        else:
            secrets = self._read_secrets()
            try:
                cfg = config_from_objects(objects, secrets, self._secret)
            except ConfigError as e:
                raise StoreError(f"{self.where}: the stored desired state is not valid: {e}; serve with --config "
                                 "FILE to replace it") from None
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise StoreError(f"{self.where}: the stored desired state is unreadable ({type(e).__name__}: {e}); "
                                 "serve with --config FILE to replace it") from None
            source = desired.value.get("source") if desired is not None else None
            if source:
                cfg = dataclasses.replace(cfg, source=Path(source))
        pools = {p.name for p in cfg.pools}
        runtime = {k: v for k, v in self._pool_devices(entries).items() if k in pools and v}
        return StoredState(cfg, self._identities([e for e in entries if e.key.startswith(IDENTITIES)]), runtime,
                           desired.revision if desired is not None else 0)

    # --- what running pools took in (not desired state: kept across imports) -----------------------

    def _pool_devices(self, entries: list[Entry]) -> dict[str, tuple[str, ...]]:
        out = {}
        for e in entries:
            if e.key.startswith(POOL_DEVICES):
                refs = e.value.get("refs")
                if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
                    raise StoreError(f"{self.where}: {e.key} has no list of device refs; use another --data-dir")
                out[e.key.removeprefix(POOL_DEVICES).replace("%2F", "/").replace("%25", "%")] = tuple(refs)
        return out

    def pool_runtime_devices(self, pool: str) -> tuple[str, ...]:
        return self._pool_devices(self._run(self._kv.list(POOL_DEVICES + _seg(pool)))).get(pool, ())

    def set_pool_runtime_devices(self, pool: str, refs: tuple[str, ...] | list[str]) -> None:
        key = POOL_DEVICES + _seg(pool)
        refs = list(dict.fromkeys(refs))
        self._run(self._kv.put(key, {"refs": refs}) if refs else self._kv.delete(key))

    # --- migration of a data dir an older openvsan kept (state.db) -----------------------------------

    def _migrate_legacy(self, legacy: Path) -> None:
        if not legacy.exists():
            return
        if self._run(self._kv.get(DESIRED)) is None:
            try:
                with LegacyStateDb(legacy) as old:
                    cfg = old.load() if old.holds_state() else None
                    identities, pool_devices, schema = old.identities(), old.pool_runtime_devices(), old.found_version
            except LegacyStoreError as e:
                raise StoreError(str(e)) from None
            puts: dict[str, Mapping[str, Any]] = {}
            if cfg is not None:
                # the secrets stay in secrets.json, where the old store kept them: these objects carry none
                puts.update(config_objects(cfg))
                puts[DESIRED] = {"format": FORMAT_VERSION, "source": str(cfg.source) if cfg.source else None,
                                 "imported": _now(), "migrated_from": f"{LEGACY_STATE_DB} schema {schema}"}
            for name, (u, serial, created) in identities.items():
                puts[IDENTITIES + _seg(name)] = {"uuid": str(u), "serial": serial, "created": created}
            for pool, refs in pool_devices.items():
                puts[POOL_DEVICES + _seg(pool)] = {"refs": list(refs)}
            # all or nothing: a crash before this commit migrates again at the next open
            self._run(self._kv.txn({DESIRED: 0}, puts))
            log.info("%s: migrated the desired state of %s (schema %d) into it", self.where, legacy, schema)
        # kept, not deleted: the old openvsan's own copy, should anyone go back
        target = legacy.with_name(MIGRATED)
        n = 1
        while target.exists():
            target, n = legacy.with_name(f"{MIGRATED}.{n}"), n + 1
        os.rename(legacy, target)
        sync_dir(legacy.parent)


def _new_identity() -> VolumeIdentity:
    u = uuid.uuid4()
    # the serial is the uuid's hex: unique, ASCII (SPC-4 7.8.16), and short enough for every initiator
    return VolumeIdentity(u, u.hex)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# --- for a running node: the store's work off its event loop ------------------------------------------

# one thread, so the writes a node makes land in the order it made them
_on_writer = threading.local()
_writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer",
                                                initializer=lambda: setattr(_on_writer, "yes", True))


def _wait_for_writer() -> None:
    """Let the writes this process queued land first, so a Store opened here reads what the node wrote."""
    if not getattr(_on_writer, "yes", False):
        _writer.submit(lambda: None).result()


async def import_desired(data_dir: Path, cfg: NodeConfig, *,
                         identities: Mapping[str, VolumeIdentity] | None = None, forget: Sequence[str] = (),
                         expect_revision: int | None = None) -> int:
    """Store.open(data_dir).import_config(...) on the writer thread: an event loop awaiting it never waits for
    SQLite's fsync (or etcd's round trips)."""

    def work() -> int:
        with Store.open(data_dir) as store:
            return store.import_config(cfg, identities=identities, forget=forget, expect_revision=expect_revision)

    return await asyncio.wrap_future(_writer.submit(work))


def record_pool_devices(data_dir: Path, pool: str, refs: Sequence[str]) -> concurrent.futures.Future[None]:
    """Store.open(data_dir).set_pool_runtime_devices(...) on the writer thread, in call order; the caller may
    go on at once (a running pool does not wait for the record of what it took in)."""

    def work() -> None:
        with Store.open(data_dir) as store:
            store.set_pool_runtime_devices(pool, list(refs))

    return _writer.submit(work)
