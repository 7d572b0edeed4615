"""NVMe Asymmetric Namespace Access (NVMe Base 2.0 §8.1): Identify fields, the ANA log page (§5.16.1.12)
byte for byte, state changes per group and per portal with their change counts, the ANA change notice once
until the log is read, and the path-related refusals (Status Code Type 3h) on the normal and the fast path
alike, since both ask protocol/nvme/io.py admit()."""

from __future__ import annotations

import asyncio
import struct
import uuid
from typing import Any

import pytest
from fastpath_fakes import AsyncOnly, Counting, nvme_controller
from nvme_host import HostReader, capsule, connect_cmd, connect_data, sqe

from openvsan.block import RamDevice
from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.nvme_tcp import NvmeTcpServer
from openvsan.protocol.nvme import ana
from openvsan.protocol.nvme import identify as ID
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.ana import AnaGroups
from openvsan.protocol.nvme.command import Sqe
from openvsan.protocol.nvme.controller import Controller
from openvsan.protocol.nvme.fabrics import Fabric
from openvsan.protocol.nvme.io import execute_io, read_now, write_now
from openvsan.protocol.nvme.subsystem import Namespace, Port, Subsystem
from openvsan.volume import Volume

NQN = "nqn.2026-11.org.openvsan:ana"
A = ("192.0.2.1", 4420)
B = ("192.0.2.2", 4420)
BS = 512
ANA_NOTICE = 0x02 | (0x03 << 8) | (0x0C << 16)   # Notice, ANA change, log 0Ch (§5.2 Figure 148/150)


def vol(i: int, blocks: int = 256) -> Volume:
    return Volume(RamDevice(blocks, BS), name=f"v{i}", uuid=uuid.UUID(int=i))


def make(*, groups: dict[int, int] | None = None, cntlids: tuple[int, int] = (1, 0xFFEF)) -> tuple[Fabric, Subsystem]:
    """nsid -> ANA group (default: namespaces 1 and 3 in group 1, 2 in group 2)."""
    groups = groups or {1: 1, 2: 2, 3: 1}
    sub = Subsystem(NQN, [Namespace(n, vol(n), ana_group=g) for n, g in groups.items()], serial="SN",
                    cntlids=cntlids)
    fabric = Fabric([sub], {NQN: [Port(1, *A), Port(2, *B)]}, clock=lambda: 0.0)
    return fabric, sub


async def enabled(fabric: Fabric, portal: tuple[str, int] | None = A, aec: int = 1 << 11) -> Controller:
    res = fabric.connect(Sqe(connect_cmd(1, 0, 31)), connect_data(NQN), portal=portal)
    ctrl = res.controller
    assert res.completion.status == 0 and ctrl is not None
    await ctrl.admin(Sqe(sqe(0x7F, 2, 0x00, cdw11=0x14, cdw12=1 | (6 << 16) | (4 << 20))), b"")
    assert ctrl.ready
    if aec:
        c = await ctrl.admin(Sqe(sqe(0x09, 3, 0, cdw10=0x0B, cdw11=aec)), b"")
        assert c is not None and c.status == 0
    return ctrl


async def ana_log(ctrl: Controller, size: int = 4096, *, offset: int = 0, rgo: bool = False,
                  rae: bool = False) -> S.Completion:
    numd = size // 4 - 1
    cdw10 = 0x0C | ((1 if rgo else 0) << 8) | ((1 << 15) if rae else 0) | ((numd & 0xFFFF) << 16)
    c = await ctrl.admin(Sqe(sqe(0x02, 9, 0xFFFFFFFF, cdw10=cdw10, cdw11=numd >> 16, cdw12=offset & 0xFFFFFFFF,
                                 cdw13=offset >> 32, sgl_len=size)), b"")
    assert c is not None
    return c


def parse(page: bytes) -> tuple[int, list[tuple[int, int, int, list[int]]]]:
    """(change count, [(group, change count, state, nsids)]) from an ANA log page."""
    chg, n = struct.unpack_from("<QH", page)
    assert page[10:16] == bytes(6)
    off, out = 16, []
    for _ in range(n):
        grp, nn, gchg, state = struct.unpack_from("<IIQB", page, off)
        assert page[off + 17:off + 32] == bytes(15)
        nsids = list(struct.unpack_from(f"<{nn}I", page, off + 32))
        out.append((grp, gchg, state, nsids))
        off += 32 + 4 * nn
    return chg, out


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --- Identify ------------------------------------------------------------------------------------------
def test_identify_controller_and_namespace_report_ana() -> None:
    fabric, _sub = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        idc = ID.controller(ctrl)
        assert idc[76] & 0x0B == 0x0B                      # CMIC: multi-port, multi-controller, ANA reporting
        assert struct.unpack_from("<I", idc, 92)[0] & (1 << 11)   # OAES: ANA change notices
        assert idc[340] == ana.ANATT == 10
        assert idc[341] == 0x1F                            # ANACAP: five states; bit 6 clear: ANAGRPID may change
        assert struct.unpack_from("<II", idc, 342) == (128, 128)   # ANAGRPMAX, NANAGRPID
        mnan = struct.unpack_from("<I", idc, 540)[0]
        # Linux reserves NANAGRPID descriptors and MNAN NSIDs and drops ANA if that is over MDTS
        assert ana.log_size(128, mnan) <= ID.MAX_TRANSFER
        for nsid, grp in ((1, 1), (2, 2), (3, 1)):
            idn = (await ctrl.admin(Sqe(sqe(0x06, 4, nsid, cdw10=0x00, sgl_len=4096)), b"")).data   # type: ignore[union-attr]
            assert idn is not None and struct.unpack_from("<I", idn, 92)[0] == grp and idn[30] & 1   # ANAGRPID, NMIC
            ind = (await ctrl.admin(Sqe(sqe(0x06, 5, nsid, cdw10=0x08, sgl_len=4096)), b"")).data   # type: ignore[union-attr]
            assert ind is not None and struct.unpack_from("<I", ind, 12)[0] == grp and ind[1] & 1
        disc = fabric.connect(Sqe(connect_cmd(1, 0, 31)), connect_data("nqn.2014-08.org.nvmexpress.discovery"))
        assert disc.controller is not None
        d = ID.controller(disc.controller)
        assert d[76] == 0 and d[341] == 0 and d[342:350] == bytes(8)   # a discovery controller: no ANA
    run(go())


def test_single_node_default_is_one_optimized_group() -> None:
    sub = Subsystem(NQN, [Namespace(1, vol(1))])
    assert sub.ana.groups == [1] and sub.ana_state(1) == ana.OPTIMIZED and sub.ana.change_count == 0
    fabric = Fabric([sub], {NQN: [Port(1, *A)]}, clock=lambda: 0.0)

    async def go() -> None:
        ctrl = await enabled(fabric, portal=None)
        c = await ana_log(ctrl, 64)
        assert c.status == 0 and parse(bytes(c.data or b""))[1] == [(1, 0, 1, [1])]
        w = await execute_io(ctrl, Sqe(sqe(0x01, 1, 1, cdw12=0, sgl_len=BS)), b"\1" * BS)
        assert w.status == 0
    run(go())


# --- the log page --------------------------------------------------------------------------------------
def test_ana_log_bytes_rgo_and_offsets() -> None:
    fabric, _sub = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        c = await ana_log(ctrl, 4096)
        page = bytes(c.data or b"")
        want = (struct.pack("<QH6x", 0, 2)
                + struct.pack("<IIQB15x", 1, 2, 0, 1) + struct.pack("<II", 1, 3)
                + struct.pack("<IIQB15x", 2, 1, 0, 1) + struct.pack("<I", 2))
        assert c.status == 0 and page == want.ljust(4096, b"\0")
        # RGO (LSP bit 0): the descriptors without their NSIDs
        rgo = bytes((await ana_log(ctrl, 4096, rgo=True)).data or b"")
        assert rgo[:80] == struct.pack("<QH6x", 0, 2) + struct.pack("<IIQB15x", 1, 0, 0, 1) + \
            struct.pack("<IIQB15x", 2, 0, 0, 1) and rgo[80:] == bytes(4096 - 80)
        # offsets (LPOL/LPOU) and short lengths, as every log page: a slice of the same bytes
        for off, size in ((16, 32), (48, 8), (56, 64), (8, 4), (len(want), 4)):
            part = await ana_log(ctrl, size, offset=off)
            assert part.status == 0 and bytes(part.data or b"") == want[off:off + size].ljust(size, b"\0")
        assert (await ana_log(ctrl, 16, offset=2)).status == S.INVALID_FIELD            # not dword aligned
        assert (await ana_log(ctrl, 16, offset=len(want) + 4)).status == S.INVALID_FIELD   # past the end
    run(go())


def test_log_of_many_namespaces_lists_them_ascending_in_their_group() -> None:
    groups = {n: 1 + n % 3 for n in (9, 1, 5, 2, 7, 4, 3)}
    fabric, _sub = make(groups=groups)

    async def go() -> None:
        ctrl = await enabled(fabric)
        _, descs = parse(bytes((await ana_log(ctrl)).data or b""))
        assert [(g, nsids) for g, _, _, nsids in descs] == [(1, [3, 9]), (2, [1, 4, 7]), (3, [2, 5])]
    run(go())


# --- changes and the notice ------------------------------------------------------------------------------
def test_state_change_counts_and_one_notice_until_the_log_is_read() -> None:
    fabric, sub = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        events: list[tuple[int, int]] = []
        ctrl.on_async_event = lambda cid, comp: events.append((cid, comp.dw0))
        assert await ctrl.admin(Sqe(sqe(0x0C, 70)), b"") is None           # AER held
        assert await ctrl.admin(Sqe(sqe(0x0C, 71)), b"") is None
        sub.set_ana_state(1, ana.NON_OPTIMIZED)
        assert events == [(70, ANA_NOTICE)]
        sub.set_ana_state(1, ana.NON_OPTIMIZED)                            # no change: no count, no notice
        sub.set_ana_state(2, ana.INACCESSIBLE)                             # a change, masked: log not read yet
        assert events == [(70, ANA_NOTICE)] and not ctrl.pending_events
        chg, descs = parse(bytes((await ana_log(ctrl, rae=True)).data or b""))   # RAE: stays masked
        assert chg == 2 and [(g, c, s) for g, c, s, _ in descs] == [(1, 1, 2), (2, 1, 3)]
        sub.set_ana_state(2, ana.CHANGE)
        assert len(events) == 1
        await ana_log(ctrl, 64)                                            # read: the notice is armed again
        sub.set_ana_state(2, ana.OPTIMIZED)
        assert events == [(70, ANA_NOTICE), (71, ANA_NOTICE)]
        chg, descs = parse(bytes((await ana_log(ctrl)).data or b""))
        assert chg == 4 and [(g, c, s) for g, c, s, _ in descs] == [(1, 1, 2), (2, 3, 1)]
        sub.set_ana_state(1, ana.INACCESSIBLE)                             # no AER held: it waits
        assert len(events) == 2 and ctrl.pending_events == [ANA_NOTICE]
        c = await ctrl.admin(Sqe(sqe(0x0C, 72)), b"")
        assert c is not None and c.dw0 == ANA_NOTICE
    run(go())


def test_no_notice_unless_the_host_enabled_it() -> None:
    fabric, sub = make()

    async def go() -> None:
        ctrl = await enabled(fabric, aec=1 << 8)                           # namespace attribute notices only
        assert await ctrl.admin(Sqe(sqe(0x0C, 70)), b"") is None
        sub.set_ana_state(1, ana.INACCESSIBLE)
        assert not ctrl.pending_events and ctrl.aer_cids == [70]
        st = await execute_io(ctrl, Sqe(sqe(0x02, 1, 1, cdw12=0, sgl_len=BS)), b"")
        assert st.status == S.ANA_INACCESSIBLE                             # I/O sees it all the same
    run(go())


def test_a_portal_gets_its_own_state_and_only_its_controllers_hear_of_it() -> None:
    fabric, sub = make()

    async def go() -> None:
        on_a, on_b = await enabled(fabric, A), await enabled(fabric, B)
        heard: list[str] = []
        on_a.on_async_event = lambda cid, comp: heard.append("a")
        on_b.on_async_event = lambda cid, comp: heard.append("b")
        for c in (on_a, on_b):
            assert await c.admin(Sqe(sqe(0x0C, 70)), b"") is None
        sub.set_ana_state(1, ana.NON_OPTIMIZED, portal=B)
        assert heard == ["b"]
        assert parse(bytes((await ana_log(on_a)).data or b""))[1][0][2] == ana.OPTIMIZED
        assert parse(bytes((await ana_log(on_b)).data or b""))[1][0][2] == ana.NON_OPTIMIZED
        sub.set_ana_state(1, ana.INACCESSIBLE, portal=A)
        a = await execute_io(on_a, Sqe(sqe(0x02, 1, 1, cdw12=0, sgl_len=BS)), b"")
        b = await execute_io(on_b, Sqe(sqe(0x02, 1, 1, cdw12=0, sgl_len=BS)), b"")
        assert (a.status, b.status) == (S.ANA_INACCESSIBLE, 0)
        # a state for the whole subsystem decides every portal again: the overrides go
        sub.set_ana_state(1, ana.OPTIMIZED)
        assert sub.ana_state(1, A) == sub.ana_state(1, B) == ana.OPTIMIZED
        late = await enabled(fabric, B)                                   # a controller made later sees the same
        assert late.ana_refusals == {1: 0, 2: 0}
    run(go())


def test_moving_a_namespace_to_another_group() -> None:
    fabric, sub = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        events: list[int] = []
        ctrl.on_async_event = lambda cid, comp: events.append(comp.dw0)
        assert await ctrl.admin(Sqe(sqe(0x0C, 70)), b"") is None
        sub.set_ana_group(3, 7)                                            # a new group: optimized
        assert events == [ANA_NOTICE]
        idn = (await ctrl.admin(Sqe(sqe(0x06, 4, 3, cdw10=0x00, sgl_len=4096)), b"")).data   # type: ignore[union-attr]
        assert idn is not None and struct.unpack_from("<I", idn, 92)[0] == 7
        chg, descs = parse(bytes((await ana_log(ctrl)).data or b""))
        # both groups' descriptors changed (group 2's did not), and the log's count with them
        assert [(g, c, s, n) for g, c, s, n in descs] == [(1, 1, 1, [1]), (2, 0, 1, [2]), (7, 1, 1, [3])]
        assert chg == 2
        sub.set_ana_group(1, 7)
        chg, descs = parse(bytes((await ana_log(ctrl)).data or b""))
        assert chg == 4 and [(g, c, n) for g, c, _, n in descs] == [(1, 2, []), (2, 0, [2]), (7, 2, [1, 3])]
        sub.set_ana_state(7, ana.PERSISTENT_LOSS)
        r3 = await execute_io(ctrl, Sqe(sqe(0x02, 1, 3, cdw12=0, sgl_len=BS)), b"")
        r2 = await execute_io(ctrl, Sqe(sqe(0x02, 1, 2, cdw12=0, sgl_len=BS)), b"")
        assert (r3.status, r2.status) == (S.ANA_PERSISTENT_LOSS, 0)
        # a namespace added in a new group is served at once (its group is in every controller's view)
        sub.add_namespace(Namespace(4, vol(4), ana_group=9))
        r4 = await execute_io(ctrl, Sqe(sqe(0x02, 1, 4, cdw12=0, sgl_len=BS)), b"")
        assert r4.status == 0
        with pytest.raises(ValueError, match="no namespace 5"):
            sub.set_ana_group(5, 1)
    run(go())


def test_bad_groups_and_states_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"ANA group 0 is out of range: use 1\.\.128"):
        Subsystem(NQN, [Namespace(1, vol(1), ana_group=0)])
    _, sub = make()
    with pytest.raises(ValueError, match="ANA group 129"):
        sub.set_ana_state(129, ana.OPTIMIZED)
    with pytest.raises(ValueError, match=r"ANA state 0x5 is not one of 0x1 \(optimized\)"):
        sub.set_ana_state(1, 0x05)
    with pytest.raises(ValueError, match="ANA group 200"):
        sub.add_namespace(Namespace(8, vol(8), ana_group=200))
    assert 8 not in sub.namespaces


def test_change_counts_roll_over_to_zero() -> None:
    groups = AnaGroups()
    groups.change_count = groups.group_change_counts[1] = (1 << 64) - 1
    assert groups.set_state(1, ana.CHANGE)
    assert groups.change_count == 0 and groups.group_change_counts[1] == 0


def test_path_errors_have_no_dnr() -> None:
    # a multipath host retries them on another path; with DNR (Linux: nvme_decide_disposition) it would not
    for st in (S.ANA_PERSISTENT_LOSS, S.ANA_INACCESSIBLE, S.ANA_TRANSITION):
        assert st & S.DNR == 0 and (st >> 8) & 7 == S.SCT_PATH
    assert [S.ANA_PERSISTENT_LOSS & 0xFF, S.ANA_INACCESSIBLE & 0xFF, S.ANA_TRANSITION & 0xFF] == [1, 2, 3]


# --- refusals on either path --------------------------------------------------------------------------
REFUSED = {ana.OPTIMIZED: 0, ana.NON_OPTIMIZED: 0, ana.INACCESSIBLE: S.ANA_INACCESSIBLE,
           ana.PERSISTENT_LOSS: S.ANA_PERSISTENT_LOSS, ana.CHANGE: S.ANA_TRANSITION}


def test_each_state_refuses_or_serves_every_io_command() -> None:
    fabric, sub = make()

    async def go() -> None:
        ctrl = await enabled(fabric)
        # Read, Write, Compare (with what was written), Flush, Write Zeroes, Dataset Management (deallocate)
        cmds = [(sqe(0x02, 1, 1, cdw12=0, sgl_len=BS), b""), (sqe(0x01, 2, 1, cdw12=0, sgl_len=BS), b"\5" * BS),
                (sqe(0x05, 5, 1, cdw12=0, sgl_len=BS), b"\5" * BS),
                (sqe(0x00, 3, 1), b""), (sqe(0x08, 4, 1, cdw12=0), b""),
                (sqe(0x09, 6, 1, cdw10=0, cdw11=4, sgl_len=16), struct.pack("<IIQ", 0, 1, 9))]
        for state in ana.STATES:
            sub.set_ana_state(1, state)
            got = [(await execute_io(ctrl, Sqe(c), d)).status for c, d in cmds]
            assert got == [REFUSED[state]] * len(cmds), (state, got)
            flush_all = await execute_io(ctrl, Sqe(sqe(0x00, 7, 0xFFFFFFFF)), b"")
            assert flush_all.status == REFUSED[state]
            # the fast path asks the same admit(): it declines what is refused, and does what is not
            rd = read_now(ctrl, Sqe(sqe(0x02, 8, 1, cdw12=0, sgl_len=BS)))
            wr = write_now(ctrl, Sqe(sqe(0x01, 9, 1, cdw12=0, sgl_len=BS)), b"\6" * BS)
            assert (rd is not None, wr) == (not REFUSED[state],) * 2
            # namespace 2 (group 2) stays optimized throughout
            assert (await execute_io(ctrl, Sqe(sqe(0x02, 10, 2, cdw12=0, sgl_len=BS)), b"")).status == 0
    run(go())


async def _wire_run(devices: list[Any], steps: list[tuple[str, Any]]) -> bytes:
    vols = [Volume(d, name=f"v{i}", uuid=uuid.UUID(int=i + 1)) for i, d in enumerate(devices)]
    cfg = NvmeSubsystemConfig(NQN, [NvmeNamespaceConfig(1, vols[0])], [A], serial="SN")
    srv = NvmeTcpServer([cfg])
    admin, io, _, iw = await nvme_controller(srv, A, NQN)
    for kind, arg in steps:
        if kind == "io":
            io.data_received(arg)
        elif kind == "ana":
            srv.set_ana_state(NQN, 1, arg)
        else:
            srv.set_ana_state(NQN, 1, arg, portal=A)
        for _ in range(4):
            await asyncio.sleep(0)
    io.close()
    admin.close()
    return bytes(iw.out)


def test_refusals_are_the_same_bytes_on_the_fast_and_the_normal_path() -> None:
    def rd(cid: int) -> bytes:
        return capsule(sqe(0x02, cid, 1, cdw10=cid, cdw12=0, sgl_len=BS))

    def wr(cid: int) -> bytes:
        return capsule(sqe(0x01, cid, 1, cdw10=cid, cdw12=0, sgl_len=BS, in_capsule=True), bytes([cid]) * BS)

    steps: list[tuple[str, Any]] = [("io", wr(1) + rd(2))]
    cid = 3
    for state in (*ana.STATES, ana.OPTIMIZED):
        steps += [("ana", state), ("io", wr(cid) + rd(cid + 1))]
        cid += 2
    steps += [("portal", ana.CHANGE), ("io", wr(cid) + rd(cid + 1)), ("ana", ana.NON_OPTIMIZED),
              ("io", wr(cid + 2) + rd(cid + 3))]

    async def go() -> tuple[bytes, bytes, int]:
        fast_dev, slow_dev = Counting(64, BS), RamDevice(64, BS)
        fast = await _wire_run([fast_dev], steps)
        used = fast_dev.fast
        slow = await _wire_run([AsyncOnly(slow_dev)], steps)
        assert fast_dev.read_now(0, 64) == slow_dev.read_now(0, 64)
        return fast, slow, used

    fast, slow, used = asyncio.run(go())
    assert fast == slow
    got = [(p.cid, p.status) for p in HostReader().feed(fast) if p.type == 5][1:]
    want = [(1, 0), (2, 0)]
    c = 3
    for state in (*ana.STATES, ana.OPTIMIZED):
        want += [(c, REFUSED[state]), (c + 1, REFUSED[state])]
        c += 2
    want += [(c, S.ANA_TRANSITION), (c + 1, S.ANA_TRANSITION), (c + 2, 0), (c + 3, 0)]
    assert got == want
    assert used == 2 * sum(1 for st in (ana.OPTIMIZED, *ana.STATES, ana.OPTIMIZED, ana.NON_OPTIMIZED)
                           if not REFUSED[st])


# --- controller IDs for a subsystem exported by several nodes ---------------------------------------------
def test_each_node_hands_out_its_own_controller_ids() -> None:
    fa, a = make(cntlids=(1, 2))
    fb, _b = make(cntlids=(0x100, 0x1FF))

    async def go() -> None:
        ids_a = [(await enabled(fa)).cntlid for _ in range(2)]
        ids_b = [(await enabled(fb)).cntlid for _ in range(3)]
        assert ids_a == [1, 2] and ids_b == [0x100, 0x101, 0x102]
        full = fa.connect(Sqe(connect_cmd(1, 0, 31)), connect_data(NQN), portal=A)
        assert full.completion.status == S.CONNECT_CONTROLLER_BUSY
        del a.controllers[1]
        again = fa.connect(Sqe(connect_cmd(1, 0, 31)), connect_data(NQN), portal=A)
        assert again.controller is not None and again.controller.cntlid == 1
    run(go())
    with pytest.raises(ValueError, match=r"controller IDs 0\.\.5 are not within 1\.\.65519"):
        Subsystem(NQN, cntlids=(0, 5))
    with pytest.raises(ValueError, match="own range"):
        a.set_cntlid_range(9, 3)
