"""A StateStore held in memory: the third implementation of node/statestore.py's interface, with leases on
an injected clock, for the unit tier (the cluster's logic, replication's records and elections, is tested
against it with no socket and no real clock) and for one process's tests.

`MemoryState` is the state (entries, revisions, the event history, leases); each `MemoryStateStore` is one
client of it, so two stores over one state are two nodes sharing a store, as two etcd clients are. Leases
expire when the clock passes their deadline: checked on every call, and, on the real clock, by a timer at
the deadline (a watcher sees the delete without anyone calling). It passes the same suite as SQLite and etcd
(tests/integration/statestore_suite.py). Nothing is durable: it is not a node's store.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from openvsan.node.statestore import (
    Compacted,
    Conflict,
    Entry,
    Event,
    Lease,
    LeaseExpired,
    StateStore,
    StoreUnavailable,
    check_key,
    check_prefix,
    check_txn,
    decode_value,
    encode_value,
)

DEFAULT_HISTORY = 10_000


@dataclass
class _Lease:
    id: int
    ttl: int
    deadline: float
    keys: set[str] = field(default_factory=set)


class MemoryState:
    """The shared state. `clock`: seconds (time.monotonic by default); `history`: revisions of events kept."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, history: int = DEFAULT_HISTORY) -> None:
        self.clock = clock
        self.real_clock = clock is time.monotonic
        self.history = history
        self.revision = 0
        self.compacted = 0
        self.kv: dict[str, Entry] = {}
        self.events: list[Event] = []
        self.leases: dict[int, _Lease] = {}
        self.lease_of: dict[str, int] = {}
        self._ids = itertools.count(0x1000)
        self._wakeups: set[asyncio.Event] = set()

    # ---- changes

    def apply(self, compares: Mapping[str, int], puts: Mapping[str, dict[str, Any]], deletes: Sequence[str],
              lease: _Lease | None = None, *, expire: bool = True) -> int:
        if expire:
            self.expire_due()
        for key, expected in compares.items():
            e = self.kv.get(key)
            actual = 0 if e is None else e.revision
            if actual != expected:
                raise Conflict(key, expected, actual)
        rev = self.revision + 1
        changed: list[Event] = []
        for key, value in puts.items():
            old = self.kv.get(key)
            entry = Entry(key, value, rev, rev if old is None else old.created, 1 if old is None else old.version + 1)
            self.kv[key] = entry
            self._attach(key, lease)
            changed.append(Event("put", entry, rev))
        for key in deletes:
            if self.kv.pop(key, None) is not None:
                self._attach(key, None)
                changed.append(Event("delete", Entry(key, {}, rev, 0, 0), rev))
        if not changed:      # like etcd: a txn that changes nothing takes no revision
            return self.revision
        self.revision = rev
        self.events += changed
        floor = rev - self.history
        if floor > self.compacted:
            self.events = [e for e in self.events if e.revision > floor]
            self.compacted = floor
        for w in self._wakeups:
            w.set()
        return rev

    def _attach(self, key: str, lease: _Lease | None) -> None:
        old = self.lease_of.pop(key, None)
        if old is not None and old in self.leases:
            self.leases[old].keys.discard(key)
        if lease is not None:
            lease.keys.add(key)
            self.lease_of[key] = lease.id

    # ---- leases

    def grant(self, ttl: int) -> _Lease:
        self.expire_due()
        lease = _Lease(next(self._ids), ttl, self.clock() + ttl)
        self.leases[lease.id] = lease
        if self.real_clock:
            self._arm(lease)
        return lease

    def _arm(self, lease: _Lease) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_later(max(0.0, lease.deadline - self.clock()) + 0.01, self.expire_due)

    def refresh(self, lease_id: int) -> int:
        self.expire_due()
        lease = self.leases.get(lease_id)
        if lease is None:
            raise LeaseExpired(f"lease {lease_id:x} has expired")
        lease.deadline = self.clock() + lease.ttl
        if self.real_clock:
            self._arm(lease)
        return lease.ttl

    def revoke(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None and lease.keys:
            self.apply({}, {}, sorted(lease.keys), expire=False)

    def expire_due(self) -> None:
        """Every lease past its deadline ends, its keys deleted in one revision (each lease its own)."""
        now = self.clock()
        for lease in [x for x in self.leases.values() if x.deadline <= now]:
            del self.leases[lease.id]
            if lease.keys:
                self.apply({}, {}, sorted(lease.keys), expire=False)


class MemoryLease(Lease):
    def __init__(self, state: MemoryState, lease: _Lease) -> None:
        self._state = state
        self.id = lease.id
        self.ttl = lease.ttl

    async def refresh(self) -> int:
        return self._state.refresh(self.id)

    async def revoke(self) -> None:
        self._state.revoke(self.id)


class MemoryStateStore(StateStore):
    """One client of a MemoryState (a new one when none is given)."""

    def __init__(self, state: MemoryState | None = None) -> None:
        self.state = state if state is not None else MemoryState()
        self._closed = False

    def _live(self) -> MemoryState:
        if self._closed:
            raise StoreUnavailable("memory state store is closed")
        self.state.expire_due()
        return self.state

    async def get(self, key: str) -> Entry | None:
        check_key(key)
        return self._live().kv.get(key)

    async def put(
        self, key: str, value: Mapping[str, Any], *, expect: int | None = None, lease: Lease | None = None
    ) -> int:
        check_key(key)
        s = self._live()
        held = None
        if lease is not None:
            held = s.leases.get(lease.id)
            if held is None:
                raise LeaseExpired(f"lease {lease.id:x} has expired")
        return s.apply({} if expect is None else {key: expect}, {key: _copy(key, value)}, [], held)

    async def delete(self, key: str, *, expect: int | None = None) -> int:
        return await self.txn({} if expect is None else {key: expect}, {}, [key])

    async def list(self, prefix: str) -> list[Entry]:
        check_prefix(prefix)
        kv = self._live().kv
        return [kv[k] for k in sorted(k for k in kv if k.startswith(prefix))]

    async def txn(
        self,
        compares: Mapping[str, int],
        puts: Mapping[str, Mapping[str, Any]] = {},
        deletes: Sequence[str] = (),
    ) -> int:
        check_txn(compares, puts, deletes)
        return self._live().apply(dict(compares), {k: _copy(k, v) for k, v in puts.items()}, list(deletes))

    async def revision(self) -> int:
        return self._live().revision

    async def grant_lease(self, ttl: int) -> Lease:
        if not isinstance(ttl, int) or ttl < 1:
            raise ValueError(f"lease ttl: a whole number of seconds >= 1, not {ttl!r}")
        s = self._live()
        return MemoryLease(s, s.grant(ttl))

    async def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[Event]:
        check_prefix(prefix)
        s = self._live()
        wake = asyncio.Event()
        s._wakeups.add(wake)
        try:
            nxt = s.revision + 1 if start_revision is None else max(start_revision, 1)
            while True:
                wake.clear()
                s = self._live()
                if nxt <= s.compacted:
                    raise Compacted(nxt, s.compacted + 1)
                top = s.revision     # what this scan covers: changes made while the events are handed out
                events = [e for e in s.events if e.revision >= nxt and e.entry.key.startswith(prefix)]
                for ev in events:
                    yield ev
                nxt = max(nxt, top + 1)
                if not events and s.revision == top:
                    await wake.wait()
        finally:
            s._wakeups.discard(wake)

    async def close(self) -> None:
        self._closed = True


def _copy(key: str, value: Mapping[str, Any]) -> dict[str, Any]:
    """What a real store would hand back: the value through JSON (its checks, and no shared mutable dict)."""
    return decode_value(encode_value(key, value))
