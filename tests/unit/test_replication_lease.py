"""The primary's lease keeper (replication/lease.py): renewed while the store answers, and given up (no more
acknowledgements) before the store could expire it when the store stops answering."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from openvsan.block import RamDevice
from openvsan.node.memstore import MemoryState, MemoryStateStore
from openvsan.node.statestore import StoreUnavailable
from openvsan.replication import record as R
from openvsan.replication.lease import LeaseKeeper
from openvsan.replication.mirror import MirrorLayer, NotPrimary


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


async def setup(ttl: int = 6) -> tuple[Clock, MemoryState, Any, LeaseKeeper]:
    clock = Clock()
    state = MemoryState(clock=clock)
    store = MemoryStateStore(state)
    asked = clock()
    lease = await store.grant_lease(ttl)
    return clock, state, lease, LeaseKeeper(lease, asked, clock=clock, sleep=clock.sleep)


async def run_for(keeper: LeaseKeeper, clock: Clock, seconds: float) -> None:
    end = clock.now + seconds
    task = asyncio.ensure_future(keeper.run())
    while clock.now < end and not task.done():
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_renewed_while_the_store_answers() -> None:
    async def go() -> None:
        clock, state, lease, keeper = await setup()
        await run_for(keeper, clock, 60)
        assert keeper.held and not keeper.lost and lease.id in state.leases
    asyncio.run(go())


def test_given_up_before_the_store_can_expire_it() -> None:
    async def go() -> None:
        clock, state, lease, keeper = await setup(ttl=6)
        await run_for(keeper, clock, 10)
        real = lease.refresh

        async def unreachable() -> int:
            raise StoreUnavailable("etcd: no member answers")
        lease.refresh = unreachable
        task = asyncio.ensure_future(keeper.run())
        for _ in range(10_000):                # simulated seconds pass in the keeper's sleeps
            if not keeper.held:
                break
            await asyncio.sleep(0)
        task.cancel()
        assert not keeper.held, "still acknowledging although no renewal got through"
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # the moment this node stops acknowledging, the store still holds its lease: nobody else can be
        # primary yet, so no two nodes acknowledge at once
        assert lease.id in state.leases and state.leases[lease.id].deadline > clock.now + 1
        assert keeper.failures >= 1
        lease.refresh = real
    asyncio.run(go())


def test_an_expired_lease_is_lost_for_good() -> None:
    async def go() -> None:
        clock, _, _, keeper = await setup(ttl=3)
        clock.now += 10                       # the node was stopped past its TTL
        await run_for(keeper, clock, 5)
        assert keeper.lost and not keeper.held
    asyncio.run(go())


async def leased_mirror() -> tuple[Clock, MirrorLayer]:
    """A primary's mirror (a, peer b, RAM) whose acknowledgements ask a 6 s lease kept on a test clock."""
    clock = Clock()
    store = MemoryStateStore(MemoryState(clock=clock))
    await R.create(store, "v", ("a", "b"))
    asked = clock()
    lease = await store.grant_lease(6)
    view = await R.claim_primary(store, "v", "a", lease)
    keeper = LeaseKeeper(lease, asked, clock=clock, sleep=clock.sleep)
    m = MirrorLayer(RamDevice(256, 512), me="a", view=view, store=store, peers={"b": RamDevice(256, 512)},
                    region_size=4096, lease=keeper)
    return clock, m


def test_the_mirror_acknowledges_nothing_without_the_lease() -> None:
    async def go() -> None:
        clock, m = await leased_mirror()
        await m.write(0, b"x" * 512)          # held: acknowledged
        clock.now += 5                        # no renewal for 5 of 6 s: past the margin
        with pytest.raises(NotPrimary, match="lease was not renewed in time"):
            await m.write(0, b"y" * 512)
        with pytest.raises(NotPrimary):
            await m.flush()
        assert m.fenced
    asyncio.run(go())


def test_write_soon_acknowledges_nothing_without_the_lease() -> None:
    """The fast path asks the lease where write() does, before the acknowledgement: a write started once the
    lease was past its margin ends in NotPrimary, and the mirror is fenced."""
    async def go() -> None:
        clock, m = await leased_mirror()
        await m.write(0, b"x" * 512)          # held: acknowledged, and the epoch is written
        fut: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        assert m.write_soon(8, b"y" * 512, False, fut.set_result)
        assert await fut is None              # held: acknowledged
        clock.now += 5                        # no renewal for 5 of 6 s: past the margin
        fut = asyncio.get_running_loop().create_future()
        assert m.write_soon(16, b"z" * 512, False, fut.set_result)
        e = await fut
        assert isinstance(e, NotPrimary) and "lease was not renewed in time" in str(e)
        assert m.fenced and not m.write_soon(24, b"w" * 512, False, fut.set_result)
    asyncio.run(go())
