"""Our userspace NVMe/TCP host (openvsan.initiator.nvme_tcp) against `vsan serve`'s NVMe/TCP target.

Discovery, Identify, data round trips at two block sizes with several queue counts, depths and digests,
keep-alive expiry (the host goes quiet, the controller is dropped, the host builds a new association), a
connection cut mid-I/O, the same volume through iSCSI and NVMe/TCP, and ext4 over `vsan initiator attach`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_initiator_fuse import ext4_over_attach
from test_initiator_iscsi import roundtrip
from vsan_harness import IQN, VsanServer

from openvsan.block.errors import DeviceFailed, OutOfRange
from openvsan.initiator.iscsi import IscsiInitiator
from openvsan.initiator.nvme_tcp import NvmeTcpInitiator, discover

pytestmark = pytest.mark.interop

NQN = "nqn.2026-11.org.openvsan:disk0"
MiB = 1 << 20


def with_nvme(vsan: Callable[..., VsanServer], *args: object, **kw: object) -> VsanServer:
    """A vsan serve whose volume is also namespace 1 of NQN on its own NVMe/TCP portal."""
    server = vsan(*args, start=False, **kw)
    with open(server.config, "a") as f:
        f.write(f'\n[nvme]\nportals = ["127.0.0.1:{server.nvme_port}"]\n\n[[nvme.subsystems]]\n'
                f'nqn = "{NQN}"\nnamespaces = [{{ nsid = 1, volume = "disk0" }}]\n')
    server.start()
    return server


def nvme_url(server: VsanServer, query: str = "") -> str:
    return f"nvme+tcp://127.0.0.1:{server.nvme_port}/{NQN}/1" + (f"?{query}" if query else "")


@pytest.mark.parametrize(("block_size", "query", "concurrency"), [
    (512, "", 1),
    (512, "queues=2&queue_depth=16&hdgst=1&ddgst=1", 16),
    (4096, "queues=3&queue_depth=4", 12),
    (4096, "queue_depth=128", 32),
])
def test_roundtrip(vsan: Callable[..., VsanServer], block_size: int, query: str, concurrency: int) -> None:
    server = with_nvme(vsan, "ram", "64MiB", block_size=block_size)

    async def main() -> None:
        found = await discover(f"nvme+tcp://127.0.0.1:{server.nvme_port}")
        assert found == [(NQN, [f"127.0.0.1:{server.nvme_port}"])]
        dev = await NvmeTcpInitiator.open_url(nvme_url(server, query))
        try:
            assert (dev.block_size, dev.num_blocks) == (block_size, (64 << 20) // block_size)
            assert any(line.startswith("namespace:  1:") for line in dev.describe())
            await roundtrip(dev, block_size, concurrency)  # type: ignore[arg-type]
            await dev.write(10, os.urandom(20 * block_size))
            await dev.unmap(10, 5)
            await dev.write_zeroes(15, 5)
            assert bytes(await dev.read(15, 5)) == bytes(5 * block_size)
            with pytest.raises(OutOfRange):
                await dev.read(dev.num_blocks - 1, 2)
        finally:
            await dev.close()

    asyncio.run(main())


def test_keep_alive_expiry_then_reconnect(vsan: Callable[..., VsanServer]) -> None:
    """KATO 1 s and no Keep Alive: the controller drops the association; the next I/O builds a new one."""
    server = with_nvme(vsan)

    async def main() -> None:
        dev = await NvmeTcpInitiator.open_url(nvme_url(server, "kato=1"))
        try:
            await dev.write(0, b"\xa5" * 512)
            # with keep-alives flowing, the association outlives several KATOs
            await asyncio.sleep(2.5)
            assert dev.assoc is not None and not dev.assoc.dead and dev.reconnects == 0
            dev.assoc.keep_alive_paused = True
            old = dev.assoc
            deadline = time.monotonic() + 10
            while not old.dead:
                assert time.monotonic() < deadline, "controller kept a silent host past KATO"
                await asyncio.sleep(0.1)
            assert bytes(await dev.read(0, 1)) == b"\xa5" * 512
            assert dev.reconnects == 1 and dev.assoc is not old
        finally:
            await dev.close()

    asyncio.run(main())
    assert "keep-alive" in server.log_text().lower()


def test_connection_cut_mid_io_then_reconnect(vsan: Callable[..., VsanServer]) -> None:
    server = with_nvme(vsan)

    async def main() -> None:
        dev = await NvmeTcpInitiator.open_url(nvme_url(server, "queues=2&queue_depth=16"))
        try:
            blobs = {i * 512: os.urandom(256 * 512) for i in range(48)}
            writes = asyncio.gather(*(dev.write(a, d) for a, d in blobs.items()))
            for _ in range(10000):
                if dev.assoc is not None and all(q.cmds for q in dev.assoc.queues):
                    break
                await asyncio.sleep(0.0005)
            dev.cut_connections()
            await writes
            assert dev.reconnects >= 1
            got = await asyncio.gather(*(dev.read(a, 256) for a in blobs))
            for (a, d), g in zip(blobs.items(), got):
                assert bytes(g) == d, f"LBA {a} differs after the reconnect"
        finally:
            await dev.close()

    asyncio.run(main())


def test_no_reconnect_when_told(vsan: Callable[..., VsanServer]) -> None:
    """reconnect=False (the replication path's peer links): a cut connection is not connected again; every
    later command fails, and `lost` says so (the link then takes the replica again itself)."""
    server = with_nvme(vsan)

    async def main() -> None:
        dev = await NvmeTcpInitiator.open_url(nvme_url(server), reconnect=False, command_timeout=3.0)
        try:
            await dev.write(0, b"\x5a" * 512)
            assert not dev.lost
            dev.cut_connections()
            with pytest.raises(DeviceFailed, match="does not reconnect"):
                await dev.read(0, 1)
            assert dev.lost and dev.reconnects == 0
        finally:
            await dev.close()

    asyncio.run(main())


def test_same_volume_over_iscsi_and_nvme(vsan: Callable[..., VsanServer]) -> None:
    server = with_nvme(vsan)

    async def main() -> None:
        isc = await IscsiInitiator.open_url(f"iscsi://127.0.0.1:{server.port}/{IQN}/0")
        nv = await NvmeTcpInitiator.open_url(nvme_url(server))
        try:
            a, b = os.urandom(64 * 1024), os.urandom(64 * 1024)
            await isc.write(1000, a, fua=True)
            assert bytes(await nv.read(1000, 128)) == a
            await nv.write(2000, b, fua=True)
            assert bytes(await isc.read(2000, 128)) == b
        finally:
            await isc.close()
            await nv.close()

    asyncio.run(main())


def test_unknown_subsystem_fails_fast(vsan: Callable[..., VsanServer]) -> None:
    server = with_nvme(vsan)

    async def main() -> None:
        t0 = time.monotonic()
        with pytest.raises(DeviceFailed, match="Connect failed"):
            await NvmeTcpInitiator.open_url(f"nvme+tcp://127.0.0.1:{server.nvme_port}/nqn.2026-11.x:nope/1")
        with pytest.raises(DeviceFailed, match="not active"):
            await NvmeTcpInitiator.open_url(f"nvme+tcp://127.0.0.1:{server.nvme_port}/{NQN}/7")
        assert time.monotonic() - t0 < 10

    asyncio.run(main())


def test_nvme_attach_ext4(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    server = with_nvme(vsan, "file", "128MiB")
    ext4_over_attach(nvme_url(server, "queue_depth=16"), 128 * MiB, tmp_path, server.restart)
