"""What a frontend does when its Volume changes: a SCSI LU reports CAPACITY DATA HAS CHANGED to every
nexus and the new capacity (SBC-4 4.6), an NVMe subsystem sends its controllers Namespace Attribute
Changed (NVMe Base 2.0 §5.2, §5.16.1.5). No sockets: CDBs and SQEs straight into the protocol machines."""

from __future__ import annotations

import asyncio
import struct
import uuid

from nvme_host import HOSTNQN, connect_cmd, connect_data, sqe

from openvsan.block import Capabilities, Layer, RamDevice
from openvsan.protocol.nvme.command import Sqe
from openvsan.protocol.nvme.controller import Controller
from openvsan.protocol.nvme.fabrics import Fabric
from openvsan.protocol.nvme.subsystem import Namespace, Port, Subsystem
from openvsan.protocol.scsi import CHECK_CONDITION, GOOD, Lun, Nexus, parse_sense
from openvsan.volume import Volume

BLOCKS = 2048
IQN = "iqn.2026-11.org.openvsan:test"
NX1 = Nexus("iqn.2026-11.org.openvsan.test:init1", 0x23D000000001, IQN)
NX2 = Nexus("iqn.2026-11.org.openvsan.test:init2", 0x23D000000002, IQN)
TUR = bytes(6)
READ_CAPACITY_16 = bytes([0x9E, 0x10] + [0] * 8 + [0, 0, 0, 32, 0, 0])
UNIT_ATTENTION, CAPACITY_DATA_HAS_CHANGED = 6, 0x2A09


def read10(lba: int, n: int) -> bytes:
    return struct.pack(">BBIBHB", 0x28, 0, lba, 0, n, 0)


# --- SCSI ------------------------------------------------------------------------------------------------

def test_a_lun_reports_capacity_data_has_changed_to_each_nexus_after_a_resize() -> None:
    async def go() -> None:
        vol = Volume(RamDevice(BLOCKS, 512), name="disk0", uuid=uuid.UUID(int=7))
        lun = Lun(vol)

        async def cmd(cdb: bytes, nexus: Nexus) -> tuple[int, bytes, tuple[int, int] | None]:
            r = await lun.execute(cdb, memoryview(b""), nexus)
            return r.status, bytes(r.data), parse_sense(r.sense) if r.sense else None

        for nx in (NX1, NX2):
            assert (await cmd(TUR, nx))[0] == GOOD
        assert lun.read_now(read10(0, 1), NX1) == bytes(512)
        await vol.resize(2 * BLOCKS)
        # the fast path stands aside while a unit attention waits (it is the normal path's to report)
        assert lun.read_now(read10(0, 1), NX1) is None
        for nx in (NX1, NX2):
            status, _, sense = await cmd(READ_CAPACITY_16, nx)
            assert status == CHECK_CONDITION and sense == (UNIT_ATTENTION, CAPACITY_DATA_HAS_CHANGED), nx
            status, data, _ = await cmd(READ_CAPACITY_16, nx)          # reported once, then cleared
            assert status == GOOD and struct.unpack_from(">QI", data) == (2 * BLOCKS - 1, 512)
            status, data, _ = await cmd(bytes([0x25] + [0] * 9), nx)   # READ CAPACITY(10) too
            assert status == GOOD and struct.unpack(">II", data) == (2 * BLOCKS - 1, 512)
        # the new blocks are there, on either path
        status, data, _ = await cmd(read10(2 * BLOCKS - 1, 1), NX1)
        assert status == GOOD and data == bytes(512)
        assert lun.read_now(read10(2 * BLOCKS - 1, 1), NX2) == bytes(512)
        # a LU gone (its listener removed) hears no more
        lun.unlisten()
        await vol.resize(3 * BLOCKS)
        assert (await cmd(TUR, NX1))[0] == GOOD
    asyncio.run(go())


class ZeroesNotPromised(Layer):
    @property
    def capabilities(self) -> Capabilities:
        return super().capabilities.but(unmap_reads_zero=False)


def test_a_lun_rereads_lbprz_when_the_stack_is_swapped() -> None:
    async def go() -> None:
        ram = RamDevice(BLOCKS, 512)
        vol = Volume(ram, name="disk0")
        lun = Lun(vol)
        r = await lun.execute(READ_CAPACITY_16, memoryview(b""), NX1)
        assert r.status == GOOD and r.data[14] & 0x40                  # LBPRZ (SBC-4 5.20.2)
        await vol.swap(ZeroesNotPromised(ram))
        assert lun.lbprz is False
        r = await lun.execute(READ_CAPACITY_16, memoryview(b""), NX1)
        assert r.status == GOOD and not r.data[14] & 0x40
    asyncio.run(go())


# --- NVMe ------------------------------------------------------------------------------------------------

NQN = "nqn.2026-11.org.openvsan:test"


async def enabled(fabric: Fabric, hostnqn: str) -> Controller:
    res = fabric.connect(Sqe(connect_cmd(1, 0, 31, 5000)), connect_data(NQN, hostnqn, 0xFFFF))
    ctrl = res.controller
    assert res.completion.status == 0 and ctrl is not None
    comp = await ctrl.admin(Sqe(sqe(0x7F, 2, 0x00, cdw11=0x14, cdw12=1 | (6 << 16) | (4 << 20))), b"")
    assert comp is not None and comp.status == 0 and ctrl.ready
    # Set Features, Asynchronous Event Configuration: Namespace Attribute Notices (Base 2.0 §5.27.1.7)
    comp = await ctrl.admin(Sqe(sqe(0x09, 1, 0, cdw10=0x0B, cdw11=1 << 8)), b"")
    assert comp is not None and comp.status == 0
    return ctrl


def test_nvme_controllers_get_namespace_attribute_changed_after_a_resize() -> None:
    async def go() -> None:
        vol = Volume(RamDevice(BLOCKS, 512), name="vol", uuid=uuid.UUID(int=9))
        sub = Subsystem(NQN, [Namespace(1, vol)], serial="SN1")
        fabric = Fabric([sub], {NQN: [Port(1, "192.0.2.1", 4420)]}, clock=lambda: 100.0)
        ctrls = [await enabled(fabric, HOSTNQN), await enabled(fabric, HOSTNQN + ".two")]
        events: list[list[tuple[int, int]]] = [[], []]
        for i, ctrl in enumerate(ctrls):
            ctrl.on_async_event = lambda cid, comp, i=i: events[i].append((cid, comp.dw0))
            assert await ctrl.admin(Sqe(sqe(0x0C, 40 + i)), b"") is None      # an AER, held
        await vol.resize(2 * BLOCKS)
        notice = 0x02 | (0x00 << 8) | (0x04 << 16)   # notice, Namespace Attribute Changed, log page 04h
        assert events == [[(40, notice)], [(41, notice)]]
        for ctrl in ctrls:
            chl = await ctrl.admin(Sqe(sqe(0x02, 1, 0, cdw10=0x04 | (1023 << 16), sgl_len=4096)), b"")
            assert chl is not None and chl.data is not None
            assert struct.unpack_from("<II", chl.data) == (1, 0)               # Changed Namespace List: NSID 1
            ident = await ctrl.admin(Sqe(sqe(0x06, 1, 1, cdw10=0)), b"")
            assert ident is not None and ident.data is not None
            assert struct.unpack_from("<QQ", ident.data) == (2 * BLOCKS, 2 * BLOCKS)   # NSZE, NCAP
        # a namespace removed stops listening: its volume's next resize is no news to anyone
        log_04 = Sqe(sqe(0x02, 1, 0, cdw10=0x04 | (1023 << 16), sgl_len=4096))
        assert await ctrls[0].admin(Sqe(sqe(0x0C, 50)), b"") is None
        assert sub.remove_namespace(1) is not None
        assert events[0][-1] == (50, notice)                                    # the removal is news
        assert (await ctrls[0].admin(log_04, b"")) is not None                  # read: reported again
        assert await ctrls[0].admin(Sqe(sqe(0x0C, 51)), b"") is None
        events[0].clear()
        await vol.resize(3 * BLOCKS)
        assert events[0] == [] and ctrls[0].pending_events == []
    asyncio.run(go())
