"""NVMe admin, fabrics and I/O commands over RamDevice, without sockets (NVMe Base 2.0, NVMe-oF 1.1)."""

from __future__ import annotations

import asyncio
import struct
import uuid

import pytest
from nvme_host import HOSTID, HOSTNQN, connect_cmd, connect_data, sqe

from openvsan.block import FaultDevice, RamDevice
from openvsan.block.errors import MediumError
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.command import Sqe, data_plan
from openvsan.protocol.nvme.controller import Controller
from openvsan.protocol.nvme.fabrics import Fabric
from openvsan.protocol.nvme.io import execute_io
from openvsan.protocol.nvme.subsystem import (
    ANA_INACCESSIBLE,
    ANA_NON_OPTIMIZED,
    DISCOVERY_NQN,
    Namespace,
    Port,
    Subsystem,
)
from openvsan.volume import Volume

NQN = "nqn.2026-11.org.openvsan:test"
UUID = uuid.UUID("12345678-1234-5678-9abc-def012345678")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def make(bs: int = 512, blocks: int = 2048, allowed: list[str] | None = None, device=None):  # type: ignore[no-untyped-def]
    dev = device or RamDevice(blocks, bs)
    sub = Subsystem(NQN, [Namespace(1, Volume(dev, name="vol", uuid=UUID))], allowed_hosts=allowed, serial="SN1")
    clock = Clock()
    fabric = Fabric([sub], {NQN: [Port(1, "192.0.2.1", 4420), Port(2, "192.0.2.2", 4420)]}, clock=clock)
    return fabric, sub, clock


def connect(fabric: Fabric, nqn: str = NQN, qid: int = 0, cntlid: int = 0xFFFF, kato: int = 0,
            hostnqn: str = HOSTNQN) -> tuple[int, Controller | None]:
    res = fabric.connect(Sqe(connect_cmd(1, qid, 31 if qid == 0 else 63, kato)),
                         connect_data(nqn, hostnqn, cntlid))
    return res.completion.status, res.controller


async def enabled(fabric: Fabric) -> Controller:
    st, ctrl = connect(fabric, kato=5000)
    assert st == 0 and ctrl is not None
    comp = await ctrl.admin(Sqe(sqe(0x7F, 2, 0x00, cdw11=0x14, cdw12=1 | (6 << 16) | (4 << 20))), b"")
    assert comp is not None and comp.status == 0 and ctrl.ready
    return ctrl


async def admin(ctrl: Controller, cmd: bytes, data: bytes = b"") -> S.Completion:
    comp = await ctrl.admin(Sqe(cmd), data)
    assert comp is not None
    return comp


def test_connect_admin_and_io_queue() -> None:
    fabric, sub, _ = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        assert sub.controllers == {ctrl.cntlid: ctrl} and ctrl.hostid == HOSTID and ctrl.kato_ms == 5000
        st, joined = connect(fabric, qid=1, cntlid=ctrl.cntlid)
        assert st == 0 and joined is ctrl and ctrl.io_queues == {1}
        assert connect(fabric, qid=1, cntlid=ctrl.cntlid)[0] == S.CONNECT_INVALID_PARAMETERS   # taken
        assert connect(fabric, qid=2, cntlid=ctrl.cntlid + 1)[0] == S.CONNECT_INVALID_PARAMETERS  # no such cntlid
        st2, other = connect(fabric)                   # a second controller gets its own ID
        assert st2 == 0 and other is not None and other.cntlid != ctrl.cntlid
    run(go())


def test_connect_with_an_empty_host_nqn() -> None:
    """SPDK's spdk_nvme_perf sends an empty Host NQN by default: a subsystem open to any host admits it (as
    Linux nvmet and SPDK's target do), one with a host list or DH-HMAC-CHAP hosts does not."""
    fabric, _, _ = make()

    async def go() -> None:
        st, ctrl = connect(fabric, hostnqn="")
        assert st == 0 and ctrl is not None and ctrl.hostnqn == ""
        await ctrl.admin(Sqe(sqe(0x7F, 2, 0x00, cdw11=0x14, cdw12=1 | (6 << 16) | (4 << 20))), b"")
        st, joined = connect(fabric, qid=1, cntlid=ctrl.cntlid, hostnqn="")
        assert st == 0 and joined is ctrl
        assert connect(fabric, qid=2, cntlid=ctrl.cntlid)[0] == S.CONNECT_INVALID_PARAMETERS  # another host's
    run(go())
    listed, _, _ = make(allowed=["nqn.2014-08.org.example:allowed"])
    assert connect(listed, hostnqn="")[0] == S.CONNECT_INVALID_HOST


def test_an_io_queue_may_bring_another_host_id() -> None:
    """A host that makes a new Host ID per connection: its I/O queue joins the controller of its admin queue
    (matched by controller ID and Host NQN, as Linux nvmet and SPDK do), reported once per controller, and
    the controller keeps the admin queue's Host ID (reservations key on it)."""
    fabric, _, _ = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        refused = fabric.connect(Sqe(connect_cmd(1, 999, 63)), connect_data(NQN, HOSTNQN, ctrl.cntlid, bytes(16)))
        assert refused.completion.status == S.CONNECT_INVALID_PARAMETERS and refused.other_hostid is None
        res = fabric.connect(Sqe(connect_cmd(1, 1, 63)), connect_data(NQN, HOSTNQN, ctrl.cntlid, bytes(16)))
        assert res.completion.status == 0 and res.controller is ctrl and ctrl.hostid == HOSTID
        assert res.other_hostid == bytes(16)
        res = fabric.connect(Sqe(connect_cmd(1, 2, 63)), connect_data(NQN, HOSTNQN, ctrl.cntlid, b"\x01" * 16))
        assert res.completion.status == 0 and res.other_hostid is None and ctrl.io_queues == {1, 2}
        res = fabric.connect(Sqe(connect_cmd(1, 3, 63)),
                             connect_data(NQN, "nqn.2014-08.org.example:other", ctrl.cntlid))
        assert res.completion.status == S.CONNECT_INVALID_PARAMETERS and res.completion.dw0 == 16 | (1 << 16)
    run(go())


def test_connect_refusals() -> None:
    fabric, _, _ = make(allowed=["nqn.2014-08.org.example:allowed"])
    assert connect(fabric)[0] == S.CONNECT_INVALID_HOST
    assert connect(fabric, hostnqn="nqn.2014-08.org.example:allowed")[0] == 0
    assert connect(fabric, nqn="nqn.2014-08.org.example:nope")[0] == S.CONNECT_INVALID_PARAMETERS
    res = fabric.connect(Sqe(connect_cmd(1, 0, 31)), connect_data("nqn.x"))
    assert res.completion.dw0 == 256 | (1 << 16)           # IPO: SUBNQN, IATTR: in the Connect data
    fabric2, _, _ = make()
    res = fabric2.connect(Sqe(connect_cmd(1, 0, 8)), connect_data(NQN))   # admin SQ smaller than 32
    assert res.completion.status == S.CONNECT_INVALID_PARAMETERS and res.completion.dw0 == 44
    _st, ctrl = connect(fabric2)
    assert ctrl is not None
    assert connect(fabric2, qid=1, cntlid=ctrl.cntlid)[0] == S.COMMAND_SEQUENCE_ERROR   # CC.EN not set yet
    bad = bytearray(connect_cmd(1, 0, 31))
    bad[40] = 1                                              # RECFMT 1
    assert fabric2.connect(Sqe(bytes(bad)), connect_data(NQN)).completion.status == S.CONNECT_INCOMPATIBLE_FORMAT


def test_properties_and_shutdown() -> None:
    fabric, _, _ = make()

    async def go() -> None:
        _st, ctrl = connect(fabric)
        assert ctrl is not None
        cap = await admin(ctrl, sqe(0x7F, 1, 0x04, cdw10=1, cdw11=0))
        value = cap.dw0 | (cap.dw1 << 32)
        assert value & 0xFFFF == 1023 and value >> 37 & 1 and (value >> 24) & 0xFF == 15
        assert (await admin(ctrl, sqe(0x7F, 1, 0x04, cdw11=0x08))).dw0 == 0x00020000
        assert (await admin(ctrl, sqe(0x06, 1, 0, cdw10=1))).status == S.COMMAND_SEQUENCE_ERROR   # not ready
        # IOSQES wrong: controller fatal status
        await admin(ctrl, sqe(0x7F, 1, 0x00, cdw11=0x14, cdw12=1 | (5 << 16) | (4 << 20)))
        assert (await admin(ctrl, sqe(0x7F, 1, 0x04, cdw11=0x1C))).dw0 == 2      # CSTS.CFS
        await admin(ctrl, sqe(0x7F, 1, 0x00, cdw11=0x14, cdw12=0))
        await admin(ctrl, sqe(0x7F, 1, 0x00, cdw11=0x14, cdw12=1 | (6 << 16) | (4 << 20)))
        assert (await admin(ctrl, sqe(0x7F, 1, 0x04, cdw11=0x1C))).dw0 == 1      # RDY
        await admin(ctrl, sqe(0x7F, 1, 0x00, cdw11=0x14, cdw12=1 | (1 << 14) | (6 << 16) | (4 << 20)))
        assert (await admin(ctrl, sqe(0x7F, 1, 0x04, cdw11=0x1C))).dw0 == 1 | (2 << 2)   # shutdown complete
        assert (await admin(ctrl, sqe(0x7F, 1, 0x00, cdw11=0x1C, cdw12=0))).status == S.INVALID_FIELD
    run(go())


def test_identify() -> None:
    fabric, _sub, _ = make(bs=4096, blocks=1000)

    async def go() -> None:
        ctrl = await enabled(fabric)
        idc = (await admin(ctrl, sqe(0x06, 1, 0, cdw10=1))).data
        assert idc is not None and len(idc) == 4096
        assert idc[4:24] == b"SN1".ljust(20) and idc[24:32] == b"openvsan"
        assert struct.unpack_from("<H", idc, 78)[0] == ctrl.cntlid and idc[111] == 1
        assert idc[512] == 0x66 and idc[513] == 0x44 and idc[768:768 + len(NQN)] == NQN.encode()
        ioccsz, iorcsz = struct.unpack_from("<II", idc, 1792)
        assert ioccsz == (64 + 8192) // 16 and iorcsz == 1
        nn, mnan = struct.unpack_from("<I", idc, 516)[0], struct.unpack_from("<I", idc, 540)[0]
        assert mnan <= nn
        ns = (await admin(ctrl, sqe(0x06, 1, 1, cdw10=0))).data
        assert ns is not None and struct.unpack_from("<QQ", ns, 0) == (1000, 1000)
        assert ns[128 + 2] == 12 and ns[104:120] == UUID.bytes and struct.unpack_from("<I", ns, 92)[0] == 1
        lst = (await admin(ctrl, sqe(0x06, 1, 0, cdw10=2))).data
        assert lst is not None and struct.unpack_from("<II", lst) == (1, 0)
        assert (await admin(ctrl, sqe(0x06, 1, 1, cdw10=2))).data == bytes(4096)
        desc = (await admin(ctrl, sqe(0x06, 1, 1, cdw10=3))).data
        assert desc is not None
        kinds = {}
        pos = 0
        while desc[pos]:
            kinds[desc[pos]] = desc[pos + 4:pos + 4 + desc[pos + 1]]
            pos += 4 + desc[pos + 1]
        assert kinds[2] == UUID.bytes and kinds[3] == UUID.bytes and len(kinds[1]) == 8 and kinds[4] == b"\0"
        again = (await admin(ctrl, sqe(0x06, 1, 1, cdw10=3))).data
        assert again == desc                                  # stable
        assert (await admin(ctrl, sqe(0x06, 1, 7, cdw10=0))).data == bytes(4096)   # inactive NSID
        assert (await admin(ctrl, sqe(0x06, 1, 0, cdw10=0))).status == S.INVALID_NAMESPACE
        assert (await admin(ctrl, sqe(0x06, 1, 0, cdw10=0x06))).data == bytes(4096)
        assert (await admin(ctrl, sqe(0x06, 1, 1, cdw10=0x08))).status == 0
        assert (await admin(ctrl, sqe(0x06, 1, 0, cdw10=0x42))).status == S.INVALID_FIELD
    run(go())


def test_features() -> None:
    fabric, _, _ = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        c = await admin(ctrl, sqe(0x09, 1, 0, cdw10=0x07, cdw11=(200 << 16) | 200))
        assert c.dw0 == 63 | (63 << 16) and ctrl.nr_io_queues == 64
        c = await admin(ctrl, sqe(0x09, 1, 0, cdw10=0x07, cdw11=(3 << 16) | 3))
        assert c.dw0 == 3 | (3 << 16)
        assert (await admin(ctrl, sqe(0x0A, 1, 0, cdw10=0x07))).dw0 == 3 | (3 << 16)
        assert (await admin(ctrl, sqe(0x0A, 1, 0, cdw10=0x06))).dw0 == 1
        await admin(ctrl, sqe(0x09, 1, 0, cdw10=0x06, cdw11=0))
        assert (await admin(ctrl, sqe(0x0A, 1, 0, cdw10=0x06))).dw0 == 0 and not ctrl.write_cache
        await admin(ctrl, sqe(0x09, 1, 0, cdw10=0x0F, cdw11=12000))
        assert (await admin(ctrl, sqe(0x0A, 1, 0, cdw10=0x0F))).dw0 == 12000
        await admin(ctrl, sqe(0x09, 1, 0, cdw10=0x01, cdw11=0x0305))
        assert (await admin(ctrl, sqe(0x0A, 1, 0, cdw10=0x01))).dw0 == 0x0305
        await admin(ctrl, sqe(0x09, 1, 0, cdw10=0x0B, cdw11=0xFFFFFFFF))
        assert (await admin(ctrl, sqe(0x0A, 1, 0, cdw10=0x0B))).dw0 == (1 << 8) | (1 << 11)
        assert (await admin(ctrl, sqe(0x09, 1, 0, cdw10=0x06 | (1 << 31), cdw11=1))).status == S.FEATURE_NOT_SAVEABLE
        assert (await admin(ctrl, sqe(0x0A, 1, 0, cdw10=0x06 | (3 << 8)))).dw0 == 4
        assert (await admin(ctrl, sqe(0x0A, 1, 0, cdw10=0x7E))).status == S.INVALID_FIELD
        hid = await admin(ctrl, sqe(0x0A, 1, 0, cdw10=0x81, cdw11=1))
        assert hid.data == HOSTID
    run(go())


def test_log_pages_and_async_events() -> None:
    fabric, sub, _ = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        events: list[tuple[int, int]] = []
        ctrl.on_async_event = lambda cid, comp: events.append((cid, comp.dw0))
        await admin(ctrl, sqe(0x09, 1, 0, cdw10=0x0B, cdw11=(1 << 8) | (1 << 11)))
        assert await ctrl.admin(Sqe(sqe(0x0C, 77)), b"") is None                 # held
        ana = (await admin(ctrl, sqe(0x02, 1, 0, cdw10=0x0C | (1023 << 16), sgl_len=(1023 + 1) * 4))).data
        assert ana is not None and len(ana) == 4096
        _chg, ngrps = struct.unpack_from("<QH", ana)
        grp, nns, _, state = struct.unpack_from("<IIQB", ana, 16)
        assert (ngrps, grp, nns, state) == (1, 1, 1, 1) and struct.unpack_from("<I", ana, 48)[0] == 1
        sub.set_ana_state(1, ANA_NON_OPTIMIZED)
        assert events == [(77, 0x02 | (0x03 << 8) | (0x0C << 16))]
        sub.set_ana_state(1, ANA_INACCESSIBLE)                                   # masked until the log is read
        assert len(events) == 1 and not ctrl.pending_events
        ana = (await admin(ctrl, sqe(0x02, 1, 0, cdw10=0x0C | (1023 << 16), sgl_len=(1023 + 1) * 4))).data
        assert ana is not None and ana[16 + 16] == ANA_INACCESSIBLE and struct.unpack_from("<Q", ana)[0] == 2
        c = await execute_io(ctrl, Sqe(sqe(0x02, 5, 1, cdw12=0, sgl_len=512)), b"")
        assert c.status == S.ANA_INACCESSIBLE
        sub.set_ana_state(1, 1)
        c2 = await ctrl.admin(Sqe(sqe(0x0C, 78)), b"")                             # event waiting: at once
        assert c2 is not None and c2.dw0 == 0x02 | (0x03 << 8) | (0x0C << 16)
        # namespace change: changed namespace list
        assert await ctrl.admin(Sqe(sqe(0x0C, 79)), b"") is None
        sub.add_namespace(Namespace(2, Volume(RamDevice(64, 512), name="vol2", uuid=uuid.uuid4())))
        assert events[-1] == (79, 0x02 | (0x04 << 16))   # notice, NS attribute changed, log 04h
        chl = (await admin(ctrl, sqe(0x02, 1, 0, cdw10=0x04 | (1023 << 16), sgl_len=(1023 + 1) * 4))).data
        assert chl is not None and struct.unpack_from("<II", chl) == (2, 0)
        smart = (await admin(ctrl, sqe(0x02, 1, 0xFFFFFFFF, cdw10=0x02 | (127 << 16), sgl_len=(127 + 1) * 4))).data
        assert smart is not None and len(smart) == 512 and smart[3] == 100
        err = (await admin(ctrl, sqe(0x02, 1, 0, cdw10=0x01 | (15 << 16), sgl_len=(15 + 1) * 4))).data
        assert err is not None and len(err) == 64
        # offsets (LPA extended data)
        part = (await admin(ctrl, sqe(0x02, 1, 0, cdw10=0x02 | (3 << 16), cdw12=4, sgl_len=(3 + 1) * 4))).data
        assert part == smart[4:20]
        assert (await admin(ctrl, sqe(0x02, 1, 0, cdw10=0x55, sgl_len=(0 + 1) * 4))).status == S.INVALID_LOG_PAGE
        for cid in (80, 81, 82, 83):
            await ctrl.admin(Sqe(sqe(0x0C, cid)), b"")
        assert (await admin(ctrl, sqe(0x0C, 84))).status == S.ASYNC_EVENT_LIMIT_EXCEEDED
    run(go())


def test_discovery_controller_and_log() -> None:
    fabric, _, _ = make(allowed=[HOSTNQN])
    other = Subsystem("nqn.2026-11.org.openvsan:hidden", [], allowed_hosts=["nqn.x"])
    fabric.subsystems[other.nqn] = other
    fabric.placement[other.nqn] = [Port(1, "192.0.2.1", 4420)]

    async def go() -> None:
        st, ctrl = connect(fabric, nqn=DISCOVERY_NQN)
        assert st == 0 and ctrl is not None
        await admin(ctrl, sqe(0x7F, 1, 0x00, cdw11=0x14, cdw12=1 | (6 << 16) | (4 << 20)))
        idc = (await admin(ctrl, sqe(0x06, 1, 0, cdw10=1))).data
        assert idc is not None and idc[111] == 2
        assert (await admin(ctrl, sqe(0x06, 1, 1, cdw10=0))).status == S.INVALID_FIELD
        hdr = (await admin(ctrl, sqe(0x02, 1, 0, cdw10=0x70 | (3 << 16), sgl_len=(3 + 1) * 4))).data
        assert hdr is not None and struct.unpack_from("<QQ", hdr)[1] == 2     # 1 visible subsystem x 2 ports
        full = (await admin(ctrl, sqe(0x02, 1, 0, cdw10=0x70 | ((3072 // 4 - 1) << 16), sgl_len=3072))).data
        assert full is not None
        e0 = full[1024:2048]
        assert e0[0] == 3 and e0[1] == 1 and e0[2] == 2 and struct.unpack_from("<HH", e0, 4) == (1, 0xFFFF)
        assert e0[32:36] == b"4420" and e0[256:256 + len(NQN)] == NQN.encode() and e0[512:521] == b"192.0.2.1"
        assert full[2048 + 512:2048 + 521] == b"192.0.2.2"
        assert connect(fabric, nqn=DISCOVERY_NQN, qid=1, cntlid=ctrl.cntlid)[0] == S.CONNECT_INVALID_PARAMETERS
        assert (await admin(ctrl, sqe(0x02, 1, 0, cdw10=0x02 | (127 << 16), sgl_len=(127 + 1) * 4))).status == S.INVALID_LOG_PAGE
    run(go())


def test_keep_alive_expiry() -> None:
    fabric, _, clock = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        clock.now += 4.0
        assert not ctrl.expired(clock.now)
        await admin(ctrl, sqe(0x18, 1))
        clock.now += 5.4
        assert not ctrl.expired(clock.now)
        clock.now += 0.2
        assert ctrl.expired(clock.now)
        _st, nokato = connect(fabric, kato=0)
        assert nokato is not None and not nokato.expired(clock.now + 1e6)
    run(go())


def test_read_write_compare_zeroes_dsm() -> None:
    fabric, sub, _ = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        data = bytes(range(256)) * 8                                 # 4 blocks
        w = await execute_io(ctrl, Sqe(sqe(0x01, 1, 1, cdw10=10, cdw12=3 | (1 << 30), sgl_len=2048)), data)
        assert w.status == 0
        r = await execute_io(ctrl, Sqe(sqe(0x02, 2, 1, cdw10=10, cdw12=3, sgl_len=2048)), b"")
        assert r.status == 0 and bytes(r.data) == data                # type: ignore[arg-type]
        c = await execute_io(ctrl, Sqe(sqe(0x05, 3, 1, cdw10=10, cdw12=3, sgl_len=2048)), data)
        assert c.status == 0
        c = await execute_io(ctrl, Sqe(sqe(0x05, 3, 1, cdw10=11, cdw12=3, sgl_len=2048)), data)
        assert c.status == S.COMPARE_FAILURE
        z = await execute_io(ctrl, Sqe(sqe(0x08, 4, 1, cdw10=11, cdw12=0)), b"")
        assert z.status == 0
        r = await execute_io(ctrl, Sqe(sqe(0x02, 2, 1, cdw10=10, cdw12=3, sgl_len=2048)), b"")
        assert bytes(r.data)[512:1024] == bytes(512) and bytes(r.data)[:512] == data[:512]  # type: ignore[arg-type]
        rng = struct.pack("<IIQ", 0, 2, 12)
        d = await execute_io(ctrl, Sqe(sqe(0x09, 5, 1, cdw10=0, cdw11=4, sgl_len=16)), rng)
        assert d.status == 0
        r = await execute_io(ctrl, Sqe(sqe(0x02, 2, 1, cdw10=12, cdw12=1, sgl_len=1024)), b"")
        assert bytes(r.data) == bytes(1024)                           # type: ignore[arg-type]
        assert (await execute_io(ctrl, Sqe(sqe(0x00, 6, 1)), b"")).status == 0
        assert (await execute_io(ctrl, Sqe(sqe(0x00, 6, 0xFFFFFFFF)), b"")).status == 0
        # errors
        assert (await execute_io(ctrl, Sqe(sqe(0x02, 7, 1, cdw10=2047, cdw12=1, sgl_len=1024)), b"")).status == \
            S.LBA_OUT_OF_RANGE
        assert (await execute_io(ctrl, Sqe(sqe(0x02, 7, 2, cdw12=0, sgl_len=512)), b"")).status == \
            S.INVALID_NAMESPACE
        assert (await execute_io(ctrl, Sqe(sqe(0x02, 7, 1, cdw12=1, sgl_len=512)), b"")).status == \
            S.DATA_SGL_LENGTH_INVALID
        assert (await execute_io(ctrl, Sqe(sqe(0x01, 7, 1, cdw12=1, sgl_len=1024)), bytes(512))).status == \
            S.DATA_SGL_LENGTH_INVALID
        assert (await execute_io(ctrl, Sqe(sqe(0x7C, 7, 1)), b"")).status == S.INVALID_OPCODE
        assert (await execute_io(ctrl, Sqe(sqe(0x09, 5, 1, cdw10=0, cdw11=4, sgl_len=16)),
                                 struct.pack("<IIQ", 0, 10, 2045))).status == S.LBA_OUT_OF_RANGE
        assert sub.read_commands >= 3 and sub.write_commands == 1
        sub.namespaces[1].read_only = True
        assert (await execute_io(ctrl, Sqe(sqe(0x01, 7, 1, cdw12=0, sgl_len=512)), bytes(512))).status == \
            S.NS_WRITE_PROTECTED
    run(go())


def test_medium_error_maps_to_nvme_status() -> None:
    dev = FaultDevice(RamDevice(2048, 512))
    dev.fail(100, 4, reads=True, writes=True, error=MediumError)
    fabric, sub, _ = make(device=dev)

    async def go() -> None:
        ctrl = await enabled(fabric)
        r = await execute_io(ctrl, Sqe(sqe(0x02, 9, 1, cdw10=100, cdw12=0, sgl_len=512)), b"")
        assert r.status == S.UNRECOVERED_READ_ERROR
        w = await execute_io(ctrl, Sqe(sqe(0x01, 9, 1, cdw10=100, cdw12=0, sgl_len=512)), bytes(512))
        assert w.status == S.WRITE_FAULT
        assert sub.media_errors == 2 and ctrl.error_count == 2
        err = (await admin(ctrl, sqe(0x02, 1, 0, cdw10=0x01 | (15 << 16), sgl_len=(15 + 1) * 4))).data
        assert err is not None and struct.unpack_from("<QHHH", err) == (2, 0, 9, S.WRITE_FAULT << 1)
    run(go())


def test_reservations() -> None:
    fabric, sub, _ = make()
    other_id = bytes(range(16))

    async def go() -> None:
        a = await enabled(fabric)
        res = fabric.connect(Sqe(connect_cmd(1, 0, 31)), connect_data(NQN, "nqn.2014-08.org.example:b",
                                                                       hostid=other_id))
        b = res.controller
        assert b is not None
        await b.admin(Sqe(sqe(0x7F, 2, 0x00, cdw11=0x14, cdw12=1 | (6 << 16) | (4 << 20))), b"")

        async def io(ctrl: Controller, op: int, cdw10: int = 0, data: bytes = b"", **kw: int) -> int:
            return (await execute_io(ctrl, Sqe(sqe(op, 1, 1, cdw10=cdw10, sgl_len=len(data) or kw.pop("n", 0),
                                                   **kw)), data)).status

        keys = struct.pack("<QQ", 0, 0xAAAA)
        assert await io(a, 0x0D, 0, keys) == 0                               # A registers key AAAA
        assert await io(b, 0x0D, 0, struct.pack("<QQ", 0, 0xBBBB)) == 0      # B registers key BBBB
        assert await io(a, 0x11, 1 << 8, struct.pack("<QQ", 0xAAAA, 0)) == 0   # A: Write Exclusive
        assert await io(b, 0x01, 0, bytes(512), cdw12=0) == S.RESERVATION_CONFLICT
        assert await io(b, 0x02, 0, n=512, cdw12=0) == 0                     # reads still allowed
        assert await io(a, 0x01, 0, bytes(512), cdw12=0) == 0
        assert await io(b, 0x11, 1 << 8, struct.pack("<QQ", 0xBBBB, 0)) == S.RESERVATION_CONFLICT
        rep = await execute_io(a, Sqe(sqe(0x0E, 1, 1, cdw10=255, cdw11=1, sgl_len=1024)), b"")
        assert rep.status == 0 and rep.data is not None
        _gen, rtype, regctl = struct.unpack_from("<IBH", rep.data)
        assert (rtype, regctl) == (1, 2)
        e0 = rep.data[64:128]
        assert struct.unpack_from("<HBxxxxxQ", e0) == (0xFFFF, 1, 0xAAAA) and e0[16:32] == HOSTID
        assert (await execute_io(a, Sqe(sqe(0x0E, 1, 1, cdw10=255, cdw11=0, sgl_len=1024)), b"")).status == \
            S.HOST_ID_INCONSISTENT
        # B preempts A with A's key: B holds Exclusive Access, A is unregistered
        assert await io(b, 0x11, 1 | (2 << 8), struct.pack("<QQ", 0xBBBB, 0xAAAA)) == 0
        assert await io(a, 0x02, 0, n=512, cdw12=0) == S.RESERVATION_CONFLICT
        assert await io(b, 0x15, 2 << 8, struct.pack("<Q", 0xBBBB)) == 0        # release
        assert await io(a, 0x02, 0, n=512, cdw12=0) == 0
        assert await io(b, 0x15, 1, struct.pack("<Q", 0xBBBB)) == 0             # clear
        assert not sub.namespaces[1].reservations.registrants
        assert await io(a, 0x0D, 1, struct.pack("<QQ", 1, 0)) == S.RESERVATION_CONFLICT   # not registered
        assert await io(a, 0x0D, 2 << 30, keys) == S.INVALID_FIELD              # persist through power loss
    run(go())


@pytest.mark.parametrize(("cmd", "in_capsule", "want"), [
    (sqe(0x01, 1, 1, sgl_len=4096, in_capsule=True), 4096, (0, 4096, False)),
    (sqe(0x01, 1, 1, sgl_len=4096, in_capsule=True), 512, (S.DATA_SGL_LENGTH_INVALID, 4096, False)),
    (sqe(0x01, 1, 1, sgl_len=65536), 0, (0, 65536, True)),
    (sqe(0x02, 1, 1, sgl_len=65536), 0, (0, 65536, False)),
    (sqe(0x02, 1, 1, sgl_len=4096, in_capsule=True), 0, (S.SGL_TYPE_INVALID, 4096, False)),
    (sqe(0x01, 1, 1, sgl_len=1 << 30), 0, (S.DATA_SGL_LENGTH_INVALID, 1 << 30, False)),
    (sqe(0x08, 1, 1, sgl_len=0), 0, (0, 0, False)),
])
def test_data_plan(cmd: bytes, in_capsule: int, want: tuple[int, int, bool]) -> None:
    assert data_plan(Sqe(cmd), in_capsule, 1 << 20) == want


from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_FUZZ_FABRIC, _FUZZ_SUB, _ = make(blocks=4096)
_FUZZ_CTRL = run(enabled(_FUZZ_FABRIC))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opcode=st.sampled_from([0x00, 0x01, 0x02, 0x05, 0x06, 0x08, 0x09, 0x0A, 0x0C, 0x0D, 0x0E, 0x11, 0x15, 0x18,
                               0x7F, 0x08, 0x02, 0x42]),
       nsid=st.sampled_from([0, 1, 2, 0xFFFFFFFF, 0xFFFFFFFE]),
       cdws=st.lists(st.integers(0, 0xFFFFFFFF), min_size=6, max_size=6),
       sgl_len=st.sampled_from([0, 16, 512, 4096, 1 << 20]),
       data=st.binary(max_size=64))
def test_random_commands_never_raise(opcode: int, nsid: int, cdws: list[int], sgl_len: int, data: bytes) -> None:
    cmd = Sqe(sqe(opcode, 1, nsid, cdw10=cdws[0], cdw11=cdws[1], cdw12=cdws[2], cdw13=cdws[3], cdw14=cdws[4],
                  cdw15=cdws[5], sgl_len=sgl_len))
    if opcode == 0x7F and cmd.fctype == 0x00 and cmd.cdw11 == 0x14:
        return                                          # CC writes would disable the shared controller

    async def go() -> None:
        comp = await _FUZZ_CTRL.admin(cmd, data)
        if comp is not None:
            assert 0 <= comp.status < 0x8000
            assert comp.data is None or len(comp.data) <= max(sgl_len, 4096)
        comp = await execute_io(_FUZZ_CTRL, cmd, data)
        assert 0 <= comp.status < 0x8000
        assert comp.data is None or len(comp.data) <= 1 << 20
    run(go())
    _FUZZ_CTRL.aer_cids.clear()


def test_an_error_is_logged_once() -> None:
    fabric, _, _ = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        ctrl.record_error(0, 9, S.WRITE_FAULT, 1, 100)      # the I/O handler, with the LBA
        ctrl.record_error(3, 9, S.WRITE_FAULT, 1)           # then the queue that completed it
        assert ctrl.error_count == 1 and ctrl.errors[0].sqid == 3 and ctrl.errors[0].lba == 100
    run(go())
