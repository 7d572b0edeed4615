"""An NVMe/TCP controller that moves to another worker with its subsystem (node/workers.py move): its admin
and I/O queues suspended at any point of the host's stream (frontend/nvme_tcp.py Connection.suspend:
command capsules held from then on) and resumed on another server over the same device, with the
controller's state (Controller.moving_state: properties, features, held Asynchronous Event Requests), send
the host what queues that never moved send, SQHD going on, and an event after the move completes the
Asynchronous Event Request the host left on the old worker."""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

from fastpath_fakes import Wire, chunks, nvme_controller, spin
from nvme_host import HostReader, capsule, sqe
from test_nvme_fastpath import BLOCKS, BS, NQN, PORTAL, rw

from openvsan.block.ram import RamDevice
from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.nvme_tcp import Connection, NvmeTcpServer
from openvsan.protocol.nvme.identify import OAES_ANA_CHANGE
from openvsan.protocol.nvme.subsystem import ANA_NON_OPTIMIZED
from openvsan.volume import Volume

AER_CID = 500


def server(dev: RamDevice) -> NvmeTcpServer:
    vol = Volume(dev, name="v0", uuid=uuid.UUID(int=1), serial="s0")
    return NvmeTcpServer([NvmeSubsystemConfig(NQN, [NvmeNamespaceConfig(1, vol)], [PORTAL], serial="SN")])


def stream(rnd: random.Random, n: int) -> bytes:
    out = []
    for cid in range(1, n + 1):
        lba = rnd.randrange(BLOCKS - 16)
        nlb = rnd.choice((1, 8, 16))
        if rnd.random() < 0.5:
            out.append(rw(0x02, cid, 1, lba, nlb))
        else:
            out.append(rw(0x01, cid, 1, lba, nlb, data=rnd.randbytes(nlb * BS)))
    return b"".join(out)


async def controller(dev: RamDevice, flow_off: bool) -> tuple[NvmeTcpServer, Connection, Connection, Wire, Wire]:
    srv = server(dev)
    admin, io, aw, iw = await nvme_controller(srv, PORTAL, NQN, sq_flow_off=flow_off)
    # Set Features, Asynchronous Event Configuration: ANA change notices; then an AER the target holds
    admin.data_received(capsule(sqe(0x09, 3, 0, cdw10=0x0B, cdw11=OAES_ANA_CHANGE)))
    admin.data_received(capsule(sqe(0x0C, AER_CID, 0)))
    await spin()
    return srv, admin, io, aw, iw


async def once(wire: bytes, sizes: list[int], flow_off: bool) -> tuple[bytes, bytes]:
    dev = RamDevice(BLOCKS, BS)
    dev.write_now(0, random.Random(7).randbytes(BLOCKS * BS))
    _, _, io, _, iw = await controller(dev, flow_off)
    for part in chunks(wire, sizes):
        io.data_received(part)
        await spin()
    return bytes(iw.out), bytes(dev.read_now(0, BLOCKS))


async def moved(wire: bytes, sizes: list[int], cut: int, flow_off: bool) -> tuple[bytes, bytes, bytes, bytes, Any]:
    dev = RamDevice(BLOCKS, BS)
    dev.write_now(0, random.Random(7).randbytes(BLOCKS * BS))
    _, admin, io, aw, iw = await controller(dev, flow_off)
    parts = chunks(wire, sizes)
    fed = pos = 0
    while fed < len(parts) and pos + len(parts[fed]) <= cut:
        io.data_received(parts[fed])
        pos += len(parts[fed])
        fed += 1
        await spin()
    got = await asyncio.gather(admin.suspend(), io.suspend())
    assert all(g is not None for g in got)
    (sa, ra), (si, ri) = got  # type: ignore[misc]
    assert admin.ctrl is not None
    sa["controller"] = admin.ctrl.moving_state()
    admin_out = len(aw.out)
    for c in (admin, io):
        c.detach_for_move()
    srv_b = server(dev)
    aw_b, iw_b = Wire(), Wire()
    admin_b, io_b = Connection(srv_b, PORTAL), Connection(srv_b, PORTAL)
    admin_b.resumed(sa, ra)
    admin_b.connection_made(aw_b)  # type: ignore[arg-type]
    io_b.resumed(si, ri)
    io_b.connection_made(iw_b)  # type: ignore[arg-type]
    for part in parts[fed:]:
        io_b.data_received(part)
        await spin()
    assert len(aw.out) == admin_out                    # nothing more from the old worker's admin queue
    srv_b.set_ana_state(NQN, 1, ANA_NON_OPTIMIZED)   # an event: answered by the AER held since before
    await spin()
    return bytes(iw.out), bytes(iw_b.out), bytes(aw_b.out), bytes(dev.read_now(0, BLOCKS)), io_b


def check(wire: bytes, sizes: list[int], cuts: list[int], flow_off: bool) -> None:
    async def go() -> None:
        sent, device = await once(wire, sizes, flow_off)
        for cut in cuts:
            a, b, admin_b, dev, io_b = await moved(wire, sizes, cut, flow_off)
            assert a + b == sent, cut                   # every completion, SQHD going on, as if never moved
            assert dev == device, cut
            (aen,) = HostReader().feed(admin_b)
            assert aen.type == 5 and aen.cid == AER_CID and aen.status == 0, cut
            assert (aen.u32(8) >> 16) & 0xFF == 0x0C    # log page: ANA
            assert io_b.ctrl is not None and io_b.ctrl.cntlid == 1

    asyncio.run(go())


def test_a_controller_moved_at_any_point_answers_what_one_that_stayed_answers() -> None:
    rnd = random.Random(9)
    wire = stream(rnd, 120)
    cuts = sorted({0, 1, 71, 72, 73, len(wire) // 2, len(wire) - 1, len(wire), *rnd.sample(range(len(wire)), 25)})
    for flow_off in (False, True):
        for sizes in ([4000], [72], [1000, 3000, 333]):   # at most 64 commands a receive: the queue holds 64
            check(wire, sizes, cuts, flow_off)


def test_a_queue_resumed_here_after_a_failed_move_goes_on() -> None:
    wire = stream(random.Random(5), 60)

    async def go() -> None:
        sent, device = await once(wire, [900], False)
        dev = RamDevice(BLOCKS, BS)
        dev.write_now(0, random.Random(7).randbytes(BLOCKS * BS))
        _, admin, io, _, iw = await controller(dev, False)
        parts = chunks(wire, [900])
        half = len(parts) // 2
        for part in parts[:half]:
            io.data_received(part)
            await spin()
        got = await asyncio.gather(admin.suspend(), io.suspend())
        assert iw.paused
        for c in (admin, io):
            c.detach_for_move()
        for c, g in zip((admin, io), got, strict=True):
            assert g is not None
            c.reattach()
            c.resume_here(*g)
        for part in parts[half:]:
            io.data_received(part)
            await spin()
        assert bytes(iw.out) == sent and bytes(dev.read_now(0, BLOCKS)) == device

    asyncio.run(go())
