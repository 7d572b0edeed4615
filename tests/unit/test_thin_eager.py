"""A thin volume under the frontends' way of running commands (netio.start_eagerly: the command runs in the
caller's turn up to its first suspension; only then does a Task carry on). Two writes to one cluster not yet
allocated, both started eagerly in one turn, wait on the same allocation: the second must wait too, not fail
(awaiting one asyncio future twice before its Task has taken it raises "await wasn't used with future")."""

from __future__ import annotations

import asyncio

from openvsan.block.fault import FaultDevice
from openvsan.block.ram import RamDevice
from openvsan.netio import start_eagerly
from openvsan.volume.thin import VolumeGroup


def slow_device() -> FaultDevice:
    """A device whose I/O suspends (as a file device's does, in its thread), so an allocation is in flight."""
    return FaultDevice(RamDevice((32 << 20) // 512, 512), latency=0.001)


def test_two_eager_writes_to_one_unallocated_cluster_both_complete() -> None:
    async def main() -> None:
        group = await VolumeGroup.format(slow_device(), cluster_size=64 << 10)
        lv = await group.create("v", 8 << 20)
        errors: list[BaseException] = []

        async def write(lba: int, fill: int) -> None:
            try:
                await lv.write(lba, bytes([fill]) * 4096)
            except BaseException as e:  # noqa: BLE001 - the test reports it
                errors.append(e)

        tasks = [start_eagerly(write(i * 8, i + 1)) for i in range(4)]   # four 4 KiB writes in cluster 0
        await asyncio.gather(*(t for t in tasks if t is not None))
        assert errors == []
        data = bytes(await lv.read(0, 32))
        assert [data[i * 4096] for i in range(4)] == [1, 2, 3, 4]
        assert group.info("v")["mapped"] == 64 << 10

    asyncio.run(main())


def test_eager_unmap_waits_for_an_eager_allocation_of_the_same_cluster() -> None:
    async def main() -> None:
        group = await VolumeGroup.format(slow_device(), cluster_size=64 << 10)
        lv = await group.create("v", 8 << 20)
        t1 = start_eagerly(lv.write(0, b"\x07" * 4096))
        t2 = start_eagerly(lv.unmap(0, 128))
        t3 = start_eagerly(lv.write(8, b"\x08" * 4096))   # overlaps nothing of the first, but the unmap
        results = await asyncio.gather(*(t for t in (t1, t2, t3) if t is not None), return_exceptions=True)
        assert [r for r in results if isinstance(r, BaseException)] == []
        data = bytes(await lv.read(0, 16))
        assert data[:4096] == bytes(4096)        # the unmap waited for the first write's allocation
        # commands in flight together have no order (SAM-5): the second write lands before or after the unmap
        assert data[4096:] in (bytes(4096), b"\x08" * 4096)

    asyncio.run(main())
