"""The StateStore: desired state as JSON documents under '/'-separated keys, with revisions (the etcd v3 model).

Every change gets the next store-wide revision; an entry remembers the revision it was created at, the
revision it was last modified at and how many times it was written (etcd's create_revision, mod_revision,
version). Writers compare-and-swap on the modified revision (`expect=`), so two writers racing on one key
cannot both win, and a reconciler commits a volume and its export together (`txn`). `watch()` replays changes
from a revision, in revision order, then follows new ones: what the node's reconciler and, later, the
replication issue's cluster are built on.

Two implementations, one test suite (tests/integration/statestore_suite.py):
- `SqliteStateStore` (here): one file in the node's data dir, the embedded default for a single node.
- `EtcdStateStore` (cluster/etcd.py): a real etcd, for a cluster.

History kept for watch (the compaction rule): SQLite keeps the events of the last `history` revisions
(10,000 by default) and drops older ones as it writes; etcd keeps what the server keeps (no compaction unless
its operator turns on --auto-compaction-*). A watch that starts below what is kept raises `Compacted`: the
watcher then re-reads the state with list() and watches from revision() + 1.

Leases (a key that disappears when its owner stops renewing it) exist only on etcd: one node needs none, so the
SQLite store raises NotImplementedError for them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self, TypeVar

T = TypeVar("T")

STATE_DB_NAME = "state-kv.db"  # in the node's data dir
DEFAULT_HISTORY = 10_000  # revisions of events the SQLite store keeps for watch
POLL_SECONDS = 0.2  # how soon a SQLite watcher sees another process's writes


@dataclass(frozen=True)
class Entry:
    key: str
    value: dict[str, Any]
    revision: int  # last modified at (etcd mod_revision): what `expect=` compares with
    created: int  # created at (etcd create_revision)
    version: int  # writes since created: 1 after the first put


@dataclass(frozen=True)
class Event:
    """One change. A delete's entry has the key, the deletion's revision, an empty value and version 0."""

    kind: Literal["put", "delete"]
    entry: Entry
    revision: int


class StoreError(Exception):
    """Base of the errors a StateStore raises."""


class Conflict(StoreError):
    """A compare-and-swap failed: the key is not at the revision the writer expected."""

    def __init__(self, key: str, expected: int, actual: int) -> None:
        self.key, self.expected, self.actual = key, expected, actual
        super().__init__(f"{key}: expected {_rev_words(expected)}, found {_rev_words(actual)}")


def _rev_words(rev: int) -> str:
    return "no entry" if rev == 0 else f"revision {rev}"


class StoreUnavailable(StoreError):
    """The store cannot be reached or opened; str() says which store and why."""


class Compacted(StoreError):
    """A watch asked for history the store no longer keeps."""

    def __init__(self, start_revision: int, oldest: int) -> None:
        self.start_revision, self.oldest = start_revision, oldest
        super().__init__(
            f"watch from revision {start_revision}: history before revision {oldest} is compacted; "
            "list() the state and watch from revision() + 1"
        )


class LeaseExpired(StoreError):
    """A lease was renewed after it had expired (or been revoked): its keys are gone."""


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key.startswith("/") or "\0" in key or len(key) < 2:
        raise ValueError(f"store key {key!r}: must be a '/'-separated path such as '/volumes/live1'")


def check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix.startswith("/") or "\0" in prefix:
        raise ValueError(f"store prefix {prefix!r}: must start with '/' ('/' for everything)")


def encode_value(key: str, value: Mapping[str, Any]) -> str:
    if not isinstance(value, Mapping):
        raise TypeError(f"store value for {key}: must be a JSON object (dict), not {type(value).__name__}")
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"store value for {key}: not JSON: {e}") from None


def decode_value(text: str | bytes) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise StoreError(f"stored value is not a JSON object: {text[:60]!r}")
    return value


class Lease(ABC):
    """A time-to-live that keys can be attached to (put(..., lease=)); they are deleted when it expires."""

    id: int
    ttl: int  # seconds, as granted

    @abstractmethod
    async def refresh(self) -> int:
        """One keep-alive; returns the TTL it renewed. Raises LeaseExpired when it had already expired."""

    @abstractmethod
    async def revoke(self) -> None:
        """End it now: its keys are deleted at once."""

    def keep_alive(self) -> asyncio.Task[None]:
        """Renew it until the task is cancelled or the lease is gone: every ttl/3, and every ttl/10 while the
        store does not answer (replication/lease.py LeaseKeeper: one failed renewal does not end it)."""
        import time

        from openvsan.replication.lease import LeaseKeeper  # it builds on this module: imported late

        keeper = LeaseKeeper(self, time.monotonic())
        return asyncio.get_running_loop().create_task(keeper.run(), name=f"lease {self.id:x} keep-alive")


class StateStore(ABC):
    """Async key-value store with revisions. `expect`: None writes unconditionally, 0 means "must not exist",
    N means "must be at (modified) revision N"; a mismatch raises Conflict and changes nothing."""

    @abstractmethod
    async def get(self, key: str) -> Entry | None: ...

    @abstractmethod
    async def put(
        self, key: str, value: Mapping[str, Any], *, expect: int | None = None, lease: Lease | None = None
    ) -> int:
        """Store `value` under `key`; returns the new revision."""

    @abstractmethod
    async def delete(self, key: str, *, expect: int | None = None) -> int:
        """Remove `key`; returns the revision of the deletion (the current revision when there was nothing)."""

    @abstractmethod
    async def list(self, prefix: str) -> list[Entry]:
        """Every entry whose key starts with `prefix`, sorted by key (by code point, as etcd sorts bytes)."""

    @abstractmethod
    async def txn(
        self,
        compares: Mapping[str, int],
        puts: Mapping[str, Mapping[str, Any]] = {},
        deletes: Sequence[str] = (),
    ) -> int:
        """All or nothing: when every key in `compares` is at its expected revision (0: absent), apply `puts`
        and `deletes` under one new revision and return it; else raise Conflict naming the first mismatch.
        A key may be written once per txn (etcd's rule)."""

    @abstractmethod
    def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[Event]:
        """Changes under `prefix` in revision order, from `start_revision` inclusive (None: from the next
        revision), then new ones as they happen; Compacted when that history is gone. Close it (aclose(), or
        break out of `async for` and let it go) to stop."""

    @abstractmethod
    async def revision(self) -> int:
        """The revision of the last change to the store."""

    async def grant_lease(self, ttl: int) -> Lease:
        raise NotImplementedError(f"{type(self).__name__} has no leases: one node needs none; a cluster uses etcd")

    @abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def check_txn(compares: Mapping[str, int], puts: Mapping[str, Mapping[str, Any]], deletes: Sequence[str]) -> None:
    for key, rev in compares.items():
        check_key(key)
        if not isinstance(rev, int) or rev < 0:
            raise ValueError(f"txn compare for {key}: expected revision must be an int >= 0, not {rev!r}")
    for key in [*puts, *deletes]:
        check_key(key)
    written = [*puts, *deletes]
    if len(set(written)) != len(written):
        twice = min(k for k in written if written.count(k) > 1)
        raise ValueError(f"txn writes {twice} twice: a key may be written once per txn")


@dataclass
class _Watchers:
    """In-process wake-ups: every SQLite watcher of this store waits on its own event; a commit sets them all."""

    events: set[asyncio.Event] = field(default_factory=set)

    def wake(self) -> None:
        for e in self.events:
            e.set()


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('revision', 0), ('compacted', 0), ('schema', 1);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY, value TEXT NOT NULL,
    revision INTEGER NOT NULL, created INTEGER NOT NULL, version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, revision INTEGER NOT NULL, kind TEXT NOT NULL, key TEXT NOT NULL,
    value TEXT NOT NULL, created INTEGER NOT NULL, version INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS events_revision ON events (revision);
"""


class SqliteStateStore(StateStore):
    """The StateStore in one SQLite file (WAL mode, 0600): a global revision in `meta`, the entries in `kv`, the
    changes of the last `history` revisions in `events` for watch. Every write is one IMMEDIATE transaction, so
    two processes sharing the file serialize and CAS holds across them; watchers in this process are woken by
    the commit, those in another see it within POLL_SECONDS.

    SQLite calls run on one worker thread of the store's own: a commit waits for fsync (several ms on a real
    disk), which must not stall the event loop that serves I/O.
    """

    def __init__(self, path: str | os.PathLike[str], *, history: int = DEFAULT_HISTORY) -> None:
        self.path = Path(path)
        self.history = history
        self._watchers = _Watchers()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="statestore")
        self._db: sqlite3.Connection | None = None
        self._closed = False
        try:
            self._executor.submit(self._open).result()
        except (OSError, sqlite3.Error) as e:
            self._executor.shutdown(wait=False)
            raise StoreUnavailable(f"state store {self.path}: {e}") from None

    @classmethod
    def in_data_dir(cls, data_dir: str | os.PathLike[str], **kwargs: Any) -> SqliteStateStore:
        return cls(Path(data_dir) / STATE_DB_NAME, **kwargs)

    # -- on the worker thread --

    def _open(self) -> None:
        # created 0600 before SQLite sees it; SQLite gives the -wal and -shm files the same mode
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(self.path, 0o600)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a commit the caller saw survives power loss
        db.execute("PRAGMA busy_timeout=10000")
        db.executescript(_SCHEMA)
        self._db = db

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreUnavailable(f"state store {self.path} is closed")
        return self._db

    def _row_entry(self, row: tuple[Any, ...]) -> Entry:
        key, value, revision, created, version = row
        return Entry(key, decode_value(value), revision, created, version)

    def _get(self, key: str) -> Entry | None:
        row = (
            self._conn()
            .execute("SELECT key, value, revision, created, version FROM kv WHERE key = ?", (key,))
            .fetchone()
        )
        return None if row is None else self._row_entry(row)

    def _list(self, prefix: str) -> list[Entry]:
        rows = (
            self._conn()
            .execute(
                "SELECT key, value, revision, created, version FROM kv WHERE key >= ? AND substr(key, 1, ?) = ? "
                "ORDER BY key",
                (prefix, len(prefix), prefix),
            )
            .fetchall()
        )
        return [self._row_entry(r) for r in rows]

    def _meta(self, db: sqlite3.Connection, name: str) -> int:
        return int(db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()[0])

    def _revision(self) -> int:
        return self._meta(self._conn(), "revision")

    def _txn(self, compares: Mapping[str, int], puts: Mapping[str, str], deletes: Sequence[str]) -> int:
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            for key, expected in compares.items():
                row = db.execute("SELECT revision FROM kv WHERE key = ?", (key,)).fetchone()
                actual = 0 if row is None else int(row[0])
                if actual != expected:
                    raise Conflict(key, expected, actual)
            current = self._meta(db, "revision")
            rev = current + 1
            changed = False
            for key, text in puts.items():
                row = db.execute("SELECT created, version FROM kv WHERE key = ?", (key,)).fetchone()
                created, version = (rev, 1) if row is None else (int(row[0]), int(row[1]) + 1)
                db.execute(
                    "INSERT OR REPLACE INTO kv (key, value, revision, created, version) VALUES (?, ?, ?, ?, ?)",
                    (key, text, rev, created, version),
                )
                db.execute(
                    "INSERT INTO events (revision, kind, key, value, created, version) VALUES (?, 'put', ?, ?, ?, ?)",
                    (rev, key, text, created, version),
                )
                changed = True
            for key in deletes:
                if db.execute("DELETE FROM kv WHERE key = ?", (key,)).rowcount:
                    db.execute(
                        "INSERT INTO events (revision, kind, key, value, created, version) "
                        "VALUES (?, 'delete', ?, '{}', 0, 0)",
                        (rev, key),
                    )
                    changed = True
            if not changed:  # like etcd: a txn that changes nothing takes no revision
                db.execute("COMMIT")
                return current
            db.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (rev,))
            floor = rev - self.history
            if floor > self._meta(db, "compacted"):
                db.execute("DELETE FROM events WHERE revision <= ?", (floor,))
                db.execute("UPDATE meta SET value = ? WHERE name = 'compacted'", (floor,))
            db.execute("COMMIT")
            return rev
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _events(self, prefix: str, start: int, limit: int = 1000) -> tuple[list[Event], int]:
        """Events from `start` on, whole revisions only, and the compaction floor (history <= it is gone)."""
        db = self._conn()
        db.execute("BEGIN")  # one snapshot: the floor and the events agree
        try:
            floor = self._meta(db, "compacted")
            select = "SELECT id, revision, kind, key, value, created, version FROM events WHERE "
            in_prefix = " AND key >= ? AND substr(key, 1, ?) = ?"
            rows = db.execute(
                select + "revision >= ?" + in_prefix + " ORDER BY id LIMIT ?",
                (start, prefix, len(prefix), prefix, limit),
            ).fetchall()
            if len(rows) == limit:  # never hand out half a revision: the rest of the last one comes too
                rows += db.execute(
                    select + "revision = ? AND id > ?" + in_prefix + " ORDER BY id",
                    (rows[-1][1], rows[-1][0], prefix, len(prefix), prefix),
                ).fetchall()
        finally:
            db.execute("COMMIT")
        events = [
            Event(kind, Entry(key, decode_value(value), rev, created, version), rev)
            for _, rev, kind, key, value, created, version in rows
        ]
        return events, floor

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # -- on the event loop --

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise StoreUnavailable(f"state store {self.path} is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except sqlite3.Error as e:
            raise StoreUnavailable(f"state store {self.path}: {e}") from None

    async def get(self, key: str) -> Entry | None:
        check_key(key)
        return await self._call(self._get, key)

    async def put(
        self, key: str, value: Mapping[str, Any], *, expect: int | None = None, lease: Lease | None = None
    ) -> int:
        if lease is not None:
            raise NotImplementedError("SqliteStateStore has no leases: one node needs none; a cluster uses etcd")
        return await self.txn({} if expect is None else {key: expect}, {key: value})

    async def delete(self, key: str, *, expect: int | None = None) -> int:
        return await self.txn({} if expect is None else {key: expect}, {}, [key])

    async def list(self, prefix: str) -> list[Entry]:
        check_prefix(prefix)
        return await self._call(self._list, prefix)

    async def txn(
        self,
        compares: Mapping[str, int],
        puts: Mapping[str, Mapping[str, Any]] = {},
        deletes: Sequence[str] = (),
    ) -> int:
        check_txn(compares, puts, deletes)
        texts = {key: encode_value(key, value) for key, value in puts.items()}
        rev = await self._call(self._txn, dict(compares), texts, list(deletes))
        self._watchers.wake()
        return rev

    async def revision(self) -> int:
        return await self._call(self._revision)

    async def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[Event]:
        check_prefix(prefix)
        wake = asyncio.Event()
        self._watchers.events.add(wake)
        try:
            nxt = (await self.revision()) + 1 if start_revision is None else max(start_revision, 1)
            while True:
                wake.clear()  # before reading, so a commit after the read is not missed
                events, floor = await self._call(self._events, prefix, nxt)
                if nxt <= floor:
                    raise Compacted(nxt, floor + 1)
                for ev in events:
                    yield ev
                if events:
                    nxt = events[-1].revision + 1
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), POLL_SECONDS)
                except TimeoutError:
                    pass
        finally:
            self._watchers.events.discard(wake)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close)
        self._executor.shutdown(wait=True)
