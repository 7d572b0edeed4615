"""A replicated volume carved thin from each node's device (volume/thin under the mirror), on two real
`vsan serve` processes and a real etcd: each node is killed with SIGKILL in turn, with writes acknowledged but
not flushed in flight (a thin volume's mappings commit at a flush, so a killed replica loses them), and in
the end both replicas hold every acknowledged write, byte for byte the same, and stay thin.

- The secondary is killed and restarted with no write in between: the primary's link to it drops and comes
  back, and what it had not flushed is copied again (mirror.peer_reconnected), so its lost mappings never
  make it differ.
- The primary is killed: the other node, which has every write, takes over; the old primary comes back with
  its activity log's regions published, and gets them copied."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

from replica_nodes import VOLUME, two_nodes, unflushed_then, write_through

from openvsan.block.file import FileDevice
from openvsan.volume.thin import VolumeGroup

BS = 512
W = 8                          # blocks per write (4 KiB)
MiB = 1 << 20
VOLUME_SIZE = 16 * MiB


def block(tag: bytes, lba: int) -> bytes:
    return hashlib.sha256(tag + lba.to_bytes(8, "little")).digest() * (BS * W // 32)


async def volume_image(path: Path) -> tuple[bytes, int]:
    """The replicated volume's contents in a node's device file (opened as the node would), and its mapped
    bytes."""
    dev = FileDevice(path)
    try:
        g = await VolumeGroup.open(dev)
        lv = g.volume(VOLUME)
        data = bytes(await lv.read(0, VOLUME_SIZE // BS))
        mapped = g.info(VOLUME)["mapped"]
        await g.close()
        return data, mapped
    finally:
        await dev.close()


def test_a_thin_replicated_volume_keeps_every_write_when_either_node_is_killed(tmp_path: Path) -> None:
    with two_nodes(tmp_path, size="64MiB", carve="16MiB") as cluster:
        first = cluster.wait_primary()
        other = "b" if first == "a" else "a"
        expect: dict[int, bytes] = {}

        def wrote(tag: bytes, lbas: list[int]) -> None:
            expect.update({lba: block(tag, lba) for lba in lbas})

        # regions 0-1 written and flushed; region 2 written, acknowledged, not flushed
        one = [i * 256 for i in range(16)]
        two = [4096 + i * 256 for i in range(8)]
        asyncio.run(write_through(cluster[first].nvme_url, one, lambda lba: block(b"one", lba), flush=True,
                                  deadline=time.monotonic() + 30))
        wrote(b"one", one)
        sent_before = cluster[first].status()["mirror"]["resync_bytes"]  # type: ignore[index]

        def secondary_killed_and_back() -> dict[str, Any]:
            # no write in between: region 2 is copied to it again
            cluster[other].kill()
            cluster[other].start()
            return cluster.wait_in_sync()

        s = asyncio.run(unflushed_then(cluster[first].nvme_url, two, lambda lba: block(b"two", lba),
                                      secondary_killed_and_back))
        wrote(b"two", two)
        assert s["role"] == "primary" and s["mirror"]["resync_bytes"] > sent_before, s

        # region 3 written, not flushed; then the primary is killed: the other one has it all
        three = [6144 + i * 256 for i in range(8)]

        asyncio.run(unflushed_then(cluster[first].nvme_url, three, lambda lba: block(b"three", lba),
                                   cluster[first].kill))
        wrote(b"three", three)
        four = [100, 3000]
        asyncio.run(write_through(cluster[other].nvme_url, four, lambda lba: block(b"four", lba), flush=True,
                                  deadline=time.monotonic() + 30))
        wrote(b"four", four)
        assert cluster.wait_primary() == other
        cluster[first].start()
        cluster.wait_in_sync()
        cluster.stop_all()

        images = {n: asyncio.run(volume_image(cluster[n].image)) for n in ("a", "b")}
    (a, mapped_a), (b, mapped_b) = images["a"], images["b"]
    for lba, data in expect.items():
        got = a[lba * BS:lba * BS + len(data)]
        assert got == data, f"acknowledged write at lba {lba} lost on a"
    assert a == b, "the replicas differ: first at byte " + str(next(i for i in range(len(a)) if a[i] != b[i]))
    # thin on both: the written clusters (at most 4 MiB: regions 0-3), not the volume's 16 MiB
    assert 0 < mapped_a <= 4 * MiB and 0 < mapped_b <= 4 * MiB, (mapped_a, mapped_b)
