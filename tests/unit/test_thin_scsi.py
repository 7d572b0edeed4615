"""Thin provisioning over SCSI: a LUN over a logical volume of a volume group (volume/thin) says whether it is
thin (VPD B2h PROVISIONING TYPE, READ CAPACITY(16) LBPME/LBPRZ), answers GET LBA STATUS from the volume's map,
fails a write the group has no space for with DATA PROTECT, SPACE ALLOCATION FAILED WRITE PROTECT, and
reports the group's soft threshold as a unit attention (SBC-4 4.7). No sockets: CDBs into the LU."""

from __future__ import annotations

import asyncio
import struct
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from openvsan.block.ram import RamDevice
from openvsan.protocol.scsi import CHECK_CONDITION, GOOD, Lun, Nexus, ScsiResult, parse_sense
from openvsan.volume import Volume
from openvsan.volume.thin import LogicalVolume, VolumeGroup

BS = 512
CLUSTER = 64 << 10
CB = CLUSTER // BS                  # blocks per cluster
SIZE = 16 << 20
BLOCKS = SIZE // BS
IQN = "iqn.2026-11.org.openvsan:test"
NX1 = Nexus("iqn.2026-11.org.openvsan.test:init1", 0x23D000000001, IQN)
NX2 = Nexus("iqn.2026-11.org.openvsan.test:init2", 0x23D000000002, IQN)
TUR = bytes(6)
DATA_PROTECT, SPACE_ALLOCATION_FAILED = 0x7, 0x2707
UNIT_ATTENTION, SOFT_THRESHOLD_REACHED = 0x6, 0x3807


def run(fn: Callable[..., Awaitable[None]], *, device_mib: int = 64) -> None:
    """fn(group, make_lun) in one event loop over a fresh group on RAM; the group is closed after."""
    async def go() -> None:
        group = await VolumeGroup.format(RamDevice((device_mib << 20) // BS, BS), cluster_size=CLUSTER)

        async def make_lun(name: str, *, thin: bool = True, size: int = SIZE) -> tuple[Lun, LogicalVolume]:
            lv = await group.create(name, size, thin=thin)
            return Lun(Volume(lv, name=name, uuid=uuid.uuid5(uuid.NAMESPACE_URL, name))), lv

        try:
            await fn(group, make_lun)
        finally:
            await group.close()

    asyncio.run(go())


async def ok(lun: Lun, cdb: bytes | list[int], data: bytes = b"", nexus: Nexus = NX1) -> bytes:
    r = await lun.execute(bytes(cdb), memoryview(data), nexus)
    assert r.status == GOOD, parse_sense(r.sense) if r.sense else r.status
    return bytes(r.data)


async def sense(lun: Lun, cdb: bytes | list[int], data: bytes = b"", nexus: Nexus = NX1) -> tuple[int, int]:
    r: ScsiResult = await lun.execute(bytes(cdb), memoryview(data), nexus)
    assert r.status == CHECK_CONDITION, r.status
    return parse_sense(r.sense)


def rw10(op: int, lba: int, n: int) -> bytes:
    return struct.pack(">BBIBHB", op, 0, lba, 0, n, 0)


def write_same16(lba: int, n: int, *, unmap: bool = False) -> bytes:
    return struct.pack(">BBQIBB", 0x93, 0x08 if unmap else 0, lba, n, 0, 0)


def unmap_cdb(ranges: list[tuple[int, int]]) -> tuple[bytes, bytes]:
    descs = b"".join(struct.pack(">QI4x", lba, n) for lba, n in ranges)
    params = struct.pack(">HH4x", 6 + len(descs), len(descs)) + descs
    return bytes([0x42, 0, 0, 0, 0, 0, 0]) + struct.pack(">HB", len(params), 0), params


async def lba_status(lun: Lun, lba: int, alloc: int = 4096) -> tuple[int, list[tuple[int, int, int]], bytes]:
    """(PARAMETER DATA LENGTH, descriptors, raw data) of GET LBA STATUS from `lba`."""
    out = await ok(lun, struct.pack(">BBQIBB", 0x9E, 0x12, lba, alloc, 0, 0))
    length = struct.unpack_from(">I", out)[0] if len(out) >= 4 else -1
    descs = [struct.unpack_from(">QIB", out, 8 + 16 * i) for i in range((len(out) - 8) // 16)]
    return length, [(s, c, st & 0x0F) for s, c, st in descs], out


# --- what the LU says it is ----------------------------------------------------------------------

def test_b2h_says_thin_for_a_thin_volume_and_full_for_a_thick_one() -> None:
    async def go(group: VolumeGroup, make_lun: Any) -> None:
        thin, _ = await make_lun("thin")
        thick, _ = await make_lun("thick", thin=False)
        for lun, ptype in ((thin, 0b010), (thick, 0b000)):
            page = await ok(lun, [0x12, 1, 0xB2, 0, 255, 0])
            assert page[1] == 0xB2 and struct.unpack_from(">H", page, 2)[0] == 4
            assert page[6] & 0x07 == ptype
            assert page[5] & 0xE0 == 0xE0                        # LBPU, LBPWS, LBPWS10: both deallocate or zero
            assert page[5] & 0x1C == 0x04                        # LBPRZ 001b: deallocated blocks read zeroes
            assert page[4] == 0                                  # THRESHOLD EXPONENT: no threshold descriptors
            rc16 = await ok(lun, [0x9E, 0x10] + [0] * 8 + [0, 0, 0, 32, 0, 0])
            last, bs, _, _, flags = struct.unpack_from(">QIBBH", rc16)
            assert (last, bs) == (BLOCKS - 1, BS)
            assert flags & 0x8000 and flags & 0x4000             # LBPME, LBPRZ, as B2h has them

    run(go)


def test_a_ram_lun_is_not_reported_thin() -> None:
    """A device that is not a thin volume (capabilities.thin clear) reports PROVISIONING TYPE 000b; it still
    unmaps (LBPME, LBPU), as before."""
    async def go() -> None:
        lun = Lun(Volume(RamDevice(2048, BS), name="ram", uuid=uuid.UUID(int=3)))
        page = await ok(lun, [0x12, 1, 0xB2, 0, 255, 0])
        assert page[6] & 0x07 == 0 and page[5] & 0xE4 == 0xE4
        rc16 = await ok(lun, [0x9E, 0x10] + [0] * 8 + [0, 0, 0, 32, 0, 0])
        assert struct.unpack_from(">H", rc16, 14)[0] & 0xC000 == 0xC000

    asyncio.run(go())


# --- GET LBA STATUS --------------------------------------------------------------------------------

def test_get_lba_status_follows_writes_and_unmaps_of_a_thin_volume() -> None:
    async def go(group: VolumeGroup, make_lun: Any) -> None:
        lun, _ = await make_lun("thin")
        assert (await lba_status(lun, 0))[1] == [(0, BLOCKS, 1)]              # nothing allocated yet
        await ok(lun, rw10(0x2A, CB + 2, 1), b"a" * BS)                         # one block of cluster 1
        await ok(lun, rw10(0x2A, 5 * CB - 1, 2), b"b" * 2 * BS)                 # the ends of clusters 4 and 5
        want = [(0, CB, 1), (CB, CB, 0), (2 * CB, 2 * CB, 1), (4 * CB, 2 * CB, 0), (6 * CB, BLOCKS - 6 * CB, 1)]
        length, descs, _ = await lba_status(lun, 0)
        assert descs == want and length == 4 + 16 * len(want)
        # from a starting LBA inside an extent: the first descriptor starts there
        assert (await lba_status(lun, CB + 100))[1] == [(CB + 100, CB - 100, 0)] + want[2:]
        assert (await lba_status(lun, BLOCKS - 1))[1] == [(BLOCKS - 1, 1, 1)]
        # ALLOCATION LENGTH: as many descriptors as fit, at least one (cut short)
        length, descs, raw = await lba_status(lun, 0, alloc=8 + 2 * 16)
        assert descs == want[:2] and length == 4 + 32 and len(raw) == 40
        length, descs, raw = await lba_status(lun, 0, alloc=8 + 16 + 15)
        assert descs == want[:1] and length == 4 + 16 and len(raw) == 24
        _, _, raw = await lba_status(lun, 0, alloc=12)
        assert len(raw) == 12 and struct.unpack_from(">I", raw)[0] == 4 + 16
        assert (await lba_status(lun, 0, alloc=0))[2] == b""
        # UNMAP whole clusters: deallocated again (and reads zeroes); a part of a cluster is zeroed, stays mapped
        cdb, params = unmap_cdb([(CB, CB), (4 * CB, 10)])
        await ok(lun, cdb, params)
        assert (await lba_status(lun, 0))[1] == [(0, 4 * CB, 1), (4 * CB, 2 * CB, 0), (6 * CB, BLOCKS - 6 * CB, 1)]
        assert await ok(lun, rw10(0x28, CB + 2, 1)) == bytes(BS)
        # WRITE SAME(16) with UNMAP of zeroes deallocates too
        await ok(lun, write_same16(4 * CB, 2 * CB, unmap=True), bytes(BS))
        assert (await lba_status(lun, 0))[1] == [(0, BLOCKS, 1)]
        assert await ok(lun, rw10(0x28, 5 * CB - 1, 2)) == bytes(2 * BS)
        # WRITE SAME of data allocates
        await ok(lun, write_same16(8 * CB, CB), b"s" * BS)
        assert (await lba_status(lun, 8 * CB - 1))[1][:2] == [(8 * CB - 1, 1, 1), (8 * CB, CB, 0)]

    run(go)


def test_get_lba_status_of_a_thick_volume_says_mapped_even_after_unmap() -> None:
    async def go(group: VolumeGroup, make_lun: Any) -> None:
        lun, _ = await make_lun("thick", thin=False)
        assert (await lba_status(lun, 0))[1] == [(0, BLOCKS, 0)]
        await ok(lun, rw10(0x2A, 7, 1), b"t" * BS)
        cdb, params = unmap_cdb([(0, 4 * CB)])
        await ok(lun, cdb, params)
        assert (await lba_status(lun, 3))[1] == [(3, BLOCKS - 3, 0)]
        assert await ok(lun, rw10(0x28, 7, 1)) == bytes(BS)                   # zeroed, still provisioned

    run(go)


# --- out of space --------------------------------------------------------------------------------

def test_a_write_the_group_has_no_space_for_fails_with_space_allocation_failed() -> None:
    async def go(group: VolumeGroup, make_lun: Any) -> None:
        lun, _ = await make_lun("thin")
        await ok(lun, rw10(0x2A, 0, 1), b"k" * BS)                             # cluster 0 allocated first
        filler = await group.create("filler", SIZE, thin=True)                 # then another volume fills the group
        free = group.clusters - group.used
        for c in range(free):
            await filler.write(c * CB, bytes(CLUSTER))
        assert group.used == group.clusters
        assert await sense(lun, rw10(0x2A, 3 * CB, 1), b"x" * BS) == (DATA_PROTECT, SPACE_ALLOCATION_FAILED)
        assert await sense(lun, struct.pack(">BBQIBB", 0x8A, 0, 5 * CB, 2, 0, 0), b"y" * 2 * BS) == \
            (DATA_PROTECT, SPACE_ALLOCATION_FAILED)
        assert await sense(lun, write_same16(6 * CB, CB), b"z" * BS) == (DATA_PROTECT, SPACE_ALLOCATION_FAILED)
        # what is allocated still takes writes, and reads go on
        await ok(lun, rw10(0x2A, 1, 2), b"m" * 2 * BS)
        assert await ok(lun, rw10(0x28, 0, 3)) == b"k" * BS + b"m" * 2 * BS
        assert await ok(lun, rw10(0x28, 3 * CB, 1)) == bytes(BS)
        # space given back (the other volume unmaps) lets the write through
        await filler.unmap(0, CB)
        await group.commit()
        await ok(lun, rw10(0x2A, 3 * CB, 1), b"x" * BS)
        assert await ok(lun, rw10(0x28, 3 * CB, 1)) == b"x" * BS

    run(go, device_mib=12)


# --- the soft threshold --------------------------------------------------------------------------

def test_the_soft_threshold_unit_attention_reaches_each_nexus_once() -> None:
    async def go(group: VolumeGroup, make_lun: Any) -> None:
        lun, _ = await make_lun("thin")
        for nx in (NX1, NX2):
            await ok(lun, TUR, nexus=nx)
        lun.soft_threshold_reached()
        lun.soft_threshold_reached()                 # before anyone saw it: still one per nexus
        for nx in (NX1, NX2):
            await ok(lun, [0x12, 0, 0, 0, 96, 0], nexus=nx)                   # INQUIRY does not consume it
            assert await sense(lun, TUR, nexus=nx) == (UNIT_ATTENTION, SOFT_THRESHOLD_REACHED)
            await ok(lun, TUR, nexus=nx)                                      # reported once, then cleared
        # the next crossing: again, here through the volume's listeners (what the node calls)
        volume = lun.volume
        notify = getattr(volume, "notify", None) or volume._changed
        notify("thin-threshold")
        assert await sense(lun, rw10(0x28, 0, 1), nexus=NX2) == (UNIT_ATTENTION, SOFT_THRESHOLD_REACHED)
        assert await ok(lun, rw10(0x28, 0, 1), nexus=NX2) == bytes(BS)
        assert await sense(lun, TUR, nexus=NX1) == (UNIT_ATTENTION, SOFT_THRESHOLD_REACHED)
        await ok(lun, TUR, nexus=NX1)

    run(go)
