"""SqliteStateStore details the shared suite (tests/integration/statestore_suite.py) does not cover: the file
in the data dir, restart, bounded watch history, what it refuses. No sockets, no waiting."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from openvsan.node.statestore import (
    STATE_DB_NAME,
    Compacted,
    Conflict,
    Lease,
    SqliteStateStore,
    StoreUnavailable,
)


def test_one_private_file_in_the_data_dir(tmp_path: Path) -> None:
    async def body() -> None:
        async with SqliteStateStore.in_data_dir(tmp_path) as s:
            await s.put("/volumes/v", {"size": 1})
        db = tmp_path / STATE_DB_NAME
        assert db.name == "state-kv.db"
        assert stat.S_IMODE(db.stat().st_mode) == 0o600
        assert {p.name for p in tmp_path.iterdir()} <= {"state-kv.db", "state-kv.db-wal", "state-kv.db-shm"}

    asyncio.run(body())


def test_state_and_revision_survive_reopen(tmp_path: Path) -> None:
    async def body() -> None:
        async with SqliteStateStore(tmp_path / "s.db") as s:
            r1 = await s.put("/a", {"x": 1})
            r2 = await s.put("/a", {"x": 2}, expect=r1)
        async with SqliteStateStore(tmp_path / "s.db") as s:
            e = await s.get("/a")
            assert e is not None and (e.value, e.revision, e.created, e.version) == ({"x": 2}, r2, r1, 2)
            assert await s.revision() == r2
            assert await s.put("/b", {}) == r2 + 1
            with pytest.raises(Conflict):
                await s.put("/a", {}, expect=r1)

    asyncio.run(body())


def test_two_connections_to_one_file_serialize_cas(tmp_path: Path) -> None:
    """Two stores on one file stand for two processes: a CAS won through one is seen by the other."""

    async def body() -> None:
        async with SqliteStateStore(tmp_path / "s.db") as a, SqliteStateStore(tmp_path / "s.db") as b:
            r = await a.put("/k", {"by": "a"}, expect=0)
            with pytest.raises(Conflict) as ei:
                await b.put("/k", {"by": "b"}, expect=0)
            assert ei.value.actual == r
            assert await b.put("/k", {"by": "b"}, expect=r) == r + 1
            e = await a.get("/k")
            assert e is not None and e.value == {"by": "b"}

    asyncio.run(body())


def test_watch_below_the_kept_history_is_compacted(tmp_path: Path) -> None:
    async def body() -> None:
        async with SqliteStateStore(tmp_path / "s.db", history=5) as s:
            revs = [await s.put(f"/k/{i}", {"i": i}) for i in range(12)]
            oldest_kept = revs[-1] - 5 + 1
            with pytest.raises(Compacted) as ei:
                await anext(s.watch("/k/", start_revision=revs[0]))
            assert ei.value.oldest == oldest_kept
            assert "list() the state and watch from revision() + 1" in str(ei.value)
            ev = await anext(s.watch("/k/", start_revision=oldest_kept))
            assert (ev.revision, ev.entry.key) == (oldest_kept, f"/k/{12 - 5}")

    asyncio.run(body())


def test_no_leases_on_one_node(tmp_path: Path) -> None:
    class FakeLease(Lease):
        id, ttl = 1, 10

        async def refresh(self) -> int:
            return 10

        async def revoke(self) -> None:
            pass

    async def body() -> None:
        async with SqliteStateStore(tmp_path / "s.db") as s:
            with pytest.raises(NotImplementedError, match="one node needs none"):
                await s.grant_lease(10)
            with pytest.raises(NotImplementedError):
                await s.put("/k", {}, lease=FakeLease())
            assert await s.get("/k") is None

    asyncio.run(body())


def test_unusable_path_and_closed_store(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailable, match="no-such-dir"):
        SqliteStateStore(tmp_path / "no-such-dir" / "s.db")

    async def body() -> None:
        s = SqliteStateStore(tmp_path / "s.db")
        await s.close()
        with pytest.raises(StoreUnavailable, match="closed"):
            await s.get("/k")

    asyncio.run(body())
