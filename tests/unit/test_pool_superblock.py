"""Member superblock: format round trip, CRC, two alternating copies surviving a torn write."""

from __future__ import annotations

import asyncio
import uuid

from openvsan.block import RamDevice
from openvsan.pool.superblock import (
    SLOT_SIZE,
    SPARE_INDEX,
    MemberState,
    Role,
    Superblock,
    read_superblock,
    write_superblock,
)


def sample(event: int = 7) -> Superblock:
    roles = tuple(Role(uuid.uuid4(), s, cp) for s, cp in [(MemberState.ACTIVE, 0), (MemberState.REBUILDING, 4096),
                                                           (MemberState.FAILED, 0)])
    return Superblock(
        pool_uuid=uuid.uuid4(), member_uuid=roles[1].uuid, level=5, chunk_size=65536, block_size=512,
        member_count=3, member_index=1, event=event, data_offset=2048, data_size=1 << 20, bitmap_region=64,
        state=MemberState.REBUILDING, checkpoint=4096, clean=True, created=1700000000, name="tank", roles=roles,
    )


def test_round_trip_and_crc() -> None:
    sb = sample()
    raw = sb.pack()
    assert len(raw) == 192 + 3 * 32 + 4
    assert Superblock.unpack(raw + bytes(SLOT_SIZE - len(raw))) == sb
    for pos in (0, 20, 80, 130, 200, len(raw) - 1):  # magic, uuid, offsets, name, roles, CRC itself
        bad = bytearray(raw)
        bad[pos] ^= 0x40
        assert Superblock.unpack(bytes(bad)) is None
    spare = sb.evolve(member_index=SPARE_INDEX, state=MemberState.SPARE, roles=())
    back = Superblock.unpack(spare.pack())
    assert back is not None and back.is_spare and back.roles == ()


def test_two_copies_survive_a_torn_write() -> None:
    async def go() -> None:
        dev = RamDevice(4096)
        assert await read_superblock(dev) is None  # blank
        sb = sample(event=10)
        await write_superblock(dev, sb)  # slot 0
        await write_superblock(dev, sb.evolve(event=11))  # slot 1
        got = await read_superblock(dev)
        assert got is not None and got.event == 11
        # event 12 goes to slot 0 and tears half-way: slot 1 (event 11) still stands
        raw = sb.evolve(event=12).pack()
        await dev.write(0, raw[:128] + bytes(384))
        got = await read_superblock(dev)
        assert got is not None and got.event == 11
        # a good event 12 in slot 0 and slot 1 wiped: slot 0 is used
        await write_superblock(dev, sb.evolve(event=12))
        await dev.write(SLOT_SIZE // 512, bytes(512))
        got = await read_superblock(dev)
        assert got is not None and got.event == 12
        assert await read_superblock(RamDevice(8)) is None  # smaller than the two slots

    asyncio.run(go())
