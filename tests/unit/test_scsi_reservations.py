"""Persistent reservations, RESERVE/RELEASE(6), unit attentions, resets and CAW atomicity."""

from __future__ import annotations

import asyncio
import json
import pathlib
import struct
import uuid

from openvsan.block.ram import RamDevice
from openvsan.protocol.scsi import (
    CHECK_CONDITION,
    GOOD,
    RESERVATION_CONFLICT,
    Lun,
    Nexus,
    ScsiResult,
    ScsiTarget,
    parse_sense,
)
from openvsan.volume import Volume

IQN = "iqn.2026-11.org.openvsan:test"
A = Nexus("iqn.2026-11.org.openvsan.test:a", 1, IQN)
B = Nexus("iqn.2026-11.org.openvsan.test:b", 2, IQN)
C = Nexus("iqn.2026-11.org.openvsan.test:a", 3, IQN)   # same initiator as A, another session (ISID)


def make(pr_path: pathlib.Path | None = None) -> ScsiTarget:
    lun = Lun(Volume(RamDevice(256), name="d", uuid=uuid.UUID(int=7), serial="S"), pr_state_path=pr_path)
    return ScsiTarget(IQN, {0: lun})


def run(t: ScsiTarget, nexus: Nexus, cdb: bytes | list[int], data: bytes = b"") -> ScsiResult:
    return asyncio.run(t.execute(0, bytes(cdb), memoryview(data), nexus))


def prout(t: ScsiTarget, nexus: Nexus, sa: int, rk: int = 0, sark: int = 0, rtype: int = 0,
          aptpl: bool = False) -> ScsiResult:
    params = struct.pack(">QQ4xBxH", rk, sark, 0x01 if aptpl else 0, 0)
    return run(t, nexus, struct.pack(">BBBxxIB", 0x5F, sa, rtype, 24, 0), params)


def prin(t: ScsiTarget, nexus: Nexus, sa: int) -> bytes:
    r = run(t, nexus, struct.pack(">BB5xHB", 0x5E, sa, 4096, 0))
    assert r.status == GOOD
    return bytes(r.data)


READ = bytes((0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0))
WRITE = bytes((0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0))
TUR = bytes(6)


def can(t: ScsiTarget, nexus: Nexus) -> tuple[bool, bool]:
    r = run(t, nexus, READ).status
    w = run(t, nexus, WRITE, bytes(512)).status
    assert r in (GOOD, RESERVATION_CONFLICT) and w in (GOOD, RESERVATION_CONFLICT)
    return r == GOOD, w == GOOD


def test_register_reserve_release_and_keys() -> None:
    t = make()
    assert prout(t, A, 0, sark=0xAA).status == GOOD
    assert prout(t, A, 0, rk=0x11, sark=0xAB).status == RESERVATION_CONFLICT   # wrong key
    assert prout(t, B, 6, sark=0xBB).status == GOOD                             # register and ignore
    gen, length = struct.unpack_from(">II", prin(t, A, 0))
    assert gen == 2 and length == 16
    assert prout(t, B, 1, rk=0xBB, rtype=1).status == GOOD                      # WRITE EXCLUSIVE
    res = prin(t, A, 1)
    assert struct.unpack_from(">IIQ", res)[1:] == (16, 0xBB) and res[21] == 1
    assert can(t, A) == (True, False) and can(t, B) == (True, True)
    assert prout(t, B, 2, rk=0xBB, rtype=3).status == CHECK_CONDITION           # wrong type
    assert prout(t, B, 2, rk=0xBB, rtype=1).status == GOOD
    assert struct.unpack_from(">II", prin(t, A, 1))[1] == 0
    caps = prin(t, A, 2)
    assert caps[1] == 8 and caps[3] & 0x80 and struct.unpack_from(">H", caps, 4)[0] == 0xEA01
    full = prin(t, A, 3)
    assert struct.unpack_from(">I", full, 4)[0] > 0 and b",i,0x" in full


def test_reservation_types_access() -> None:
    expect = {1: ((True, False), (True, False)), 3: ((False, False), (False, False)),
              5: ((True, True), (True, False)), 6: ((True, True), (False, False)),
              7: ((True, True), (True, False)), 8: ((True, True), (False, False))}
    for rtype, (registered, unregistered) in expect.items():
        t = make()
        prout(t, A, 0, sark=1)
        prout(t, B, 0, sark=2)
        assert prout(t, A, 1, rk=1, rtype=rtype).status == GOOD
        assert can(t, A) == (True, True)
        assert can(t, B) == registered, rtype
        assert can(t, C) == unregistered, rtype
        assert run(t, C, TUR).status == GOOD
        assert run(t, C, [0x12, 0, 0, 0, 36, 0]).status == GOOD


def test_preempt_and_clear_give_unit_attentions() -> None:
    t = make()
    prout(t, A, 0, sark=1)
    prout(t, B, 0, sark=2)
    prout(t, A, 1, rk=1, rtype=3)
    gen = struct.unpack_from(">I", prin(t, B, 0))[0]
    assert prout(t, B, 4, rk=2, sark=1, rtype=1).status == GOOD            # B preempts A
    assert struct.unpack_from(">I", prin(t, B, 0))[0] == gen + 1
    r = run(t, A, TUR)
    assert parse_sense(r.sense) == (6, 0x2A05)                              # REGISTRATIONS PREEMPTED
    assert run(t, A, TUR).status == GOOD
    assert prout(t, A, 1, rk=1, rtype=1).status == RESERVATION_CONFLICT    # A is no longer registered
    prout(t, A, 0, sark=5)
    assert prout(t, B, 3, rk=2).status == GOOD                              # CLEAR
    assert parse_sense(run(t, A, TUR).sense) == (6, 0x2A03)
    assert struct.unpack_from(">II", prin(t, A, 0))[1] == 0


def test_register_and_move() -> None:
    t = make()
    prout(t, A, 0, sark=1)
    prout(t, A, 1, rk=1, rtype=1)
    name = f"{B.initiator_name},i,0x{B.isid:012x}".encode() + b"\0"
    name += b"\0" * (-len(name) % 4)
    tid = bytes((0x45, 0)) + struct.pack(">H", len(name)) + name
    params = struct.pack(">QQxBHI", 1, 9, 0x02, 1, len(tid)) + tid
    r = run(t, A, struct.pack(">BBBxxIB", 0x5F, 7, 1, len(params), 0), params)
    assert r.status == GOOD, parse_sense(r.sense)
    res = prin(t, A, 1)
    assert struct.unpack_from(">Q", res, 8)[0] == 9
    assert can(t, B) == (True, True) and can(t, A) == (True, False)


def test_aptpl_survives_restart(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "pr" / "lun0.json"
    t = make(path)
    prout(t, A, 0, sark=0x77, aptpl=True)
    prout(t, A, 1, rk=0x77, rtype=5)
    assert json.loads(path.read_text())["type"] == 5
    t2 = make(path)
    assert struct.unpack_from(">Q", prin(t2, B, 1), 8)[0] == 0x77
    assert can(t2, B) == (True, False)
    prout(t2, A, 0, rk=0x77, sark=0x77, aptpl=False)
    assert not path.exists()


def test_spc2_reserve_release() -> None:
    t = make()
    assert run(t, A, [0x16, 0, 0, 0, 0, 0]).status == GOOD
    assert run(t, A, [0x16, 0, 0, 0, 0, 0]).status == GOOD
    assert run(t, B, [0x16, 0, 0, 0, 0, 0]).status == RESERVATION_CONFLICT
    assert run(t, B, [0x17, 0, 0, 0, 0, 0]).status == GOOD                  # a no-op
    assert run(t, B, [0x1A, 0, 0x3F, 0, 255, 0]).status == RESERVATION_CONFLICT
    assert run(t, B, [0x12, 0, 0, 0, 36, 0]).status == GOOD
    t.nexus_lost(A)
    assert run(t, B, [0x16, 0, 0, 0, 0, 0]).status == GOOD
    t.logical_unit_reset(0, A)
    run(t, A, TUR)   # A was forgotten with its nexus: a UA or not, the reservation is gone
    assert run(t, A, [0x16, 0, 0, 0, 0, 0]).status == GOOD


def test_unit_attentions_after_reset_and_mode_change() -> None:
    t = make()
    assert run(t, A, TUR).status == GOOD      # no power-on UA for a new nexus
    assert run(t, B, TUR).status == GOOD
    t.logical_unit_reset(0, A)
    assert parse_sense(run(t, A, TUR).sense) == (6, 0x2903)   # every nexus, the issuer's too
    assert run(t, A, TUR).status == GOOD
    assert run(t, B, [0x12, 0, 0, 0, 36, 0]).status == GOOD                 # INQUIRY does not consume it
    assert run(t, B, [0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0]).status == GOOD
    sense = run(t, B, [0x03, 0, 0, 0, 18, 0])                                # REQUEST SENSE returns it
    assert sense.status == GOOD and parse_sense(bytes(sense.data)) == (6, 0x2903)
    assert run(t, B, TUR).status == GOOD
    # MODE SELECT changing WCE: MODE PARAMETERS CHANGED for the others
    page = bytes(4) + bytes((0x08, 18)) + bytes(18)
    assert run(t, A, [0x15, 0x10, 0, 0, 24, 0], page).status == GOOD
    assert parse_sense(run(t, B, TUR).sense) == (6, 0x2A01)
    assert run(t, A, TUR).status == GOOD
    t.target_reset(A, cold=False)
    assert parse_sense(run(t, B, READ).sense) == (6, 0x2900)


def test_compare_and_write_is_atomic_against_writes() -> None:
    """Many CAWs race writes to the same block: every CAW that reports GOOD saw exactly its compare
    data, and the block always holds one whole write (never a mix)."""
    t = make()
    lun = t.luns[0]
    bs = 512

    async def main() -> None:
        await lun.volume.write(0, b"\0" * bs)
        slow_read = lun.volume.read

        async def read(lba: int, blocks: int) -> bytes:
            data = await slow_read(lba, blocks)
            await asyncio.sleep(0)   # give writers a chance to slip in between read and write
            return bytes(data)
        lun.volume.read = read  # type: ignore[method-assign]
        caw = struct.pack(">BBQ3xBBB", 0x89, 0, 0, 1, 0, 0)
        wr = bytes((0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0))
        winners = 0

        async def cas(i: int) -> None:
            nonlocal winners
            while True:
                cur = bytes(await lun.volume.read(0, 1))
                r = await t.execute(0, caw, memoryview(cur + bytes([i]) * bs), A)
                if r.status == GOOD:
                    winners += 1
                    return
                assert parse_sense(r.sense)[0] == 0x0E

        async def writer() -> None:
            for _ in range(20):
                r = await t.execute(0, wr, memoryview(b"\xee" * bs), B)
                assert r.status == GOOD
                await asyncio.sleep(0)
        await asyncio.gather(*(cas(i) for i in range(1, 30)), writer(), writer())
        final = bytes(await slow_read(0, 1))
        assert final == final[:1] * bs
        assert winners == 29
    asyncio.run(main())
