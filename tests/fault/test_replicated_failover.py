"""A replicated volume on two real `vsan serve` processes and a real etcd, on loopback: the primary is killed
with SIGKILL while a writer runs; the other node takes over, I/O resumes on its path; the old primary comes
back, gets only the regions it missed, and the two replica files end byte for byte identical.

The client is our own NVMe/TCP initiator, one connection per node (each node's path); the secondary's path
refuses I/O with ANA inaccessible (NVMe path status), the primary's serves it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from history import check_identical
from replica_nodes import CLUSTER_ID, two_nodes

from openvsan.cluster import membership as M
from openvsan.cluster.etcd import EtcdStateStore
from openvsan.initiator.nvme_tcp import AnaPathError, NvmeOptions, NvmeTcpInitiator
from openvsan.node.replicas import ETCD_PREFIX
from openvsan.protocol.nvme.auth import format_secret
from openvsan.replication.peer import PeerFenced, connect_peer, replica_nqn, replication_keys

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
    with two_nodes(tmp_path, size="16MiB") as cluster:
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
    a, b = (cluster[n].image.read_bytes() for n in ("a", "b"))
    assert len(a) == len(b) == os.path.getsize(cluster["a"].image)
    assert a == b, "the two replicas differ after resync: first at byte " + str(
        next(i for i in range(len(a)) if a[i] != b[i]))


def test_resync_sends_only_what_a_downed_secondary_missed(tmp_path: Path) -> None:
    """A secondary down for 30 s while 5 % of a 1 GiB volume is rewritten (51 of its 1,024 regions, each by
    random 4 KiB writes): its resync sends at most 1.1 x those regions, far from a full copy."""
    with two_nodes(tmp_path, size="1GiB") as cluster:
        p = cluster.wait_primary()
        s = "b" if p == "a" else "a"
        cluster.wait_in_sync()
        cluster[s].kill()
        down = time.monotonic()
        rng = random.Random(7)
        regions = rng.sample(range(1024), 51)

        async def rewrite() -> None:
            dev = await open_url(cluster[p].nvme_url)
            try:
                for r in regions:
                    for _ in range(16):
                        lba = r * (REGION // BS) + rng.randrange(REGION // 4096) * 8
                        await dev.write(lba, block(b"new", lba))
                await dev.flush()
            finally:
                await dev.close()

        asyncio.run(rewrite())
        time.sleep(max(0.0, 30 - (time.monotonic() - down)))
        cluster[s].start()
        st = cluster.wait_in_sync(timeout=120)
        sent, dirty = st["mirror"]["resync_bytes"], len(regions) * REGION
        print(f"resync after 30 s down: {sent} bytes sent for {dirty} bytes of dirty regions "
              f"({sent / dirty:.2f}x; the volume is {1 << 30} bytes)")
        assert dirty <= sent <= 1.1 * dirty, (sent, dirty)
    same = check_identical({n: cluster[n].image for n in ("a", "b")})
    assert same.ok, str(same)


def test_strangers_stale_epochs_and_other_clusters_are_refused(tmp_path: Path) -> None:
    with two_nodes(tmp_path, size="16MiB") as cluster:
        p = cluster.wait_primary()
        s = "b" if p == "a" else "a"
        node = cluster[s]           # the secondary's replica, which the primary holds
        before = node.status()
        assert before is not None

        async def attempts() -> None:
            # a host that is not one of the volume's nodes cannot connect to the replica at all
            with pytest.raises(Exception, match="(?i)refused|not allowed|connect"):
                dev = NvmeTcpInitiator("127.0.0.1", node.repl_port, replica_nqn("v1"), 1,
                                       NvmeOptions(hostnqn="nqn.2014-08.org.example:stranger",
                                                   reconnect_timeout=0.0, connect_timeout=3.0))
                await dev.open()
            # a host that claims a node's NQN without the cluster's keys: refused at authentication
            with pytest.raises(Exception, match="asks for DH-HMAC-CHAP authentication"):
                await connect_peer("127.0.0.1", node.repl_port, "v1", p, 10**9,
                                   opts=NvmeOptions(reconnect_timeout=0.0, connect_timeout=3.0))
            # the primary itself (its NQN and the keys, read from the cluster's store) with an old epoch:
            # refused by the fence, and counted
            store = EtcdStateStore(cluster.etcd, prefix=ETCD_PREFIX)
            try:
                host_key, ctrl_key = replication_keys(await M.secret(store, CLUSTER_ID))
            finally:
                await store.close()
            with pytest.raises(PeerFenced):
                await connect_peer("127.0.0.1", node.repl_port, "v1", p, 1,
                                   opts=NvmeOptions(reconnect_timeout=0.0, connect_timeout=3.0,
                                                    dhchap_secret=format_secret(host_key),
                                                    dhchap_ctrl_secret=format_secret(ctrl_key)))

        asyncio.run(attempts())
        after = node.status()
        assert after is not None and after["fence"]["refused"] > before["fence"]["refused"], after
        # a node of another cluster does not start (one line, exit status not 0)
        other = cluster["a"].config.read_text().replace('id = "ctest"', 'id = "other"')
        bad = tmp_path / "other.toml"
        bad.write_text(other.replace(str(cluster["a"].data_dir), str(tmp_path / "other-data")))
        r = subprocess.run([sys.executable, "-m", "openvsan.cli.main", "serve", "--config", str(bad)],
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode != 0 and "holds openvsan cluster 'ctest', not 'other'" in r.stderr, r.stderr


def test_a_wiped_replica_is_copied_in_full(tmp_path: Path) -> None:
    """A secondary whose data dir and device are lost (a replaced server) comes back empty: it declares itself
    out of sync, is never elected meanwhile, and gets every region; the replicas end identical."""
    with two_nodes(tmp_path, size="8MiB") as cluster:
        p = cluster.wait_primary()
        s = "b" if p == "a" else "a"

        async def fill() -> None:
            dev = await open_url(cluster[p].nvme_url)
            try:
                for i in range(0, 16384, 512):
                    await dev.write(i, block(b"full", i))
                await dev.flush()
            finally:
                await dev.close()

        asyncio.run(fill())
        # a resync may have run already (b connected after the fill began): only what follows counts
        before = cluster.wait_in_sync()["mirror"]["resync_bytes"]
        cluster[s].kill()
        shutil.rmtree(cluster[s].data_dir)
        cluster[s].image.unlink()
        cluster[s].start()
        st = cluster.wait_in_sync(timeout=120)
        assert st["mirror"]["resync_bytes"] - before == 8 << 20, (before, st["mirror"])
    same = check_identical({n: cluster[n].image for n in ("a", "b")})
    assert same.ok, str(same)


def test_persistent_reservations_are_the_volumes_on_every_node(tmp_path: Path) -> None:
    """SCSI PR taken through the secondary's (standby) path is enforced by the primary at once, reported by
    both, and still enforced by the other node after the primary is killed (SPC-4 5.13: the logical unit's
    reservations, whichever port)."""
    from openvsan.initiator.iscsi import IscsiInitiator

    def pr_out(sa: int, key: int, sa_key: int, rtype: int = 0) -> tuple[bytes, bytes]:
        cdb = bytes((0x5F, sa, rtype)) + b"\0\0" + (24).to_bytes(4, "big") + b"\0"
        return cdb, key.to_bytes(8, "big") + sa_key.to_bytes(8, "big") + bytes(8)

    read_keys = bytes((0x5E, 0)) + bytes(5) + (512).to_bytes(2, "big") + b"\0"
    write10 = bytes((0x2A, 0)) + (64).to_bytes(4, "big") + b"\0" + (1).to_bytes(2, "big") + b"\0"

    with two_nodes(tmp_path, size="8MiB") as cluster:
        p = cluster.wait_primary()
        s = "b" if p == "a" else "a"

        async def take() -> None:
            x = await IscsiInitiator.open_url(cluster[s].iscsi_url + "?initiator=iqn.2026-12.test:x")
            y = await IscsiInitiator.open_url(cluster[p].iscsi_url + "?initiator=iqn.2026-12.test:y")
            try:
                for sa, key, sa_key, rtype in ((0, 0, 0xA1, 0), (1, 0xA1, 0, 1)):   # REGISTER, RESERVE WE
                    cdb, params = pr_out(sa, key, sa_key, rtype)
                    done = await x.execute(cdb, data=params)
                    assert done.status == 0, (sa, done.status, done.sense.hex())
                done = await y.execute(write10, data=bytes(BS))
                assert done.status == 0x18, f"write of another initiator under X's reservation: {done.status}"
                keys = await y.execute(read_keys, read_len=512)
                assert bytes(keys.data)[8:16] == (0xA1).to_bytes(8, "big"), bytes(keys.data).hex()
            finally:
                await x.close()
                await y.close()

        asyncio.run(take())
        cluster[p].kill()
        cluster.wait_primary(not_=p)

        async def after() -> None:
            y = await IscsiInitiator.open_url(cluster[s].iscsi_url + "?initiator=iqn.2026-12.test:y")
            try:
                done = await y.execute(write10, data=bytes(BS))
                assert done.status == 0x18, f"the new primary forgot the reservation: status {done.status}"
            finally:
                await y.close()

        asyncio.run(after())


def test_nvme_reservations_move_with_the_primary(tmp_path: Path) -> None:
    """An NVMe reservation taken through the primary holds on the next primary after a kill -9: the other
    host's writes get Reservation Conflict there, the holder's go through (Base 2.0 §8.19)."""
    from openvsan.initiator.nvme_tcp import NvmeCommandError

    def host(name: str) -> NvmeOptions:
        return NvmeOptions(hostnqn=f"nqn.2026-12.org.openvsan.test:{name}", command_timeout=3.0,
                           reconnect_timeout=0.0, connect_timeout=3.0)

    async def open_as(url: str, name: str) -> NvmeTcpInitiator:
        dev = await NvmeTcpInitiator.open_url(url, hostnqn=host(name).hostnqn, command_timeout=3.0,
                                              reconnect_timeout=0.0, connect_timeout=3.0)
        return dev

    with two_nodes(tmp_path, size="8MiB") as cluster:
        p = cluster.wait_primary()
        s = "b" if p == "a" else "a"

        async def take() -> None:
            x, y = await open_as(cluster[p].nvme_url, "x"), await open_as(cluster[p].nvme_url, "y")
            try:
                await x.reservation_register(0xB1)
                await x.reservation_acquire(0xB1, 1)              # Write Exclusive
                with pytest.raises(NvmeCommandError) as e:
                    await y.write(64, bytes(BS))
                assert e.value.status & 0xFF == 0x83, hex(e.value.status)
            finally:
                await x.close()
                await y.close()

        asyncio.run(take())
        cluster[p].kill()
        cluster.wait_primary(not_=p)

        async def after() -> None:
            x, y = await open_as(cluster[s].nvme_url, "x"), await open_as(cluster[s].nvme_url, "y")
            try:
                with pytest.raises(NvmeCommandError) as e:
                    await y.write(64, bytes(BS))
                assert e.value.status & 0xFF == 0x83, f"the new primary forgot the reservation: {e.value}"
                await x.write(64, bytes(BS))                       # the holder writes
            finally:
                await x.close()
                await y.close()

        asyncio.run(after())


def test_a_ram_replica_that_restarts_is_copied_in_full(tmp_path: Path) -> None:
    """A RAM replica comes back empty from a restart even though its node's state is intact: it must not count
    as in sync (else, the primary lost next, an empty replica would be elected)."""
    with two_nodes(tmp_path, size="4MiB", ram=True) as cluster:
        p = cluster.wait_primary()
        s = "b" if p == "a" else "a"

        async def fill(url: str) -> None:
            dev = await open_url(url)
            try:
                await dev.write(0, block(b"ram", 0))
                await dev.flush()
            finally:
                await dev.close()

        asyncio.run(fill(cluster[p].nvme_url))
        before = cluster.wait_in_sync()["mirror"]["resync_bytes"]
        cluster[s].stop()                       # a clean stop: no write missed, but its RAM is gone
        cluster[s].start()
        st = cluster.wait_in_sync(timeout=60)
        assert st["mirror"]["resync_bytes"] - before == 4 << 20, (before, st["mirror"])
        cluster[p].kill()                       # now the restarted one serves what was written
        cluster.wait_primary(not_=p)

        async def read() -> bytes:
            dev = await open_url(cluster[s].nvme_url)
            try:
                return bytes(await dev.read(0, BLOCKS_PER_WRITE))
            finally:
                await dev.close()

        assert asyncio.run(read()) == block(b"ram", 0)


def test_move_primary_hands_over_without_losing_a_write(tmp_path: Path) -> None:
    """`vsan volume move-primary` on the primary: it drains and steps down, the other node is elected at once
    (no lease to wait out), and what was written reads back from it. On a secondary it is refused."""
    with two_nodes(tmp_path, size="4MiB") as cluster:
        p = cluster.wait_primary()
        s = "b" if p == "a" else "a"

        async def write(url: str, tag: bytes) -> None:
            dev = await open_url(url)
            try:
                await dev.write(8, block(tag, 8))
                await dev.flush()
            finally:
                await dev.close()

        asyncio.run(write(cluster[p].nvme_url, b"before"))
        refused = subprocess.run([sys.executable, "-m", "openvsan.cli.main", "volume", "move-primary", "v1",
                                  "--data-dir", str(cluster[s].data_dir)], capture_output=True, text=True,
                                 timeout=60, check=False)
        assert refused.returncode == 2 and "is not its primary" in refused.stderr, refused.stderr
        started = time.monotonic()
        moved = subprocess.run([sys.executable, "-m", "openvsan.cli.main", "volume", "move-primary", "v1",
                                "--data-dir", str(cluster[p].data_dir)], capture_output=True, text=True,
                               timeout=60, check=False)
        assert moved.returncode == 0, moved.stderr
        assert cluster.wait_primary(not_=p, timeout=20) == s
        print(f"move-primary: {s} primary {time.monotonic() - started:.2f} s after the command")

        async def read(url: str) -> bytes:
            dev = await open_url(url)
            try:
                return bytes(await dev.read(8, BLOCKS_PER_WRITE))
            finally:
                await dev.close()

        assert asyncio.run(read(cluster[s].nvme_url)) == block(b"before", 8)
        asyncio.run(write(cluster[s].nvme_url, b"after"))
