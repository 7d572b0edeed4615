"""The NVMe/TCP target's fast path (a Read, or a Write with in-capsule data, on a namespace whose device has
SyncRead/SyncWrite, answered without a Task) must say exactly what the normal path says: the same bytes on the
wire for the same command stream, whichever path each command takes, and every refusal (invalid namespace,
read-only namespace, out of range, transfer and SGL lengths, ANA inaccessible, reservation conflicts) the same,
because both ask protocol/nvme/io.py's admit()."""

from __future__ import annotations

import asyncio
import random
import struct
import uuid
from collections import Counter
from typing import Any

from fastpath_fakes import AsyncOnly, Counting, SlowRam, SoonRam, nvme_controller
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nvme_host import HostReader, capsule, sqe

from openvsan.block.ram import RamDevice
from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.nvme_tcp import NvmeTcpServer
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.reservations import EXCLUSIVE_ACCESS, WRITE_EXCLUSIVE
from openvsan.protocol.nvme.subsystem import ANA_CHANGE, ANA_INACCESSIBLE, ANA_NON_OPTIMIZED, ANA_OPTIMIZED
from openvsan.volume import Volume

NQN = "nqn.2026-11.org.openvsan:fast"
PORTAL = ("127.0.0.1", 4420)
BS = 512
BLOCKS = 4096
OTHER_HOST = b"\x99" * 16
OTHER_KEY = 0xABCD
MY_KEY = 0x1234
FUA = 1 << 30
PRINFO = 1 << 26     # CDW12 PRINFO bit: no protection information here, execute_io ignores it


# --- the stream: commands (bytes for the I/O queue) and changes made between them ---------------------
# ("io", capsules) | ("ana", state) | ("reserve", type): another host registers and reserves | ("release",)
Step = tuple[Any, ...]


def rw(op: int, cid: int, nsid: int, slba: int, nlb: int, *, extra: int = 0, sgl: int | None = None,
       data: bytes = b"") -> bytes:
    cdw12 = ((nlb - 1) & 0xFFFF) | extra
    n = nlb * BS if sgl is None else sgl
    if op in (0x01, 0x05):   # Write, Compare: the data in the capsule
        return capsule(sqe(op, cid, nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=cdw12, sgl_len=len(data),
                           in_capsule=True), data)
    return capsule(sqe(op, cid, nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=cdw12, sgl_len=n))


def other(op: int, cid: int, nsid: int, *, cdw10: int = 0, cdw11: int = 0, cdw12: int = 0, data: bytes = b"") -> bytes:
    if data:
        return capsule(sqe(op, cid, nsid, cdw10=cdw10, cdw11=cdw11, cdw12=cdw12, sgl_len=len(data), in_capsule=True),
                       data)
    return capsule(sqe(op, cid, nsid, cdw10=cdw10, cdw11=cdw11, cdw12=cdw12))


def random_command(rnd: random.Random, cid: int) -> bytes:
    nsid = rnd.choice((1, 1, 1, 1, 2, 2, 3))              # 2 is read-only, 3 does not exist
    kind = rnd.random()
    nlb = rnd.choice((1, 8, 16, 1, 8, 2049))              # 2049 blocks: over MDTS (1 MiB)
    slba = rnd.randrange(BLOCKS - 16) if rnd.random() < 0.85 else BLOCKS - nlb + rnd.choice((0, 1, 5))
    slba = max(slba, 0)
    extra = rnd.choice((0, 0, 0, FUA, PRINFO))
    if kind < 0.45:
        sgl = None if rnd.random() < 0.85 else nlb * BS + rnd.choice((-BS, BS))
        if nlb > 2048:
            sgl = BS
        return rw(0x02, cid, nsid, slba, nlb, extra=extra, sgl=sgl)
    if kind < 0.85:
        nlb = min(nlb, 16)
        size = nlb * BS if rnd.random() < 0.9 else max(BS, nlb * BS - BS)   # some with too little data
        return rw(0x01, cid, nsid, slba, nlb, extra=extra, data=rnd.randbytes(size))
    if kind < 0.88:
        return rw(0x05, cid, nsid, slba, 1, data=rnd.randbytes(BS))
    if kind < 0.91:
        return rw(0x08, cid, nsid, slba, min(nlb, 16))
    if kind < 0.93:
        return other(0x00, cid, rnd.choice((nsid, 0xFFFFFFFF)))
    if kind < 0.95:
        ad = rnd.choice((0, 4))
        return other(0x09, cid, nsid, cdw10=0, cdw11=ad, data=struct.pack("<IIQ", 0, 2, slba))
    if kind < 0.97:
        return other(0x7C, cid, nsid)                      # not an NVM command
    # this host's own reservation: register its key, or reserve (write exclusive, registrants only), or let go
    action = rnd.randrange(3)
    if action == 0:
        return other(0x0D, cid, 1, cdw10=0, data=struct.pack("<QQ", 0, MY_KEY))
    if action == 1:
        return other(0x11, cid, 1, cdw10=3 << 8, data=struct.pack("<QQ", MY_KEY, 0))
    return other(0x15, cid, 1, cdw10=3 << 8, data=struct.pack("<Q", MY_KEY))


def random_stream(rnd: random.Random, n: int) -> list[Step]:
    steps: list[Step] = []
    batch: list[bytes] = []
    for cid in range(1, n + 1):
        batch.append(random_command(rnd, cid))
        if len(batch) >= rnd.randint(1, 8):
            steps.append(("io", b"".join(batch)))
            batch = []
        r = rnd.random()
        if r < 0.02:
            steps.append(("ana", rnd.choice((ANA_INACCESSIBLE, ANA_CHANGE, ANA_NON_OPTIMIZED, ANA_OPTIMIZED))))
        elif r < 0.03:
            steps.append(("ana", ANA_OPTIMIZED))
        elif r < 0.045:
            steps.append(("reserve", rnd.choice((WRITE_EXCLUSIVE, EXCLUSIVE_ACCESS))))
        elif r < 0.06:
            steps.append(("release",))
    steps.append(("io", b"".join(batch)))
    return steps


# --- a target with one subsystem: namespace 1 read-write, namespace 2 read-only -------------------------
async def run(devices: list[Any], steps: list[Step], sq_flow_off: bool) -> tuple[bytes, bytes]:
    vols = [Volume(d, name=f"v{i}", uuid=uuid.UUID(int=i + 1), serial=f"s{i}") for i, d in enumerate(devices)]
    cfg = NvmeSubsystemConfig(NQN, [NvmeNamespaceConfig(1, vols[0]), NvmeNamespaceConfig(2, vols[1], read_only=True)],
                              [PORTAL], serial="SN")
    srv = NvmeTcpServer([cfg])
    sub = srv.fabric.subsystems[NQN]
    admin, io, aw, iw = await nvme_controller(srv, PORTAL, NQN, sq_flow_off=sq_flow_off)
    for step in steps:
        if step[0] == "io":
            io.data_received(step[1])
        elif step[0] == "ana":
            sub.set_ana_state(1, step[1])
        elif step[0] == "reserve":
            for ns in sub.namespaces.values():
                ns.reservations.register(OTHER_HOST, 0, False, 0, 0, OTHER_KEY)
                ns.reservations.acquire(OTHER_HOST, 0, step[1], False, OTHER_KEY, 0)
        elif step[0] == "release":
            for ns in sub.namespaces.values():
                ns.reservations.register(OTHER_HOST, 1, True, 0, 0, 0)   # unregister: its reservation goes too
        for _ in range(4):
            await asyncio.sleep(0)
    io.close()
    admin.close()
    return bytes(aw.out), bytes(iw.out)


def both(steps: list[Step], sq_flow_off: bool) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes], int]:
    async def go() -> tuple[tuple[bytes, bytes], tuple[bytes, bytes], int]:
        fast_devs = [Counting(BLOCKS, BS) for _ in range(2)]
        slow_devs = [RamDevice(BLOCKS, BS) for _ in range(2)]
        for d in fast_devs + slow_devs:
            d.write_now(0, random.Random(7).randbytes(BLOCKS * BS))
        for d in fast_devs:
            d.fast = 0
        fast = await run(fast_devs, steps, sq_flow_off)
        used = sum(d.fast for d in fast_devs)
        slow = await run([AsyncOnly(d) for d in slow_devs], steps, sq_flow_off)
        for f, s in zip(fast_devs, slow_devs, strict=True):
            assert f.read_now(0, BLOCKS) == s.read_now(0, BLOCKS)
        return fast, slow, used

    return asyncio.run(go())


def statuses(wire: bytes) -> Counter[int]:
    """How many commands ended with each status: CapsuleResps, and C2HData PDUs that carry SUCCESS."""
    out: Counter[int] = Counter()
    for p in HostReader().feed(wire):
        if p.type == 5:
            out[p.status] += 1
        elif p.type == 7 and p.flags & 0x08:
            out[0] += 1
    return out


def test_ram_offers_sync_io_and_the_wrapper_does_not() -> None:
    caps = AsyncOnly(RamDevice(8, BS)).capabilities
    assert RamDevice(8, BS).capabilities.sync_write and not caps.sync_read and not caps.sync_write


def test_a_random_command_stream_gets_the_same_bytes_on_either_path() -> None:
    steps = random_stream(random.Random(11), 700)
    for flow_off in (False, True):
        fast, slow, used = both(steps, flow_off)
        assert used > 150, "the fast path was hardly taken"
        assert fast[1] == slow[1]
        assert fast[0] == slow[0]
    seen = statuses(fast[1])
    # every refusal admit() gives was met on the way
    for st_ in (S.SUCCESS, S.INVALID_NAMESPACE, S.NS_WRITE_PROTECTED, S.LBA_OUT_OF_RANGE, S.INVALID_FIELD,
                S.DATA_SGL_LENGTH_INVALID, S.ANA_INACCESSIBLE, S.ANA_TRANSITION, S.RESERVATION_CONFLICT,
                S.INVALID_OPCODE):
        assert seen[st_], f"no command ended with status {st_:#x}: {seen}"


def test_ana_and_reservation_refusals_on_either_path() -> None:
    steps: list[Step] = [
        ("io", rw(0x01, 1, 1, 10, 1, data=b"\x11" * BS) + rw(0x02, 2, 1, 10, 1)),   # both fast
        ("ana", ANA_INACCESSIBLE),
        ("io", rw(0x02, 3, 1, 10, 1) + rw(0x01, 4, 1, 10, 1, data=b"\x22" * BS)),
        ("ana", ANA_NON_OPTIMIZED),
        ("io", rw(0x02, 5, 1, 10, 1)),                                               # admitted: fast
        ("reserve", WRITE_EXCLUSIVE),
        ("io", rw(0x01, 6, 1, 10, 1, data=b"\x33" * BS) + rw(0x02, 7, 1, 10, 1)),  # write refused, read fast
        ("release",),
        ("reserve", EXCLUSIVE_ACCESS),
        ("io", rw(0x02, 8, 1, 10, 1)),
        ("release",),
        ("io", rw(0x01, 9, 2, 10, 1, data=b"\x44" * BS) + rw(0x02, 10, 3, 0, 1) + rw(0x02, 11, 1, BLOCKS, 1)),
    ]
    fast, slow, used = both(steps, False)
    assert fast == slow
    assert used == 4   # commands 1, 2, 5 and 7
    got = [(p.cid, p.status) for p in HostReader().feed(fast[1]) if p.type == 5][1:]   # after the Connect
    assert got == [(1, 0), (2, 0), (3, S.ANA_INACCESSIBLE), (4, S.ANA_INACCESSIBLE), (5, 0),
                   (6, S.RESERVATION_CONFLICT), (7, 0), (8, S.RESERVATION_CONFLICT),
                   (9, S.NS_WRITE_PROTECTED), (10, S.INVALID_NAMESPACE), (11, S.LBA_OUT_OF_RANGE)]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.integers(1, 120), st.booleans())
def test_any_command_stream_gets_the_same_bytes_on_either_path(seed: int, n: int, flow_off: bool) -> None:
    fast, slow, _ = both(random_stream(random.Random(seed), n), flow_off)
    assert fast == slow


def test_data_that_fails_its_digest_is_refused_and_not_written() -> None:
    """NVMe/TCP 1.0 §3.5.3: data that fails its data digest (in a capsule, or in H2CData after an R2T) ends its
    command with Transient Transport Error and is not written; the queue goes on."""
    from fastpath_fakes import Wire
    from nvme_host import connect_cmd, connect_data, h2c_data, icreq

    from openvsan.frontend.nvme_tcp import Connection

    async def go() -> None:
        dev = RamDevice(BLOCKS, BS)
        vol = Volume(dev, name="v", uuid=uuid.UUID(int=1), serial="s")
        srv = NvmeTcpServer([NvmeSubsystemConfig(NQN, [NvmeNamespaceConfig(1, vol)], [PORTAL], serial="SN")])
        admin, _, aw, _ = await nvme_controller(srv, PORTAL, NQN)
        cntlid = next(p for p in HostReader().feed(bytes(aw.out)) if p.type == 5).u32(8) & 0xFFFF
        io, wire = Connection(srv, PORTAL), Wire()
        io.connection_made(wire)  # type: ignore[arg-type]
        io.data_received(icreq(dd=True))
        io.data_received(capsule(connect_cmd(1, 2, 63), connect_data(NQN, cntlid=cntlid), dd=True))   # queue 2
        good, bad = b"\x11" * BS, bytearray(capsule(sqe(0x01, 2, 1, cdw10=5, sgl_len=BS, in_capsule=True), b"\x22" * BS,
                                                     dd=True))
        bad[-1] ^= 0xFF                                                   # the in-capsule data's digest
        io.data_received(bytes(bad))
        io.data_received(capsule(sqe(0x01, 3, 1, cdw10=6, sgl_len=BS), b""))   # by R2T
        await asyncio.sleep(0)
        r2t = [p for p in HostReader(dd=True).feed(bytes(wire.out)) if p.type == 9][-1]
        ttag = r2t.u16(10)
        h2c = bytearray(h2c_data(3, ttag, 0, b"\x33" * BS, last=True, dd=True))
        h2c[-1] ^= 0xFF
        io.data_received(bytes(h2c))
        io.data_received(capsule(sqe(0x01, 4, 1, cdw10=7, sgl_len=BS, in_capsule=True), good, dd=True))
        for _ in range(4):
            await asyncio.sleep(0)
        got = [(p.cid, p.status) for p in HostReader(dd=True).feed(bytes(wire.out)) if p.type == 5]
        assert got == [(1, 0), (2, S.TRANSIENT_TRANSPORT_ERROR), (3, S.TRANSIENT_TRANSPORT_ERROR), (4, 0)]
        assert dev.read_now(5, 2) == bytes(2 * BS) and dev.read_now(7, 1) == good
        io.close()
        admin.close()

    asyncio.run(go())


# --- write_soon: a device whose write waits on others (a replicated volume) answers by callback ----------
def test_writes_answered_by_write_soon_are_the_same_bytes_as_the_normal_path() -> None:
    rnd = random.Random(5)
    steps: list[Step] = []
    cid = 1
    for _ in range(60):
        batch = b""
        for _ in range(rnd.randint(1, 6)):
            nlb = rnd.choice((1, 8, 16))
            slba = rnd.choice((rnd.randrange(BLOCKS - 16), rnd.randrange(90, 120)))   # some in SlowRam.BAD
            extra = rnd.choice((0, FUA))
            batch += rw(0x01, cid, 1, slba, nlb, extra=extra, data=rnd.randbytes(nlb * BS))
            if rnd.random() < 0.3:
                batch += rw(0x02, cid + 1, 1, slba, nlb)
            cid += 2
        steps.append(("io", batch))

    async def go() -> tuple[tuple[bytes, bytes], tuple[bytes, bytes], int]:
        fast_devs = [SoonRam(BLOCKS, BS), SoonRam(BLOCKS, BS)]
        slow_devs = [SlowRam(BLOCKS, BS), SlowRam(BLOCKS, BS)]
        fast = await run(fast_devs, steps, False)
        slow = await run(slow_devs, steps, False)
        for f, s in zip(fast_devs, slow_devs, strict=True):
            assert f.read_now(0, BLOCKS) == s.read_now(0, BLOCKS)
        return fast, slow, fast_devs[0].soon

    fast, slow, used = asyncio.run(go())
    assert used > 100, "write_soon was hardly taken"
    assert fast == slow
    seen = statuses(fast[1])
    assert seen[S.SUCCESS] and seen[S.WRITE_FAULT]
