"""The iSCSI target's fast path (plain READ/WRITE on a device with SyncRead/SyncWrite, answered without a Task) must say
exactly what the normal path says: the same bytes on the wire for the same command stream, whichever path
each command takes, and every condition (unit attention, reservation, range, residual) still reported."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import struct
import uuid
from typing import Any

from fastpath_fakes import AsyncOnly, Counting, Wire

from openvsan.block.device import SyncRead, SyncWrite
from openvsan.block.ram import RamDevice
from openvsan.frontend.config import IscsiTargetConfig
from openvsan.frontend.iscsi import Connection, IscsiServer
from openvsan.protocol.iscsi.login import LoginState
from openvsan.protocol.scsi import Lun, ScsiTarget
from openvsan.volume import Volume

IQN = "iqn.2026-11.org.openvsan:fast"
BS = 512
BLOCKS = 4096


def cmd(itt: int, cmdsn: int, cdb: bytes, *, read: bool = False, write: bool = False, edtl: int = 0,
        data: bytes = b"", immediate: bool = False, lun: int = 0, final: bool = True) -> bytes:
    """A SCSI Command PDU; final=False: unsolicited Data-Out PDUs follow (§11.3.1)."""
    b = bytearray(48)
    b[0] = 0x01 | (0x40 if immediate else 0)
    b[1] = (0x80 if final else 0) | (0x40 if read else 0) | (0x20 if write else 0)
    b[5:8] = len(data).to_bytes(3, "big")
    b[8:10] = lun.to_bytes(2, "big")
    struct.pack_into(">III", b, 16, itt, edtl, cmdsn)
    b[32:32 + len(cdb)] = cdb
    return bytes(b) + data + bytes(-len(data) % 4)


def nop_out(itt: int, cmdsn: int, data: bytes) -> bytes:
    b = bytearray(48)
    b[0], b[1] = 0x40, 0x80           # RFC 7143 §11.18: NOP-Out, immediate, F
    b[5:8] = len(data).to_bytes(3, "big")
    struct.pack_into(">IIII", b, 16, itt, 0xFFFFFFFF, cmdsn, 0)
    return bytes(b) + data + bytes(-len(data) % 4)


def rw(op: int, lba: int, n: int, flags: int = 0) -> bytes:
    if op in (0x28, 0x2A):
        return struct.pack(">BBIBHB", op, flags, lba, 0, n, 0)
    return struct.pack(">BBQIBB", op, flags, lba, n, 0, 0)


def connect(device: Any, *, setup: Any = None) -> tuple[Connection, Wire]:
    """A target Connection in full feature phase (logged in to IQN, LUN 0 on `device`) over a Wire."""
    unit = Lun(Volume(device, name="d", uuid=uuid.UUID(int=1), serial="s"))
    t = IscsiTargetConfig(IQN, ScsiTarget(IQN, {0: unit}), [("127.0.0.1", 3260)])
    srv = IscsiServer([t])
    c = Connection(srv, ("127.0.0.1", 3260))
    wire = Wire()
    c.connection_made(wire)  # type: ignore[arg-type]
    st = LoginState(isid=b"\x40\0\0\0\0\1", initiator_name="iqn.x:y", target_name=IQN, target=t, cmdsn=1)
    st.params.initiator_mrdsl = 65536
    srv.admit(c, st)
    c.login = None
    c.reader.max_dsl = st.params.target_mrdsl = 65536   # what login would have set
    c._lane = True
    if setup is not None:
        setup(unit, c)
    return c, wire


async def run(device: Any, stream: list[bytes], *, setup: Any = None) -> tuple[bytes, Connection]:
    c, wire = connect(device, setup=setup)
    for chunk in stream:
        c.data_received(chunk)
        for _ in range(4):
            await asyncio.sleep(0)
    return bytes(wire.out), c


def both(stream: list[bytes], setup: Any = None) -> tuple[bytes, bytes, int]:
    async def go() -> tuple[bytes, bytes, int]:
        fast_dev = Counting(BLOCKS, BS)
        slow_dev = RamDevice(BLOCKS, BS)
        for d in (fast_dev, slow_dev):
            d.write_now(0, random.Random(7).randbytes(BLOCKS * BS))
        fast_dev.fast = 0
        fast, _ = await run(fast_dev, stream, setup=setup)
        used = fast_dev.fast
        slow, _ = await run(AsyncOnly(slow_dev), stream, setup=setup)
        assert fast_dev.read_now(0, BLOCKS) == slow_dev.read_now(0, BLOCKS)
        return fast, slow, used

    return asyncio.run(go())


def test_ram_offers_sync_io_and_the_wrapper_does_not() -> None:
    assert isinstance(RamDevice(8, BS), SyncRead) and isinstance(RamDevice(8, BS), SyncWrite)
    assert not isinstance(AsyncOnly(RamDevice(8, BS)), SyncRead)
    assert not isinstance(AsyncOnly(RamDevice(8, BS)), SyncWrite)


def test_a_random_command_stream_gets_the_same_bytes_on_either_path() -> None:
    rnd = random.Random(1)
    stream: list[bytes] = []
    batch: list[bytes] = []
    every: list[bytes] = []
    sn = 1
    for itt in range(1, 400):
        op = rnd.choice((0x28, 0x88, 0x2A, 0x8A))
        # reads of 300 blocks take several Data-In PDUs (MRDSL 64 KiB); writes stay within one immediate PDU
        n = rnd.choice((1, 8, 64, 0) + ((300,) if op in (0x28, 0x88) else ()))
        lba = rnd.choice((rnd.randrange(BLOCKS - 64), BLOCKS - n + rnd.randrange(3)))  # some past the end
        flags = rnd.choice((0, 0, 0x08, 0x10, 0x20))  # FUA, DPO, and a protection bit (refused)
        edtl = n * BS + rnd.choice((0, 0, 0, 0, -BS, BS))  # some residuals
        edtl = max(edtl, 0)
        if op in (0x28, 0x88):
            pdu = cmd(itt, sn, rw(op, lba, n, flags), read=True, edtl=edtl)
        else:
            payload = rnd.randbytes(min(edtl, n * BS))
            pdu = cmd(itt, sn, rw(op, lba, n, flags), write=True, edtl=edtl, data=payload[:edtl])
        sn += 1
        batch.append(pdu)
        every.append(pdu)
        if rnd.random() < 0.1:
            # an immediate NOP-Out among the commands: the lane stops there and the reader takes the rest
            ping = nop_out(10000 + itt, sn, rnd.randbytes(rnd.choice((0, 4, 13))))
            batch.append(ping)
            every.append(ping)
        if rnd.random() < 0.3:
            stream.append(b"".join(batch))
            batch = []
    stream.append(b"".join(batch))
    # split one read's bytes at random points too: the reader joins them
    whole = b"".join(stream)
    cuts = sorted(rnd.sample(range(1, len(whole)), 50))
    pieces = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
    fast, slow, used = both(pieces)
    assert used > 100, "the fast path was hardly taken"
    assert fast == slow
    pings = sum(p.startswith(b"\x40") for p in every)
    assert pings >= 20 and sum(op == 0x20 for op, _, _ in _pdus(fast)) == pings   # a NOP-In for each
    # one PDU per receive: data_received's lane, which skips the PDU reader
    fast, slow, used = both(every)
    assert used > 100, "the fast path was hardly taken"
    assert fast == slow


def test_commands_out_of_order_and_immediate_ones_agree() -> None:
    data = bytes(range(256)) * 2
    stream = [
        cmd(1, 1, rw(0x28, 0, 1), read=True, edtl=BS),           # a nexus's first command: normal path
        cmd(2, 2, rw(0x2A, 10, 1), write=True, edtl=BS, data=data),
        cmd(4, 4, rw(0x28, 10, 1), read=True, edtl=BS),          # ahead of its turn: waits for CmdSN 3
        cmd(3, 3, rw(0x88, 10, 1), read=True, edtl=BS),
        cmd(5, 5, rw(0x28, 11, 1), read=True, edtl=BS, immediate=True),
    ]
    fast, slow, used = both([b"".join(stream)])
    assert used == 1   # the write; the rest are first, wait behind a queued CmdSN or are immediate
    assert fast == slow
    assert data in fast


def _pdus(wire: bytes) -> list[tuple[int, int, bytes]]:
    """(opcode, status byte, data) of each PDU the target sent."""
    out, pos = [], 0
    while pos < len(wire):
        dsl = int.from_bytes(wire[pos + 5:pos + 8], "big")
        out.append((wire[pos] & 0x3F, wire[pos + 3], wire[pos + 48:pos + 48 + dsl]))
        pos += 48 + dsl + (-dsl & 3)
    return out


def test_a_unit_attention_and_a_reservation_are_still_reported() -> None:
    def pending_ua(unit: Lun, c: Connection) -> None:
        assert c.session is not None and c.session.nexus is not None
        unit.nexuses.add(c.session.nexus)
        unit.add_ua(c.session.nexus, 0x2900)   # POWER ON, RESET

    stream = [cmd(1, 1, rw(0x28, 0, 1), read=True, edtl=BS), cmd(2, 2, rw(0x28, 0, 1), read=True, edtl=BS)]
    fast, slow, used = both([b"".join(stream)], pending_ua)
    assert fast == slow
    sent = _pdus(fast)
    assert sent[0][0] == 0x21 and sent[0][1] == 0x02   # SCSI Response, CHECK CONDITION (the UA)
    assert sent[1][0] == 0x25 and used == 1            # then the read, fast

    def reserved_elsewhere(unit: Lun, c: Connection) -> None:
        assert c.session is not None and c.session.nexus is not None
        unit.nexuses.add(c.session.nexus)
        unit.spc2_holder = type(c.session.nexus)("iqn.other", 1, IQN, 1)

    fast, slow, used = both([b"".join(stream)], reserved_elsewhere)
    assert fast == slow and used == 0
    assert [p[1] for p in _pdus(fast)] == [0x18, 0x18]   # RESERVATION CONFLICT


def _other(c: Connection) -> Any:
    assert c.session is not None and c.session.nexus is not None
    return type(c.session.nexus)("iqn.other", 1, IQN, 1)


def test_what_admit_refuses_is_refused_on_either_path() -> None:
    """Lun.admit and sbc.admit_rw are asked by both paths: a write-protected LU, a persistent reservation
    held by another nexus (Write Exclusive: reads run, fast; Exclusive Access: nothing runs), no medium,
    a range past the end, a transfer over the Block Limits, a unit attention pending for another nexus
    only (this one's commands run, fast)."""
    data = bytes(range(256)) * 2
    stream = [cmd(1, 1, rw(0x28, 0, 1), read=True, edtl=BS),           # first command: records the nexus
              cmd(2, 2, rw(0x2A, 10, 1), write=True, edtl=BS, data=data),
              cmd(3, 3, rw(0x88, 10, 1), read=True, edtl=BS),
              cmd(4, 4, rw(0x8A, 11, 1, 0x08), write=True, edtl=BS, data=data),
              cmd(5, 5, rw(0x28, BLOCKS - 1, 2), read=True, edtl=2 * BS),  # past the end
              cmd(6, 6, rw(0x2A, BLOCKS, 1), write=True, edtl=BS, data=data)]

    def known(unit: Lun, c: Connection) -> None:
        assert c.session is not None and c.session.nexus is not None
        unit.nexuses.add(c.session.nexus)

    def read_only(unit: Lun, c: Connection) -> None:
        known(unit, c)
        unit.read_only = True

    def pr(kind: int) -> Any:
        def setup(unit: Lun, c: Connection) -> None:
            known(unit, c)
            holder = _other(c)
            unit.pr.keys[holder] = 0x1234
            unit.pr.holder, unit.pr.type = holder, kind
        return setup

    def no_medium(unit: Lun, c: Connection) -> None:
        known(unit, c)
        unit.medium_present = False

    def ua_elsewhere(unit: Lun, c: Connection) -> None:
        known(unit, c)
        unit.add_ua(_other(c), 0x2900)

    def small_transfers(unit: Lun, c: Connection) -> None:
        known(unit, c)
        unit.limits = dataclasses.replace(unit.limits, max_transfer=1)

    wanted = {   # (statuses of the six commands, how many took the fast path)
        known: ([0, 0, 0, 0, 2, 2], 4),
        read_only: ([0, 2, 0, 2, 2, 2], 2),
        pr(1): ([0, 0x18, 0, 0x18, 2, 0x18], 2),        # WRITE EXCLUSIVE: reads run
        pr(3): ([0x18] * 6, 0),                         # EXCLUSIVE ACCESS
        no_medium: ([2] * 6, 0),
        ua_elsewhere: ([0, 0, 0, 0, 2, 2], 4),
        small_transfers: ([0, 0, 0, 0, 2, 2], 4),
    }
    for setup, (statuses, fast_ones) in wanted.items():
        fast, slow, used = both([b"".join(stream)], setup)
        assert fast == slow
        assert [p[1] for p in _pdus(fast)] == statuses, setup
        assert used == fast_ones, setup
    # a transfer over the Block Limits: INVALID FIELD IN CDB on either path
    fast, slow, used = both([cmd(1, 1, rw(0x28, 0, 1), read=True, edtl=BS),
                             cmd(2, 2, rw(0x28, 0, 2), read=True, edtl=2 * BS)], small_transfers)
    assert fast == slow and used == 1
    assert [p[1] for p in _pdus(fast)] == [0, 2]   # Data-In with GOOD, then CHECK CONDITION
