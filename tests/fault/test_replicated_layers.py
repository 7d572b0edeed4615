"""A replicated volume that is encrypted and compressed on each node (issue 16: both layers in every replica's
own stack, over a thin volume carved with 4 KiB clusters), on two real `vsan serve` processes and a real etcd.
The primary is killed with SIGKILL with writes acknowledged but not flushed; the other node takes over; the old
primary comes back and is resynced. Then, read offline through each node's own stack (its LUKS2 container
unlocked with the key file, its chunks decompressed), both replicas hold every acknowledged write, byte for
byte the same; each stores the half-compressible data in about half the space; and neither device file holds
the written data in clear. Each node formats its own container (its own volume key): what replication carries
between them is the plain data, above the layers (as DRBD over dm-crypt in LINSTOR's default stack)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Any

from replica_nodes import VOLUME, two_nodes, unflushed_then, write_through

from openvsan.block.file import FileDevice
from openvsan.node.specs import VolumeSpec
from openvsan.volume.registry import open_stack
from openvsan.volume.thin import VolumeGroup

BS = 4096                      # the volume's block: the LUKS2 sector (4096 unless asked)
MiB = 1 << 20
SIZE = "32MiB"


def half_compressible(tag: bytes, lba: int) -> bytes:
    """4 KiB as fio's buffer_compress_percentage=50 makes it: each 512 bytes, 256 random then 256 zeros."""
    out = b""
    for i in range(BS // 512):
        seed = hashlib.sha256(tag + lba.to_bytes(8, "little") + bytes([i])).digest()
        out += hashlib.shake_256(seed).digest(256) + bytes(256)
    return out


def spec(key: Path) -> VolumeSpec:
    return VolumeSpec(VOLUME, "d0", size=SIZE, compression="lz4", replicas=2, nodes=("a", "b"),
                      encryption={"key_file": key, "kdf": "pbkdf2", "kdf_iterations": 1000, "allow_discards": True})


async def plain_image(path: Path, key: Path) -> tuple[bytes, dict[str, Any], list[str]]:
    """The volume as a node's own stack reads it from its device file (thin volume, LUKS2, chunks), the
    compression's stats, and the layers it found."""
    dev = FileDevice(path)
    try:
        g = await VolumeGroup.open(dev)
        top = await open_stack(g.volume(VOLUME), spec(key).layers, name=VOLUME)
        data = bytes(await top.read(0, top.num_blocks))
        stats = top.stats()  # type: ignore[attr-defined]
        from openvsan.block.layer import stack_of

        kinds = [getattr(d, "type_name", type(d).__name__) for d in stack_of(top)]
        await g.close()
        return data, stats, kinds
    finally:
        await dev.close()


def test_an_encrypted_compressed_replicated_volume_keeps_every_write_through_a_failover(tmp_path: Path) -> None:
    key = tmp_path / "v1.key"
    key.write_bytes(os.urandom(32))
    crypt = f'encryption = {{ key_file = "{key}", kdf = "pbkdf2", kdf_iterations = 1000, allow_discards = true }}'
    with two_nodes(tmp_path, size="160MiB", carve=SIZE, device_lines=['cluster = "4KiB"'],
                   volume_lines=['compression = "lz4"', crypt]) as cluster:
        first = cluster.wait_primary()
        other = "b" if first == "a" else "a"
        expect: dict[int, bytes] = {}

        def wrote(tag: bytes, lbas: list[int]) -> None:
            expect.update({lba: half_compressible(tag, lba) for lba in lbas})

        async def put(url: str, tag: bytes, lbas: list[int]) -> None:
            await write_through(url, lbas, lambda lba: half_compressible(tag, lba), flush=True,
                                deadline=time.monotonic() + 30)

        # 8 MiB written and flushed through the primary, in 4 KiB writes
        one = list(range(8 * MiB // BS))
        asyncio.run(put(cluster[first].nvme_url, b"one", one))
        wrote(b"one", one)
        cluster.wait_in_sync()

        # more written, acknowledged, not flushed; then the primary is killed: the other node has it all
        two = list(range(8 * MiB // BS, 12 * MiB // BS, 4))
        asyncio.run(unflushed_then(cluster[first].nvme_url, two, lambda lba: half_compressible(b"two", lba),
                                   cluster[first].kill))
        wrote(b"two", two)
        three = list(range(0, 2 * MiB // BS, 2))     # overwrites of chunks the old primary holds
        asyncio.run(put(cluster[other].nvme_url, b"three", three))
        wrote(b"three", three)
        assert cluster.wait_primary() == other
        cluster[first].start()
        s = cluster.wait_in_sync()
        assert s["mirror"]["resync_bytes"] > 0, s
        cluster.stop_all()

    images = {n: asyncio.run(plain_image(cluster[n].image, key)) for n in ("a", "b")}
    (a, stats_a, kinds), (b, stats_b, _) = images["a"], images["b"]
    assert kinds[:2] == ["compress", "crypt"], kinds
    for lba, data in expect.items():
        assert a[lba * BS:lba * BS + len(data)] == data, f"acknowledged write at lba {lba} lost on a"
    assert a == b, "the replicas differ: first at byte " + str(next(i for i in range(len(a)) if a[i] != b[i]))
    for name, st in (("a", stats_a), ("b", stats_b)):
        assert st["chunks"] >= 12 * MiB // (64 << 10) and st["ratio"] >= 1.6, (name, st)
    for n in ("a", "b"):
        raw = cluster[n].image.read_bytes()
        for lba in (one[0], one[-1], two[0], three[-1]):
            assert expect[lba][:256] not in raw, f"{n}'s device holds the data at lba {lba} in clear"
