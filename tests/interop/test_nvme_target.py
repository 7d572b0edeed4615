"""NvmeTcpServer over real sockets, driven by the test host in nvme_host.py: several I/O queues per
controller, R2T writes, digests, SUCCESS, keep-alive expiry, allow-lists, and bad input (mutated PDUs,
commands on unconnected queues) that gets a C2HTermReq or a clean close while another host's I/O goes on."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import struct
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from nvme_host import (
    DISCOVERY_NQN,
    Queue,
    capsule,
    connect_cmd,
    connect_controller,
    connect_data,
    h2c_data,
    icreq,
    sqe,
)
from vsan_harness import free_port

from openvsan.block import RamDevice
from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.nvme_tcp import NvmeTcpServer
from openvsan.volume import Volume

NQN = "nqn.2026-11.org.openvsan:t0"
PRIVATE = "nqn.2026-11.org.openvsan:private"
BS = 512


def run(coro: Callable[[NvmeTcpServer, int], Coroutine[Any, Any, None]], caplog: pytest.LogCaptureFixture,
        **kw: Any) -> None:
    async def main() -> None:
        port = free_port()
        subs = [
            NvmeSubsystemConfig(NQN, [NvmeNamespaceConfig(1, Volume(RamDevice(65536, BS), name="v0", uuid=uuid.uuid4())),
                                      NvmeNamespaceConfig(2, Volume(RamDevice(8192, 4096), name="v1", uuid=uuid.uuid4()))],
                                [("127.0.0.1", port)]),
            NvmeSubsystemConfig(PRIVATE, [NvmeNamespaceConfig(1, Volume(RamDevice(1024, BS), name="v2", uuid=uuid.uuid4()))],
                                [("127.0.0.1", port)], allowed_hosts=["nqn.2014-08.org.example:only"]),
        ]
        server = NvmeTcpServer(subs, **kw)
        await server.start()
        try:
            await asyncio.wait_for(coro(server, port), 120)
        finally:
            await server.stop()

    with caplog.at_level(logging.WARNING, logger="openvsan"):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_io_on_several_queues(caplog: pytest.LogCaptureFixture) -> None:
    async def go(server: NvmeTcpServer, port: int) -> None:
        admin, ios = await connect_controller(port, NQN, io_queues=4, sqsize=63)
        assert [q.cntlid for q in ios] == [admin.cntlid] * 4
        rng = random.Random(1)
        blobs = {}

        async def worker(q: Queue, base: int) -> None:
            for i in range(40):
                n = rng.choice([1, 8, 16, 64, 256, 1024, 2048])          # 512 B .. 1 MiB: in-capsule and R2T
                lba = base + (i % 8) * 2048                              # 8 slots of 1 MiB each
                data = os.urandom(n * BS)
                blobs[lba] = data
                assert await q.write(1, lba, data, fua=i % 7 == 0) == 0
            await asyncio.gather(*(check(q, lba, d) for lba, d in list(blobs.items()) if base <= lba < base + 16384))

        async def check(q: Queue, lba: int, data: bytes) -> None:
            st, got = await q.read(1, lba, len(data) // BS)
            assert st == 0 and got == data

        await asyncio.gather(*(worker(q, i * 16384) for i, q in enumerate(ios)))
        # the 4 KiB namespace, a flush, and an out-of-range read
        st = await ios[0].write(2, 10, b"\xab" * 8192, bs=4096)
        assert st == 0
        st, got = await ios[1].read(2, 10, 2, bs=4096)
        assert st == 0 and got == b"\xab" * 8192
        rsp, _ = await ios[2].command(sqe(0x00, 0, 1))
        assert rsp is not None and rsp.status == 0
        st, _ = await ios[3].read(1, 65535, 2)
        assert st == 0x80 | 0x4000                                       # LBA out of range, DNR
        for q in ios + [admin]:
            await q.close()
    run(go, caplog)


def test_hosts_that_spdk_perf_and_others_are(caplog: pytest.LogCaptureFixture) -> None:
    """Two hosts SPDK's target accepts and openvsan refused (issue 13): one that sends an empty Host NQN in
    Connect (spdk_nvme_perf's default), and one whose I/O queues come with another Host ID than its admin
    queue (a new Host ID per connection). Both get their I/O through; the private subsystem (a host list)
    still refuses the empty NQN."""
    async def go(server: NvmeTcpServer, port: int) -> None:
        admin, (io,) = await connect_controller(port, NQN, hostnqn="")
        data = os.urandom(8 * BS)
        assert await io.write(1, 0, data) == 0
        assert await io.read(1, 0, 8) == (0, data)
        await io.close()
        await admin.close()
        with pytest.raises(ConnectionRefusedError, match="status 0x4184"):   # Connect Invalid Host, DNR
            await Queue.open(port, PRIVATE, hostnqn="")

        admin = await Queue.open(port, NQN, hostid=os.urandom(16))
        await admin.enable()
        rsp, _ = await admin.command(sqe(0x09, 0, 0, cdw10=0x07, cdw11=1 | (1 << 16)))
        assert rsp is not None and rsp.status == 0
        ios = [await Queue.open(port, NQN, qid=i + 1, cntlid=admin.cntlid, hostid=os.urandom(16)) for i in range(2)]
        for i, q in enumerate(ios):
            assert await q.write(1, 64 + i, data[:BS]) == 0
            assert await q.read(1, 64 + i, 1) == (0, data[:BS])
        for q in (*ios, admin):
            await q.close()

    run(go, caplog)
    other = [r.getMessage() for r in caplog.records if "came with Host ID" in r.getMessage()]
    assert len(other) == 1, other              # logged once for the controller, not once per queue


def test_digests_and_success_flag(caplog: pytest.LogCaptureFixture) -> None:
    async def go(server: NvmeTcpServer, port: int) -> None:
        admin, (io,) = await connect_controller(port, NQN, hd=True, dd=True, cattr=0x04)
        data = os.urandom(300 * 1024)
        assert await io.write(1, 0, data) == 0                          # R2T + H2CData with digests
        rsp, got = await io.read(1, 0, len(data) // BS), None
        st, got = rsp
        assert st == 0 and got == data                                  # completed by C2HData SUCCESS
        assert io.term is None
        await io.close()
        await admin.close()
    run(go, caplog)


def test_discovery_and_allow_list(caplog: pytest.LogCaptureFixture) -> None:
    async def go(server: NvmeTcpServer, port: int) -> None:
        disc = await Queue.open(port, DISCOVERY_NQN)
        await disc.enable()
        st, log = await disc.get_log(0x70, 4096, nsid=0)
        assert st == 0
        numrec = struct.unpack_from("<Q", log, 8)[0]
        nqns = {log[1024 * (i + 1) + 256:1024 * (i + 2)].split(b"\0")[0].decode() for i in range(numrec)}
        assert nqns == {NQN}                                             # the private one is hidden from us
        await disc.close()
        with pytest.raises(ConnectionRefusedError, match="0x4184"):
            await Queue.open(port, PRIVATE)
        q = await Queue.open(port, PRIVATE, hostnqn="nqn.2014-08.org.example:only")
        await q.close()
    run(go, caplog)


def test_keep_alive_timeout_drops_the_controller(caplog: pytest.LogCaptureFixture) -> None:
    async def go(server: NvmeTcpServer, port: int) -> None:
        admin, (io,) = await connect_controller(port, NQN, kato=1000)
        for _ in range(3):                                              # a live host keeps it
            await asyncio.sleep(0.6)
            rsp, _ = await admin.command(sqe(0x18, 0))
            assert rsp is not None and rsp.status == 0
        await asyncio.sleep(2.5)                                        # then it goes silent
        # both queues were closed by the target (the host's readers saw EOF)
        assert admin._pump is not None and admin._pump.done() and io._pump is not None and io._pump.done()
        assert not server.fabric.subsystems[NQN].controllers
    run(go, caplog)


async def raw(port: int, payload: bytes, timeout: float = 5) -> bytes:
    """Send bytes on a fresh connection; return everything the target sends until it closes."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(payload)
    got = b""
    try:
        while data := await asyncio.wait_for(r.read(1 << 20), timeout):
            got += data
    except (TimeoutError, ConnectionError):
        pass                      # a connection the target keeps open, or one it reset
    finally:
        w.close()
    return got


def termreq(out: bytes) -> tuple[int, int] | None:
    """The (FES, FEI) of the C2HTermReq that ends `out`, if there is one."""
    pos = 0
    found = None
    while pos + 8 <= len(out):
        plen = int.from_bytes(out[pos + 4:pos + 8], "little")
        if out[pos] == 0x03:
            found = struct.unpack_from("<HI", out, pos + 8)
        pos += max(plen, 8)
    return found


def test_bad_input_gets_term_req_while_another_host_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async def go(server: NvmeTcpServer, port: int) -> None:
        admin, (io,) = await connect_controller(port, NQN)
        stop = asyncio.Event()
        done = 0

        async def good_host() -> None:
            nonlocal done
            i = 0
            while not stop.is_set():
                data = os.urandom(4096 * (1 + i % 20))
                assert await io.write(1, 1000, data) == 0
                st, got = await io.read(1, 1000, len(data) // BS)
                assert st == 0 and got == data
                done += 1
                i += 1

        traffic = asyncio.get_running_loop().create_task(good_host())
        ic = icreq()
        conn = capsule(connect_cmd(1, 0, 31), connect_data(NQN))
        cases: list[tuple[bytes, int | None]] = [
            (icreq(pfv=7), 0x06),
            (capsule(sqe(0x06, 1, 0, cdw10=1, sgl_len=4096)), 0x02),               # before ICReq
            (ic + ic, 0x02),
            (ic + bytes([0x0B, 0, 24, 0, 24, 0, 0, 0]) + bytes(16), 0x01),
            (ic + struct.pack("<BBBBI", 4, 0, 72, 76, 0x7FFFFFFF), 0x05),
            (ic + h2c_data(1, 7, 0, bytes(512), last=True), 0x01),                 # no R2T for it
            (ic + bytes(capsule(sqe(0x06, 1)))[:2] + b"\x30" + bytes(capsule(sqe(0x06, 1)))[3:], 0x01),  # HLEN
            (icreq(hd=True) + capsule(sqe(0x06, 1)), 0x01),                         # digest flag missing
            (ic + conn[:3] + b"\x10" + conn[4:], 0x01),                              # PDO inside the header
        ]
        for payload, fes in cases:
            out = await raw(port, payload)
            got = termreq(out)
            assert got is not None and got[0] == fes, (payload[:16].hex(), out[:64].hex())
        # header digest error
        bad = bytearray(icreq(hd=True) + capsule(sqe(0x06, 1), hd=True))
        bad[-2] ^= 0xFF
        got = termreq(await raw(port, bytes(bad)))
        assert got is not None and got[0] == 0x03
        # commands on a queue that never connected get Command Sequence Error, and the connection lives
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(ic + capsule(sqe(0x06, 5, 0, cdw10=1, sgl_len=4096)) + capsule(sqe(0x02, 6, 1, sgl_len=512)))
        data = await asyncio.wait_for(r.readexactly(128 + 48), 5)
        for off in (128, 152):
            assert data[off] == 0x05 and (struct.unpack_from("<H", data, off + 22)[0] >> 1) == 0x400C
        w.close()
        # an I/O queue Connect for someone else's controller
        out = await raw(port, ic + capsule(connect_cmd(1, 1, 31), connect_data(NQN, cntlid=admin.cntlid,
                                                                                 hostnqn="nqn.x:other")), 1)
        assert out[128] == 0x05 and (struct.unpack_from("<H", out, 128 + 22)[0] >> 1) == 0x4182
        # random mutations of a good session
        rng = random.Random(7)
        good = ic + conn + capsule(sqe(0x7F, 2, 0x04, cdw11=0)) + capsule(sqe(0x06, 3, 0, cdw10=1, sgl_len=4096))
        mutants = []
        for _ in range(100):
            m = bytearray(good)
            for _ in range(rng.randint(1, 4)):
                m[rng.randrange(len(m))] = rng.randrange(256)
            mutants.append(bytes(m[:rng.randint(8, len(m))]))
        for i in range(0, len(mutants), 25):           # 25 bad hosts at a time beside the good one
            await asyncio.gather(*(raw(port, m, timeout=1.0) for m in mutants[i:i + 25]))
        stop.set()
        await traffic
        assert done > 5
        assert set(server.fabric.subsystems[NQN].controllers) == {admin.cntlid}
        await io.close()
        await admin.close()
    run(go, caplog)


def test_queue_depth_and_disconnect(caplog: pytest.LogCaptureFixture) -> None:
    async def go(server: NvmeTcpServer, port: int) -> None:
        admin, (io,) = await connect_controller(port, NQN, sqsize=3, io_queues=1)     # 4 entries
        # 4 commands outstanding are fine; the I/O queue keeps working
        results = await asyncio.gather(*(io.read(1, i, 1) for i in range(4)))
        assert all(st == 0 for st, _ in results)
        # Disconnect deletes the I/O queue: answered, then closed (NVMe-oF 1.1 §3.4)
        rsp, _ = await io.command(sqe(0x7F, 0, 0x08))
        assert rsp is not None and rsp.status == 0
        await asyncio.sleep(0.2)
        assert io._pump is not None and io._pump.done()
        ctrl = server.fabric.subsystems[NQN].controllers[admin.cntlid]
        assert ctrl.io_queues == set()
        # the QID can be connected again
        again = await Queue.open(port, NQN, qid=1, cntlid=admin.cntlid, sqsize=3)
        # a host that ignores SQSIZE: 6 commands in one burst on a 4-entry queue get a C2HTermReq
        burst = b"".join(capsule(sqe(0x02, 100 + i, 1, cdw10=i, sgl_len=512)) for i in range(6))
        again.w.write(burst)
        await asyncio.sleep(0.5)
        assert again.term is not None and again.term.u16(8) == 0x02
        await again.close()
        # the admin queue's association is still there
        rsp, _ = await admin.command(sqe(0x18, 0))
        assert rsp is not None and rsp.status == 0
        await admin.close()
    run(go, caplog)


def test_bursts_of_capsules_in_one_receive(caplog: pytest.LogCaptureFixture) -> None:
    """Several CapsuleCmds in one send (the target's capsule lane takes them straight from the receive),
    some cut across two sends, mixed with R2T writes, out-of-range reads and unsupported opcodes: every
    command gets its own answer, and what was written reads back."""
    async def go(server: NvmeTcpServer, port: int) -> None:
        admin, (io,) = await connect_controller(port, NQN, sqsize=63)
        loop = asyncio.get_running_loop()
        rng = random.Random(11)
        stored: dict[int, bytes] = {}       # LBA -> the 4 KiB written there in an earlier burst
        for _ in range(40):
            parts: list[bytes] = []
            expect: list[tuple[asyncio.Future[tuple[Any, bytes]], int, bytes | None]] = []
            written: dict[int, bytes] = {}
            for _ in range(rng.randint(2, 14)):
                cid = io.next_cid()
                kind = rng.choice(["write", "write", "read", "read", "r2t", "range", "opcode"])
                lba = rng.randrange(128) * 8
                want: bytes | None = None
                status = 0
                if kind == "read":
                    if not stored:
                        continue
                    lba = rng.choice(list(stored))
                    part = capsule(sqe(0x02, cid, 1, cdw10=lba, cdw12=7, sgl_len=4096))
                    want = stored[lba]
                elif kind in ("write", "r2t"):
                    if lba in written or lba in stored:
                        continue     # NVMe does not order commands in flight: one write per block a burst
                    data = rng.randbytes(4096)
                    cmd = sqe(0x01, cid, 1, cdw10=lba, cdw12=7, sgl_len=4096, in_capsule=kind == "write")
                    if kind == "r2t":
                        io.wdata[cid] = data
                        part = capsule(cmd)
                    else:
                        part = capsule(cmd, data)
                    written[lba] = data
                elif kind == "range":
                    part = capsule(sqe(0x02, cid, 1, cdw10=65535, cdw12=1, sgl_len=1024))
                    status = 0x80 | 0x4000        # LBA out of range, DNR
                else:
                    part = capsule(sqe(0x7E, cid, 1))
                    status = 0x01 | 0x4000        # invalid opcode, DNR
                fut: asyncio.Future[tuple[Any, bytes]] = loop.create_future()
                io.waiting[cid] = fut
                parts.append(part)
                expect.append((fut, status, want))
            if not parts:
                continue
            blob = b"".join(parts)
            # cut the burst across two sends, unless an R2T in it would put its H2CData inside the cut
            cut = rng.randrange(1, len(blob)) if rng.random() < 0.5 and not io.wdata else len(blob)
            io.w.write(blob[:cut])
            await io.w.drain()
            if cut < len(blob):
                await asyncio.sleep(0.001)
                io.w.write(blob[cut:])
            for fut, status, data in expect:
                rsp, got = await asyncio.wait_for(fut, 10)
                assert (rsp.status if rsp is not None else 0) == status
                if data is not None:
                    assert got == data
            stored.update(written)
        assert io.term is None
        await io.close()
        await admin.close()
    run(go, caplog)
