"""The primary's mirror layer (replication/mirror.py) over devices in memory and the in-memory cluster store:
the ack rule, the out-of-sync record made before the acknowledgement, fencing, and a resync that copies only
what a peer missed while the volume takes writes."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from openvsan.block import FaultDevice, RamDevice
from openvsan.block.device import Buffer
from openvsan.node.memstore import MemoryState, MemoryStateStore
from openvsan.node.statestore import StoreUnavailable
from openvsan.replication import record as R
from openvsan.replication.mirror import MirrorLayer, NotPrimary

BS = 512
BLOCKS = 2048            # 1 MiB volumes
REGION = 64 * 1024       # 16 regions


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Yielding(RamDevice):
    """A RAM device whose requests take a few loop turns, so that concurrent ones interleave."""

    def __init__(self, *args: Any, rng: random.Random, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.rng = rng

    async def _turns(self) -> None:
        for _ in range(self.rng.randrange(4)):
            await asyncio.sleep(0)

    async def read(self, lba: int, blocks: int) -> Buffer:
        await self._turns()
        return await super().read(lba, blocks)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        await self._turns()
        await super().write(lba, data, fua=fua)


async def cluster(nodes: tuple[str, ...] = ("a", "b", "c"), *, rng: random.Random | None = None) -> Any:
    clock = Clock()
    store = MemoryStateStore(MemoryState(clock=clock))
    await R.create(store, "v", nodes)
    view = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
    make = (lambda n: Yielding(BLOCKS, BS, name=n, rng=rng)) if rng else (lambda n: RamDevice(BLOCKS, BS, name=n))
    local = make("a")
    peers = {n: FaultDevice(make(n)) for n in nodes if n != "a"}
    mirror = MirrorLayer(local, me="a", view=view, store=store, peers=peers, region_size=REGION)
    return clock, store, local, peers, mirror


async def image(dev: Any) -> bytes:
    return bytes(await dev.read(0, BLOCKS))


def test_a_write_is_on_every_replica_when_it_is_acknowledged() -> None:
    async def go() -> None:
        _, _, local, peers, m = await cluster()
        await m.write(8, b"x" * 4096, fua=True)
        for d in (local, *peers.values()):
            assert bytes(await d.read(8, 8)) == b"x" * 4096
        assert bytes(await m.read(8, 8)) == b"x" * 4096
        await m.flush()
    asyncio.run(go())


def test_a_peer_that_fails_is_recorded_out_of_sync_before_the_ack() -> None:
    async def go() -> None:
        _, store, _, peers, m = await cluster()
        peers["b"].fail_device()
        await m.write(0, b"y" * BS)                     # acknowledged: b is recorded as missing it
        rs = await R.load(store, "v")
        assert rs.out_of_sync == {"b": m.view.epoch} and m.dirty == {"b": {0}}
        await m.write(REGION // BS * 3, b"z" * BS)      # b gets no more writes; its dirty regions grow
        assert m.dirty["b"] == {0, 3} and m.stats["peer_failures"] == 1
        assert bytes(await peers["c"].read(0, 1)) == b"y" * BS
    asyncio.run(go())


def test_without_the_store_a_write_a_peer_missed_is_not_acknowledged() -> None:
    async def go() -> None:
        _, store, _, peers, m = await cluster()
        peers["b"].fail_device()
        await store.close()                             # the cluster store is unreachable
        with pytest.raises(StoreUnavailable):
            await m.write(0, b"y" * BS)
    asyncio.run(go())


def test_the_old_primary_is_fenced_when_a_peer_fails_after_a_new_election() -> None:
    async def go() -> None:
        clock, store, _, peers, m = await cluster()
        clock.now += 6                                  # a's lease expired: c is elected
        await R.claim_primary(store, "v", "c", await store.grant_lease(5))
        peers["b"].fail_device()
        with pytest.raises(NotPrimary, match="epoch .* is over"):
            await m.write(0, b"y" * BS)
        assert m.fenced
        with pytest.raises(NotPrimary):                 # and every write after it
            await m.write(8, b"y" * BS)
        assert (await R.load(store, "v")).out_of_sync == {}
    asyncio.run(go())


def test_concurrent_failures_make_one_record() -> None:
    async def go() -> None:
        _, store, _, peers, m = await cluster()
        peers["b"].fail_device()
        before = await store.revision()
        await asyncio.gather(*(m.write(i * 8, b"q" * 4096) for i in range(16)))
        assert await store.revision() == before + 1      # one compare-and-swap for all sixteen
        assert m.dirty["b"] == {0}                      # 16 x 4 KiB: the first 64 KiB region
    asyncio.run(go())


def test_a_failed_flush_marks_what_the_peer_held_unflushed() -> None:
    async def go() -> None:
        _, store, _, peers, m = await cluster()
        await m.write(0, b"1" * BS)                     # region 0, not flushed yet
        await m.flush()
        await m.write(REGION // BS * 5, b"2" * BS)      # region 5, not flushed
        await m.write(REGION // BS * 7, b"3" * BS, fua=True)   # region 7, durable at once
        peers["c"].fail_device()
        await m.flush()
        assert m.dirty == {"c": {5}}
        assert (await R.load(store, "v")).out_of_sync == {"c": m.view.epoch}
    asyncio.run(go())


def test_resync_copies_only_the_dirty_regions_and_the_peer_is_in_sync_again() -> None:
    async def go() -> None:
        _, store, local, peers, m = await cluster()
        for i in range(16):
            await m.write(i * (REGION // BS), bytes([i]) * REGION)
        await m.flush()                                 # else b may have lost all 16 with its cache
        peers["b"].fail_device()
        for r in (2, 9):
            await m.write(r * (REGION // BS) + 3, b"n" * BS)
        peers["b"].clear_faults()
        sent = await m.resync("b")
        assert sent == 2 * REGION and m.stats["resync_regions"] == 2
        assert await image(peers["b"]) == await image(local)
        rs = await R.load(store, "v")
        assert rs.out_of_sync == {} and "b" not in m.dirty
        await m.write(0, b"after" * 100 + bytes(12))    # b gets writes again
        assert bytes(await peers["b"].read(0, 1)) == bytes(await local.read(0, 1))
    asyncio.run(go())


@pytest.mark.parametrize("seed", range(8))
def test_resync_under_concurrent_writes_leaves_the_replicas_identical(seed: int) -> None:
    async def go() -> None:
        rng = random.Random(seed)
        _, store, local, peers, m = await cluster(("a", "b"), rng=rng)
        peers["b"].fail_device()
        for _ in range(40):
            lba = rng.randrange(BLOCKS - 8)
            await m.write(lba, rng.randbytes(8 * BS))
        peers["b"].clear_faults()

        async def writer() -> None:
            for _ in range(60):
                lba = rng.randrange(BLOCKS - 16)
                await m.write(lba, rng.randbytes(rng.randrange(1, 16) * BS))

        await asyncio.gather(m.resync("b"), writer(), writer())
        assert await image(peers["b"]) == await image(local)
        assert (await R.load(store, "v")).out_of_sync == {}
    asyncio.run(go())


def test_a_peer_out_of_sync_before_the_election_needs_a_full_copy() -> None:
    async def go() -> None:
        clock = Clock()
        store = MemoryStateStore(MemoryState(clock=clock))
        await R.create(store, "v", ("a", "b"))
        old = await R.claim_primary(store, "v", "b", await store.grant_lease(5))
        await R.mark_out_of_sync(store, old, "a")       # b was primary and a fell behind... then b died
        clock.now += 6
        with pytest.raises(R.NotInSync):
            await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        # b comes back as primary: what a missed is unknown here, so all of it is dirty
        view = await R.claim_primary(store, "v", "b", await store.grant_lease(5))
        m = MirrorLayer(RamDevice(BLOCKS, BS), me="b", view=view, store=store,
                        peers={"a": RamDevice(BLOCKS, BS)}, region_size=REGION)
        assert m.dirty == {"a": set(range(16))}
        assert await m.resync("a") == BLOCKS * BS
    asyncio.run(go())


def test_a_layer_for_a_node_that_is_not_primary_is_refused() -> None:
    async def go() -> None:
        _, store, _, peers, m = await cluster()
        with pytest.raises(ValueError, match="b is not its primary"):
            MirrorLayer(RamDevice(BLOCKS, BS), me="b", view=m.view, store=store, peers=peers)
        with pytest.raises(ValueError, match="no device for peer"):
            MirrorLayer(RamDevice(BLOCKS, BS), me="a", view=m.view, store=store, peers={"b": peers["b"]})
    asyncio.run(go())


class Held(RamDevice):
    """A peer whose writes wait for the test to let them go (release()), and which notes when a write's
    coroutine ended (done) or was abandoned (closed)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate: asyncio.Future[None] | None = None
        self.ended: list[str] = []

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        self.gate = asyncio.get_running_loop().create_future()
        try:
            await self.gate
            await super().write(lba, data, fua=fua)
            self.ended.append("done")
        except BaseException:
            self.ended.append("abandoned")
            raise


def test_peers_answering_out_of_order_and_a_write_cancelled_while_they_wait() -> None:
    """The peers' commands are all sent before the mirror waits for any (netio.start_inline); answers in any
    order complete the write; a write cancelled meanwhile leaves no peer's command behind."""

    async def go() -> None:
        store = MemoryStateStore(MemoryState(clock=Clock()))
        await R.create(store, "v", ("a", "b", "c"))
        view = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        peers = {n: Held(BLOCKS, BS, name=n) for n in ("b", "c")}
        m = MirrorLayer(RamDevice(BLOCKS, BS, name="a"), me="a", view=view, store=store, peers=peers,
                        region_size=REGION)
        w = asyncio.create_task(m.write(0, b"y" * 4096))
        await asyncio.sleep(0)
        assert all(p.gate is not None for p in peers.values())      # both sent before any answer
        peers["c"].gate.set_result(None)                            # type: ignore[union-attr]
        await asyncio.sleep(0)
        assert not w.done()                                         # b has not answered
        peers["b"].gate.set_result(None)                            # type: ignore[union-attr]
        await w
        assert all(p.ended == ["done"] for p in peers.values())
        assert bytes(await peers["b"].read(0, 8)) == b"y" * 4096

        w = asyncio.create_task(m.write(8, b"z" * 4096))
        await asyncio.sleep(0)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert [p.ended[-1] for p in peers.values()] == ["abandoned", "abandoned"]
        assert not m._ops                                            # the ordering gate let it go

    asyncio.run(go())


def test_a_failed_write_marks_what_the_peer_held_unflushed_too() -> None:
    """A peer that fails may have lost its cache: the regions written to it since its last flush are among
    those it misses, not only the failed write's."""
    async def go() -> None:
        _, _, _, peers, m = await cluster()
        await m.write(REGION // BS * 3, b"1" * BS)      # region 3, acknowledged, not flushed
        await m.write(REGION // BS * 4, b"2" * BS, fua=True)   # region 4, durable
        peers["b"].fail_device()
        await m.write(REGION // BS * 6, b"3" * BS)
        assert m.dirty == {"b": {3, 6}}
    asyncio.run(go())


def test_a_peer_whose_link_came_back_gets_what_it_had_not_flushed_again() -> None:
    """The link to b dropped and came back with no write failing meanwhile (b restarted between two writes):
    what b had not flushed may be gone, so it is recorded out of sync and copied again."""
    async def go() -> None:
        _, store, local, peers, m = await cluster()
        await m.write(REGION // BS * 2, b"1" * BS)
        await m.write(REGION // BS * 5, b"2" * BS, fua=True)
        await m.peer_reconnected("c")                   # c had region 2 unflushed: out of sync
        assert m.dirty == {"c": {2}}
        await m.flush()                                 # b's cache flushed (c gets no writes now)
        await m.write(REGION // BS * 8, b"3" * BS)
        await peers["b"].write(REGION // BS * 8, bytes(BS))   # as if b's cache lost it
        await m.peer_reconnected("b")
        assert m.dirty == {"b": {8}, "c": {2, 8}}
        assert set((await R.load(store, "v")).out_of_sync) == {"b", "c"}
        for n in ("b", "c"):
            await m.resync(n)
        for d in peers.values():
            assert await image(d) == await image(local)
        await m.peer_reconnected("b")                   # flushed by the resync: nothing to copy
        assert "b" not in m.dirty
    asyncio.run(go())


def test_a_replicated_volume_states_a_volatile_write_cache() -> None:
    async def go() -> None:
        _, _, local, _, m = await cluster()
        assert not local.capabilities.volatile_cache
        assert m.capabilities.volatile_cache           # a peer's replica may have one the primary cannot see
    asyncio.run(go())


class Counting(RamDevice):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.calls: list[tuple[str, int, int]] = []

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        self.calls.append(("write", lba, memoryview(data).nbytes // BS))
        await super().write(lba, data, fua=fua)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        self.calls.append(("zeroes", lba, blocks))
        await super().write_zeroes(lba, blocks)


def test_resync_sends_pieces_of_zeros_as_write_zeroes() -> None:
    """A thin replica stays thin through a resync: 64 KiB pieces of a region that read zero go as Write
    Zeroes, runs of them as one command."""
    async def go() -> None:
        store = MemoryStateStore(MemoryState(clock=Clock()))
        await R.create(store, "v", ("a", "b"))
        view = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        local, b = RamDevice(BLOCKS, BS, name="a"), Counting(BLOCKS, BS, name="b")
        peer = FaultDevice(b)
        m = MirrorLayer(local, me="a", view=view, store=store, peers={"b": peer}, region_size=512 << 10)
        piece = (64 << 10) // BS
        await local.write(1 * piece + 5, b"x" * BS)     # region 0: pieces 0 zero, 1 data, 2-7 zero
        await b.write(3 * piece, b"stale" * (BS // 5) + bytes(BS % 5))   # b holds junk where a has zeros
        peer.fail_device()
        await m.write(0, bytes(BS))                     # b misses region 0
        peer.clear_faults()
        b.calls.clear()
        await m.resync("b")
        assert b.calls == [("zeroes", 0, piece), ("write", piece, piece), ("zeroes", 2 * piece, 6 * piece)]
        assert await image(b) == await image(local)
    asyncio.run(go())


# ---- write_soon: write()'s fast path (no coroutine per write), the same rules

async def soon(m: MirrorLayer, lba: int, data: bytes, *, fua: bool = False) -> bool:
    """write_soon as a frontend uses it: True and its outcome awaited, or False (declined, nothing done)."""
    fut: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    calls: list[BaseException | None] = []

    def done(e: BaseException | None) -> None:
        calls.append(e)
        fut.set_result(e)

    if not m.write_soon(lba, data, fua, done):
        assert not calls
        return False
    e = await fut
    await asyncio.sleep(0)
    assert len(calls) == 1                              # done exactly once
    if e is not None:
        raise e
    return True


def test_write_soon_puts_the_write_on_every_replica_before_it_is_done() -> None:
    async def go() -> None:
        _, _, local, peers, m = await cluster()
        assert not await soon(m, 8, b"w" * 4096)         # the first write of an epoch is recorded: write() does it
        await m.write(8, b"x" * 4096)
        before = m.stats["writes"]
        assert await soon(m, 16, b"y" * 4096, fua=True)
        for d in (local, *peers.values()):
            assert bytes(await d.read(16, 8)) == b"y" * 4096
        assert m.stats["writes"] == before + 1 and not m._ops and not m._busy_grains
        assert await soon(m, 24, b"z" * 4096)           # not FUA: unflushed on the peers until a flush
        assert all(3 in m._unflushed[n] or 0 in m._unflushed[n] for n in peers)
    asyncio.run(go())


def test_write_soon_with_a_failing_peer_records_it_out_of_sync_before_it_is_done() -> None:
    async def go() -> None:
        _, store, _, peers, m = await cluster()
        await m.write(0, b"x" * BS)
        peers["b"].fail_device()
        assert await soon(m, REGION // BS * 2, b"y" * 4096)   # done: b recorded as missing it first
        rs = await R.load(store, "v")
        # region 2, and region 0, which b held unflushed (its cache may be gone with it)
        assert rs.out_of_sync == {"b": m.view.epoch} and m.dirty == {"b": {0, 2}}
        assert bytes(await peers["c"].read(REGION // BS * 2, 8)) == b"y" * 4096
        assert not await soon(m, 0, b"z" * BS)          # a peer out of sync: write() takes every write now
    asyncio.run(go())


def test_write_soon_fails_as_write_would_once_a_new_primary_was_elected() -> None:
    async def go() -> None:
        clock, store, _, peers, m = await cluster()
        await m.write(0, b"x" * BS)
        clock.now += 6
        await R.claim_primary(store, "v", "c", await store.grant_lease(5))
        peers["b"].fail_device()
        with pytest.raises(NotPrimary, match="epoch .* is over"):
            await soon(m, 8, b"y" * BS)
        assert m.fenced and not await soon(m, 16, b"y" * BS)
    asyncio.run(go())


class SoonPeer(RamDevice):
    """A peer with a fast send (WriteSoon), as our NVMe/TCP initiator is: its answer comes in a later turn; the
    ones in `lose` fail, as a send on a connection that dropped does (the initiator never retries them)."""

    def __init__(self, name: str) -> None:
        super().__init__(BLOCKS, BS, name=name)
        self.lose = 0
        self.soon_sent = self.writes = 0

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: Any) -> bool:
        self.soon_sent += 1
        if self.lose:
            self.lose -= 1
            asyncio.get_running_loop().call_soon(done, ConnectionError("lost with the connection"))
            return True
        self._put(lba, data)
        asyncio.get_running_loop().call_soon(done, None)
        return True

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        self.writes += 1
        await asyncio.sleep(0)
        self._put(lba, data)


@pytest.mark.parametrize("nodes", [("a", "b"), ("a", "b", "c")])
def test_write_soon_sends_again_the_normal_way_what_a_fast_send_lost(nodes: tuple[str, ...]) -> None:
    """A peer's fast send that fails is not a peer failure: the write goes to it again through write() (which
    retries and reconnects), and is done once every replica has it, no peer marked out of sync."""
    async def go() -> None:
        clock = Clock()
        store = MemoryStateStore(MemoryState(clock=clock))
        await R.create(store, "v", nodes)
        view = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        local = RamDevice(BLOCKS, BS, name="a")
        peers = {n: SoonPeer(n) for n in nodes if n != "a"}
        m = MirrorLayer(local, me="a", view=view, store=store, peers=peers, region_size=REGION)
        await m.write(0, b"x" * BS)                      # the epoch's first write, recorded by write()
        last = peers[nodes[-1]]
        last.lose = 1
        assert await soon(m, 64, b"s" * 4096)
        for d in (local, *peers.values()):
            assert bytes(await d.read(64, 8)) == b"s" * 4096
        assert last.writes == 2 and all(p.writes == 1 for p in peers.values() if p is not last)  # one resend
        assert not (await R.load(store, "v")).out_of_sync and not m.dirty and not m._ops
        assert await soon(m, 72, b"t" * 4096)            # and the next write takes the fast send again
        assert all(p.soon_sent == 2 for p in peers.values()) and last.writes == 2
    asyncio.run(go())


class CachingReplica(RamDevice):
    """A local replica that keeps small writes in a volatile cache, as the compression layer's write cache does:
    write_now declines them (it must be durable on return), write_soon takes them, at once or (`later`) in a
    later turn, or fails them (`fail`); flush writes the cache back."""

    def __init__(self, name: str) -> None:
        super().__init__(BLOCKS, BS, name=name)
        self.cache: dict[int, bytes] = {}
        self.later = False
        self.fail: BaseException | None = None

    def write_now(self, lba: int, data: Buffer) -> bool:
        return False

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: Any) -> bool:
        if self.fail is not None:
            asyncio.get_running_loop().call_soon(done, self.fail)
            return True
        if fua:
            self._put(lba, data)
        else:
            self.cache[lba] = bytes(data)
        if self.later:
            asyncio.get_running_loop().call_soon(done, None)
        else:
            done(None)          # in the caller's turn, before the mirror has sent anything to its peers
        return True

    async def read(self, lba: int, blocks: int) -> Buffer:
        out = bytearray(await super().read(lba, blocks))
        for at, data in self.cache.items():
            lo, hi = max(at, lba), min(at + len(data) // BS, lba + blocks)
            if lo < hi:
                out[(lo - lba) * BS:(hi - lba) * BS] = data[(lo - at) * BS:(hi - at) * BS]
        return bytes(out)

    async def flush(self) -> None:
        for at, data in self.cache.items():
            self._put(at, data)
        self.cache.clear()


def test_write_soon_takes_a_write_the_local_replica_caches_and_acknowledges_it_once_every_replica_has_it() -> None:
    """A compressed replica's write cache declines write_now (not durable on return) but takes write_soon: the
    mirror's fast path uses it rather than leave the write to write()'s coroutine; the write is acknowledged
    when the peers have it too, whether the local answer came first or last, and a local failure is not
    acknowledged."""
    async def go() -> None:
        clock = Clock()
        store = MemoryStateStore(MemoryState(clock=clock))
        await R.create(store, "v", ("a", "b"))
        view = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        local = CachingReplica("a")
        peer = SoonPeer("b")
        m = MirrorLayer(local, me="a", view=view, store=store, peers={"b": peer}, region_size=REGION)
        await m.write(0, b"x" * BS)                      # the epoch's first write, recorded by write()
        for later, lba in ((False, 64), (True, 72)):
            local.later = later
            before = m.stats["writes"]
            assert await soon(m, lba, b"c" * 4096)
            assert local.cache[lba] == b"c" * 4096 and bytes(await peer.read(lba, 8)) == b"c" * 4096
            assert m.stats["writes"] == before + 1 and not m._ops and not m._busy_grains
        assert peer.soon_sent == 2 and peer.writes == 1  # both on the fast path (write() took the first)
        assert bytes(await m.read(64, 16)) == b"c" * 8192
        await m.flush()
        assert not local.cache and bytes(await RamDevice.read(local, 64, 16)) == b"c" * 8192
        local.fail = OSError("the local replica failed")
        with pytest.raises(OSError, match="local replica failed"):
            await soon(m, 80, b"f" * 4096)
        assert not m._ops and not m._busy_grains
    asyncio.run(go())


def test_write_soon_declines_a_write_that_overlaps_one_in_flight() -> None:
    async def go() -> None:
        _, _, _, _, m = await cluster(("a", "b"), rng=random.Random(3))
        await m.write(0, b"x" * BS)
        first = asyncio.ensure_future(m.write(64, b"1" * 4096))
        await asyncio.sleep(0)
        assert m._ops
        assert not m.write_soon(64 + 4, b"2" * BS, False, lambda e: None)   # overlaps: ordered by write()
        assert not m.write_soon(60, b"2" * 4096, False, lambda e: None)     # overlaps its first blocks
        assert await soon(m, 64 + 8, b"3" * BS)         # the next grain: overlaps nothing, goes now
        await first
    asyncio.run(go())


def test_two_small_writes_in_one_grain_that_do_not_overlap_both_go() -> None:
    async def go() -> None:
        _, _, local, peers, m = await cluster(("a", "b"), rng=random.Random(5))
        await m.write(0, b"x" * BS)
        await asyncio.gather(m.write(200, b"a" * BS), m.write(201, b"b" * BS))   # one 4 KiB grain, no overlap
        for d in (local, peers["b"]):
            assert bytes(await d.read(200, 2)) == b"a" * BS + b"b" * BS
        assert not m._ops and not m._busy_grains and not m._large
    asyncio.run(go())


@pytest.mark.parametrize("seed", range(6))
def test_write_and_write_soon_together_keep_the_replicas_identical(seed: int) -> None:
    """Overlapping writes of every size through both paths at once, peers taking a few loop turns each: the
    ordering gate is one for both, so every replica ends with the same bytes."""
    async def go() -> None:
        rng = random.Random(seed)
        _, _, local, peers, m = await cluster(("a", "b", "c"), rng=rng)
        await m.write(0, b"\0" * BS)
        taken = [0]

        async def writer() -> None:
            for _ in range(80):
                blocks = rng.choice((1, 1, 8, 8, 16, 300))
                lba = rng.randrange(0, 256 - min(blocks, 200)) if blocks < 300 else rng.randrange(BLOCKS - 300)
                data = rng.randbytes(blocks * BS)
                if rng.random() < 0.6 and await soon(m, lba, data):
                    taken[0] += 1
                else:
                    await m.write(lba, data)

        await asyncio.gather(*(writer() for _ in range(6)))
        assert taken[0] > 50                            # the fast path did most of its share
        want = await image(local)
        for p in peers.values():
            assert await image(p) == want
        assert not m._ops and not m._busy_grains and not m._large
    asyncio.run(go())


def test_a_peer_links_command_closed_unfinished_awaits_nothing() -> None:
    """A hurried exit (a second SIGTERM) leaves a peer command suspended; when it is closed (GeneratorExit,
    at garbage collection) it must not await its clean-up, or Python prints 'coroutine ignored GeneratorExit'
    with a traceback in the node's log. Any other failure still drops the connection."""
    from openvsan.replication.controller import PeerLink

    class Stuck:
        lost = False
        closed = 0

        async def flush(self) -> None:
            await asyncio.Event().wait()

        async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
            await asyncio.Event().wait()

        async def close(self) -> None:
            self.closed += 1

    async def go() -> None:
        async def nowhere() -> str | None:
            return None

        link = PeerLink("b", nowhere, "v", "a", 1, RamDevice(64, 512), timeout=1.0)
        for make in (link.flush, lambda: link.write(0, bytes(512))):
            dev = link.dev = Stuck()
            coro = make()
            coro.send(None)           # suspended in the peer's command
            coro.close()              # raised RuntimeError('coroutine ignored GeneratorExit') before
            assert dev.closed == 0
        dev = link.dev = Stuck()
        task = asyncio.ensure_future(link.flush())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert dev.closed == 1 and link.dev is None      # a cancelled command still drops the connection
    asyncio.run(go())
