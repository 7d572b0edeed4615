"""A first write to part of a cluster writes only its own blocks when the cluster reads zero (zeroed at
format, or by a write_zeroes that costs no transfer); a cluster that held anything since reads zero around
the write all the same."""

from __future__ import annotations

import asyncio

from openvsan.block.ram import RamDevice
from openvsan.volume.thin import VolumeGroup

CLUSTER = 64 << 10


def test_a_reused_cluster_reads_zero_around_a_first_partial_write() -> None:
    async def main() -> None:
        dev = RamDevice((8 << 20) // 512, 512)
        group = await VolumeGroup.format(dev, cluster_size=CLUSTER, metadata_size=4 << 20)
        free = group.clusters
        thick = await group.create("thick", free * CLUSTER, thin=False)      # every cluster, then filled
        await thick.write(0, b"\xee" * (free * CLUSTER))
        await group.delete("thick")
        await group.commit()
        thin = await group.create("thin", free * CLUSTER)
        for c in range(free):                                                 # one 4 KiB write per cluster
            await thin.write(c * (CLUSTER // 512) + 16, bytes([c % 250 + 1]) * 4096)
        for c in range(free):
            got = bytes(await thin.read(c * (CLUSTER // 512), CLUSTER // 512))
            assert got[:8192] == bytes(8192) and got[12288:] == bytes(CLUSTER - 12288), c
            assert got[8192:12288] == bytes([c % 250 + 1]) * 4096

    asyncio.run(main())


def test_first_partial_writes_of_a_fresh_group_touch_only_their_blocks() -> None:
    async def main() -> None:
        dev = RamDevice((8 << 20) // 512, 512)
        group = await VolumeGroup.format(dev, cluster_size=CLUSTER, metadata_size=4 << 20)
        thin = await group.create("thin", 2 << 20)
        writes: list[int] = []
        real = dev.write

        async def counted(lba: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
            writes.append(len(memoryview(data).cast("B")))
            await real(lba, data, fua=fua)

        dev.write = counted  # type: ignore[method-assign]
        await thin.write(8, b"\x01" * 4096)
        assert writes == [4096]          # not the whole cluster
        assert bytes(await thin.read(0, 128))[4096:8192] == b"\x01" * 4096

    asyncio.run(main())
