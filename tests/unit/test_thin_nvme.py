"""Thin provisioning over NVMe: a namespace over a logical volume of a volume group (volume/thin) reports
NSFEAT THINP and the blocks allocated now as NUSE (NVM Command Set 1.0 §4.1.5.1), deallocated blocks
reading as zeroes (DLFEAT), gives space back on Dataset Management deallocate and Write Zeroes, and fails
a write the group has no space for with Capacity Exceeded (Generic Command Status 81h). No sockets: SQEs
into the controller."""

from __future__ import annotations

import asyncio
import struct
import uuid
from collections.abc import Awaitable, Callable

from nvme_host import HOSTNQN, connect_cmd, connect_data, sqe

from openvsan.block.ram import RamDevice
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.command import Sqe
from openvsan.protocol.nvme.controller import Controller
from openvsan.protocol.nvme.fabrics import Fabric
from openvsan.protocol.nvme.io import execute_io
from openvsan.protocol.nvme.subsystem import Namespace, Port, Subsystem
from openvsan.volume import Volume
from openvsan.volume.thin import VolumeGroup

NQN = "nqn.2026-11.org.openvsan:thin"
BS = 512
CLUSTER = 64 << 10
CB = CLUSTER // BS
SIZE = 16 << 20
BLOCKS = SIZE // BS


async def controller(namespaces: list[Namespace]) -> Controller:
    sub = Subsystem(NQN, namespaces, serial="SN1")
    fabric = Fabric([sub], {NQN: [Port(1, "192.0.2.1", 4420)]}, clock=lambda: 100.0)
    res = fabric.connect(Sqe(connect_cmd(1, 0, 31, 0)), connect_data(NQN, HOSTNQN, 0xFFFF))
    ctrl = res.controller
    assert res.completion.status == 0 and ctrl is not None
    comp = await ctrl.admin(Sqe(sqe(0x7F, 2, 0x00, cdw11=0x14, cdw12=1 | (6 << 16) | (4 << 20))), b"")
    assert comp is not None and comp.status == 0 and ctrl.ready
    return ctrl


def run(fn: Callable[..., Awaitable[None]], *, device_mib: int = 64, thick: bool = True) -> None:
    """fn(group, ctrl) with namespace 1 a thin volume (and 2 a thick one) of a fresh group on RAM."""
    async def go() -> None:
        group = await VolumeGroup.format(RamDevice((device_mib << 20) // BS, BS), cluster_size=CLUSTER)
        try:
            namespaces = [Namespace(1, Volume(await group.create("thin", SIZE), name="thin", uuid=uuid.UUID(int=1)))]
            if thick:
                lv = await group.create("thick", SIZE, thin=False)
                namespaces.append(Namespace(2, Volume(lv, name="thick", uuid=uuid.UUID(int=2))))
            ctrl = await controller(namespaces)
            await fn(group, ctrl)
        finally:
            await group.close()

    asyncio.run(go())


async def identify_ns(ctrl: Controller, nsid: int) -> bytes:
    comp = await ctrl.admin(Sqe(sqe(0x06, 1, nsid, cdw10=0)), b"")
    assert comp is not None and comp.status == 0 and comp.data is not None
    return bytes(comp.data)


async def sizes(ctrl: Controller, nsid: int) -> tuple[int, int, int]:
    """NSZE, NCAP, NUSE."""
    return struct.unpack_from("<QQQ", await identify_ns(ctrl, nsid))  # type: ignore[return-value]


async def write(ctrl: Controller, nsid: int, lba: int, data: bytes, cid: int = 10) -> int:
    nlb = len(data) // BS
    comp = await execute_io(ctrl, Sqe(sqe(0x01, cid, nsid, cdw10=lba, cdw12=nlb - 1, sgl_len=len(data))), data)
    return comp.status


async def read(ctrl: Controller, nsid: int, lba: int, nlb: int) -> bytes:
    comp = await execute_io(ctrl, Sqe(sqe(0x02, 11, nsid, cdw10=lba, cdw12=nlb - 1, sgl_len=nlb * BS)), b"")
    assert comp.status == 0 and comp.data is not None
    return bytes(comp.data)


async def deallocate(ctrl: Controller, nsid: int, ranges: list[tuple[int, int]]) -> int:
    data = b"".join(struct.pack("<IIQ", 0, nlb, slba) for slba, nlb in ranges)
    comp = await execute_io(ctrl, Sqe(sqe(0x09, 12, nsid, cdw10=len(ranges) - 1, cdw11=4, sgl_len=len(data))),
                            data)
    return comp.status


def test_identify_namespace_says_thin_and_reports_what_is_allocated() -> None:
    async def go(group: VolumeGroup, ctrl: Controller) -> None:
        thin, thick = await identify_ns(ctrl, 1), await identify_ns(ctrl, 2)
        assert thin[24] & 0x01 and not thick[24] & 0x01                       # NSFEAT THINP
        assert thin[24] & 0x18 == thick[24] & 0x18 == 0x18                    # the other NSFEAT bits as before
        assert thin[33] & 0x07 == thick[33] & 0x07 == 0x01                    # DLFEAT: deallocated reads zeroes
        assert await sizes(ctrl, 1) == (BLOCKS, BLOCKS, 0)
        assert await sizes(ctrl, 2) == (BLOCKS, BLOCKS, BLOCKS)
        # NUSE grows by whole clusters as writes allocate them
        assert await write(ctrl, 1, 3, b"a" * BS) == 0
        assert await sizes(ctrl, 1) == (BLOCKS, BLOCKS, CB)
        assert await write(ctrl, 1, 4 * CB - 1, b"b" * 2 * BS) == 0         # the ends of clusters 3 and 4
        assert await write(ctrl, 1, 4, b"c" * BS) == 0                        # cluster 0 again: nothing new
        assert (await sizes(ctrl, 1))[2] == 3 * CB
        # Dataset Management deallocate gives whole clusters back; a part of one is only zeroed
        assert await deallocate(ctrl, 1, [(3 * CB, CB), (4 * CB, 5)]) == 0
        assert (await sizes(ctrl, 1))[2] == 2 * CB
        assert await read(ctrl, 1, 4 * CB - 1, 2) == bytes(2 * BS)
        # Write Zeroes deallocates whole clusters of a thin volume too
        comp = await execute_io(ctrl, Sqe(sqe(0x08, 13, 1, cdw10=0, cdw12=CB - 1)), b"")
        assert comp.status == 0 and (await sizes(ctrl, 1))[2] == CB
        assert await read(ctrl, 1, 3, 2) == bytes(2 * BS)
        # a thick volume stays all in use
        assert await write(ctrl, 2, 0, b"t" * BS) == 0
        assert await deallocate(ctrl, 2, [(0, 4 * CB)]) == 0
        assert await sizes(ctrl, 2) == (BLOCKS, BLOCKS, BLOCKS)
        assert await read(ctrl, 2, 0, 1) == bytes(BS)

    run(go)


def test_a_ram_namespace_is_not_reported_thin() -> None:
    async def go() -> None:
        ctrl = await controller([Namespace(1, Volume(RamDevice(2048, BS), name="ram", uuid=uuid.UUID(int=3)))])
        ns = await identify_ns(ctrl, 1)
        assert not ns[24] & 0x01 and struct.unpack_from("<QQQ", ns) == (2048, 2048, 2048) and ns[33] == 0x09

    asyncio.run(go())


def test_a_write_the_group_has_no_space_for_fails_with_capacity_exceeded() -> None:
    async def go(group: VolumeGroup, ctrl: Controller) -> None:
        assert await write(ctrl, 1, 0, b"k" * BS) == 0
        filler = await group.create("filler", SIZE, thin=True)
        for c in range(group.clusters - group.used):
            await filler.write(c * CB, bytes(CLUSTER))
        assert group.used == group.clusters
        st = await write(ctrl, 1, 5 * CB, b"x" * BS, cid=21)
        assert st == S.CAPACITY_EXCEEDED and st & 0x7FF == 0x81 and st & S.DNR     # generic 81h, do not retry
        log = await ctrl.admin(Sqe(sqe(0x02, 1, 0, cdw10=0x01 | (15 << 16), sgl_len=64)), b"")
        assert log is not None and log.data is not None
        assert struct.unpack_from("<QHHH", bytes(log.data)) == (1, 0, 21, S.CAPACITY_EXCEEDED << 1)
        # FUA or not, and a write of many blocks: the same
        comp = await execute_io(ctrl, Sqe(sqe(0x01, 22, 1, cdw10=6 * CB, cdw12=(2 * CB - 1) | (1 << 30),
                                             sgl_len=2 * CLUSTER)), bytes(2 * CLUSTER))
        assert comp.status == S.CAPACITY_EXCEEDED
        # allocated blocks still take writes; space given back lets the write through
        assert await write(ctrl, 1, 1, b"m" * BS) == 0
        assert await read(ctrl, 1, 0, 2) == b"k" * BS + b"m" * BS
        await filler.unmap(0, CB)
        await group.commit()
        assert await write(ctrl, 1, 5 * CB, b"x" * BS) == 0
        assert await read(ctrl, 1, 5 * CB, 1) == b"x" * BS

    run(go, device_mib=12, thick=False)

