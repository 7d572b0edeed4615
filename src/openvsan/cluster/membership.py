"""A cluster's members, in its StateStore (etcd): who is in it, how to reach them, who is up.

Keys (under the store's prefix):
- `/cluster/info`: the cluster's ID (what `vsan cluster init` was given), the next node number, and the
  cluster's secret (random, made once): the replication path's DH-HMAC-CHAP keys derive from it, so only
  nodes that can read the cluster's store reach a replica. A node whose [cluster] id differs cannot join,
  and no node can serve replicas until the cluster exists.
- `/cluster/nodes/<name>`: a member: its number (1, 2, ...: never reused; a node's ALUA target port group
  and its NVMe controller IDs derive from it, so they differ on every node that exports one volume), its
  replication address (where peers reach its replicas), its management address. Made by `join` (a txn with
  the info key, so two joins never get one number), removed by `leave`.
- `/cluster/alive/<name>`: put by a serving node under a lease of its own: present while it is up.
"""

from __future__ import annotations

import base64
import datetime as dt
import os
from dataclasses import dataclass
from typing import Any

from openvsan.node.statestore import Conflict, Lease, StateStore
from openvsan.node.values import check_object_name

INFO = "/cluster/info"
NODES = "/cluster/nodes/"
ALIVE = "/cluster/alive/"


class ClusterError(Exception):
    """A membership change the cluster refuses; str() is one line for the user."""


@dataclass(frozen=True)
class Member:
    name: str
    number: int
    replication: str            # host:port
    management: str | None = None

    def value(self) -> dict[str, Any]:
        return {"number": self.number, "replication": self.replication, "management": self.management}

    @classmethod
    def from_value(cls, name: str, v: dict[str, Any]) -> Member:
        return cls(name, int(v["number"]), str(v["replication"]), v.get("management"))


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


async def init(store: StateStore, cluster_id: str) -> None:
    """Make the cluster (once): an existing one with another ID is refused, the same ID is a no-op."""
    check_object_name(cluster_id)
    try:
        await store.put(INFO, {"id": cluster_id, "next": 1, "created": _now(), "secret": _new_secret()}, expect=0)
    except Conflict:
        await check(store, cluster_id)


def _new_secret() -> str:
    return base64.b64encode(os.urandom(32)).decode()


async def secret(store: StateStore, cluster_id: str) -> bytes:
    """The cluster's secret (32 bytes); a cluster made before secrets existed gets one now (compare-and-swap,
    so every node takes the same)."""
    while True:
        e = await store.get(INFO)
        if e is None or e.value.get("id") != cluster_id:
            await check(store, cluster_id)     # says what is wrong
            continue
        text = e.value.get("secret")
        if text:
            return base64.b64decode(text)
        try:
            await store.put(INFO, {**e.value, "secret": _new_secret()}, expect=e.revision)
        except Conflict:
            continue


async def check(store: StateStore, cluster_id: str) -> dict[str, Any]:
    """The cluster's info, if this store holds cluster `cluster_id`; else ClusterError."""
    e = await store.get(INFO)
    if e is None:
        raise ClusterError("the etcd cluster holds no openvsan cluster yet; run `vsan cluster init --id "
                           f"{cluster_id} --etcd ...` once first")
    if e.value.get("id") != cluster_id:
        raise ClusterError(f"the etcd cluster holds openvsan cluster {e.value.get('id')!r}, not {cluster_id!r}: "
                           "this node belongs to another cluster (check [cluster] id)")
    return e.value


async def join(store: StateStore, cluster_id: str, name: str, replication: str,
               management: str | None = None) -> Member:
    """Add node `name` (or update the addresses of a member of that name, keeping its number)."""
    check_object_name(name)
    while True:
        info = await store.get(INFO)
        await check(store, cluster_id)
        assert info is not None
        known = await store.get(NODES + name)
        if known is not None:
            m = Member(name, int(known.value["number"]), replication,
                       management or known.value.get("management"))     # None: keep what `join` was told
            try:
                await store.put(NODES + name, m.value(), expect=known.revision)
            except Conflict:
                continue
            return m
        n = int(info.value.get("next", 1))
        m = Member(name, n, replication, management)
        try:
            await store.txn({INFO: info.revision, NODES + name: 0},
                            {INFO: {**info.value, "next": n + 1}, NODES + name: m.value()})
        except Conflict:
            continue              # another join got in first: take the next number
        return m


async def leave(store: StateStore, name: str, *, holds: list[str] | None = None) -> None:
    """Remove member `name`; refused while it holds replicas (`holds`: the volumes that list it)."""
    if holds:
        raise ClusterError(f"node {name} holds replicas of {', '.join(sorted(holds))}; move them to another "
                           "node first")
    e = await store.get(NODES + name)
    if e is None:
        raise ClusterError(f"node {name} is not a member of the cluster")
    await store.delete(NODES + name, expect=e.revision)


async def members(store: StateStore) -> dict[str, Member]:
    return {e.key[len(NODES):]: Member.from_value(e.key[len(NODES):], e.value) for e in await store.list(NODES)}


async def alive(store: StateStore) -> dict[str, dict[str, Any]]:
    return {e.key[len(ALIVE):]: e.value for e in await store.list(ALIVE)}


async def announce(store: StateStore, name: str, lease: Lease, **facts: Any) -> None:
    """This node is up (for as long as `lease` lives)."""
    await store.put(ALIVE + name, {"since": _now(), **facts}, lease=lease)


async def status(store: StateStore) -> dict[str, Any]:
    """The cluster as its store has it: members (up or not) and every replicated volume's primary, epoch and
    replicas (`vsan cluster status`, and any member's REST API: /api/v1/cluster)."""
    from openvsan.replication import record as R

    info = await store.get(INFO)
    if info is None:
        raise ClusterError("no openvsan cluster in this etcd; run `vsan cluster init --id NAME` first")
    listed, up = await members(store), await alive(store)
    volumes = []
    for e in await store.list(R.VOLUMES):
        rs = R.ReplicaSet.from_entry(e.key[len(R.VOLUMES):], e.value, e.revision)
        held = await store.get(R.PRIMARY + rs.volume)
        volumes.append({"volume": rs.volume, "nodes": list(rs.nodes), "epoch": rs.epoch,
                        "primary": held.value.get("node") if held is not None else None,
                        "in_sync": list(rs.in_sync), "out_of_sync": dict(rs.out_of_sync)})
    return {"id": info.value.get("id"),
            "nodes": [{"name": n, "number": m.number, "replication": m.replication, "management": m.management,
                       "up": n in up} for n, m in sorted(listed.items(), key=lambda x: x[1].number)],
            "volumes": volumes}
