"""The NBD client initiator (initiator/nbd.py) against our NbdServer in process over loopback, and
vsan bench over it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from openvsan.bench.engine import Plan, Worker
from openvsan.bench.profiles import custom_job
from openvsan.block import FaultDevice, RamDevice
from openvsan.block.errors import DeviceFailed, MediumError, OutOfRange, ReadOnly
from openvsan.frontend.config import NbdExportConfig
from openvsan.frontend.nbd import NbdServer
from openvsan.initiator import open_url
from openvsan.initiator.nbd import NbdInitiator
from openvsan.volume import Volume


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def serving(dev: FaultDevice, *, read_only: bool = False) -> AsyncIterator[int]:
    port = free_port()
    server = NbdServer([NbdExportConfig("disk0", Volume(dev, name="disk0"), [("127.0.0.1", port)], read_only=read_only)])
    await server.start()
    try:
        yield port
    finally:
        await server.stop()


def test_every_command_and_the_errors() -> None:
    async def main() -> None:
        dev = FaultDevice(RamDevice(8192, 4096))  # 32 MiB, 4 KiB blocks
        async with serving(dev) as port:
            nbd = await open_url(f"nbd://127.0.0.1:{port}/disk0")
            assert isinstance(nbd, NbdInitiator)
            try:
                assert (nbd.block_size, nbd.num_blocks) == (4096, 8192)
                await nbd.write(5, b"\xab" * 8192, fua=True)
                assert bytes(await nbd.read(5, 2)) == b"\xab" * 8192
                big = bytes(range(256)) * (32 << 12)  # the whole 32 MiB device, split at the max payload
                await nbd.write(0, big[: 8192 * 4096])
                assert bytes(await nbd.read(0, 8192)) == big[: 8192 * 4096]
                await nbd.flush()
                await nbd.write_zeroes(5, 2)
                assert bytes(await nbd.read(5, 2)) == bytes(8192)
                await nbd.unmap(0, 4)
                assert bytes(await nbd.read(0, 4)) == bytes(4 * 4096)
                dev.fail_reads(100)
                with pytest.raises(MediumError):
                    await nbd.read(99, 4)
                with pytest.raises(OutOfRange):
                    await nbd.read(8191, 2)
                # the connection survives errors: 32 reads in flight at once still come back right
                await nbd.write(200, b"".join(bytes([i]) * 4096 for i in range(32)))
                got = await asyncio.gather(*(nbd.read(200 + i, 1) for i in range(32)))
                assert [bytes(g)[0] for g in got] == list(range(32))
            finally:
                await nbd.close()
            with pytest.raises(DeviceFailed, match="UNKNOWN"):
                await open_url(f"nbd://127.0.0.1:{port}/nosuch")
        async with serving(FaultDevice(RamDevice(64)), read_only=True) as port:
            ro = await open_url(f"nbd://127.0.0.1:{port}/disk0")
            with pytest.raises(ReadOnly):
                await ro.write(0, bytes(512))
            await ro.close()

    asyncio.run(main())


def test_multi_conn_and_bench_verify_through_nbd() -> None:
    async def main() -> None:
        dev = FaultDevice(RamDevice(4096))  # 2 MiB
        async with serving(dev) as port:
            url = f"nbd://127.0.0.1:{port}/disk0?connections=3"
            nbd = await open_url(url)
            assert isinstance(nbd, NbdInitiator) and len(nbd.conns) == 3  # our server sets CAN_MULTI_CONN
            try:
                plan = Plan(url, custom_job("randrw", "4k", qd=8, mix=50), duration=0.3, verify=True,
                            precondition=True)
                res = await Worker(nbd, plan).run()
                assert res.mismatches == 0 and res.read.count > 0 and res.write.count > 0
                await dev.corrupt(1000, bit=4000)
                plan = Plan(url, custom_job("read", "64k", qd=4), duration=0.3, verify=True)
                res = await Worker(nbd, plan).run()
                assert [p["lba"] for p in res.problems] == [1000]
            finally:
                await nbd.close()

    asyncio.run(main())
