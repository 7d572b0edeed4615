"""Cluster membership in the store (cluster/membership.py): init once, join numbers, leave refused while a
node holds replicas, a node of another cluster refused."""

from __future__ import annotations

import asyncio

import pytest

from openvsan.cluster import membership as M
from openvsan.node.memstore import MemoryState, MemoryStateStore


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_members_get_numbers_once_and_a_foreign_cluster_is_refused() -> None:
    async def body() -> None:
        s = MemoryStateStore(MemoryState(clock=lambda: 0.0))
        with pytest.raises(M.ClusterError, match="no openvsan cluster yet"):
            await M.join(s, "c1", "a", "10.0.0.1:4430")
        await M.init(s, "c1")
        await M.init(s, "c1")                            # again, same ID: nothing changes
        with pytest.raises(M.ClusterError, match="holds openvsan cluster 'c1', not 'c2'"):
            await M.init(s, "c2")
        a = await M.join(s, "c1", "a", "10.0.0.1:4430")
        b = await M.join(s, "c1", "b", "10.0.0.2:4430")
        again = await M.join(s, "c1", "a", "10.0.0.9:4430")   # new address, same number
        assert (a.number, b.number, again.number) == (1, 2, 1)
        with pytest.raises(M.ClusterError, match="another cluster"):
            await M.join(s, "c2", "x", "10.0.0.3:4430")
        members = await M.members(s)
        assert {n: m.replication for n, m in members.items()} == {"a": "10.0.0.9:4430", "b": "10.0.0.2:4430"}
        with pytest.raises(M.ClusterError, match="holds replicas of v1"):
            await M.leave(s, "b", holds=["v1"])
        await M.leave(s, "b")
        assert set(await M.members(s)) == {"a"}
        c = await M.join(s, "c1", "c", "10.0.0.3:4430")
        assert c.number == 3                             # numbers are never reused
        with pytest.raises(M.ClusterError, match="not a member"):
            await M.leave(s, "b")

    run(body())


def test_concurrent_joins_never_share_a_number() -> None:
    async def body() -> None:
        state = MemoryState(clock=lambda: 0.0)
        await M.init(MemoryStateStore(state), "c1")
        got = await asyncio.gather(*(M.join(MemoryStateStore(state), "c1", f"n{i}", f"10.0.0.{i}:4430")
                                     for i in range(8)))
        assert sorted(m.number for m in got) == list(range(1, 9))

    run(body())


def test_the_cluster_secret_is_made_once_and_every_node_gets_the_same() -> None:
    """The replication path's DH-HMAC-CHAP keys derive from it (replication/peer.py replication_keys); a
    cluster made before secrets existed gets one, by compare-and-swap, however many nodes ask at once."""
    async def body() -> None:
        store = MemoryStateStore(MemoryState())
        await M.init(store, "c1")
        a = await M.secret(store, "c1")
        assert len(a) == 32 and await M.secret(store, "c1") == a
        with pytest.raises(M.ClusterError, match="openvsan cluster 'c1', not 'c2'"):
            await M.secret(store, "c2")
        old = MemoryStateStore(MemoryState())
        await old.put(M.INFO, {"id": "c1", "next": 1}, expect=0)          # as an older `vsan cluster init` made it
        got = await asyncio.gather(*(M.secret(old, "c1") for _ in range(5)))
        assert len(set(got)) == 1 and len(got[0]) == 32 and got[0] != a
        assert (await old.get(M.INFO)).value["next"] == 1                 # nothing else changed
    run(body())
