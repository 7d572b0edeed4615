"""Power cuts at every write a volume group (volume/thin) makes: a workload of several volumes (writes across
clusters, flushes, FUA writes, unmaps, write_zeroes, snapshots, clones, rollbacks, deletes, creates, resizes
and renames) runs on a FaultDevice with a volatile cache that loses power after its k-th write, for k = 1, 2,
3, ... until the workload ends first, with a random part of the cache written back (`survive`). After each
cut the device powers on, the group must open with no repair, and:

- every write acknowledged before a completed flush or FUA write (or a volume operation, which commits) reads
  back, or a newer write issued to the same blocks does;
- nothing else appears anywhere: each block holds zeros, or a value written to exactly that block of that
  volume since (or last before) the last commit, or, in a snapshot or clone, the value its origin's block had;
  never another volume's data, another block's, or a torn block;
- a volume operation under way at the cut either happened (and committed everything before it) or did not;
- every third cut, the power goes again while the group recovers (in the checkpoint that opening writes);
- every fifth, the group then works on: deleting every volume gives every cluster back (no reference leaked),
  and a new volume's write stays through another open.

Every block written carries (write number, volume, lba) in each of its 16-byte pieces, so the checker knows
where any block it reads came from. The group commits group-wide (a flush of one volume makes every
volume's acknowledged writes durable), and the checker holds it to that. The devices are small: allocation
wraps round and takes freed clusters again, and sometimes finds none (NoSpace is part of the workload). Two
mixes: "mixed" commits often and fills the journal (checkpoints are cut too), "churn" frees and reallocates
clusters with few commits between.

Seeds are fixed: a failure names its seed and cut, and reruns the same. About 15,800 crash points in CI;
THIN_CRASH_SEEDS=N runs N longer workloads of each mix (`pytest -m soak`)."""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from power_cut import PowerCut

from openvsan.block import RamDevice
from openvsan.block.device import BlockDevice
from openvsan.block.errors import BlockError, NoSpace
from openvsan.volume.thin import VolumeGroup

BS = 512
CS = 4096
CB = CS // BS
META = 200 << 10            # a journal of 16 blocks: it fills, and checkpoints are cut too
REC = np.dtype([("tag", "<u8"), ("vid", "<u4"), ("lba", "<u4")])
PER_BLOCK = BS // REC.itemsize
SURVIVE = (0.0, 0.0, 0.25, 0.5, 0.75, 1.0)


def block(tag: int, vid: int, lba: int) -> bytes:
    return np.array([(tag, vid, lba)], dtype=REC).tobytes() * PER_BLOCK


def blocks(tag: int, vid: int, lba: int, n: int) -> bytes:
    a = np.zeros((n, PER_BLOCK), dtype=REC)
    a["tag"] = tag
    a["vid"] = vid
    a["lba"] = np.arange(lba, lba + n, dtype=np.uint32)[:, None]
    return a.tobytes()


# ---- the model: what each block may hold

@dataclass
class Vol:
    uid: int                      # the volume id written into its blocks
    writable: bool
    cur: np.ndarray               # per block: the write number it holds now (0: zeros)
    extra: dict[int, set[int]] = field(default_factory=dict)   # per block: also allowed after a cut

    def copy(self) -> Vol:
        return Vol(self.uid, self.writable, self.cur.copy(), {b: set(s) for b, s in self.extra.items()})

    def issue(self, lba: int, n: int, tag: int) -> None:
        """A write (tag) or zeros (0) issued: until the next commit the block may hold the old or the new."""
        for b in range(lba, lba + n):
            s = self.extra.setdefault(b, set())
            s.add(int(self.cur[b]))
            s.add(tag)


@dataclass
class World:
    vols: dict[str, Vol] = field(default_factory=dict)

    def copy(self) -> World:
        return World({n: v.copy() for n, v in self.vols.items()})

    def commit(self) -> World:
        for v in self.vols.values():
            v.extra.clear()
        return self


def check(g: VolumeGroup, world: World, raws: dict[str, bytes], writer: np.ndarray) -> str | None:
    """None if what the group holds is allowed in this world, else what is wrong."""
    if sorted(g.by_name) != sorted(world.vols):
        return f"volumes {sorted(g.by_name)}, expected {sorted(world.vols)}"
    for name, v in world.vols.items():
        raw = raws[name]
        n = len(raw) // BS
        if n != len(v.cur):
            return f"{name}: {n} blocks, expected {len(v.cur)}"
        a = np.frombuffer(raw, dtype=REC).reshape(n, PER_BLOCK)
        first = a[:, 0]
        whole = (a == first[:, None]).all(axis=1)
        tags, vids, lbas = first["tag"].astype(np.int64), first["vid"], first["lba"]
        zero = (tags == 0) & (vids == 0) & (lbas == 0)
        known = (tags > 0) & (tags < len(writer))
        wrote = np.where(known, writer[np.where(known, tags, 0)], -1)
        sane = whole & (zero | (known & (lbas == np.arange(n)) & (wrote == vids)))
        for b in np.flatnonzero(~(sane & (tags == v.cur))).tolist():
            t = int(tags[b])
            if not sane[b]:
                return (f"{name} block {b}: a torn or foreign block (write {t}, volume {int(vids[b])}, "
                        f"lba {int(lbas[b])}); expected write {int(v.cur[b])}")
            if t not in v.extra.get(b, ()):
                return f"{name} block {b}: write {t}; allowed {int(v.cur[b])} or {sorted(v.extra.get(b, ()))}"
    return None


# ---- the workload

Op = tuple[Any, ...]


# the share of each kind of operation: "mixed" commits often (flushes and volume operations); "churn" writes and
# unmaps with few commits between, so clusters are freed and wanted again before their frees are committed
MIXES: dict[str, dict[str, float]] = {
    "mixed": {"write": 50, "unmap": 10, "flush": 12, "copy": 8, "delete": 5, "rollback": 3, "create": 4,
              "resize": 5, "rename": 3},
    "churn": {"write": 55, "unmap": 33, "flush": 3, "copy": 3, "delete": 2, "rollback": 1, "create": 2,
              "resize": 1, "rename": 0},
}
FUA = {"mixed": 0.12, "churn": 0.03}
# (data clusters of the device, clusters of a volume at most, volumes and snapshots at most): small enough
# that allocation wraps round the device and takes freed clusters again, and sometimes finds none
SHAPE = {"mixed": (48, 16, 6), "churn": (20, 8, 4)}


def workload(seed: int, length: int, mix: str = "mixed") -> list[Op]:
    """A deterministic list of operations on volumes that exist when each runs (had nothing failed)."""
    rng = random.Random(seed)
    vols: dict[str, list[Any]] = {}     # name -> [blocks, writable, thin]
    ops: list[Op] = []
    count = 0
    kinds, weights = zip(*MIXES[mix].items(), strict=True)

    def new_name() -> str:
        nonlocal count
        count += 1
        return f"v{count}"

    _, max_clusters, max_volumes = SHAPE[mix]

    def size() -> int:
        return rng.randint(2, max_clusters) * CB - rng.randrange(CB)

    for thin in (True, False):
        name = new_name()
        vols[name] = [size(), True, thin]
        ops.append(("create", name, vols[name][0], thin))
    while len(ops) < length:
        writable = [n for n, v in vols.items() if v[1]]
        kind = rng.choices(kinds, weights)[0]
        if kind == "write" and writable:
            name = rng.choice(writable)
            lba = rng.randrange(vols[name][0])
            n = min(rng.randint(1, 2 * CB + 4), vols[name][0] - lba)
            ops.append(("write", name, lba, n, rng.random() < FUA[mix]))
        elif kind == "unmap" and writable:
            name = rng.choice(writable)
            lba = rng.randrange(vols[name][0])
            n = vols[name][0] - lba if rng.random() < 0.2 else min(rng.randint(1, 3 * CB), vols[name][0] - lba)
            ops.append(("zeroes" if rng.random() < 0.4 else "unmap", name, lba, n))
        elif kind == "copy" and vols and len(vols) < max_volumes:
            origin, name = rng.choice(sorted(vols)), new_name()
            clone = rng.random() < 0.4
            ops.append(("clone" if clone else "snapshot", origin, name))
            vols[name] = [vols[origin][0], clone, True if clone else vols[origin][2]]
        elif kind == "delete" and len(vols) > 2:
            snaps = [n for n, v in vols.items() if not v[1]]
            name = rng.choice(snaps if snaps and rng.random() < 0.6 else sorted(vols))
            ops.append(("delete", name))
            del vols[name]
        elif kind == "rollback" and writable and len(vols) > 1:
            name = rng.choice(writable)
            to = rng.choice(sorted(n for n in vols if n != name))
            ops.append(("rollback", name, to))
            vols[name][0] = vols[to][0]
        elif kind == "create" and len(vols) < max_volumes:
            name, thin = new_name(), rng.random() < 0.7
            vols[name] = [size(), True, thin]
            ops.append(("create", name, vols[name][0], thin))
        elif kind == "resize" and writable:
            name = rng.choice(writable)
            vols[name][0] = size()
            ops.append(("resize", name, vols[name][0]))
        elif kind == "rename" and vols:
            name, new = rng.choice(sorted(vols)), new_name()
            ops.append(("rename", name, new))
            vols[new] = vols.pop(name)
        elif vols:
            ops.append(("flush", rng.choice(sorted(vols))))
    return ops


class Run:
    """One run of a workload against a group, the model kept beside it."""

    def __init__(self, g: VolumeGroup) -> None:
        self.g = g
        self.world = World()
        self.writer = [0]            # write number -> the volume id it was written to
        self.uids = 0
        self.alternatives: list[World] = []   # what may be found if the operation under way is cut
        self.nospace = 0

    def new_vol(self, writable: bool, cur: np.ndarray) -> Vol:
        self.uids += 1
        return Vol(self.uids, writable, cur)

    async def step(self, op: Op) -> None:
        """Run one operation and keep the model with it. An operation on a volume the workload expected but
        that is not there (a create that found no space) is left out; one that finds no space changes nothing
        (a write: its clusters up to the one that found none are written, as reading them back shows)."""
        g, w = self.g, self.world
        kind = op[0]
        self.alternatives = [w]
        if kind != "create" and op[1] not in w.vols:
            return
        if kind in ("write", "zeroes", "unmap"):
            _, name, lba, n = op[:4]
            v = w.vols[name]
            n = min(n, len(v.cur) - lba)
            if n <= 0:
                return
            lv = g.volume(name)
            tag = 0
            try:
                if kind == "write":
                    tag = len(self.writer)
                    self.writer.append(v.uid)
                    v.issue(lba, n, tag)
                    await lv.write(lba, blocks(tag, v.uid, lba, n), fua=op[4])
                else:
                    v.issue(lba, n, 0)
                    await (lv.write_zeroes(lba, n) if kind == "zeroes" else lv.unmap(lba, n))
            except NoSpace:
                got = np.frombuffer(bytes(await lv.read(lba, n)), dtype=REC).reshape(n, PER_BLOCK)[:, 0]["tag"]
                for i, t in enumerate(got.tolist()):
                    assert t in (v.cur[lba + i], tag), f"{op}: block {lba + i} holds write {t} after NoSpace"
                    v.cur[lba + i] = t
                self.nospace += 1
                return
            v.cur[lba:lba + n] = tag
            if kind == "write" and op[4]:
                w.commit()
            return
        if kind == "flush":
            await g.volume(op[1]).flush()
            w.commit()
            return
        post = w.copy()
        if kind in ("snapshot", "clone"):
            _, origin, name = op
            post.vols[name] = self.new_vol(kind == "clone", w.vols[origin].cur.copy())
            self.alternatives = [post.commit(), w]
            change = g.snapshot(origin, name) if kind == "snapshot" else g.clone(origin, name)
        elif kind == "delete":
            del post.vols[op[1]]
            self.alternatives = [post.commit(), w]
            change = g.delete(op[1])
        elif kind == "rollback":
            _, name, to = op
            if to not in w.vols:
                return
            post.vols[name].cur = w.vols[to].cur.copy()
            self.alternatives = [post.commit(), w]
            change = g.rollback(name, to)
        elif kind == "create":
            _, name, n, thin = op
            post.vols[name] = self.new_vol(True, np.zeros(n, dtype=np.int64))
            self.alternatives = [post.commit(), w]
            change = g.create(name, n * BS, thin=thin)
        elif kind == "resize":
            _, name, n = op
            v = post.vols[name]
            v.cur = np.concatenate((v.cur[:n], np.zeros(max(0, n - len(v.cur)), dtype=np.int64)))
            self.alternatives = [post.commit(), w]
            change = g.resize(name, n * BS, force=True)
        elif kind == "rename":
            _, name, new = op
            post.vols[new] = post.vols.pop(name)
            self.alternatives = [post.commit(), w]
            change = g.rename(name, new)
        else:  # pragma: no cover
            raise AssertionError(kind)
        try:
            await change
        except NoSpace:
            self.alternatives = [w]
            self.nospace += 1
            return
        self.world = post


def device(mix: str) -> RamDevice:
    return RamDevice((META + SHAPE[mix][0] * CS) // BS, BS)


async def format_group(dev: BlockDevice) -> VolumeGroup:
    g = await VolumeGroup.format(dev, cluster_size=CS, metadata_size=META)
    g.commit_interval = 1e9      # commits at flushes only: the same writes in the same order every run
    return g


async def cut_at(ops: list[Op], mix: str, k: int, survive: float, rng: random.Random) -> str | None | bool:
    """Run ops with the power cut after the k-th write; False if they ended first, else what the checker
    found wrong after the cut (None: nothing)."""
    dev = PowerCut(device(mix), survive, rng)
    g = await format_group(dev)
    dev.crash_after_writes = dev.writes + k
    run = Run(g)
    at = None
    for i, op in enumerate(ops):
        try:
            await run.step(op)
        except BlockError:
            if not dev.crashed:
                raise
            at = i
            break
    if at is None:
        await dev.close()
        return False
    await dev.restart()
    if k % 3 == 0:   # the power cut again while the group recovers (in the checkpoint that opening writes)
        dev.survive = rng.choice(SURVIVE)
        dev.crash_after_writes = dev.writes + 1
        try:
            await VolumeGroup.open(dev)
        except BlockError:
            pass
        else:
            return "opening wrote no checkpoint"
        await dev.restart()
    try:
        g = await VolumeGroup.open(dev)
    except Exception as e:  # noqa: BLE001 - reported as the finding
        return f"the group did not open: {e!r} (cut in {ops[at]})"
    raws = {name: bytes(await g.volume(name).read(0, g.volume(name).num_blocks)) for name in g.names()}
    writer = np.array(run.writer, dtype=np.int64)
    found = [check(g, world, raws, writer) for world in run.alternatives]
    if all(found):
        return f"cut in {ops[at]}: " + " | or | ".join(str(f) for f in found)
    if k % 5 == 0:   # the group works on: every volume deleted gives every cluster back; a new one keeps data
        for name in g.names():
            await g.delete(name)
        if g.used or g.space()["used"]:
            return f"{g.used} clusters in use after every volume was deleted"
        lv = await g.create("after", 4 * CS)
        await lv.write(0, block(1, 1, 0) * 16, fua=True)     # two clusters
        g = await VolumeGroup.open(dev)
        if bytes(await g.volume("after").read(0, 16)) != block(1, 1, 0) * 16 or g.used != 2:
            return "a write after the reopen did not stay"
    await dev.close()
    return None


async def sweep(seeds: range, length: int, mix: str = "mixed") -> tuple[int, list[str]]:
    """Every crash point of each seed's workload; (points, failures)."""
    points = 0
    failures: list[str] = []
    for seed in seeds:
        ops = workload(seed, length, mix)
        rng = random.Random(seed * 7919)
        k = 1
        while True:
            survive = rng.choice(SURVIVE)
            found = await cut_at(ops, mix, k, survive, random.Random(rng.random()))
            if found is False:
                break
            points += 1
            if found is not None:
                failures.append(f"seed {seed}, cut after write {k}, survive {survive}: {found}")
                if len(failures) >= 5:
                    return points, failures
            k += 1
    return points, failures


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_the_workload_runs_and_the_model_agrees_without_a_cut(mix: str) -> None:
    async def go() -> None:
        for seed in range(20):
            run = Run(await format_group(device(mix)))
            for op in workload(seed, 120, mix):
                await run.step(op)
            raws = {n: bytes(await run.g.volume(n).read(0, run.g.volume(n).num_blocks)) for n in run.g.names()}
            assert check(run.g, run.world.commit(), raws, np.array(run.writer, dtype=np.int64)) is None
    asyncio.run(go())


SEEDS = int(os.environ.get("THIN_CRASH_SEEDS", "0"))
BATCHES = [(mix, range(b * 24, b * 24 + 24)) for mix in sorted(MIXES) for b in range(3)]


@pytest.mark.parametrize("mix,seeds", BATCHES, ids=[f"{m}-seeds{r.start}-{r.stop - 1}" for m, r in BATCHES])
def test_every_crash_point(mix: str, seeds: range) -> None:
    points, failures = asyncio.run(sweep(seeds, 70, mix))
    assert not failures, "\n".join(failures)
    assert points >= 2000, points    # six batches: over 12,000 crash points in all (about 15,800)


@pytest.mark.soak
def test_every_crash_point_soak() -> None:
    for mix in sorted(MIXES):
        points, failures = asyncio.run(sweep(range(1000, 1000 + (SEEDS or 200)), 150, mix))
        assert not failures, "\n".join(failures)
        assert points > 0
