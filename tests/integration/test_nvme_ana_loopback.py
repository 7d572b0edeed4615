"""ANA over real NVMe/TCP on loopback: two in-process targets export one subsystem NQN and one namespace
identity, as two replica nodes of a replicated volume do, each with its own controller ID range. A raw host
(tests/interop/nvme_host.py) connects to both, enables ANA change notices, and reads the ANA log page of
each; a failover (the optimized node goes inaccessible, the other optimized) reaches it as one notice per
controller, the log pages show the new states, and I/O follows: refused with ANA Inaccessible on the old
path, served on the new one."""

from __future__ import annotations

import asyncio
import struct
import uuid
from collections.abc import Awaitable, Callable

from nvme_host import Queue, connect_controller, sqe
from vsan_harness import free_port

from openvsan.block import RamDevice
from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.nvme_tcp import NvmeTcpServer
from openvsan.protocol.nvme import ana
from openvsan.protocol.nvme import status as S
from openvsan.volume import Volume

NQN = "nqn.2026-11.org.openvsan:replicated"
UUID = uuid.UUID("0b0e7a5e-0000-4000-8000-000000000012")
BS = 512
ANA_NOTICE = 0x02 | (0x03 << 8) | (0x0C << 16)


def run(body: Callable[[], Awaitable[None]], timeout: float = 30) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout))


def node(port: int, cntlids: tuple[int, int]) -> NvmeTcpServer:
    """One replica node: its own RAM, the volume's one identity, the subsystem on its own portal."""
    vol = Volume(RamDevice(1024, BS), name="vol", uuid=UUID, serial="vol-serial")
    srv = NvmeTcpServer([NvmeSubsystemConfig(NQN, [NvmeNamespaceConfig(1, vol)], [("127.0.0.1", port)],
                                             serial="SN-REPLICATED")])
    sub = srv.subsystem(NQN)
    assert sub is not None
    sub.set_cntlid_range(*cntlids)
    return srv


def parse(page: bytes) -> list[tuple[int, int, list[int]]]:
    _, n = struct.unpack_from("<QH", page)
    off, out = 16, []
    for _ in range(n):
        grp, nn, _, state = struct.unpack_from("<IIQB", page, off)
        out.append((grp, state, list(struct.unpack_from(f"<{nn}I", page, off + 32))))
        off += 32 + 4 * nn
    return out


async def ana_log(admin: Queue) -> list[tuple[int, int, list[int]]]:
    st, page = await admin.get_log(0x0C, 4096)
    assert st == 0
    return parse(page)


def test_two_nodes_one_namespace_failover_seen_by_the_host() -> None:
    pa, pb = free_port(), free_port()
    a, b = node(pa, (1, 0x7FF)), node(pb, (0x800, 0xFFF))

    async def body() -> None:
        await a.start()
        await b.start()
        try:
            b.set_ana_state(NQN, 1, ana.NON_OPTIMIZED)        # the secondary before any host comes
            (adm_a, (io_a,)), (adm_b, (io_b,)) = await connect_controller(pa, NQN), await connect_controller(pb, NQN)
            try:
                assert adm_a.cntlid in range(1, 0x800) and adm_b.cntlid in range(0x800, 0x1000)
                # one namespace seen through two controllers: same NGUID and EUI-64, shared, ANA group 1
                ids = []
                for adm in (adm_a, adm_b):
                    st, idn = await adm.identify(0x00, nsid=1)
                    assert st == 0 and idn[30] & 1 and struct.unpack_from("<I", idn, 92)[0] == 1
                    ids.append(idn[104:128])
                    st, idc = await adm.identify(0x01)
                    assert st == 0 and idc[76] & 0x08 and struct.unpack_from("<II", idc, 342) == (128, 128)
                assert ids[0] == ids[1]
                assert await ana_log(adm_a) == [(1, ana.OPTIMIZED, [1])]
                assert await ana_log(adm_b) == [(1, ana.NON_OPTIMIZED, [1])]
                assert await io_b.write(1, 0, b"\x5a" * BS) == 0          # non-optimized serves everything
                for adm in (adm_a, adm_b):                               # Set Features: ANA change notices on
                    rsp, _ = await adm.command(sqe(0x09, 0, 0, cdw10=0x0B, cdw11=1 << 11))
                    assert rsp is not None and rsp.status == 0
                aer_a = asyncio.ensure_future(adm_a.command(sqe(0x0C, 0)))
                aer_b = asyncio.ensure_future(adm_b.command(sqe(0x0C, 0)))
                await asyncio.sleep(0.05)
                assert not aer_a.done() and not aer_b.done()            # held: nothing to report yet

                # failover: the primary's node first goes inaccessible, then the new primary's optimized
                a.set_ana_state(NQN, 1, ana.INACCESSIBLE)
                b.set_ana_state(NQN, 1, ana.OPTIMIZED)
                for aer in (aer_a, aer_b):
                    rsp, _ = await asyncio.wait_for(aer, 5)
                    assert rsp is not None and rsp.status == 0 and rsp.u32(8) == ANA_NOTICE
                assert await ana_log(adm_a) == [(1, ana.INACCESSIBLE, [1])]
                assert await ana_log(adm_b) == [(1, ana.OPTIMIZED, [1])]
                assert await io_a.write(1, 0, b"\x11" * BS) == S.ANA_INACCESSIBLE
                st, _ = await io_a.read(1, 0, 1)
                assert st == S.ANA_INACCESSIBLE
                assert await io_b.write(1, 1, b"\x22" * BS) == 0
                st, data = await io_b.read(1, 0, 2)
                assert st == 0 and data == b"\x5a" * BS + b"\x22" * BS
                # reading the log re-armed the notice: the next change is reported again
                aer_a = asyncio.ensure_future(adm_a.command(sqe(0x0C, 0)))
                a.set_ana_state(NQN, 1, ana.NON_OPTIMIZED)
                rsp, _ = await asyncio.wait_for(aer_a, 5)
                assert rsp is not None and rsp.u32(8) == ANA_NOTICE
                assert await io_a.write(1, 2, b"\x33" * BS) == 0
            finally:
                for q in (io_a, adm_a, io_b, adm_b):
                    await q.close()
        finally:
            await a.stop()
            await b.stop()

    run(body)


def test_a_portal_of_its_own() -> None:
    """One node, two portals: a state set for one portal reaches the controllers connected there only."""
    p1, p2 = free_port(), free_port()
    vol = Volume(RamDevice(64, BS), name="vol", uuid=UUID)
    srv = NvmeTcpServer([NvmeSubsystemConfig(NQN, [NvmeNamespaceConfig(1, vol)],
                                             [("127.0.0.1", p1), ("127.0.0.1", p2)])])

    async def body() -> None:
        await srv.start()
        try:
            (adm1, (io1,)), (adm2, (io2,)) = await connect_controller(p1, NQN), await connect_controller(p2, NQN)
            try:
                srv.set_ana_state(NQN, 1, ana.CHANGE, portal=("127.0.0.1", p2))
                assert await ana_log(adm1) == [(1, ana.OPTIMIZED, [1])]
                assert await ana_log(adm2) == [(1, ana.CHANGE, [1])]
                assert await io1.write(1, 0, b"\1" * BS) == 0
                assert await io2.write(1, 0, b"\2" * BS) == S.ANA_TRANSITION
            finally:
                for q in (io1, adm1, io2, adm2):
                    await q.close()
        finally:
            await srv.stop()

    run(body)
