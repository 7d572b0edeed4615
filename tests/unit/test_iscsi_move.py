"""An iSCSI session that moves to another worker with its volume (node/workers.py move): suspended at any
point of the initiator's stream (frontend/iscsi.py Connection.suspend: PDUs held from then on, but the
Data-Out of commands already started, which finish there) and resumed on another server over the same
device, every command gets the answer it gets from a session that never moved, StatSN goes on without a
gap or a repeat, and the device ends the same."""

from __future__ import annotations

import asyncio
import random
import struct
import uuid
from typing import Any

from fastpath_fakes import Wire, chunks, spin
from test_iscsi_fastpath import BLOCKS, BS, IQN, cmd, nop_out, rw

from openvsan.block.ram import RamDevice
from openvsan.frontend.config import IscsiTargetConfig
from openvsan.frontend.iscsi import Connection, IscsiServer
from openvsan.protocol.iscsi.login import LoginState
from openvsan.protocol.scsi import Lun, ScsiTarget
from openvsan.volume import Volume

PORTAL = ("127.0.0.1", 3260)


def data_out(itt: int, offset: int, data: bytes, final: bool) -> bytes:
    b = bytearray(48)
    b[0], b[1] = 0x05, 0x80 if final else 0          # §11.7: SCSI Data-Out, unsolicited (TTT ffffffff)
    b[5:8] = len(data).to_bytes(3, "big")
    struct.pack_into(">III", b, 16, itt, 0xFFFFFFFF, 0)
    struct.pack_into(">II", b, 36, 0, offset)          # DataSN, Buffer Offset
    return bytes(b) + data + bytes(-len(data) % 4)


def stream(rnd: random.Random, n: int) -> bytes:
    """Reads, writes with their data immediate, and writes whose data follows in unsolicited Data-Outs."""
    out, cmdsn = [], 1
    for itt in range(1, n + 1):
        lba = rnd.randrange(BLOCKS - 64)
        kind = rnd.random()
        if kind < 0.4:
            blocks = rnd.choice((1, 8, 64))
            out.append(cmd(itt, cmdsn, rw(0x28, lba, blocks), read=True, edtl=blocks * BS))
        elif kind < 0.7:
            data = rnd.randbytes(rnd.choice((1, 8)) * BS)
            out.append(cmd(itt, cmdsn, rw(0x2A, lba, len(data) // BS), write=True, edtl=len(data), data=data))
        elif kind < 0.95:
            data = rnd.randbytes(32 * BS)
            head = bytearray(cmd(itt, cmdsn, rw(0x2A, lba, 32), write=True, edtl=len(data), data=data[:4 * BS]))
            head[1] &= 0x7F                          # F clear: unsolicited Data-Out follows (§11.3.1)
            out.append(bytes(head))
            for off in range(4 * BS, len(data), 8 * BS):
                out.append(data_out(itt, off, data[off:off + 8 * BS], off + 8 * BS >= len(data)))
        else:
            out.append(nop_out(itt, cmdsn, b"ping %d" % itt))
        cmdsn += 1
    return b"".join(out)


def server(dev: RamDevice) -> tuple[IscsiServer, IscsiTargetConfig]:
    unit = Lun(Volume(dev, name="d", uuid=uuid.UUID(int=1), serial="s"))
    t = IscsiTargetConfig(IQN, ScsiTarget(IQN, {0: unit}), [PORTAL])
    return IscsiServer([t]), t


def logged_in(srv: IscsiServer, t: IscsiTargetConfig, wire: Wire) -> Connection:
    c = Connection(srv, PORTAL)
    c.connection_made(wire)  # type: ignore[arg-type]
    st = LoginState(isid=b"\x40\0\0\0\0\1", initiator_name="iqn.x:y", target_name=IQN, target=t, cmdsn=1)
    st.params.initiator_mrdsl = 65536
    st.params.initial_r2t = False          # the first burst may come as unsolicited Data-Out
    st.params.first_burst_length = 65536
    srv.admit(c, st)
    c.login = None
    c.reader.max_dsl = st.params.target_mrdsl = 65536   # what login would have set
    c._lane = True
    return c


def answers(wire: bytes) -> tuple[dict[int, tuple[int, bytes]], list[int]]:
    """Per ITT: the status and the data the target sent; and the StatSN of every PDU that carried status."""
    per: dict[int, tuple[int, bytes]] = {}
    statsns = []
    pos = 0
    while pos < len(wire):
        op, flags, status = wire[pos] & 0x3F, wire[pos + 1], wire[pos + 3]
        dsl = int.from_bytes(wire[pos + 5:pos + 8], "big")
        itt, statsn = struct.unpack_from(">II", wire, pos + 16)[0], struct.unpack_from(">I", wire, pos + 24)[0]
        data = wire[pos + 48:pos + 48 + dsl]
        if op == 0x25:                               # Data-In (status in the last, S bit)
            st, got = per.get(itt, (-1, b""))
            per[itt] = (status if flags & 0x01 else st, got + data)
            if flags & 0x01:
                statsns.append(statsn)
        elif op in (0x21, 0x20):                     # SCSI Response, NOP-In
            st, got = per.get(itt, (-1, b""))
            per[itt] = (status if op == 0x21 else 0, got + data)
            statsns.append(statsn)
        pos += 48 + dsl + (-dsl & 3)
    return per, statsns


async def once(wire: bytes, sizes: list[int]) -> tuple[bytes, bytes]:
    dev = RamDevice(BLOCKS, BS)
    dev.write_now(0, random.Random(7).randbytes(BLOCKS * BS))
    srv, t = server(dev)
    w = Wire()
    c = logged_in(srv, t, w)
    for part in chunks(wire, sizes):
        c.data_received(part)
        await spin()
    return bytes(w.out), bytes(dev.read_now(0, BLOCKS))


async def moved(wire: bytes, sizes: list[int], cut: int) -> tuple[bytes, bytes, bytes, Any]:
    dev = RamDevice(BLOCKS, BS)
    dev.write_now(0, random.Random(7).randbytes(BLOCKS * BS))
    srv_a, ta = server(dev)
    wa = Wire()
    a = logged_in(srv_a, ta, wa)
    parts = chunks(wire, sizes)
    fed = 0
    pos = 0
    while fed < len(parts) and pos + len(parts[fed]) <= cut:
        a.data_received(parts[fed])
        pos += len(parts[fed])
        fed += 1
        await spin()
    suspending = asyncio.ensure_future(a.suspend())
    await spin()
    while not suspending.done() and fed < len(parts):   # what comes meanwhile: Data-Out goes on, the rest waits
        a.data_received(parts[fed])
        fed += 1
        await spin()
    got = await suspending
    assert got is not None
    state, received = got
    assert a.session is not None and not a.session.tasks
    a.detach_for_move()
    srv_b, _ = server(dev)
    wb = Wire()
    b = Connection(srv_b, PORTAL)
    b.resumed(state, received)
    b.connection_made(wb)  # type: ignore[arg-type]
    for part in parts[fed:]:
        b.data_received(part)
        await spin()
    return bytes(wa.out), bytes(wb.out), bytes(dev.read_now(0, BLOCKS)), b


def check(wire: bytes, sizes: list[int], cuts: list[int]) -> None:
    async def go() -> None:
        sent, device = await once(wire, sizes)
        ref, ref_sn = answers(sent)
        for cut in cuts:
            a, b, dev, conn = await moved(wire, sizes, cut)
            got_a, sn_a = answers(a)
            got_b, sn_b = answers(b)
            assert not set(got_a) & set(got_b), cut                 # each command answered once
            assert {**got_a, **got_b} == ref, cut                   # and as it was without the move
            assert sorted(sn_a + sn_b) == ref_sn == sn_a + sn_b, cut  # StatSN goes on, no gap, no repeat
            assert dev == device, cut
            assert conn.session is not None and conn.session.tsih == 1 and conn.statsn == ref_sn[-1] + 1

    asyncio.run(go())


def test_a_session_moved_at_any_point_answers_what_one_that_stayed_answers() -> None:
    rnd = random.Random(3)
    wire = stream(rnd, 80)
    cuts = sorted({0, 1, 47, 48, 49, len(wire) // 2, len(wire) - 1, len(wire), *rnd.sample(range(len(wire)), 30)})
    for sizes in ([1 << 20], [48], [1000, 5000, 333]):
        check(wire, sizes, cuts)


def test_a_session_resumed_here_after_a_failed_move_goes_on() -> None:
    rnd = random.Random(4)
    wire = stream(rnd, 40)

    async def go() -> None:
        sent, device = await once(wire, [700])
        dev = RamDevice(BLOCKS, BS)
        dev.write_now(0, random.Random(7).randbytes(BLOCKS * BS))
        srv, t = server(dev)
        w = Wire()
        c = logged_in(srv, t, w)
        parts = chunks(wire, [700])
        half = len(parts) // 2
        for part in parts[:half]:
            c.data_received(part)
            await spin()
        suspending = asyncio.ensure_future(c.suspend())
        await spin()
        while not suspending.done():
            c.data_received(parts[half])
            half += 1
            await spin()
        got = await suspending
        assert got is not None and w.paused
        c.detach_for_move()
        c.reattach()
        c.resume_here(*got)
        assert not w.paused
        for part in parts[half:]:
            c.data_received(part)
            await spin()
        assert answers(bytes(w.out)) == answers(sent)
        assert bytes(dev.read_now(0, BLOCKS)) == device

    asyncio.run(go())


def test_what_a_logical_unit_holds_for_its_nexuses_moves_with_it() -> None:
    from openvsan.protocol.scsi.nexus import Nexus

    a = Lun(Volume(RamDevice(BLOCKS, BS), name="d", uuid=uuid.UUID(int=1), serial="s"))
    one, two = Nexus("iqn.x:one", 1, IQN, 1), Nexus("iqn.x:two", 2, IQN, 1)
    a.nexuses |= {one, two}
    a.pr.keys = {one: 0xABC, two: 0xDEF}
    a.pr.holder, a.pr.type, a.pr.generation = one, 1, 5
    a.spc2_holder = None
    a.prevent = {two}
    a.mode.wce = False
    a.add_ua(two, 0x2A01)
    b = Lun(Volume(RamDevice(BLOCKS, BS), name="d", uuid=uuid.UUID(int=1), serial="s"))
    b.take_state(a.moving_state())
    assert (b.pr.keys, b.pr.holder, b.pr.type, b.pr.generation) == ({one: 0xABC, two: 0xDEF}, one, 1, 5)
    assert b.prevent == {two} and b.mode.wce is False and b.nexuses == {one, two}
    assert b.unit_attentions == {two: [0x2A01]} and b.spc2_holder is None
    assert b.moving_state() == a.moving_state()
