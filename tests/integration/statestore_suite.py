"""The StateStore contract, written once and run against every implementation (the `store` fixture of
tests/integration/conftest.py: SQLite and a real etcd). tests/integration/test_statestore.py collects it; a
new implementation passes when it passes this file.

Revisions are compared with each other, never with absolute numbers: etcd starts its own count and one etcd
serves every test of a module.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openvsan.node.statestore import Conflict, Event, LeaseExpired, StateStore

if TYPE_CHECKING:
    from conftest import StoreMaker


async def take(it: AsyncIterator[Event], n: int, timeout: float = 10) -> list[Event]:
    out: list[Event] = []

    async def collect() -> None:
        async for ev in it:
            out.append(ev)
            if len(out) == n:
                return

    await asyncio.wait_for(collect(), timeout)
    return out


def test_get_put_delete(store: StoreMaker) -> None:
    async def body(s: StateStore) -> None:
        assert await s.get("/volumes/live1") is None
        r1 = await s.put("/volumes/live1", {"size": 268435456, "stack": [{"type": "qos"}]})
        e = await s.get("/volumes/live1")
        assert e is not None
        assert (e.key, e.value, e.revision, e.created, e.version) == (
            "/volumes/live1",
            {"size": 268435456, "stack": [{"type": "qos"}]},
            r1,
            r1,
            1,
        )
        r2 = await s.put("/volumes/live1", {"size": 536870912})
        e = await s.get("/volumes/live1")
        assert e is not None and (e.value, e.revision, e.created, e.version) == ({"size": 536870912}, r2, r1, 2)
        r3 = await s.delete("/volumes/live1")
        assert r3 > r2 and await s.get("/volumes/live1") is None
        assert await s.revision() == r3
        # deleting what is not there changes nothing: no new revision
        assert await s.delete("/volumes/live1") == r3 and await s.revision() == r3
        # a key created again starts over: new created revision, version 1
        r4 = await s.put("/volumes/live1", {})
        e = await s.get("/volumes/live1")
        assert e is not None and (e.created, e.version) == (r4, 1)

    store.run(body)


def test_cas_conflicts(store: StoreMaker) -> None:
    async def body(s: StateStore) -> None:
        r1 = await s.put("/k", {"v": 1}, expect=0)  # create: must not exist
        with pytest.raises(Conflict) as ei:
            await s.put("/k", {"v": 2}, expect=0)
        assert (ei.value.key, ei.value.expected, ei.value.actual) == ("/k", 0, r1)
        assert str(ei.value) == f"/k: expected no entry, found revision {r1}"
        r2 = await s.put("/k", {"v": 2}, expect=r1)
        with pytest.raises(Conflict) as ei:
            await s.put("/k", {"v": 3}, expect=r1)  # stale
        assert str(ei.value) == f"/k: expected revision {r1}, found revision {r2}"
        with pytest.raises(Conflict):
            await s.delete("/k", expect=r1)
        e = await s.get("/k")
        assert e is not None and e.value == {"v": 2} and await s.revision() == r2  # nothing changed
        with pytest.raises(Conflict) as ei:
            await s.put("/absent", {}, expect=r2)
        assert str(ei.value) == f"/absent: expected revision {r2}, found no entry"
        r3 = await s.delete("/k", expect=r2)
        assert r3 > r2 and await s.get("/k") is None

    store.run(body)


def test_txn_all_or_nothing(store: StoreMaker) -> None:
    async def body(s: StateStore) -> None:
        rv = await s.put("/volumes/v1", {"size": 1})
        # the reconciler's commit: a volume and its export together, both CAS
        rt = await s.txn(
            {"/volumes/v1": rv, "/exports/e1": 0}, {"/volumes/v1": {"size": 2}, "/exports/e1": {"volume": "v1"}}
        )
        assert rt > rv
        got = {e.key: (e.value, e.revision) for e in await s.list("/")}
        assert got == {"/exports/e1": ({"volume": "v1"}, rt), "/volumes/v1": ({"size": 2}, rt)}
        # one stale compare: nothing of it happens
        with pytest.raises(Conflict) as ei:
            await s.txn(
                {"/volumes/v1": rt, "/exports/e1": rv},
                {"/volumes/v1": {"size": 3}, "/volumes/v2": {}},
                ["/exports/e1"],
            )
        assert (ei.value.key, ei.value.expected, ei.value.actual) == ("/exports/e1", rv, rt)
        assert await s.revision() == rt
        assert {e.key: e.value for e in await s.list("/")} == {
            "/exports/e1": {"volume": "v1"},
            "/volumes/v1": {"size": 2},
        }
        # puts and deletes in one revision
        rd = await s.txn({"/exports/e1": rt}, {"/volumes/v2": {"size": 9}}, ["/exports/e1"])
        assert [(e.key, e.revision) for e in await s.list("/")] == [("/volumes/v1", rt), ("/volumes/v2", rd)]
        with pytest.raises(ValueError, match="twice"):
            await s.txn({}, {"/a": {}}, ["/a"])

    store.run(body)


def test_list_by_prefix_sorted(store: StoreMaker) -> None:
    async def body(s: StateStore) -> None:
        for key in ["/volumes/b", "/volumes/a", "/volumesX", "/exports/z", "/volumes/a/child", "/volumes/é", "/v"]:
            await s.put(key, {"k": key})
        assert [e.key for e in await s.list("/volumes/")] == [
            "/volumes/a",
            "/volumes/a/child",
            "/volumes/b",
            "/volumes/é",
        ]
        assert [e.key for e in await s.list("/volumes")] == [
            "/volumes/a",
            "/volumes/a/child",
            "/volumes/b",
            "/volumes/é",
            "/volumesX",
        ]
        assert [e.key for e in await s.list("/")] == sorted(
            ["/volumes/b", "/volumes/a", "/volumesX", "/exports/z", "/volumes/a/child", "/volumes/é", "/v"]
        )
        assert await s.list("/nothing/") == []
        assert all(e.value == {"k": e.key} for e in await s.list("/"))

    store.run(body)


def test_revisions_strictly_increase(store: StoreMaker) -> None:
    async def body(s: StateStore) -> None:
        before = await s.revision()
        revs = []
        for i in range(20):
            revs.append(await s.put(f"/r/{i % 3}", {"i": i}))
            if i % 5 == 4:
                revs.append(await s.delete(f"/r/{i % 3}"))
        assert revs[0] > before and all(b > a for a, b in itertools.pairwise(revs))
        assert await s.revision() == revs[-1]

    store.run(body)


def test_bad_keys_and_values(store: StoreMaker) -> None:
    async def body(s: StateStore) -> None:
        for key in ["volumes/x", "", "/", "/a\0b"]:
            with pytest.raises(ValueError, match="store key"):
                await s.put(key, {})
        with pytest.raises(TypeError, match="JSON object"):
            await s.put("/k", [1, 2])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not JSON"):
            await s.put("/k", {"x": object()})
        assert await s.get("/k") is None

    store.run(body)


def test_watch_replays_in_revision_order(store: StoreMaker) -> None:
    async def body(s: StateStore) -> None:
        r1 = await s.put("/w/a", {"n": 1})
        r2 = await s.put("/other/x", {})
        r3 = await s.put("/w/b", {"n": 2})
        r4 = await s.delete("/w/a")
        r5 = await s.txn({}, {"/w/c": {"n": 3}, "/w/d": {"n": 4}})
        events = await take(s.watch("/w/", start_revision=r1), 5)
        assert [(e.kind, e.entry.key, e.revision) for e in events] == [
            ("put", "/w/a", r1),
            ("put", "/w/b", r3),
            ("delete", "/w/a", r4),
            ("put", "/w/c", r5),
            ("put", "/w/d", r5),
        ]
        assert events[0].entry.value == {"n": 1} and events[0].entry.version == 1
        assert events[2].entry.value == {} and events[2].entry.version == 0
        # from a later revision: only what came at or after it
        later = await take(s.watch("/w/", start_revision=r3 + 1), 3)
        assert [(e.kind, e.entry.key) for e in later] == [("delete", "/w/a"), ("put", "/w/c"), ("put", "/w/d")]
        # inclusive start; another prefix sees only its own
        assert [e.revision for e in await take(s.watch("/other/", start_revision=r2), 1)] == [r2]

    store.run(body)


def test_watch_follows_changes_made_after_it_began(store: StoreMaker) -> None:
    async def body(s: StateStore, writer: StateStore) -> None:
        await s.put("/w/old", {})
        watch = s.watch("/w/")  # from the next revision: "/w/old" is not replayed
        first = asyncio.ensure_future(take(watch, 3))
        await asyncio.sleep(0.3)  # the watch is live before anything is written
        r1 = await writer.put("/w/x", {"v": 1})
        await writer.put("/elsewhere", {})
        r2 = await writer.put("/w/x", {"v": 2}, expect=r1)
        r3 = await writer.delete("/w/x")
        events = await first
        assert [(e.kind, e.entry.key, e.revision) for e in events] == [
            ("put", "/w/x", r1),
            ("put", "/w/x", r2),
            ("delete", "/w/x", r3),
        ]
        assert events[1].entry.version == 2 and events[1].entry.value == {"v": 2}

    store.run(body, n=2)


def test_concurrent_cas_exactly_one_wins(store: StoreMaker) -> None:
    async def body(a: StateStore, b: StateStore) -> None:
        r0 = await a.put("/volumes/v", {"owner": None})
        for round_ in range(5):
            entry = await a.get("/volumes/v")
            assert entry is not None
            results = await asyncio.gather(
                a.put("/volumes/v", {"owner": "a", "round": round_}, expect=entry.revision),
                b.put("/volumes/v", {"owner": "b", "round": round_}, expect=entry.revision),
                return_exceptions=True,
            )
            wins = [r for r in results if isinstance(r, int)]
            losses = [r for r in results if isinstance(r, Conflict)]
            assert len(wins) == 1 and len(losses) == 1, results
            now = await b.get("/volumes/v")
            assert now is not None and now.revision == wins[0] and now.value["round"] == round_
            assert losses[0].actual == wins[0] or losses[0].actual > entry.revision
        assert r0 < wins[0]

    store.run(body, n=2)


def test_cas_counter_loses_no_increment(store: StoreMaker) -> None:
    """Writers that read, add one and CAS back (retrying on Conflict): the total is every increment, once."""

    async def body(a: StateStore, b: StateStore) -> None:
        await a.put("/counter", {"n": 0})

        async def bump(s: StateStore, times: int) -> int:
            conflicts = 0
            for _ in range(times):
                while True:
                    e = await s.get("/counter")
                    assert e is not None
                    try:
                        await s.put("/counter", {"n": e.value["n"] + 1}, expect=e.revision)
                        break
                    except Conflict:
                        conflicts += 1
            return conflicts

        await asyncio.gather(bump(a, 15), bump(b, 15), bump(a, 15), bump(b, 15))
        e = await a.get("/counter")
        assert e is not None and e.value == {"n": 60} and e.version == 61

    store.run(body, n=2)


def test_lease_expiry(store: StoreMaker) -> None:
    if store.kind == "sqlite":

        async def none(s: StateStore) -> None:
            with pytest.raises(NotImplementedError, match="one node needs none"):
                await s.grant_lease(2)

        store.run(none)
        return

    async def body(s: StateStore) -> None:
        lease = await s.grant_lease(2)
        assert lease.ttl >= 2
        await s.put("/leader", {"node": "n1"}, expect=0, lease=lease)
        start = await s.revision()
        keeper = lease.keep_alive()
        await asyncio.sleep(lease.ttl * 2)  # kept alive past its TTL
        assert await s.get("/leader") is not None
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        # etcd's leader revokes an expired lease through raft (a proposal and an fsync): on a loaded machine
        # that has taken more than TTL + 5 s; renewed, it would still be there after this bound
        gone = await take(s.watch("/leader", start_revision=start + 1), 1, timeout=lease.ttl * 3 + 10)
        assert gone[0].kind == "delete" and await s.get("/leader") is None
        with pytest.raises(LeaseExpired):
            await lease.refresh()
        # revoke: the key goes at once
        l2 = await s.grant_lease(30)
        await s.put("/leader", {"node": "n2"}, lease=l2)
        await l2.revoke()
        assert await s.get("/leader") is None

    store.run(body)


KEYS = ["/m/a", "/m/b", "/m/c/d"]
op_strategy = st.tuples(
    st.sampled_from(["put", "delete"]),
    st.sampled_from(KEYS),
    st.sampled_from(["none", "absent", "current", "stale"]),
    st.integers(0, 9),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op_strategy, min_size=1, max_size=15))
def test_random_ops_match_a_dict(store: StoreMaker, ops: list[tuple[str, str, str, int]]) -> None:
    store.new_space()

    async def body(s: StateStore) -> None:
        model: dict[str, dict[str, Any]] = {}  # key -> value, revision, created, version
        last = await s.revision()
        for kind, key, mode, n in ops:
            cur = model.get(key)
            actual = cur["revision"] if cur else 0
            expect = {"none": None, "absent": 0, "current": actual, "stale": actual + 1000}[mode]
            should_conflict = expect is not None and expect != actual
            try:
                if kind == "put":
                    rev = await s.put(key, {"n": n}, expect=expect)
                else:
                    rev = await s.delete(key, expect=expect)
            except Conflict as c:
                assert should_conflict, (kind, key, mode)
                assert (c.expected, c.actual) == (expect, actual)
                continue
            assert not should_conflict, (kind, key, mode)
            if kind == "put":
                assert rev > last
                model[key] = {
                    "value": {"n": n},
                    "revision": rev,
                    "created": cur["created"] if cur else rev,
                    "version": cur["version"] + 1 if cur else 1,
                }
            elif cur is not None:
                assert rev > last
                del model[key]
            else:
                assert rev == last  # nothing to delete: no revision
            last = rev
        got = {
            e.key: {"value": e.value, "revision": e.revision, "created": e.created, "version": e.version}
            for e in await s.list("/")
        }
        assert list(got) == sorted(model) and got == model
        for key in KEYS:
            e = await s.get(key)
            assert (e is None) == (key not in model)

    store.run(body)
