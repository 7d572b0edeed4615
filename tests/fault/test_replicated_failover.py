"""A replicated volume on two real `vsan serve` processes and a real etcd, on loopback: the primary is killed
with SIGKILL while a writer runs; the other node takes over, I/O resumes on its path; the old primary comes
back, gets only the regions it missed, and the two replica files end byte for byte identical.

The client is our own NVMe/TCP initiator, one connection per node (each node's path); the secondary's path
refuses I/O with ANA inaccessible (NVMe path status), the primary's serves it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path

import pytest
from etcd_cluster import EtcdCluster
from replica_nodes import ReplicaCluster

from openvsan.initiator.nvme_tcp import AnaPathError, NvmeTcpInitiator

BS = 512
REGION = 1 << 20
BLOCKS_PER_WRITE = 8


def block(tag: bytes, lba: int) -> bytes:
    return hashlib.sha256(tag + lba.to_bytes(8, "little")).digest() * (BS * BLOCKS_PER_WRITE // 32)


async def open_url(url: str) -> NvmeTcpInitiator:
    """One path, without the initiator's own reconnects (this test picks the path)."""
    return await NvmeTcpInitiator.open_url(url, command_timeout=3.0, reconnect_timeout=0.0, connect_timeout=3.0)


async def write_until_ok(urls: list[str], lba: int, data: bytes, deadline: float) -> tuple[int, float]:
    """Write through whichever path takes it (as a multipath host would), until `deadline`; returns the path
    index that took it and when."""
    errors: list[str] = []
    while time.monotonic() < deadline:
        for i, url in enumerate(urls):
            try:
                dev = await asyncio.wait_for(open_url(url), 5)
            except Exception as e:  # noqa: BLE001 - that node is down: the other path
                errors.append(f"{url}: {e}")
                continue
            try:
                await dev.write(lba, data)
                await dev.flush()
                return i, time.monotonic()
            except AnaPathError as e:
                errors.append(f"{url}: {e}")
            except Exception as e:  # noqa: BLE001
                errors.append(f"{url}: {e}")
            finally:
                await dev.close()
        await asyncio.sleep(0.2)
    raise AssertionError("no path took the write: " + "; ".join(errors[-4:]))


def test_primary_killed_then_back(tmp_path: Path) -> None:
    with EtcdCluster(tmp_path / "etcd", ["e1"]) as etcd:
        etcd.start()
        cluster = ReplicaCluster(tmp_path, etcd.endpoints, ["a", "b"], size="16MiB")
        try:
            cluster.start_all()
            first = cluster.wait_primary()
            other = "b" if first == "a" else "a"
            urls = {n: cluster[n].nvme_url for n in ("a", "b")}

            async def phase1() -> None:
                # the secondary's path refuses I/O with the ANA path status
                dev = await open_url(urls[other])
                try:
                    with pytest.raises(AnaPathError):
                        await dev.write(0, block(b"x", 0))
                finally:
                    await dev.close()
                dev = await open_url(urls[first])
                try:
                    for i in range(64):
                        await dev.write(i * 97, block(b"one", i * 97))
                    await dev.flush()
                finally:
                    await dev.close()

            asyncio.run(phase1())
            cluster.wait_in_sync()
            cluster[first].kill()
            killed = time.monotonic()

            async def phase2() -> float:
                _path, at = await write_until_ok([urls[other]], 5000, block(b"two", 5000), killed + 30)
                dev = await open_url(urls[other])
                try:
                    # 5 regions of 16 rewritten while the old primary is down
                    for r in range(5):
                        for k in range(4):
                            lba = r * (REGION // BS) + k * 64
                            await dev.write(lba, block(b"three", lba))
                    await dev.flush()
                finally:
                    await dev.close()
                return at - killed

            resumed = asyncio.run(phase2())
            assert resumed <= 10.0, f"I/O resumed {resumed:.1f} s after the primary was killed (want <= 10 s)"
            s = cluster[other].status()
            assert s is not None and s["role"] == "primary"
            assert first in s["out_of_sync"], s
            cluster[first].start()
            s = cluster.wait_in_sync()
            dirty_bytes = 5 * REGION        # regions 0-4 (lba 5000 lies in region 2)
            sent = s["mirror"]["resync_bytes"]
            print(f"failover: I/O resumed {resumed:.2f} s after SIGKILL of the primary; resync sent {sent} bytes "
                  f"for {dirty_bytes} bytes of dirty regions")
            assert 0 < sent <= 1.1 * dirty_bytes, f"resync sent {sent} bytes for at most {dirty_bytes} dirty"

            async def read_back() -> None:
                dev = await open_url(urls[other])
                try:
                    for r in range(5):
                        for k in range(4):
                            lba = r * (REGION // BS) + k * 64
                            assert bytes(await dev.read(lba, BLOCKS_PER_WRITE)) == block(b"three", lba)
                    for i in range(64):
                        lba = i * 97
                        got = bytes(await dev.read(lba, BLOCKS_PER_WRITE))
                        newer = [x for x in range(5) for k in range(4)
                                 if x * (REGION // BS) + k * 64 < lba + BLOCKS_PER_WRITE
                                 and lba < x * (REGION // BS) + k * 64 + BLOCKS_PER_WRITE]
                        if not newer:
                            assert got == block(b"one", lba), f"acknowledged write at {lba} lost"
                finally:
                    await dev.close()

            asyncio.run(read_back())
        finally:
            cluster.stop_all()
            cluster.close()
        a, b = (cluster[n].image.read_bytes() for n in ("a", "b"))
        assert len(a) == len(b) == os.path.getsize(cluster["a"].image)
        assert a == b, "the two replicas differ after resync: first at byte " + str(
            next(i for i in range(len(a)) if a[i] != b[i]))
