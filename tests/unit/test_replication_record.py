"""A replicated volume's record and its primary's election (replication/record.py), on the in-memory StateStore
with a simulated clock: the rules that keep every acknowledged write, each one and under random interleavings
of claims, markings and lease expiries."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openvsan.node.memstore import MemoryState, MemoryStateStore
from openvsan.replication import record as R


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def world() -> tuple[Clock, MemoryStateStore]:
    clock = Clock()
    return clock, MemoryStateStore(MemoryState(clock=clock))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_one_primary_at_a_time_and_epochs_grow() -> None:
    async def go() -> None:
        clock, store = world()
        await R.create(store, "v", ["a", "b", "c"])
        la = await store.grant_lease(5)
        a = await R.claim_primary(store, "v", "a", la)
        assert a.primary == "a" and a.epoch > 0 and a.in_sync == ("a", "b", "c")
        with pytest.raises(R.PrimaryBusy, match="a is primary"):
            await R.claim_primary(store, "v", "b", await store.grant_lease(5))
        clock.now += 6                      # a stops renewing: its lease expires, its key goes
        b = await R.claim_primary(store, "v", "b", await store.grant_lease(5))
        assert b.primary == "b" and b.epoch > a.epoch
        assert (await R.load(store, "v")).epoch == b.epoch
    run(go())


def test_an_out_of_sync_replica_is_never_elected() -> None:
    async def go() -> None:
        clock, store = world()
        await R.create(store, "v", ["a", "b", "c"])
        a = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        a = await R.mark_out_of_sync(store, a, "b")       # before acknowledging a write b did not get
        assert a.out_of_sync == {"b": a.epoch} and a.in_sync == ("a", "c")
        clock.now += 6
        with pytest.raises(R.NotInSync, match=r"b misses writes since epoch \d+; it must resync from an in-sync "
                                              r"replica \(a, c\)"):
            await R.claim_primary(store, "v", "b", await store.grant_lease(5))
        c = await R.claim_primary(store, "v", "c", await store.grant_lease(5))
        assert c.out_of_sync == {"b": a.epoch}           # the mark survives the election
        c = await R.mark_in_sync(store, c, "b")           # its resync done, under c's epoch
        assert c.in_sync == ("a", "b", "c")
    run(go())


def test_the_old_primary_is_fenced_by_the_new_epoch() -> None:
    async def go() -> None:
        clock, store = world()
        await R.create(store, "v", ["a", "b"])
        a = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        clock.now += 6                                    # a is paused (SIGSTOP) past its lease
        b = await R.claim_primary(store, "v", "b", await store.grant_lease(5))
        with pytest.raises(R.Fenced, match=f"epoch {a.epoch} is over"):
            await R.mark_out_of_sync(store, a, "b")      # a wakes and would drop b to acknowledge alone
        assert (await R.load(store, "v")).out_of_sync == {}
        assert b.epoch > a.epoch
    run(go())


def test_a_claim_that_loses_the_race_to_a_marking_gives_the_epoch_back() -> None:
    async def go() -> None:
        clock, store = world()
        await R.create(store, "v", ["a", "b", "c"])
        a = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        clock.now += 6                                    # a's lease is gone; a still marks b (its last act)
        real_put = store.put

        async def put_then_mark(key: str, value: Any, **kw: Any) -> int:
            rev = await real_put(key, value, **kw)
            if key.startswith(R.PRIMARY):                 # b got the primary key; a's marking lands now
                store.put = real_put                      # type: ignore[method-assign]
                await R.mark_out_of_sync(store, a, "b")
            return rev
        store.put = put_then_mark                         # type: ignore[method-assign]
        with pytest.raises(R.PrimaryBusy, match="changed during the election"):
            await R.claim_primary(store, "v", "b", await store.grant_lease(5))
        assert await store.get(R.PRIMARY + "v") is None   # the epoch was given back
        with pytest.raises(R.NotInSync):
            await R.claim_primary(store, "v", "b", await store.grant_lease(5))
        c = await R.claim_primary(store, "v", "c", await store.grant_lease(5))
        assert c.out_of_sync == {"b": a.epoch}
    run(go())


def test_bad_sets_and_strangers_are_refused() -> None:
    async def go() -> None:
        _, store = world()
        for nodes, words in ((["a"], "2 or 3"), (["a", "a"], "2 or 3"), (["a", "b", "c", "d"], "2 or 3"),
                             (["a", "b c"], "not a usable name")):
            with pytest.raises((R.ReplicationError, ValueError), match=words):
                await R.create(store, "v", nodes)
        await R.create(store, "v", ["a", "b"])
        with pytest.raises(R.ReplicationError, match="replicated already"):
            await R.create(store, "v", ["a", "b"])
        with pytest.raises(R.NotAMember, match="z holds no replica"):
            await R.claim_primary(store, "v", "z", await store.grant_lease(5))
        with pytest.raises(R.ReplicationError, match="not replicated"):
            await R.load(store, "w")
        a = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        with pytest.raises(R.ReplicationError, match="a is not a secondary"):
            await R.mark_out_of_sync(store, a, "a")
    run(go())


def test_step_down_lets_another_in_sync_replica_take_over_at_once() -> None:
    async def go() -> None:
        _, store = world()
        await R.create(store, "v", ["a", "b"])
        a = await R.claim_primary(store, "v", "a", await store.grant_lease(30))
        await R.step_down(store, a)
        b = await R.claim_primary(store, "v", "b", await store.grant_lease(30))
        assert b.epoch > a.epoch
    run(go())


# ---- random interleavings: the invariants hold whatever the order

NODES = ("a", "b", "c")
op = st.one_of(
    st.tuples(st.just("claim"), st.sampled_from(NODES)),
    st.tuples(st.just("mark"), st.sampled_from(NODES), st.sampled_from(NODES)),   # as primary x, mark y
    st.tuples(st.just("resync"), st.sampled_from(NODES), st.sampled_from(NODES)),
    st.tuples(st.just("expire"), st.sampled_from(NODES)),
    st.tuples(st.just("stepdown"), st.sampled_from(NODES)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=40))
def test_random_histories_keep_every_acknowledged_write(ops: list[tuple[str, ...]]) -> None:
    """A model of the data: each primary 'acknowledges a write' after each successful marking round (every
    secondary either got it or is marked). Afterwards: epochs only grow, no two holders of one epoch, and
    every node ever elected held every write acknowledged before its election."""
    async def go() -> None:
        clock, store = world()
        await R.create(store, "v", NODES)
        views: dict[str, R.ReplicaSet] = {}          # each node's last view as primary (kept when fenced)
        leases: dict[str, Any] = {}
        has: dict[str, set[int]] = {n: set() for n in NODES}   # writes each replica holds
        acked: list[int] = []
        epochs: list[int] = []
        for o in ops:
            kind = o[0]
            try:
                if kind == "claim":
                    n = o[1]
                    leases[n] = await store.grant_lease(5)
                    v = await R.claim_primary(store, "v", n, leases[n])
                    assert not epochs or v.epoch > epochs[-1]
                    epochs.append(v.epoch)
                    assert set(acked) <= has[n], "an elected replica lacks an acknowledged write"
                    views[n] = v
                elif kind == "mark":
                    x, y = o[1], o[2]
                    if x not in views or y == x:
                        continue
                    v = await R.mark_out_of_sync(store, views[x], y)
                    views[x] = v
                    # x acknowledges a write now: on itself and every secondary the record keeps in sync
                    w = len(acked) + 1
                    for n in v.in_sync:
                        has[n].add(w)
                    acked.append(w)
                elif kind == "resync":
                    x, y = o[1], o[2]
                    if x not in views:
                        continue
                    has[y] |= has[x]                   # a resync copies what the primary holds
                    views[x] = await R.mark_in_sync(store, views[x], y)
                elif kind == "expire":
                    clock.now += 6
                elif kind == "stepdown" and o[1] in views:
                    await R.step_down(store, views[o[1]])
            except (R.Fenced, R.PrimaryBusy, R.NotInSync):
                pass
        rs = await R.load(store, "v")
        for n in rs.in_sync:
            assert set(acked) <= has[n], f"{n} is in sync but lacks an acknowledged write"
    run(go())


def test_a_stale_replica_declares_itself_and_only_force_brings_back_a_set_with_none_in_sync() -> None:
    async def go() -> None:
        store = MemoryStateStore(MemoryState(clock=lambda: 0.0))
        await R.create(store, "v", ["a", "b"])
        rs = await R.declare_stale(store, "v", "b")
        assert rs.out_of_sync == {"b": 0} and rs.in_sync == ("a",)
        assert (await R.declare_stale(store, "v", "b")).revision == rs.revision     # once is enough
        with pytest.raises(R.ReplicationError, match="a in sync still"):
            await R.force_in_sync(store, "v", "b")      # forcing b would lose what a has
        await R.declare_stale(store, "v", "a")
        assert (await R.load(store, "v")).in_sync == ()
        lease = await store.grant_lease(5)
        with pytest.raises(R.NotInSync):
            await R.claim_primary(store, "v", "a", lease)
        forced = await R.force_in_sync(store, "v", "a")
        assert forced.in_sync == ("a",) and forced.out_of_sync == {"b": 0}
        assert (await R.claim_primary(store, "v", "a", lease)).primary == "a"

    asyncio.run(go())
