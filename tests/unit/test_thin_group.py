"""VolumeGroup (volume/thin): thin and thick volumes, snapshots, clones, rollback, delete, rename, resize, space
accounting, running out of space and of metadata, unmap, extents, the fast paths, and reopening.

No clock: I/O "in flight" is a layer that waits on an Event the test opens."""

from __future__ import annotations

import asyncio
import functools
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import crc32c
import pytest

from openvsan.block import FaultDevice, Layer, RamDevice
from openvsan.block.device import BlockDevice, Buffer
from openvsan.block.errors import Busy, DeviceFailed, NoSpace, ReadOnly
from openvsan.volume.thin import GroupError, LogicalVolume, VolumeGroup
from openvsan.volume.thin import state as thin_state
from openvsan.volume.thin import store as thin_store
from openvsan.volume.thin.format import FormatError

BS = 512
CS = 4096                 # cluster: 8 blocks
CB = CS // BS
META = 256 << 10          # metadata: small, so that groups stay small
MiB = 1 << 20


@pytest.fixture(autouse=True)
def commits_at_flushes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No commit by the timer: what a test finds committed does not depend on how fast it runs."""
    monkeypatch.setattr(thin_store, "COMMIT_INTERVAL", 1e9)


def aio(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """The test body as a coroutine, run in a loop of its own."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))   # type: ignore[arg-type]
    return wrapper


def data(tag: int, blocks: int, lba: int = 0) -> bytes:
    """Blocks that say what they are: a tag and their lba in every one."""
    return b"".join((tag.to_bytes(4, "little") + (lba + i).to_bytes(4, "little")) * (BS // 8)
                    for i in range(blocks))


async def new_group(mib: int = 8, **kw: Any) -> tuple[RamDevice, VolumeGroup]:
    dev = RamDevice(mib * MiB // BS, BS)
    kw.setdefault("cluster_size", CS)
    kw.setdefault("metadata_size", META)
    return dev, await VolumeGroup.format(dev, **kw)


async def read(lv: LogicalVolume, lba: int, blocks: int) -> bytes:
    return bytes(await lv.read(lba, blocks))


def used_clusters(g: VolumeGroup) -> int:
    return g.space()["used"] // g.sb.cluster_size


def pages_of(v: Any) -> list[int]:
    """Mapped entries per page of a volume's mapping, counted from the mapping."""
    m = list(v.map)
    return [sum(1 for p in m[i:i + thin_state.PAGE] if p) for i in range(0, len(m), thin_state.PAGE)]


def check_refs(g: VolumeGroup) -> None:
    """The reference counts are exactly what the mappings say, and `used` counts the clusters referenced."""
    counts = [0] * (g.clusters + 1)          # clusters are numbered from 1
    for v in g.vols.values():
        mapped = [p for p in v.map if p]
        assert len(mapped) == len(set(mapped)) == v.mapped, v.rec.name
        for p in mapped:
            counts[p] += 1
        assert list(v.pages) == pages_of(v), v.rec.name
    assert list(g.ref) == counts
    assert g.used == sum(1 for c in counts if c)


class Gate(Layer):
    """Writes wait at a gate the test opens (armed only while `armed`)."""

    def __init__(self, below: BlockDevice) -> None:
        super().__init__(below)
        self.gate = asyncio.Event()
        self.armed = False
        self.waiting = 0

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        if self.armed:
            self.waiting += 1
            await self.gate.wait()
            self.waiting -= 1
        await self.below.write(lba, data, fua=fua)

    def write_now(self, lba: int, data: Buffer) -> bool:
        return bool(self.below.write_now(lba, data))  # type: ignore[attr-defined]   # no gate: never waits


async def settle(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# ---- thin and thick

@aio
async def test_thin_volume_allocates_on_first_write() -> None:
    _, g = await new_group()
    lv = await g.create("a", MiB)
    assert lv.thin and lv.capabilities.thin and lv.num_blocks == MiB // BS
    assert used_clusters(g) == 0 and g.info("a")["mapped"] == 0
    assert await read(lv, 0, 16) == bytes(16 * BS)
    await lv.write(9, data(1, 1, 9))
    assert used_clusters(g) == 1 and lv.allocated_blocks() == CB
    assert await read(lv, 8, 8) == bytes(BS) + data(1, 1, 9) + bytes(6 * BS)
    await lv.write(9, data(2, 1, 9))           # in place: no new cluster
    assert used_clusters(g) == 1
    await lv.write(6, data(3, 20, 6))          # across four clusters, one of them mapped
    assert used_clusters(g) == 4
    assert await read(lv, 6, 20) == data(3, 20, 6)
    check_refs(g)


@aio
async def test_thick_volume_allocates_at_creation_and_reads_zeros() -> None:
    _, g = await new_group()
    junk = await g.create("junk", 2 * MiB)
    await junk.write(0, data(7, 2 * MiB // BS))   # leave data in the clusters the thick volume gets next
    await g.delete("junk")
    assert used_clusters(g) == 0
    lv = await g.create("fat", 2 * MiB, thin=False)
    assert not lv.thin and not lv.capabilities.thin
    assert used_clusters(g) == 2 * MiB // CS
    assert g.info("fat")["mapped"] == 2 * MiB
    assert await read(lv, 0, 2 * MiB // BS) == bytes(2 * MiB)
    await lv.write(3, data(1, 2, 3))
    assert used_clusters(g) == 2 * MiB // CS
    await lv.unmap(0, 2 * MiB // BS)             # a thick volume keeps its clusters and reads zeros
    assert used_clusters(g) == 2 * MiB // CS and await read(lv, 0, 16) == bytes(16 * BS)
    with pytest.raises(NoSpace):
        await g.create("too-big", 64 * MiB, thin=False)
    assert "too-big" not in g.names()
    check_refs(g)


@aio
async def test_many_volumes() -> None:
    dev, g = await new_group(16, metadata_size=MiB)
    for i in range(150):
        lv = await g.create(f"v{i}", 64 << 10, thin=i % 5 != 0)
        await lv.write(i % 100, data(i, 3, i % 100))
    await g.close()
    g = await VolumeGroup.open(dev)
    assert len(g.names()) == 150
    for i in range(150):
        lv = g.volume(f"v{i}")
        assert await read(lv, i % 100, 3) == data(i, 3, i % 100)
        assert lv.thin == (i % 5 != 0)
    check_refs(g)


# ---- snapshots, clones, rollback, delete

@aio
async def test_snapshot_keeps_the_old_data_after_the_origin_writes() -> None:
    _, g = await new_group()
    lv = await g.create("a", MiB)
    await lv.write(0, data(1, 64))
    await g.snapshot("a", "s1")
    snap = g.volume("s1")
    assert snap.read_only and g.info("s1")["kind"] == "snapshot" and g.info("s1")["origin"] == "a"
    await lv.write(4, data(2, 8, 4))            # half of two clusters: copied, then written
    await lv.write(16, data(3, 8, 16))          # a whole cluster
    await lv.write(100, data(4, 1, 100))        # an unmapped one
    assert await read(snap, 0, 128) == data(1, 64) + bytes(64 * BS)
    assert await read(lv, 0, 24) == data(1, 4) + data(2, 8, 4) + data(1, 4, 12) + data(3, 8, 16)
    with pytest.raises(ReadOnly):
        await snap.write(0, data(9, 1))
    with pytest.raises(ReadOnly):
        await snap.unmap(0, 8)
    assert not snap.write_now(0, data(9, 1))
    with pytest.raises(GroupError):
        await g.snapshot("a", "s1")              # the name is taken
    await g.snapshot("s1", "s1-of-s1")          # a snapshot of a snapshot
    assert await read(g.volume("s1-of-s1"), 0, 64) == data(1, 64)
    check_refs(g)


@aio
async def test_clone_is_writable_and_independent() -> None:
    _, g = await new_group()
    lv = await g.create("a", MiB, thin=False)
    await lv.write(0, data(1, 32))
    await g.snapshot("a", "s")
    c = await g.clone("s", "c")
    assert c.thin and not c.read_only and g.info("c")["origin"] == "s"
    assert used_clusters(g) == MiB // CS        # all shared
    await c.write(2, data(2, 4, 2))
    await lv.write(10, data(3, 4, 10))
    assert await read(c, 0, 16) == data(1, 2) + data(2, 4, 2) + data(1, 10, 6)
    assert await read(lv, 0, 16) == data(1, 10) + data(3, 4, 10) + data(1, 2, 14)
    assert await read(g.volume("s"), 0, 16) == data(1, 16)
    c2 = await g.clone("c", "c2")               # a clone of a writable volume
    await c2.write(0, data(4, 1))
    assert await read(c, 0, 1) == data(1, 1)
    check_refs(g)


@aio
async def test_rollback() -> None:
    _, g = await new_group()
    lv = await g.create("a", MiB)
    await lv.write(0, data(1, 40))
    await g.snapshot("a", "s")
    await lv.write(8, data(2, 40, 8))
    await lv.unmap(0, 8)
    await g.resize("a", 2 * MiB)
    changed: list[int] = []
    lv.on_change = lambda: changed.append(lv.num_blocks)
    await g.rollback("a", "s")
    assert changed == [MiB // BS] and lv.num_blocks == MiB // BS
    assert await read(lv, 0, 48) == data(1, 40) + bytes(8 * BS)
    await lv.write(0, data(3, 1))              # still writable, the snapshot untouched
    assert await read(g.volume("s"), 0, 1) == data(1, 1)
    with pytest.raises(GroupError):
        await g.rollback("s", "a")               # a snapshot is not rolled back
    with pytest.raises(GroupError):
        await g.rollback("a", "a")
    check_refs(g)


@aio
async def test_delete_of_a_snapshot_in_the_middle_returns_only_its_own_clusters() -> None:
    _, g = await new_group()
    lv = await g.create("a", MiB)
    await lv.write(0, data(1, 64))                 # clusters 0-7
    await g.snapshot("a", "s1")
    await lv.write(0, data(2, 24))                 # clusters 0-2 copied: s1 keeps the old ones
    await g.snapshot("a", "s2")
    await lv.write(8, data(3, 32, 8))              # clusters 1-4 copied again: s2 alone has 1, 2 (of data 2)
    await g.snapshot("a", "s3")
    await lv.write(0, data(4, 8))                  # cluster 0: s2 and s3 share data 2's
    before = used_clusters(g)
    only_s2 = g.info("s2")["exclusive"] // CS
    assert only_s2 == 2
    await g.delete("s2")
    assert used_clusters(g) == before - only_s2
    assert await read(g.volume("s1"), 0, 64) == data(1, 64)
    assert await read(g.volume("s3"), 0, 64) == data(2, 8) + data(3, 32, 8) + data(1, 24, 40)
    assert await read(lv, 0, 64) == data(4, 8) + data(3, 32, 8) + data(1, 24, 40)
    assert "s2" not in g.names()
    with pytest.raises(GroupError):
        g.volume("s2")
    check_refs(g)


@aio
async def test_a_deleted_volumes_handle_reads_zeros_and_refuses_writes() -> None:
    _, g = await new_group()
    lv = await g.create("a", MiB)
    await lv.write(0, data(1, 8))
    lv.in_use = True
    with pytest.raises(Busy):
        await g.delete("a")
    await g.delete("a", force=True)
    other = await g.create("b", MiB)
    await other.write(0, data(2, 8))               # may get the cluster "a" had
    await other.flush()
    assert await read(lv, 0, 8) == bytes(8 * BS)
    assert lv.read_now(0, 8) in (None, bytes(8 * BS))
    with pytest.raises(DeviceFailed):
        await lv.write(0, data(3, 1))
    assert not lv.write_now(0, data(3, 1))
    assert await read(other, 0, 8) == data(2, 8)


@aio
async def test_rename() -> None:
    dev, g = await new_group()
    lv = await g.create("a", MiB)
    await lv.write(0, data(1, 8))
    await g.create("b", MiB)
    await g.rename("a", "z")
    assert g.names() == ["b", "z"] and lv.name == "z"
    assert await read(g.volume("z"), 0, 8) == data(1, 8)
    with pytest.raises(GroupError):
        await g.rename("z", "b")
    for bad in ("", "x/y", "x@y", "n" * 65):
        with pytest.raises(GroupError):
            await g.rename("z", bad)
    with pytest.raises(GroupError):
        g.volume("a")
    await g.close()
    g = await VolumeGroup.open(dev)
    assert g.names() == ["b", "z"]


# ---- resize

@aio
async def test_resize_grow_and_shrink() -> None:
    _, g = await new_group()
    lv = await g.create("a", MiB)
    await lv.write(0, data(1, 8))
    await lv.write(1000, data(2, 8, 1000))       # near the end
    await g.resize("a", 2 * MiB)
    assert lv.num_blocks == 2 * MiB // BS and used_clusters(g) == 2
    assert await read(lv, 2040, 16) == bytes(16 * BS)
    with pytest.raises(GroupError, match="drop data"):
        await g.resize("a", 256 << 10)           # data mapped beyond
    assert lv.num_blocks == 2 * MiB // BS
    await g.resize("a", 1008 * BS)               # nothing mapped beyond (clusters 0 and 125 are kept)
    with pytest.raises(GroupError):
        await g.resize("a", 4 * BS + 1)          # not a whole block
    await g.resize("a", 4 * BS, force=True)      # inside cluster 0: its tail stays, unseen
    assert used_clusters(g) == 1 and lv.num_blocks == 4
    await g.resize("a", MiB)                     # grown again: zeros where the shrink cut, not the old data
    assert await read(lv, 0, 16) == data(1, 4) + bytes(12 * BS)
    assert await read(lv, 1000, 8) == bytes(8 * BS)
    await g.snapshot("a", "s")
    with pytest.raises(GroupError):
        await g.resize("s", 2 * MiB)
    check_refs(g)


@aio
async def test_resize_of_a_thick_volume_allocates_and_frees() -> None:
    _, g = await new_group()
    lv = await g.create("a", MiB, thin=False)
    await g.resize("a", 2 * MiB)
    assert used_clusters(g) == 2 * MiB // CS
    assert await read(lv, MiB // BS, 16) == bytes(16 * BS)
    await g.resize("a", MiB // 2, force=True)
    assert used_clusters(g) == MiB // 2 // CS
    with pytest.raises(NoSpace):
        await g.resize("a", 64 * MiB)
    assert lv.num_blocks == MiB // 2 // BS
    check_refs(g)


# ---- space

@aio
async def test_space_accounting() -> None:
    _, g = await new_group()
    sp = g.space()
    capacity = sp["capacity"]
    assert capacity == g.clusters * CS and sp["used"] == 0 and sp["free"] == capacity
    assert (sp["volumes"], sp["snapshots"], sp["provisioned"], sp["overcommit"]) == (0, 0, 0, 0.0)
    a = await g.create("a", 4 * MiB)
    await g.create("b", 2 * MiB, thin=False)
    await a.write(0, data(1, 24))             # 3 clusters
    await g.snapshot("a", "s")
    sp = g.space()
    assert sp["used"] == (3 + 2 * MiB // CS) * CS and sp["free"] == capacity - sp["used"]
    assert (sp["volumes"], sp["snapshots"]) == (2, 1)
    assert sp["provisioned"] == 6 * MiB                    # snapshots are not provisioned space
    assert sp["overcommit"] == round(6 * MiB / capacity, 3)
    await g.create("huge", 64 * MiB)
    assert g.space()["overcommit"] > 1
    assert 0 < g.space()["metadata_used"] < 1
    info = g.info("a")
    assert (info["mapped"], info["exclusive"], info["size"], info["thin"]) == (3 * CS, 0, 4 * MiB, True)
    await a.write(0, data(2, 1))
    assert g.info("a")["exclusive"] == CS and g.info("s")["exclusive"] == CS


@aio
async def test_out_of_space_and_back_without_a_restart() -> None:
    _, g = await new_group(2)
    n = g.clusters
    a = await g.create("a", n * CS)
    b = await g.create("b", n * CS)
    await a.write(0, data(1, (n - 4) * CB))
    await b.write(0, data(2, 4 * CB))
    assert g.space()["free"] == 0
    with pytest.raises(NoSpace):
        await b.write(4 * CB, data(3, 1))     # an unallocated cluster
    with pytest.raises(NoSpace):
        await a.write((n - 1) * CB, data(3, CB))
    await a.write(5, data(4, 3, 5))           # allocated ones keep working, and reads
    await b.write(8, data(5, CB, 8), fua=True)
    assert await read(a, 0, 16) == data(1, 5) + data(4, 3, 5) + data(1, 8, 8)
    assert await read(b, 8, CB) == data(5, CB, 8)
    await g.snapshot("b", "bs")               # a snapshot needs no cluster...
    with pytest.raises(NoSpace):
        await b.write(0, data(6, 1))          # ...but a write to its shared cluster does
    await a.unmap(0, 16 * CB)                 # give back 16 clusters
    with pytest.raises(NoSpace):
        await b.write(4 * CB, data(3, 1))     # not before the unmap is committed
    await a.flush()
    await b.write(4 * CB, data(3, 1))
    await b.write(0, data(6, 1))
    await g.delete("bs")
    await b.write(100 * CB, data(7, CB * 12))
    assert await read(b, 4 * CB, 1) == data(3, 1)
    check_refs(g)


async def fragmented_writes(lv: LogicalVolume, clusters: int) -> None:
    """One write to every other cluster: each a run of its own in the checkpoint."""
    for i in range(clusters):
        await lv.write(2 * i * CB, data(i, 1, 2 * i * CB))


@aio
async def test_metadata_full_is_a_clean_no_space_and_snapshots_deleted_bring_it_back() -> None:
    dev, g = await new_group(24, metadata_size=200 << 10)      # a checkpoint slot of 64 KiB
    lv = await g.create("a", 16 * MiB)
    await fragmented_writes(lv, 1500)
    made = []
    with pytest.raises(NoSpace, match="metadata full"):
        for i in range(20):
            await g.snapshot("a", f"s{i}")
            made.append(f"s{i}")
    assert 1 <= len(made) < 20
    with pytest.raises(NoSpace, match="metadata full"):
        await fragmented_writes(await g.create("b", 16 * MiB), 1500)
    # nothing broken: the data reads back, the group commits and reopens
    for i in range(0, 1500, 97):
        assert await read(lv, 2 * i * CB, 1) == data(i, 1, 2 * i * CB)
    await lv.flush()
    await g.close()
    g = await VolumeGroup.open(dev)
    lv = g.volume("a")
    assert [n for n in g.names() if n.startswith("s")] == sorted(made)
    for name in made:
        await g.delete(name)
    await g.snapshot("a", "again")
    await g.volume("b").unmap(0, 16 * MiB // BS)
    for i in range(0, 1500, 97):
        assert await read(g.volume("again"), 2 * i * CB, 1) == data(i, 1, 2 * i * CB)
    check_refs(g)


@aio
async def test_unmap_of_a_whole_thin_volume_gives_its_clusters_back() -> None:
    _, g = await new_group(16)
    size = 10 * MiB + 3 * BS                   # not a whole number of clusters
    lv = await g.create("a", size)
    blocks = size // BS
    for lba in range(0, blocks, 300):
        await lv.write(lba, data(lba, min(300, blocks - lba), lba))
    had = used_clusters(g)
    assert had == -(-size // CS)
    await lv.unmap(0, blocks)
    await lv.flush()
    assert used_clusters(g) <= had * 0.05
    assert used_clusters(g) == 0
    assert await read(lv, blocks - 8, 8) == bytes(8 * BS)
    # write_zeroes deallocates too; a part of a cluster is zeroed in place
    await lv.write(0, data(1, 24))
    await lv.write_zeroes(4, 16)
    assert used_clusters(g) == 2 and await read(lv, 0, 24) == data(1, 4) + bytes(16 * BS) + data(1, 4, 20)
    check_refs(g)


@aio
async def test_lba_status() -> None:
    _, g = await new_group()
    lv = await g.create("a", MiB)
    assert lv.capabilities.extents
    assert await lv.lba_status(0, 2048) == [(0, 2048, 1)]
    await lv.write(10, data(1, 1, 10))                # cluster 1
    await lv.write(40, data(1, 20, 40))               # clusters 5-7
    assert await lv.lba_status(0, 2048) == [(0, 8, 1), (8, 8, 0), (16, 24, 1), (40, 24, 0), (64, 1984, 1)]
    assert await lv.lba_status(12, 30) == [(12, 4, 0), (16, 24, 1), (40, 2, 0)]
    assert await lv.lba_status(2040, 100) == [(2040, 8, 1)]    # clipped at the end
    fat = await g.create("b", MiB, thin=False)
    assert await fat.lba_status(0, 2048) == [(0, 2048, 0)]


# ---- the fast paths

@aio
async def test_read_now_and_write_now_agree_with_read_and_write() -> None:
    _, g = await new_group()
    lv = await g.create("a", MiB)
    assert lv.capabilities.sync_read and lv.capabilities.sync_write and lv.capabilities.volatile_cache
    assert lv.read_now(0, 4) == bytes(4 * BS)               # unmapped: zeros, at once
    assert not lv.write_now(0, data(1, 1))                  # unmapped: allocation is the slow path's
    await lv.write(0, data(1, 16))
    assert not lv.write_now(0, data(2, 1))                  # mapped, but not committed yet
    await lv.flush()
    assert lv.write_now(3, data(2, 2, 3))
    assert lv.read_now(0, 8) == await read(lv, 0, 8) == data(1, 3) + data(2, 2, 3) + data(1, 3, 5)
    # across clusters: a read and a write over physically consecutive ones at once
    assert lv.read_now(6, 4) == await read(lv, 6, 4)
    assert lv.write_now(6, data(3, 4, 6))
    assert lv.read_now(6, 4) == await read(lv, 6, 4) == data(3, 4, 6)
    await lv.write(6, data(1, 4, 6))
    await g.snapshot("a", "s")
    assert not lv.write_now(0, data(3, 1))                  # shared with the snapshot
    assert not lv.write_now(6, data(3, 4, 6))               # both clusters shared
    assert g.volume("s").read_now(0, 8) == data(1, 3) + data(2, 2, 3) + data(1, 3, 5)
    await lv.write(0, data(3, 1))
    await lv.flush()
    assert lv.write_now(1, data(4, 1, 1))
    assert lv.read_now(0, 3) == data(3, 1) + data(4, 1, 1) + data(1, 1, 2)
    assert lv.read_now(6, 4) is None          # cluster 0 copied on write: no longer beside cluster 1
    assert not lv.write_now(6, data(5, 4, 6))  # nor a write over both
    assert lv.read_now(0, 3) == data(3, 1) + data(4, 1, 1) + data(1, 1, 2)
    assert g.volume("s").read_now(0, 3) == await read(g.volume("s"), 0, 3) == data(1, 3)


@aio
async def test_a_cluster_provisioned_after_a_mapped_one_goes_right_after_it_where_that_is_free() -> None:
    """The allocator takes the physical cluster after the one the virtual cluster before maps, and each cluster of
    a run after the one before it, where those are free (committed free): the fast paths read and write over
    physically consecutive clusters only."""
    _, g = await new_group()
    lv = await g.create("a", MiB)
    other = await g.create("b", MiB)
    await lv.write(0, data(1, 4 * CB))                 # clusters 0-3
    await other.write(0, data(2, CB))                  # the allocator's cursor moves past them
    await lv.flush()
    await lv.unmap(CB, 3 * CB)                         # 1-3 free again, behind the cursor
    await lv.flush()
    await lv.flush()
    await lv.write(CB, data(3, CB, CB))                # cluster 1 alone
    await lv.write(2 * CB, data(4, 2 * CB, 2 * CB))    # clusters 2-3 as one run
    m = lv.vol.map
    assert [m[i] for i in range(4)] == [m[0] + i for i in range(4)], [m[i] for i in range(4)]
    await lv.flush()
    assert lv.read_now(0, 4 * CB) == await read(lv, 0, 4 * CB) == data(1, CB) + data(3, CB, CB) + data(4, 2 * CB, 2 * CB)
    assert lv.write_now(CB // 2, data(5, 3 * CB, CB // 2))


@aio
async def test_a_write_in_place_over_physically_consecutive_clusters_is_one_device_write() -> None:
    dev, g = await new_group()
    lv = await g.create("a", MiB)
    await lv.write(0, data(1, 6 * CB))            # clusters 0-5, allocated as one run
    await lv.write(100 * CB, data(1, 1, 100 * CB))  # cluster 100: elsewhere on the device
    await lv.flush()
    await g.snapshot("a", "s")
    await lv.write(2 * CB, data(2, 1, 2 * CB))    # cluster 2 copied on write: no longer beside 1 and 3
    await g.delete("s")
    await lv.flush()
    writes: list[tuple[int, int]] = []
    real = dev.write

    async def counted(lba: int, buf: Buffer, *, fua: bool = False) -> None:
        writes.append((lba, len(buf) // BS))
        await real(lba, buf, fua=fua)

    dev.write = counted  # type: ignore[method-assign]
    await lv.write(3, data(3, 2 * CB + 2, 3))     # clusters 0 (from block 3), 1 and part of 2: 0-1 one write
    assert [n for _, n in writes] == [2 * CB - 3, 5], writes
    writes.clear()
    await lv.write(3 * CB + 1, data(4, 3 * CB - 2, 3 * CB + 1))   # clusters 3, 4, 5: one write
    assert [n for _, n in writes] == [3 * CB - 2], writes
    dev.write = real  # type: ignore[method-assign]
    want = (data(1, 3) + data(3, 2 * CB + 2, 3) + data(1, 3, 2 * CB + 5) + data(1, 1, 3 * CB)
            + data(4, 3 * CB - 2, 3 * CB + 1) + data(1, 1, 6 * CB - 1))
    assert await read(lv, 0, 6 * CB) == want
    check_refs(g)


@aio
async def test_write_now_declines_while_a_snapshot_holds_the_volume() -> None:
    dev = RamDevice(8 * MiB // BS, BS)
    gate = Gate(dev)
    g = await VolumeGroup.format(gate, cluster_size=CS, metadata_size=META)
    lv = await g.create("a", MiB)
    await lv.write(0, data(1, 16))
    await lv.flush()
    gate.armed = True
    slow = asyncio.create_task(lv.write(0, data(2, 1)))     # in flight: the snapshot waits for it
    await settle()
    snap = asyncio.create_task(g.snapshot("a", "s"))
    await settle()
    assert not lv.write_now(8, data(3, 1))                  # held: it would land in the snapshot
    gate.armed = False
    gate.gate.set()
    await slow
    await snap
    assert await read(g.volume("s"), 8, 1) == data(1, 1, 8)


@aio
async def test_fast_paths_decline_on_a_device_without_them() -> None:
    dev = FaultDevice(RamDevice(8 * MiB // BS, BS))
    g = await VolumeGroup.format(dev, cluster_size=CS, metadata_size=META)
    lv = await g.create("a", MiB)
    await lv.write(0, data(1, 8))
    await lv.flush()
    assert not lv.capabilities.sync_read and not lv.capabilities.sync_write
    assert lv.read_now(0, 1) is None and not lv.write_now(0, data(2, 1))


# ---- reopening

@aio
async def test_reopen_after_close_keeps_everything() -> None:
    dev, g = await new_group(16)
    a = await g.create("a", 3 * MiB + BS)
    await a.write(0, data(1, 100))
    await g.snapshot("a", "s")
    await a.write(50, data(2, 100, 50))
    c = await g.clone("s", "c")
    await c.write(1000, data(3, 10, 1000))
    await g.create("t", MiB, thin=False)
    await g.resize("c", 4 * MiB)
    await a.unmap(0, 16)
    before = {n: (g.info(n), await read(g.volume(n), 0, g.volume(n).num_blocks)) for n in g.names()}
    space = g.space()
    del space["metadata_used"]      # a bound until the next checkpoint counts it
    await g.close()
    g = await VolumeGroup.open(dev)
    assert {k: v for k, v in g.space().items() if k != "metadata_used"} == space
    after = {n: (g.info(n), await read(g.volume(n), 0, g.volume(n).num_blocks)) for n in g.names()}
    assert after == before
    check_refs(g)
    # and once more, after changes that only the journal holds (no close: the last commit was a flush)
    await g.volume("a").write(7, data(4, 30, 7))
    await g.delete("s")
    await g.volume("a").flush()
    before = {n: await read(g.volume(n), 0, g.volume(n).num_blocks) for n in g.names()}
    g = await VolumeGroup.open(dev)
    assert {n: await read(g.volume(n), 0, g.volume(n).num_blocks) for n in g.names()} == before
    check_refs(g)


@aio
async def test_probe_and_open_refuse_what_is_not_a_group() -> None:
    dev = RamDevice(8 * MiB // BS, BS)
    assert await VolumeGroup.probe(dev) is None
    with pytest.raises(GroupError, match="no volume group"):
        await VolumeGroup.open(dev)
    await dev.write(0, b"not a group".ljust(BS, b"\0"))
    with pytest.raises(GroupError, match="not an openvsan volume group"):
        await VolumeGroup.probe(dev)
    dev2, g = await new_group()
    await g.close()
    raw = bytearray(await dev2.read(0, 8))
    raw[8] = 9                                    # a newer version (the checksum made right again)
    size = struct.calcsize("<8sII16sIIQQQQQQQ64s")
    struct.pack_into("<I", raw, size, crc32c.crc32c(bytes(raw[:size])))
    await dev2.write(0, bytes(raw) * 2)
    with pytest.raises(FormatError, match="version 9"):
        await VolumeGroup.open(dev2)
    with pytest.raises(GroupError):
        await VolumeGroup.format(RamDevice(8 * MiB // BS, BS), cluster_size=3000)
    with pytest.raises(GroupError):
        await VolumeGroup.format(RamDevice(8 * MiB // BS, BS), metadata_size=16 << 10)


@pytest.mark.parametrize("gib", [1, 100])
@aio
async def test_snapshot_and_clone_of_a_large_sparse_volume(gib: int) -> None:
    dev = RamDevice((gib << 30) // BS + (64 << 20) // BS, BS)    # sparse: only what is written takes memory
    g = await VolumeGroup.format(dev)
    lv = await g.create("big", gib << 30)
    for lba in (0, (gib << 30) // BS // 2, (gib << 30) // BS - 128):
        await lv.write(lba, data(lba, 128, lba))
    await g.snapshot("big", "s")
    c = await g.clone("s", "c")
    await c.write(0, data(9, 1))
    await lv.write(1, data(8, 1, 1))
    assert await read(g.volume("s"), 0, 2) == data(0, 2)
    assert await read(c, 0, 2) == data(9, 1) + data(0, 1, 1)
    assert await read(lv, 0, 2) == data(0, 1) + data(8, 1, 1)
    assert g.space()["used"] == (3 + 2) * (64 << 10)    # three written, two copied
    await g.close()
    await dev.close()


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@aio
async def test_snapshots_of_a_sparse_volume_hold_memory_for_what_it_maps_only() -> None:
    """A 100 GiB volume's mapping has 1.6 M entries (6.4 MiB); 20 snapshots and clones of it, sparse, touch
    the pages that map something, not 128 MiB: nor do their deletes, a checkpoint, or a reopen."""
    dev = RamDevice(((100 << 30) + (64 << 20)) // BS, BS)
    g = await VolumeGroup.format(dev)
    lv = await g.create("big", 100 << 30)
    for lba in (0, (50 << 30) // BS, (100 << 30) // BS - 128):
        await lv.write(lba, data(lba, 128, lba))
    before = resident_bytes()
    for i in range(10):
        await g.snapshot("big", f"s{i}")
        await g.clone(f"s{i}", f"c{i}")
        assert g.info(f"c{i}")["mapped"] == 3 * (64 << 10)
    await g.delete("c0")
    await g.checkpoint()
    grown = resident_bytes() - before
    assert grown < 16 << 20, f"20 sparse copies of a 100 GiB mapping took {grown >> 20} MiB"
    await g.close()
    g = await VolumeGroup.open(dev)
    assert sorted(g.names()) == sorted(["big"] + [f"s{i}" for i in range(10)] + [f"c{i}" for i in range(1, 10)])
    assert await read(g.volume("c5"), (50 << 30) // BS, 128) == data((50 << 30) // BS, 128, (50 << 30) // BS)
    await g.close()
    await dev.close()


# ---- crash rules that need a cut at a chosen point

@aio
async def test_a_cluster_left_to_one_volume_is_not_written_in_place_before_that_is_committed() -> None:
    """A and its clone C share a cluster; C's write copies it (not committed), so in memory A alone has it:
    A's write there must not land in place before C's mapping is committed, else a crash shows it in C."""
    dev = FaultDevice(RamDevice(8 * MiB // BS, BS), volatile_cache=True)
    g = await VolumeGroup.format(dev, cluster_size=CS, metadata_size=META)
    g.commit_interval = 1e9
    a = await g.create("a", MiB)
    await a.write(0, data(1, 8))
    c = await g.clone("a", "c")                 # committed: both map the cluster
    await c.write(0, data(2, 1))                # C copies it: its new mapping is not committed
    await a.write(1, data(3, 1, 1))             # A alone has the old cluster now
    dev.crash(survive=1.0)
    await dev.restart()
    g = await VolumeGroup.open(dev)
    assert await read(g.volume("c"), 0, 8) in (data(1, 8), data(2, 1) + data(1, 7, 1))
    assert await read(g.volume("a"), 0, 8) in (data(1, 8), data(1, 1) + data(3, 1, 1) + data(1, 6, 2))


@aio
async def test_an_unmap_by_a_sharer_is_committed_before_the_other_writes_in_place() -> None:
    dev = FaultDevice(RamDevice(8 * MiB // BS, BS), volatile_cache=True)
    g = await VolumeGroup.format(dev, cluster_size=CS, metadata_size=META)
    g.commit_interval = 1e9
    a = await g.create("a", MiB)
    await a.write(0, data(1, 16))
    c = await g.clone("a", "c")
    await c.unmap(0, 16)                         # not committed: the committed C still maps both clusters
    await a.write_zeroes(2, 2)                   # zeros in place...
    await a.write(9, data(3, 1, 9))              # ...and data
    dev.crash(survive=1.0)
    await dev.restart()
    g = await VolumeGroup.open(dev)
    assert await read(g.volume("c"), 0, 16) in (data(1, 16), bytes(16 * BS))


@aio
async def test_zeros_racing_a_snapshot_do_not_land_in_it() -> None:
    dev = RamDevice(8 * MiB // BS, BS)
    gate = Gate(dev)
    g = await VolumeGroup.format(gate, cluster_size=CS, metadata_size=META)
    lv = await g.create("a", MiB)
    await lv.write(0, data(1, 16))
    gate.armed = True
    slow = asyncio.create_task(lv.write(8, data(2, 1, 8)))   # in flight: the snapshot drains it
    await settle()
    snap = asyncio.create_task(g.snapshot("a", "s"))
    await settle()
    zero = asyncio.create_task(lv.write_zeroes(1, 2))         # waits for the snapshot
    await settle()
    gate.armed = False
    gate.gate.set()
    await asyncio.gather(slow, snap, zero)
    assert await read(g.volume("s"), 0, 8) == data(1, 8)
    assert await read(lv, 0, 8) == data(1, 1) + bytes(2 * BS) + data(1, 5, 3)


@aio
async def test_allocation_finds_free_clusters_behind_many_busy_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thin_state, "CANDIDATES", 4)
    _, g = await new_group(2)
    n = g.clusters
    lv = await g.create("a", n * CS)
    await lv.write(0, data(1, n * CB))            # every cluster, in order
    await lv.unmap((n - 8) * CB, 8 * CB)          # the last eight: free once committed
    await lv.flush()
    await lv.unmap(0, 40 * CB)                    # forty more, not committed: busy
    await lv.write((n - 1) * CB, data(2, 1))      # a free one is found past the busy ones
    assert await read(lv, (n - 1) * CB, 1) == data(2, 1)


class FlushGate(Layer):
    """The flushes numbered in `hold` (counting from 1) wait for good."""

    def __init__(self, below: BlockDevice) -> None:
        super().__init__(below)
        self.flushes = 0
        self.hold: set[int] = set()

    async def flush(self) -> None:
        self.flushes += 1
        if self.flushes in self.hold:
            await asyncio.Event().wait()
        await self.below.flush()


@aio
async def test_a_cancelled_commit_never_mixes_its_journal_blocks_with_the_next_commits() -> None:
    """A commit cancelled after writing its journal blocks (a flush whose caller went away): the next commit
    must not write other blocks at the same places, or a cut that keeps some of each replays a mix of the two
    (here: a mapping beyond a volume's end whose resize is skipped)."""
    fault = FaultDevice(RamDevice(16 * MiB // BS, BS), volatile_cache=True)
    gate = FlushGate(fault)
    g = await VolumeGroup.format(gate, cluster_size=CS, metadata_size=MiB)
    g.commit_interval = 1e9
    a = await g.create("a", 4 * MiB)
    b = await g.create("b", MiB)
    for i in range(241):                       # 241 mappings: a full journal block and one record more
        await a.write(i * CB, data(1, 1, i * CB))
    # this commit's flush after its journal write waits (its caller goes away); so does the next commit's
    gate.hold = {gate.flushes + 2, gate.flushes + 4}
    at = g.sb.journal_offset // BS + g.journal_pos * CB    # where this commit's journal blocks go
    first = asyncio.create_task(a.flush())
    await settle()
    resize = asyncio.create_task(g.resize("b", 2 * MiB))   # applied, then waits for the commit under way
    await settle()
    for i in range(241, 481):                  # more mappings in the same batch, then one beyond b's old end
        await a.write(i * CB, data(1, 1, i * CB))
    await b.write(MiB // BS + 8, data(2, 1))
    first.cancel()
    await settle()
    assert not resize.done() and gate.flushes == max(gate.hold)   # the next commit waits: the power is cut
    for lba in range(at + CB, at + 2 * CB):   # the cache lost the second journal block of the commit
        fault.pending.pop(lba, None)
    fault.crash(survive=1.0)
    await fault.restart()
    resize.cancel()
    g = await VolumeGroup.open(fault)
    size = g.volume("b").num_blocks
    assert size in (MiB // BS, 2 * MiB // BS)
    if size == 2 * MiB // BS:
        assert await read(g.volume("b"), MiB // BS + 8, 1) in (bytes(BS), data(2, 1))
    check_refs(g)


class ReadGate(Layer):
    """Reads wait at a gate while armed."""

    def __init__(self, below: BlockDevice) -> None:
        super().__init__(below)
        self.armed = False
        self.gate = asyncio.Event()

    async def read(self, lba: int, blocks: int) -> Buffer:
        if self.armed:
            await self.gate.wait()
        return await self.below.read(lba, blocks)


@aio
async def test_a_read_under_way_of_a_deleted_snapshot_never_sees_the_origins_next_write() -> None:
    gate = ReadGate(RamDevice(8 * MiB // BS, BS))
    g = await VolumeGroup.format(gate, cluster_size=CS, metadata_size=META)
    a = await g.create("a", MiB)
    await a.write(0, data(1, 8))
    await g.snapshot("a", "s")
    gate.armed = True
    reading = asyncio.create_task(g.volume("s").read(0, 8))     # under way: the snapshot's cluster
    await settle()
    gate.armed = False
    await g.delete("s")                                          # a alone has the cluster now
    await a.write(0, data(2, 8))
    gate.gate.set()
    assert bytes(await reading) == data(1, 8)
    assert await read(a, 0, 8) == data(2, 8)
    check_refs(g)


@aio
async def test_the_timer_commits_what_no_flush_did() -> None:
    dev = FaultDevice(RamDevice(8 * MiB // BS, BS), volatile_cache=True)
    g = await VolumeGroup.format(dev, cluster_size=CS, metadata_size=META)
    g.commit_interval = 0.0                    # due at once: the next turn of the loop
    a = await g.create("a", MiB)
    await settle()
    await a.write(0, data(1, 20))
    commits = g.commits
    await settle()
    assert g.commits == commits + 1
    dev.crash()                                # nothing of the cache survives: the commit made it durable
    await dev.restart()
    g = await VolumeGroup.open(dev)
    assert await read(g.volume("a"), 0, 20) == data(1, 20)
