"""decouple (and inflate: decouple with allocate): a clone takes its own copy of every cluster it shares, while
writes to it go on; the snapshot keeps its data and its space; with allocate, every cluster is there."""

from __future__ import annotations

import asyncio

import pytest

from openvsan.block.ram import RamDevice
from openvsan.volume.thin import GroupError, VolumeGroup

CLUSTER = 64 << 10
CB = CLUSTER // 512


async def _group() -> VolumeGroup:
    return await VolumeGroup.format(RamDevice((32 << 20) // 512, 512), cluster_size=CLUSTER, metadata_size=4 << 20)


def test_decouple_copies_only_what_is_shared_and_keeps_the_data() -> None:
    async def main() -> None:
        g = await _group()
        v = await g.create("v", 2 << 20)
        for c in range(0, 32, 2):                               # half the clusters written
            await v.write(c * CB, bytes([c + 1]) * CLUSTER)
        await g.snapshot("v", "s")
        clone = await g.clone("s", "c")
        await clone.write(0, b"\xaa" * 4096)                    # one cluster already its own
        assert g.info("c")["exclusive"] == CLUSTER
        done = await g.decouple("c")
        assert done == {"copied": 15, "allocated": 0}
        info = g.info("c")
        assert info["exclusive"] == info["mapped"] == 16 * CLUSTER
        assert g.info("s")["exclusive"] == 0                    # still shared with v
        for c in range(0, 32, 2):
            want = b"\xaa" * 4096 + bytes([1]) * (CLUSTER - 4096) if c == 0 else bytes([c + 1]) * CLUSTER
            assert bytes(await clone.read(c * CB, CB)) == want
        await g.delete("s")
        await g.delete("v")
        for c in range(2, 32, 2):
            assert bytes(await clone.read(c * CB, CB)) == bytes([c + 1]) * CLUSTER
        assert (await g.decouple("c", allocate=True)) == {"copied": 0, "allocated": 16}
        assert g.info("c")["mapped"] == 32 * CLUSTER
        assert bytes(await clone.read(CB, CB)) == bytes(CLUSTER)

    asyncio.run(main())


def test_writes_go_on_while_a_volume_decouples() -> None:
    async def main() -> None:
        g = await _group()
        v = await g.create("v", 2 << 20)
        await v.write(0, b"\x01" * (2 << 20))
        await g.snapshot("v", "s")

        async def writer() -> None:
            for i in range(64):
                await v.write((i % 32) * CB + 8, bytes([0x80 + i % 32]) * 512)
                await asyncio.sleep(0)

        await asyncio.gather(g.decouple("v"), writer())
        for c in range(32):
            got = bytes(await v.read(c * CB, CB))
            assert got[:4096] == b"\x01" * 4096 and got[4096:4608] == bytes([0x80 + c]) * 512, c
        assert bytes(await g.volume("s").read(0, 4096)) == b"\x01" * (2 << 20)
        assert g.info("v")["exclusive"] == 32 * CLUSTER

    asyncio.run(main())


def test_a_snapshot_is_not_decoupled() -> None:
    async def main() -> None:
        g = await _group()
        await g.create("v", 1 << 20)
        await g.snapshot("v", "s")
        with pytest.raises(GroupError):
            await g.decouple("s")

    asyncio.run(main())
