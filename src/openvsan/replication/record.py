"""A replicated volume's record in the cluster's StateStore, and the only ways it changes.

Two keys per volume:
- `/replication/volumes/<volume>`: the replica set: its nodes, the current epoch and primary, and the
  replicas out of sync (node -> the epoch since which it misses acknowledged writes). Every change is a
  compare-and-swap on this key's revision.
- `/replication/primary/<volume>`: put with `expect=0` under the primary's lease, so at most one node holds
  it; its revision when made is the new epoch, the fencing token every replicated write carries (DESIGN.md,
  "Replication and failover"; Jepsen: an etcd lock is safe only with such a token).

The rules, which make "no acknowledged write is ever lost" hold on any sequence of failures:
1. Only an in-sync replica can become primary (`claim_primary` refuses one that is out of sync).
2. The primary records a replica as out of sync (`mark_out_of_sync`, CAS) *before* it acknowledges a write
   that replica did not get. If the CAS fails because a new primary was elected meanwhile, the old primary
   is fenced: it must not acknowledge the write (it fails it or holds it; the initiator retries elsewhere).
3. A claim and a marking race only through the record's CAS, so one of them loses and re-reads: a replica
   that was marked cannot then be elected, and a new primary's election makes the old one's marking fail.
4. Only the primary of the current epoch puts a replica back in sync (`mark_in_sync`), after its resync.
Hence every acknowledged write is on every replica that the record says is in sync, and the next primary is
one of those.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from openvsan.node.statestore import Conflict, Lease, StateStore
from openvsan.node.values import check_object_name

VOLUMES = "/replication/volumes/"
PRIMARY = "/replication/primary/"
MAX_REPLICAS = 3


class ReplicationError(Exception):
    """A change to a replica set that the rules refuse; str() is one line."""


class NotAMember(ReplicationError):
    pass


class NotInSync(ReplicationError):
    pass


class PrimaryBusy(ReplicationError):
    """Another node holds the primary's lease (or won the race for it)."""


class Fenced(ReplicationError):
    """The caller's epoch is over: another node is primary now. It must not acknowledge anything more."""


@dataclass(frozen=True)
class ReplicaSet:
    volume: str
    nodes: tuple[str, ...]
    epoch: int = 0                      # 0: no primary was ever elected
    primary: str | None = None
    out_of_sync: Mapping[str, int] = field(default_factory=dict)   # node -> epoch since which it misses writes
    revision: int = 0                   # the record's revision in the store (what a CAS expects)
    uuid: str | None = None             # the volume's identity on every replica node (NAA, EUI-64, NGUID, serial)
    written: bool = False               # some primary acknowledged a write: a new, empty replica needs a full copy

    @property
    def in_sync(self) -> tuple[str, ...]:
        return tuple(n for n in self.nodes if n not in self.out_of_sync)

    def value(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "epoch": self.epoch, "primary": self.primary,
                "out_of_sync": dict(self.out_of_sync), **({"uuid": self.uuid} if self.uuid else {}),
                **({"written": True} if self.written else {})}

    @classmethod
    def from_entry(cls, volume: str, value: Mapping[str, Any], revision: int) -> ReplicaSet:
        return cls(volume, tuple(value["nodes"]), int(value["epoch"]), value.get("primary"),
                   {str(k): int(v) for k, v in value.get("out_of_sync", {}).items()}, revision, value.get("uuid"),
                   bool(value.get("written", False)))


def _key(prefix: str, volume: str) -> str:
    check_object_name(volume)
    return prefix + volume


async def create(store: StateStore, volume: str, nodes: Sequence[str], *, uuid: str | None = None) -> ReplicaSet:
    """A new replica set: every replica in sync (each starts empty, or from a full copy before it joins)."""
    nodes = tuple(nodes)
    if not 2 <= len(nodes) <= MAX_REPLICAS or len(set(nodes)) != len(nodes):
        raise ReplicationError(f"volume {volume}: replicas on 2 or {MAX_REPLICAS} different nodes, not {list(nodes)}")
    for n in nodes:
        check_object_name(n)
    rs = ReplicaSet(volume, nodes, uuid=uuid)
    try:
        rev = await store.put(_key(VOLUMES, volume), rs.value(), expect=0)
    except Conflict:
        raise ReplicationError(f"volume {volume} is replicated already") from None
    return replace(rs, revision=rev)


async def load(store: StateStore, volume: str) -> ReplicaSet:
    e = await store.get(_key(VOLUMES, volume))
    if e is None:
        raise ReplicationError(f"volume {volume} is not replicated (no record in the cluster store)")
    return ReplicaSet.from_entry(volume, e.value, e.revision)


async def claim_primary(store: StateStore, volume: str, node: str, lease: Lease) -> ReplicaSet:
    """Become the primary of a new epoch under `lease`; the returned set's epoch is the fencing token."""
    rs = await load(store, volume)
    if node not in rs.nodes:
        raise NotAMember(f"volume {volume}: {node} holds no replica of it (replicas: {', '.join(rs.nodes)})")
    if node in rs.out_of_sync:
        raise NotInSync(f"volume {volume}: {node} misses writes since epoch {rs.out_of_sync[node]}; it must "
                        f"resync from an in-sync replica ({', '.join(rs.in_sync) or 'none left'}) before it can "
                        "be primary")
    key = _key(PRIMARY, volume)
    try:
        epoch = await store.put(key, {"node": node}, expect=0, lease=lease)
    except Conflict:
        held = await store.get(key)
        holder = held.value.get("node") if held is not None else "another node"
        raise PrimaryBusy(f"volume {volume}: {holder} is primary (its lease has not expired)") from None
    new = replace(rs, epoch=epoch, primary=node)
    try:
        rev = await store.put(_key(VOLUMES, volume), new.value(), expect=rs.revision)
    except Conflict:
        # the record moved since we read it (a replica was marked out of sync, maybe this one): give the
        # epoch back; the caller may try again on a fresh view
        await store.delete(key, expect=epoch)
        raise PrimaryBusy(f"volume {volume}: its replica set changed during the election; try again") from None
    return replace(new, revision=rev)


async def _change(store: StateStore, view: ReplicaSet, node: str, change: Mapping[str, int | None], *,
                  written: bool = False) -> ReplicaSet:
    """Apply `change` to out_of_sync as the primary of `view.epoch`, retrying a CAS lost to a change of the
    same epoch; Fenced when the epoch is over."""
    rs = view
    while True:
        if rs.epoch != view.epoch or rs.primary != view.primary or view.primary is None:
            raise Fenced(f"volume {view.volume}: epoch {view.epoch} is over (now {rs.epoch}, primary "
                         f"{rs.primary}); {node}'s state was not recorded")
        out = {k: v for k, v in rs.out_of_sync.items()}
        for n, since in change.items():
            if since is None:
                out.pop(n, None)
            else:
                out.setdefault(n, since)      # missing writes since the first epoch it missed them
        new = replace(rs, out_of_sync=out, written=rs.written or written)
        try:
            rev = await store.put(_key(VOLUMES, view.volume), new.value(), expect=rs.revision)
        except Conflict:
            rs = await load(store, view.volume)
            continue
        return replace(new, revision=rev)


async def mark_out_of_sync(store: StateStore, view: ReplicaSet, node: str) -> ReplicaSet:
    """Rule 2: before acknowledging a write `node` did not get. Raises Fenced if `view`'s epoch is over."""
    if node not in view.nodes or node == view.primary:
        raise ReplicationError(f"volume {view.volume}: {node} is not a secondary of it")
    return await _change(store, view, node, {node: view.epoch}, written=True)   # a write is acknowledged next


async def mark_in_sync(store: StateStore, view: ReplicaSet, node: str) -> ReplicaSet:
    """Rule 4: `node` has every acknowledged write again (its resync finished under this epoch)."""
    if node not in view.nodes:
        raise NotAMember(f"volume {view.volume}: {node} holds no replica of it")
    return await _change(store, view, node, {node: None})


async def mark_written(store: StateStore, view: ReplicaSet) -> ReplicaSet:
    """Before the first acknowledged write of the volume: from now on a replica that comes empty (a new or
    wiped node) must get a full copy before it counts as in sync."""
    return await _change(store, view, view.primary or "", {}, written=True)


async def declare_stale(store: StateStore, volume: str, node: str) -> ReplicaSet:
    """A replica that knows it lacks data (its node's replica state is new or wiped) records itself out of
    sync. Any node may do this for itself at any time: it only narrows who may be elected, never widens it;
    the primary then copies it in full."""
    while True:
        rs = await load(store, volume)
        if node not in rs.nodes:
            raise NotAMember(f"volume {volume}: {node} holds no replica of it")
        if node in rs.out_of_sync:
            return rs
        new = replace(rs, out_of_sync={**rs.out_of_sync, node: rs.epoch})
        try:
            rev = await store.put(_key(VOLUMES, volume), new.value(), expect=rs.revision)
        except Conflict:
            continue
        return replace(new, revision=rev)


async def force_in_sync(store: StateStore, volume: str, node: str) -> ReplicaSet:
    """The administrator's last resort when no replica is in sync (every node lost its state, or the only
    in-sync one is gone for good): `node` is declared in sync as it is, and may be elected. Writes it missed
    are lost; the others get copied from it."""
    while True:
        rs = await load(store, volume)
        if node not in rs.nodes:
            raise NotAMember(f"volume {volume}: {node} holds no replica of it")
        if rs.in_sync and node not in rs.in_sync:
            raise ReplicationError(f"volume {volume}: {', '.join(rs.in_sync)} in sync still; elect one of them "
                                   "(forcing would lose what they have)")
        new = replace(rs, out_of_sync={n: e for n, e in rs.out_of_sync.items() if n != node})
        try:
            rev = await store.put(_key(VOLUMES, volume), new.value(), expect=rs.revision)
        except Conflict:
            continue
        return replace(new, revision=rev)


async def step_down(store: StateStore, view: ReplicaSet) -> None:
    """A planned switchover: the primary, drained, gives up its epoch (the next claim makes a new one).
    Fenced when the epoch was over already (its lease expired)."""
    try:
        await store.delete(_key(PRIMARY, view.volume), expect=view.epoch)
    except Conflict:
        raise Fenced(f"volume {view.volume}: epoch {view.epoch} is over; nothing to step down from") from None
