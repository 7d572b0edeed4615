"""The compression layer (volume/compress.py) over a thin volume (volume/thin):

- its chunk versions' headers: round trip, and every way a header can be wrong is not taken as one;
- random workloads against a model (writes of random compressibility and size, overwrites, unmaps,
  write_zeroes, flushes, FUA writes): reads equal the model's, after a reopen too, and a volume trimmed whole
  gives every cluster back to its group;
- power cuts at every write the stack makes (the thin group's and the layer's: data, unmaps, journal), with a
  random part of the volatile cache written back: after the cut the group and the layer open with no repair,
  every block holds what the last durable point (a completed flush, a FUA write) left there or a value
  written to exactly that block since, never another block's or a torn one; every third cut the power goes
  again while the layer recovers; every fifth, the volume works on and gives all its space back.

Every block written carries (write number, lba) and a filler that is random (incompressible), zeros or a
pattern, chosen by the write number, so the checker knows where any block it reads came from. Seeds are
fixed: a failure names its seed and cut and reruns the same; COMPRESS_CRASH_SEEDS=N runs N more (-m soak)."""

from __future__ import annotations

import asyncio
import os
import random
import struct
from typing import Any

import pytest
from power_cut import PowerCut

from openvsan.block import RamDevice
from openvsan.block.device import BlockDevice
from openvsan.block.errors import BlockError, MediumError, NoSpace
from openvsan.volume import compress as C
from openvsan.volume.compress import CompressError, CompressLayer, open_compress
from openvsan.volume.thin import VolumeGroup

BS = 512
CS = 4096                 # the thin group's clusters
CHUNK = 16 << 10
CB = CHUNK // BS          # blocks per chunk
CHUNKS = 6
BLOCKS = CHUNKS * CB
META = 256 << 10


def block(tag: int, lba: int) -> bytes:
    """What write `tag` puts in block `lba` (tag 0: zeros)."""
    if tag == 0:
        return bytes(BS)
    head = struct.pack("<QQ", tag, lba)
    kind = tag % 3
    if kind == 0:
        return head + random.Random(tag * 1_000_003 + lba).randbytes(BS - 16)
    if kind == 1:
        return head + bytes(BS - 16)
    return head + (b"openvsan" * (BS // 8))[:BS - 16]


def tag_of(raw: bytes, lba: int) -> int | None:
    """The write a block read back came from, or None if it is no block any write made there."""
    if raw == bytes(BS):
        return 0
    tag, at = struct.unpack_from("<QQ", raw)
    return tag if at == lba and tag and block(tag, lba) == raw else None


# ---- headers


def test_a_header_reads_back_and_nothing_else_passes_for_one() -> None:
    payload = b"x" * 100
    h = C.pack_header(C.LZ4, CHUNK, 7, 3, payload)
    assert len(h) == C.HEADER_BYTES
    assert C.read_header(h, CHUNK, 7) == (C.LZ4, 3, 100, __import__("crc32c").crc32c(payload), 0)
    assert C.read_header(h, CHUNK, 8) is None          # another chunk's
    assert C.read_header(h, 2 * CHUNK, 7) is None      # another chunk size
    assert C.read_header(bytes(64), CHUNK, 7) is None
    for i in range(C.HEADER.size + 4):                 # any bit flipped in the header or its checksum
        bad = bytearray(h)
        bad[i] ^= 0x10
        assert C.read_header(bad, CHUNK, 7) is None, i


def test_the_codec_keeps_incompressible_chunks_raw_and_zeros_as_nothing() -> None:
    codec = C._Codec("lz4", 0, CHUNK)
    noise = random.Random(1).randbytes(CHUNK)
    assert codec.encode(noise) == (C.RAW, noise)
    assert codec.encode(bytes(CHUNK)) == (C.ZERO, b"")
    text = (b"a storage administrator expects " * 1000)[:CHUNK]
    algo, packed = codec.encode(text)
    assert algo == C.LZ4 and len(packed) < CHUNK // 10 and codec.decode(algo, packed) == text
    z = C._Codec("zstd", 9, CHUNK)
    algo, packed = z.encode(text)
    assert algo == C.ZSTD and z.decode(algo, packed) == text


def mixed_chunk(rnd: random.Random) -> bytes:
    """A chunk of 4 KiB frames: zeros, text, noise (stored raw), fio's half-compressible; in that order twice."""
    kinds = [bytes(4096), (b"a storage administrator expects " * 200)[:4096], rnd.randbytes(4096),
             b"".join(rnd.randbytes(256) + bytes(256) for _ in range(8))]
    return b"".join(kinds[i % 4] for i in range(CHUNK // 4096))


@pytest.mark.parametrize("algorithm", ["lz4", "zstd"])
def test_a_framed_version_decodes_whole_and_in_any_part(algorithm: str) -> None:
    rnd = random.Random(3)
    codec = C._Codec(algorithm, 3, CHUNK, 4096)
    plain = mixed_chunk(rnd)
    algo, payload = codec.encode(plain)
    assert algo == C.FRAMED[C.ALGOS[algorithm]]
    lens, _, _ = C.frame_table(payload, 4)
    assert lens[0] == 0 and 0 < lens[1] < 4096 and lens[2] == 4096 and 0 < lens[3] < 4096, lens
    h = C.pack_header(algo, CHUNK, 2, 1, payload, codec.shift)
    _, _, length, pcrc, shift = C.read_header(h, CHUNK, 2) or (0, 0, 0, 0, 0)
    assert shift == 12 and length == len(payload) and C.payload_ok(algo, shift, payload, pcrc, CHUNK)
    assert codec.decode(algo, payload, shift) == plain
    for _ in range(200):
        start = rnd.randrange(CHUNK)
        n = rnd.randrange(1, CHUNK - start + 1)
        assert codec.decode_part(algo, payload, shift, start, n) == plain[start:start + n], (start, n)
    # a flipped byte in one frame: that frame fails its checksum, the others still decode, the whole payload fails
    bad = bytearray(payload)
    at = C._table(4).size + lens[0]            # the first byte of frame 1
    bad[at] ^= 1
    assert not C.payload_ok(algo, shift, bytes(bad), pcrc, CHUNK)
    with pytest.raises(ValueError, match="frame 1"):
        codec.decode_part(algo, bytes(bad), shift, 4096, 10)
    assert codec.decode_part(algo, bytes(bad), shift, 8192, 8192) == plain[8192:]
    # a frame shift that does not fit the chunk is no header
    for wrong in (0, 11, 14, 20):
        assert C.read_header(_header(algo, wrong, payload), CHUNK, 2) is None, wrong
    assert C.read_header(_header(algo, 12, payload), CHUNK, 2) is not None


def _header(algo: int, shift: int, payload: bytes) -> bytes:
    import crc32c

    h = C.HEADER.pack(C.MAGIC, C.VERSION, algo, shift, CHUNK, 2, 1, len(payload), 0)
    return (h + struct.pack("<I", crc32c.crc32c(h))).ljust(C.HEADER_BYTES, b"\0")


def test_a_framed_codec_keeps_all_zeros_as_nothing_and_incompressible_chunks_raw() -> None:
    codec = C._Codec("lz4", 0, CHUNK, 4096)
    noise = random.Random(1).randbytes(CHUNK)
    assert codec.encode(noise) == (C.RAW, noise)
    assert codec.encode(bytes(CHUNK)) == (C.ZERO, b"")


def test_a_small_write_encodes_only_the_frames_it_touches_and_a_bad_frame_is_not_carried_silently() -> None:
    async def go() -> None:
        rnd = random.Random(9)
        dev = ram()
        g, layer = await stack(dev, fresh=True, frame=4096)
        plain = mixed_chunk(rnd)
        await layer.write(0, plain)
        await layer.flush()
        squeezed: list[int] = []
        real = layer.codec._squeeze
        layer.codec._squeeze = lambda piece: (squeezed.append(len(piece)), real(piece))[1]  # type: ignore[method-assign]
        new = b"openvsan" * 64                                      # one 512-byte block in frame 1
        await layer.write(9, new)
        assert squeezed == [4096], squeezed                         # frame 1 only, the others copied as stored
        want = plain[:9 * BS] + new + plain[10 * BS:]
        layer._cache.clear()
        assert bytes(await layer.read(0, CB)) == want
        layer._cache.clear()
        assert bytes(layer.read_now(17, 3) or b"") == want[17 * BS:20 * BS]
        # frame 3's stored bytes damaged below the layer: a read of it fails, a read of frame 1 does not, and
        # a write into frame 3 fails with nothing written, while a write elsewhere keeps frame 3 as it was (bad)
        await layer.flush()
        s = int(layer.cur[0])
        raw = bytearray(await layer.below.read(s * layer.slot // BS, int(layer.held[0, s]) // BS))
        _, starts = C.frame_table(memoryview(raw)[C.HEADER_BYTES:], 4)[::2]
        raw[C.HEADER_BYTES + starts[3] + 5] ^= 0x40
        await layer.below.write(s * layer.slot // BS, bytes(raw))
        layer._cache.clear()
        with pytest.raises(MediumError):
            layer.read_now(3 * 8, 8)
        assert bytes(layer.read_now(8, 8) or b"") == want[4096:8192]
        gen = int(layer.gen[0])
        with pytest.raises(MediumError):
            await layer.write(3 * 8 + 1, bytes(BS))
        assert int(layer.gen[0]) == gen
        await layer.write(0, bytes(BS))
        layer._cache.clear()
        with pytest.raises(MediumError):
            await layer.read(3 * 8, 8)
        await g.close()
    asyncio.run(go())


def test_a_damaged_frame_is_not_stored_again_as_good_when_the_chunk_goes_raw() -> None:
    """A write that makes every frame incompressible stores the chunk raw, which decodes every frame: a
    damaged one copied from the old version is a medium error then, not plain bytes with a good checksum."""
    async def go() -> None:
        rnd = random.Random(11)
        dev = ram()
        g, layer = await stack(dev, fresh=True, frame=4096)
        text = (b"a storage administrator expects " * 200)[:4096]
        await layer.write(0, rnd.randbytes(3 * 4096) + text)
        await layer.flush()
        assert int(layer.algo[0]) == C.LZ4F
        s = int(layer.cur[0])
        raw = bytearray(await layer.below.read(s * layer.slot // BS, int(layer.held[0, s]) // BS))
        starts = C.frame_table(memoryview(raw)[C.HEADER_BYTES:], 4)[2]
        raw[C.HEADER_BYTES + starts[0] + 9] ^= 0x01      # frame 0, stored raw: its checksum no longer holds
        await layer.below.write(s * layer.slot // BS, bytes(raw))
        layer._cache.clear()
        gen = int(layer.gen[0])
        with pytest.raises(MediumError, match="frame 0"):
            await layer.write(3 * 8, rnd.randbytes(4096))    # frame 3 incompressible too: the chunk would go raw
        assert int(layer.gen[0]) == gen and int(layer.algo[0]) == C.LZ4F
        await g.close()
    asyncio.run(go())


def test_versions_of_another_frame_size_read_and_are_rewritten_in_this_one() -> None:
    async def go() -> None:
        rnd = random.Random(4)
        dev = ram()
        g, layer = await stack(dev, fresh=True, frame=0)
        data = b"".join(mixed_chunk(rnd) for _ in range(CHUNKS))
        await layer.write(0, data)
        assert set(layer.algo.tolist()) <= {C.LZ4, C.RAW}
        layer.set_algorithm("zstd", 8192)
        assert layer.settings["frame_size"] == 8192 and layer.stats()["frame_size"] == 8192
        await layer.write(CB + 3, b"z" * BS)           # chunk 1: its unframed version patched into frames
        data = data[:(CB + 3) * BS] + b"z" * BS + data[(CB + 4) * BS:]
        assert int(layer.algo[1]) == C.ZSTDF
        await layer.flush()
        await g.close()
        g, layer = await stack(dev, fresh=False, frame=4096)
        assert bytes(await layer.read(0, BLOCKS)) == data
        await layer.write(CB + 20, b"y" * BS)          # frames of 8 KiB in zstd, rewritten in 4 KiB ones in lz4
        data = data[:(CB + 20) * BS] + b"y" * BS + data[(CB + 21) * BS:]
        assert int(layer.algo[1]) == C.LZ4F
        layer._cache.clear()
        assert bytes(await layer.read(0, BLOCKS)) == data
        with pytest.raises(CompressError, match="frame size"):
            layer.set_algorithm("lz4", CHUNK)
        await g.close()
    asyncio.run(go())


@pytest.mark.parametrize("value, expected", [("lz4", ("lz4", 0)), ("zstd", ("zstd", 3)), ("zstd:19", ("zstd", 19))])
def test_parse_compression(value: str, expected: tuple[str, int]) -> None:
    assert C.parse_compression(value) == expected


@pytest.mark.parametrize("value", ["gzip", "lz4:1", "zstd:0", "zstd:20", "zstd:x"])
def test_parse_compression_refuses(value: str) -> None:
    with pytest.raises(ValueError, match="compression"):
        C.parse_compression(value)


# ---- the stack


FRAME = 4096              # the tests' chunks are framed unless a test says 0 (one stream per chunk)


async def stack(dev: BlockDevice, *, fresh: bool, algorithm: str = "lz4",
                frame: int = FRAME, cache: int = 0) -> tuple[VolumeGroup, CompressLayer]:
    """The layer over a thin volume of `dev`; without a write cache unless `cache` (bytes) says (the tests of
    the versions below it see every write reach them)."""
    if fresh:
        g = await VolumeGroup.format(dev, cluster_size=CS, metadata_size=META)
        g.commit_interval = 1e9
        lv = await g.create("v", C.backing_size(BLOCKS * BS, CHUNK))
    else:
        g = await VolumeGroup.open(dev)
        g.commit_interval = 1e9
        lv = g.volume("v")
    layer = await open_compress({"type": "compress", "algorithm": algorithm, "chunk_size": CHUNK, "frame_size": frame,
                                 "cache_size": cache}, lv, name="v")
    return g, layer


def ram() -> RamDevice:
    return RamDevice((META + 2 * C.backing_size(BLOCKS * BS, CHUNK)) // BS, BS)


def test_compression_needs_a_thin_volume_below() -> None:
    async def go() -> None:
        with pytest.raises(CompressError, match="carved from a device or pool"):
            await open_compress({"type": "compress"}, RamDevice(1024, BS), name="v")
    asyncio.run(go())


Op = tuple  # ("write", lba, n, fua) | ("zero", lba, n) | ("unmap", lba, n) | ("flush",) | ("commit",)


UB = C.UNIT // BS          # blocks per 4 KiB unit (the write cache's)


def workload(seed: int, length: int, commits: bool = False, units: bool = False) -> list[Op]:
    """With `commits`, some flushes are the thin group's own commit instead (its timer's: mappings made durable
    with no flush of the layer), after which the layer's fast path may write in place. With `units`, most writes
    are of whole 4 KiB units within a chunk (what the write cache takes)."""
    rnd = random.Random(seed)
    ops: list[Op] = []
    for _ in range(length):
        r = rnd.random()
        lba = rnd.randrange(BLOCKS)
        if units and rnd.random() < 0.7:
            lba -= lba % UB
            n = UB * rnd.randint(1, (CB - lba % CB) // UB)
        elif rnd.random() < 0.3:     # whole chunks
            lba -= lba % CB
            n = min(BLOCKS - lba, CB * rnd.randint(1, 2))
        else:
            n = rnd.randint(1, min(2 * CB, BLOCKS - lba))
        if r < 0.62:
            ops.append(("write", lba, n, rnd.random() < 0.15))
        elif r < 0.7:
            ops.append(("zero", lba, n))
        elif r < 0.8:
            ops.append(("unmap", lba, n))
        else:
            ops.append(("commit",) if commits and r < 0.9 else ("flush",))
    return ops


class Run:
    """Runs ops on the layer and keeps the model: cur (what each block holds now) and, per block, what else it
    may hold after a power cut (values written since the last durable point)."""

    def __init__(self, layer: CompressLayer, fast: bool = False, soon: bool = False) -> None:
        self.layer = layer
        self.fast = fast          # writes try write_now first, as the frontends do; one it takes is durable
        self.soon = soon          # then write_soon, as the NBD and NVMe frontends do: durable only if FUA
        self.soon_writes = 0
        self.cur = [0] * BLOCKS
        self.maybe: list[set[int]] = [set() for _ in range(BLOCKS)]
        self.tag = 0
        self.fast_writes = 0

    async def step(self, op: Op) -> None:
        kind = op[0]
        if kind == "flush":
            await self.layer.flush()
            for s in self.maybe:
                s.clear()
            return
        if kind == "commit":
            await self.layer.below.group.commit()  # type: ignore[attr-defined]
            return
        _, lba, n = op[:3]
        if kind == "write":
            self.tag += 1
            new = [self.tag] * n
            data = b"".join(block(self.tag, b) for b in range(lba, lba + n))
        else:
            new = [0] * n
        for i, b in enumerate(range(lba, lba + n)):
            self.maybe[b] |= {self.cur[b], new[i]}
        durable = False
        if kind == "write":
            durable = op[3]
            done: list[BaseException | None] = []
            if self.fast and self.layer.write_now(lba, data):
                durable = True
                self.fast_writes += 1
            elif self.soon and self.layer.write_soon(lba, data, op[3], done.append):
                assert done == [None]
                self.soon_writes += 1
            else:
                await self.layer.write(lba, data, fua=op[3])
        elif kind == "zero":
            await self.layer.write_zeroes(lba, n)
        else:
            await self.layer.unmap(lba, n)
        for i, b in enumerate(range(lba, lba + n)):
            self.cur[b] = new[i]
            if durable:
                self.maybe[b].clear()


async def read_all(layer: CompressLayer) -> list[int | None]:
    raw = bytes(await layer.read(0, BLOCKS))
    return [tag_of(raw[b * BS:(b + 1) * BS], b) for b in range(BLOCKS)]


@pytest.mark.parametrize("frame", [0, 4096, 8192])
def test_reads_follow_the_model_and_a_reopen_keeps_everything(frame: int) -> None:
    async def go() -> None:
        for seed in range(12):
            dev = ram()
            g, layer = await stack(dev, fresh=True, algorithm="zstd:3" if seed % 2 else "lz4", frame=frame)
            run = Run(layer)
            for i, op in enumerate(workload(seed, 150)):
                await run.step(op)
                if i % 25 == 0:
                    assert await read_all(layer) == run.cur, f"seed {seed}, after op {i} {op}"
            assert await read_all(layer) == run.cur
            await layer.flush()
            await g.close()
            g, layer = await stack(dev, fresh=False, frame=(frame or FRAME) if seed % 3 else 0)  # reads either way
            assert await read_all(layer) == run.cur, f"seed {seed}: after a reopen"
            # trimmed whole, every cluster goes back to the group (the zero versions go one flush later)
            await layer.unmap(0, BLOCKS)
            for _ in range(2):
                await layer.flush()
            assert g.used == 0, f"seed {seed}: {g.used} clusters still used after the whole volume was trimmed"
            assert await read_all(layer) == [0] * BLOCKS
    asyncio.run(go())


@pytest.mark.parametrize("frame", [0, 4096])
def test_the_fast_path_reads_the_bytes_the_normal_path_reads(frame: int) -> None:
    """read_now (in the caller's turn: the cache, or the thin volume's fast path over consecutive clusters)
    gives what the chunk's slow path (read under its lock) gives, for chunks cached and not, zero chunks and partial blocks; it declines a read
    across chunks and a chunk a write holds."""
    async def go() -> None:
        dev = ram()
        g, layer = await stack(dev, fresh=True, frame=frame)
        assert layer.capabilities.sync_read
        run = Run(layer)
        for op in workload(5, 120):
            await run.step(op)
        rng = random.Random(5)
        answered = {"cache": 0, "device": 0}
        for _ in range(400):
            c = rng.randrange(CHUNKS)
            off = rng.randrange(CB)
            n = rng.randrange(1, CB - off + 1)
            lba = c * CB + off
            if rng.random() < 0.5:
                layer._cache.clear()
            cached = c in layer._cache
            fast = layer.read_now(lba, n)
            layer._cache.pop(c, None)          # the slow path's own read of the chunk, under its lock
            async with layer._chunk(c):
                slow = (await layer._plain(c))[off * BS:(off + n) * BS]
            assert fast is not None and bytes(fast) == slow, (lba, n)
            answered["cache" if cached else "device"] += 1
        assert answered["cache"] > 50 and answered["device"] > 50, answered
        assert layer.read_now(CB - 1, 2) is None                     # across two chunks
        async with layer._chunk(1):
            assert layer.read_now(CB, 1) is None                     # a write holds it
        # the thin volume's own fast path over consecutive clusters, against its read()
        lv = layer.below
        for lba in range(0, 2 * CB * 2, 7):
            raw = lv.read_now(lba, 24)
            if raw is not None:
                assert bytes(raw) == bytes(await lv.read(lba, 24)), lba
        await g.close()
    asyncio.run(go())


@pytest.mark.parametrize("frame", [0, 4096])
def test_write_now_stores_the_versions_write_stores(frame: int) -> None:
    """The same workload on two stacks, writes through write_now first on one (as the frontends do) and through
    write() alone on the other: every chunk's newest version holds the same bytes (algorithm, generation,
    payload), only its slot may differ; both read the same; write_now declines across chunks, on a chunk a write
    holds, during a flush, and where the slot's clusters are not committed yet."""
    async def go() -> None:
        stacks = [await stack(ram(), fresh=True, frame=frame) for _ in range(2)]
        runs = [Run(stacks[0][1], fast=True), Run(stacks[1][1])]
        for op in workload(7, 300, commits=True):
            for run in runs:
                await run.step(op)
        assert runs[0].fast_writes > 20, runs[0].fast_writes
        versions = []
        for _, layer in stacks:
            got = []
            for c in range(CHUNKS):
                s = int(layer.cur[c])
                if s < 0:
                    got.append(None)
                    continue
                raw = bytes(await layer.below.read((c * 2 + s) * layer.slot // BS, int(layer.held[c, s]) // BS))
                h = C.read_header(raw, CHUNK, c)
                assert h is not None
                got.append((h[0], h[1], raw[C.HEADER_BYTES:C.HEADER_BYTES + h[2]]))
            versions.append(got)
        assert versions[0] == versions[1]
        assert await read_all(stacks[0][1]) == await read_all(stacks[1][1]) == runs[0].cur
        g, layer = await stack(ram(), fresh=True, frame=frame)
        data = block(5000, 0) + block(5000, 1)
        await layer.write(0, b"".join(block(5001, b) for b in range(2 * CB)))
        await g.commit()
        assert layer.write_now(CB - 1, data) is False                # across two chunks
        async with layer._chunk(0):
            assert layer.write_now(0, data) is False                 # a write holds it
        layer._flushes.append(C._Flush(0))
        assert layer.write_now(0, data) is False                     # a flush under way
        layer._flushes.clear()
        await layer.write(0, b"".join(block(5001, b) for b in range(CB)))
        await layer.flush()
        await layer.write(0, data)                                   # to the other slot: fresh clusters
        assert layer.write_now(0, data) is False
        await g.commit()
        assert layer.write_now(0, data) is True
        await layer.write(2 * CB, b"".join(block(5002, b) for b in range(CB)))
        await g.commit()
        s = int(layer.cur[2])
        assert layer.write_now(2 * CB, data) is True                 # a chunk never flushed: in place
        assert int(layer.cur[2]) == s == int(layer.dur[2])           # and durable
        assert bytes(await layer.read(0, 2)) == bytes(await layer.read(2 * CB, 2)) == data
    asyncio.run(go())


def test_a_framed_version_s_table_is_read_once_and_never_for_a_later_version() -> None:
    """read_now of a framed version reads its header and table from the device once (kept in _tables), then
    only the frames a read covers; a rewrite of the chunk (a new generation, in the same slot before a flush
    and in the other after it) makes it read the new version's table, and the bytes follow every write."""
    async def go() -> None:
        dev = ram()
        g, layer = await stack(dev, fresh=True, frame=4096)
        rng = random.Random(3)
        model = bytearray(b"".join(rng.randbytes(256) + bytes(256) for _ in range(CB)))   # half-compressible
        await layer.write(0, bytes(model))
        reads: list[tuple[int, int]] = []
        below = layer._below_read_now
        assert below is not None

        def counted(lba: int, blocks: int) -> object:
            reads.append((lba, blocks))
            return below(lba, blocks)
        layer._below_read_now = counted

        def read(lba: int) -> tuple[bytes, int]:
            layer._cache.clear()
            reads.clear()
            got = layer.read_now(lba, 8)
            assert got is not None
            return bytes(got), len(reads)

        assert read(0) == (bytes(model[:8 * BS]), 2)            # header and table, then the frame
        assert read(8) == (bytes(model[8 * BS:16 * BS]), 1)     # the frame alone
        assert read(24) == (bytes(model[24 * BS:32 * BS]), 1)
        slots = []
        for round_ in range(3):
            gen = layer._tables[0][0]
            new = rng.randbytes(4096)
            await layer.write(16, new)
            model[16 * BS:16 * BS + 4096] = new
            if round_ == 1:
                await layer.flush()
            assert read(16) == (new, 2)                          # the new version's table, read anew
            assert read(8) == (bytes(model[8 * BS:16 * BS]), 1)
            assert layer._tables[0][0] > gen
            slots.append(layer._tables[0][1])
        assert len(set(slots)) == 2, slots                       # the same slot and the other both met
        layer._cache.clear()
        assert bytes(await layer.read(0, CB)) == bytes(model)
        await g.close()
    asyncio.run(go())


def test_half_compressible_data_takes_about_half_the_space_and_the_ratio_is_reported() -> None:
    async def go() -> None:
        dev = ram()
        g, layer = await stack(dev, fresh=True)
        rnd = random.Random(5)
        data = b"".join(rnd.randbytes(256) + bytes(256) for _ in range(BLOCKS))   # fio's 50 %, 512-byte pieces
        await layer.write(0, data)
        await layer.flush()
        st = layer.stats()
        assert st["chunks"] == CHUNKS and st["plain_bytes"] == BLOCKS * BS
        assert 1.3 <= st["ratio"] <= 2.0, st    # 16 KiB chunks: 8 KiB and a bit take 12 KiB
        assert g.used * CS == st["stored_bytes"], (g.used, st)
        noise = rnd.randbytes(BLOCKS * BS)
        await layer.write(0, noise)
        await layer.flush()
        st = layer.stats()
        assert st["raw_chunks"] == CHUNKS and st["ratio"] < 1.0
        assert bytes(await layer.read(0, BLOCKS)) == noise
    asyncio.run(go())


def test_a_torn_newer_version_gives_way_to_the_older_durable_one() -> None:
    async def go() -> None:
        dev = ram()
        _, layer = await stack(dev, fresh=True)
        old = b"".join(block(1, b) for b in range(CB))
        await layer.write(0, old, fua=True)
        new = b"".join(block(2, b) for b in range(CB))
        await layer.write(0, new)       # not flushed: in the other slot
        s = int(layer.cur[0])
        layer2 = await torn_and_reopened(dev, layer, 0)
        assert bytes(await layer2.read(0, CB)) == old
        assert int(layer2.cur[0]) != s
    asyncio.run(go())


async def torn_and_reopened(dev: BlockDevice, layer: CompressLayer, c: int) -> CompressLayer:
    """Chunk c's newest version torn (a byte of its payload, after its header, flipped), as by a crash in the
    middle of its write; then the stack opened again over the device."""
    lv = layer.below
    at = (c * 2 + int(layer.cur[c])) * layer.slot // BS
    raw = bytearray(await lv.read(at, 1))
    raw[C.HEADER_BYTES + 3] ^= 1
    await lv.write(at, raw)
    await lv.flush()
    g2 = await VolumeGroup.open(dev)
    return await open_compress({"type": "compress", "chunk_size": CHUNK, "cache_size": 0}, g2.volume("v"))


def test_a_write_while_a_flush_makes_its_chunks_durable_keeps_the_flushed_version() -> None:
    """A flush that completed below then makes each chunk it covers durable one by one, yielding at each
    unmap; a write meanwhile to a chunk it has not reached yet must go to the other slot, not over the
    version that flush made durable: torn by a crash, the flushed data would be gone."""
    async def go() -> None:
        dev = ram()
        g, layer = await stack(dev, fresh=True)
        rng = random.Random(1)
        await layer.write(0, rng.randbytes(CB * BS))
        await layer.flush()
        await layer.write(0, rng.randbytes(CB * BS))    # chunk 0: a newer version, its old slot to go at the flush
        flushed = rng.randbytes(CB * BS)
        await layer.write(CB, flushed)                   # chunk 1: its first version, made durable by the flush
        gate, entered = asyncio.Event(), asyncio.Event()
        unmap = layer.below.unmap

        async def held_unmap(lba: int, blocks: int) -> None:
            entered.set()
            await gate.wait()
            await unmap(lba, blocks)
        layer.below.unmap = held_unmap  # type: ignore[method-assign]
        flush = asyncio.ensure_future(layer.flush())
        await entered.wait()          # done below; chunk 0's old slot going, chunk 1 not reached yet
        assert not layer._flushes and 1 in layer._written
        s = int(layer.cur[1])
        await layer.write(CB, rng.randbytes(CB * BS))
        assert int(layer.cur[1]) != s
        gate.set()
        await flush
        layer2 = await torn_and_reopened(dev, layer, 1)    # the newer version torn: the flushed one is served
        assert bytes(await layer2.read(CB, CB)) == flushed
        await g.close()
    asyncio.run(go())


# ---- power cuts


SURVIVE = (0.0, 0.0, 0.25, 0.5, 0.75, 1.0)


async def cut_at(ops: list[Op], k: int, survive: float, rng: random.Random, frame: int,
                 fast: bool = False, cache: int = 0) -> str | None | bool:
    """Run ops with the power cut after the stack's k-th write; False if they ended first, else what the
    checker found wrong (None: nothing). `fast`: the device has a fast path and writes try write_now first.
    `cache`: the layer's write cache (bytes), writes tried through write_soon, the cleaner given a turn of the
    loop after each op."""
    dev = PowerCut(ram(), survive, rng, sync=fast)
    g, layer = await stack(dev, fresh=True, frame=frame, cache=cache)
    run = Run(layer, fast, soon=bool(cache))
    dev.crash_after_writes = dev.writes + k
    at = None
    for i, op in enumerate(ops):
        try:
            await run.step(op)
            if cache:
                await asyncio.sleep(0)
                if dev.crashed:     # the cleaner met the cut
                    at = i
                    break
        except BlockError:
            if not dev.crashed:
                raise
            at = i
            break
    FAST_WRITES[0] += run.fast_writes
    SOON_WRITES[0] += run.soon_writes
    RECLAIMS[0] += layer.reclaims
    await layer._stop_cleaner()    # the process is gone: so is its cleaner
    await layer._stop_reclaimer()  # and a reclaim under way (its flush fails: the device is gone)
    if at is None:
        return False
    await dev.restart()
    if k % 3 == 0:    # the power goes again while the layer recovers (its unmaps and flushes)
        dev.crash_after_writes = dev.writes + 1 + k % 7
        try:
            await stack(dev, fresh=False, frame=frame)
        except BlockError:
            pass
        dev.crash_after_writes = None     # disarmed if opening wrote fewer
        await dev.restart()
    try:
        g, layer = await stack(dev, fresh=False, frame=frame)
    except Exception as e:  # noqa: BLE001 - reported as the finding
        return f"the stack did not open: {e!r} (cut in {ops[at]})"
    try:
        got = await read_all(layer)
    except BlockError as e:
        return f"a read failed after the cut in {ops[at]}: {e!r}"
    for b, t in enumerate(got):
        if t is None:
            return f"block {b} holds no write made to it (torn or misplaced), cut in {ops[at]}"
        if t != run.cur[b] and t not in run.maybe[b]:
            return f"block {b} holds write {t}; allowed {sorted(run.maybe[b] | {run.cur[b]})}, cut in {ops[at]}"
    if k % 5 == 0:    # it works on: a write stays through another reopen, and a whole trim frees everything
        await layer.write(0, block(999, 0), fua=True)
        g, layer = await stack(dev, fresh=False, frame=frame)
        if bytes(await layer.read(0, 1)) != block(999, 0):
            return "a write after the reopen did not stay"
        await layer.unmap(0, BLOCKS)
        await layer.flush()
        await layer.flush()
        if g.used:
            return f"{g.used} clusters in use after the whole volume was trimmed"
    return None


FAST_WRITES = [0]    # writes write_now took in the cuts run so far (a fast sweep must have some)
SOON_WRITES = [0]    # writes write_soon took (a sweep with the write cache must have some)
RECLAIMS = [0]       # flushes the layer made itself (a sweep with reclaims must have some)


async def sweep(seeds: range, length: int, frame: int = FRAME, fast: bool = False,
                cache: int = 0) -> tuple[int, list[str]]:
    points = 0
    failures: list[str] = []
    for seed in seeds:
        ops = workload(seed, length, commits=fast, units=bool(cache))
        rng = random.Random(seed * 7919)
        k = 1
        while True:
            survive = rng.choice(SURVIVE)
            found = await cut_at(ops, k, survive, random.Random(rng.random()), frame, fast, cache)
            if found is False:
                break
            points += 1
            if found is not None:
                failures.append(f"seed {seed}, cut after write {k}, survive {survive}: {found}")
                if len(failures) >= 5:
                    return points, failures
            k += 1
    return points, failures


@pytest.mark.parametrize("frame", [0, 4096])
@pytest.mark.parametrize("batch", range(3))
def test_power_cuts_at_every_write_lose_nothing_durable(batch: int, frame: int) -> None:
    points, failures = asyncio.run(sweep(range(batch * 4, batch * 4 + 4), 40, frame))
    print(f"{points} crash points")
    assert not failures, "\n".join(failures)
    assert points > 100


@pytest.mark.parametrize("frame", [0, 4096])
@pytest.mark.parametrize("batch", range(2))
def test_power_cuts_with_the_fast_path_lose_nothing_durable(batch: int, frame: int) -> None:
    """The same cuts with each write tried through write_now first, over a device with a fast path, and the thin
    group committing its mappings between the layer's flushes (its timer's commits), so that write_now takes
    writes: one it took is durable at once (the checker allows nothing older for its blocks after a cut)."""
    swept(range(100 + batch * 4, 100 + batch * 4 + 4), frame, FAST_WRITES, "write_now", 100, fast=True)


def swept(seeds: range, frame: int, taken: list[int], path: str, least: int, **kw: Any) -> None:
    """A sweep of `seeds` that finds nothing, over more than `least` crash points, with more than 50 writes
    taken by `path` (counted in `taken`)."""
    before = taken[0]
    points, failures = asyncio.run(sweep(seeds, 40, frame, **kw))
    print(f"{points} crash points, {taken[0] - before} writes through {path}")
    assert not failures, "\n".join(failures)
    assert points > least
    assert taken[0] - before > 50


CACHE = 8 * C.UNIT       # the tests' write cache: a third of their volume, so that its cleaner and its limit both act


@pytest.mark.parametrize("frame", [0, 4096])
@pytest.mark.parametrize("batch", range(2))
def test_power_cuts_with_the_write_cache_lose_nothing_durable(batch: int, frame: int) -> None:
    """The same cuts with the layer's write cache on and writes of whole 4 KiB units, tried through write_soon
    (as the NBD and NVMe frontends do): a cached write is lost with the power unless a flush came after it (or
    a FUA write of its chunk), and the cleaner's write-backs are cut like any other write."""
    swept(range(200 + batch * 4, 200 + batch * 4 + 4), frame, SOON_WRITES, "write_soon", 50, cache=CACHE)


@pytest.mark.parametrize("frame", [0, 4096])
def test_power_cuts_with_reclaims_lose_nothing_durable(frame: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same cuts with the layer flushing itself after every version it writes (as when its group is always
    short of space: RECLAIM_FREE over 1), writes through write_now, the write cache and write(): its flushes and
    the unmaps of superseded slots are cut like any other write, and nothing durable is lost."""
    monkeypatch.setattr(C, "RECLAIM_FREE", 1.5)
    before = RECLAIMS[0]
    swept(range(300, 304), frame, SOON_WRITES, "write_soon", 50, fast=True, cache=CACHE)
    print(f"{RECLAIMS[0] - before} reclaims")
    assert RECLAIMS[0] - before > 20


async def tight_stack(slack_clusters: int) -> tuple[VolumeGroup, CompressLayer, Run]:
    """The layer over a thin volume whose group has room for every chunk stored raw and `slack_clusters` more."""
    per_chunk = (CHUNK + C.UNIT) // CS
    dev = RamDevice((META + (CHUNKS * per_chunk + slack_clusters) * CS) // BS, BS)
    g = await VolumeGroup.format(dev, cluster_size=CS, metadata_size=META)
    g.commit_interval = 1e9
    assert g.clusters >= CHUNKS * per_chunk
    lv = await g.create("v", C.backing_size(BLOCKS * BS, CHUNK))
    layer = await open_compress({"type": "compress", "algorithm": "lz4", "chunk_size": CHUNK, "frame_size": FRAME,
                                 "cache_size": 0}, lv, name="v")
    return g, layer, Run(layer, fast=True)


async def rewrite_without_flushes(run: Run, seed: int, writes: int) -> None:
    """Every chunk written whole (incompressible: stored raw), then `writes` random writes, none flushed."""
    rng = random.Random(seed)
    for c in range(CHUNKS):
        run.tag += 3 - run.tag % 3                      # a tag whose blocks are random (block())
        run.cur[c * CB:(c + 1) * CB] = [run.tag] * CB
        await run.layer.write(c * CB, b"".join(block(run.tag, b) for b in range(c * CB, (c + 1) * CB)))
    for _ in range(writes):
        n = rng.choice((1, UB, CB))
        await run.step(("write", rng.randrange(BLOCKS - n + 1), n, False))
        await asyncio.sleep(0)                          # a reclaim's turn


def test_without_a_flush_from_above_the_slots_kept_for_next_versions_are_given_back_before_space_runs_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewritten with no flush, every chunk keeps both its slots (its durable version, and the newer one): a
    volume of incompressible data would take twice its size. In a group with a quarter to spare, the layer
    flushes itself as free clusters run low (RECLAIM_FREE) and every write succeeds, where without that the group
    runs out of space; once the layer is idle (RECLAIM_AFTER) the slots it kept go back too."""
    monkeypatch.setattr(C, "RECLAIM_AFTER", 0.05)
    per_chunk = (CHUNK + C.UNIT) // CS

    async def go() -> None:
        monkeypatch.setattr(C, "RECLAIM_FREE", 0.0)     # never short of space: it runs out
        g, layer, run = await tight_stack(CHUNKS * per_chunk // 4)
        with pytest.raises(NoSpace):
            await rewrite_without_flushes(run, 1, 200)
        await layer._stop_reclaimer()

        monkeypatch.setattr(C, "RECLAIM_FREE", 0.25)
        g, layer, run = await tight_stack(CHUNKS * per_chunk // 4)
        await rewrite_without_flushes(run, 1, 200)
        assert layer.reclaims >= 5, layer.reclaims
        assert await read_all(layer) == run.cur
        await run.step(("write", CB + 1, 1, False))     # a chunk keeps both slots: given back once idle
        assert layer.held[1].all()
        reclaims = layer.reclaims
        await asyncio.sleep(0.3)
        assert layer.reclaims == reclaims + 1 and not layer.held.all(axis=1).any()
        assert await read_all(layer) == run.cur
        stats = layer.stats()
        assert stats["stored_bytes"] <= CHUNKS * (CHUNK + C.UNIT) and stats["reclaims"] == layer.reclaims
        await asyncio.sleep(0.3)                        # idle and nothing kept: no reclaim more
        assert layer.reclaims == reclaims + 1
        await g.close()
    asyncio.run(go())


async def cached_run(seed: int, frame: int, cache: int = CACHE) -> tuple[RamDevice, VolumeGroup, CompressLayer, Run]:
    dev = ram()
    g, layer = await stack(dev, fresh=True, frame=frame, cache=cache)
    return dev, g, layer, Run(layer, soon=True)


@pytest.mark.parametrize("frame", [0, 4096])
def test_the_write_cache_reads_as_the_model_and_a_close_stores_it(frame: int) -> None:
    """Writes of whole units go to the cache (write_soon and write alike, write_now declines them: it cannot
    know whether they are FUA); it never holds more than its size, its cleaner writes the oldest chunks back,
    reads (read_now and read) see the cache over the stored versions, and a close writes what it holds to the
    device: a reopen reads every write."""
    async def go() -> None:
        for seed in range(6):
            dev, g, layer, run = await cached_run(seed, frame)
            assert not layer.write_now(0, block(1, 0) * UB)            # whole units: for the cache
            most = 0
            stored = 0
            for i, op in enumerate(workload(300 + seed, 160, units=True)):
                out = layer.bytes_out
                await run.step(op)
                most = max(most, layer._dirty_units)
                await asyncio.sleep(0)                                  # the cleaner's turn
                stored += layer.bytes_out > out
                assert layer._dirty_units <= layer._cap
                if i % 10 == 0:
                    assert await read_all(layer) == run.cur, f"seed {seed}, after op {i} {op}"
                    for c in list(layer._dirty):
                        fast = layer.read_now(c * CB, CB)
                        if fast is not None:
                            assert [tag_of(bytes(fast)[b * BS:(b + 1) * BS], c * CB + b) for b in range(CB)] \
                                == run.cur[c * CB:(c + 1) * CB], f"seed {seed}: read_now of chunk {c}"
            assert run.soon_writes > 40 and most >= layer._soft and stored, (run.soon_writes, most, stored)
            assert layer.stats()["cached_bytes"] == layer._dirty_units * C.UNIT
            await layer.write(0, b"".join(block(7777, b) for b in range(UB)))   # write() takes it too
            assert 0 in layer._dirty and layer._dirty_units
            run.cur[:UB] = [7777] * UB
            await layer.close()
            assert not layer._dirty
            await g.close()
            g, layer = await stack(dev, fresh=False, frame=frame)
            assert await read_all(layer) == run.cur, f"seed {seed}: after a close and a reopen"
            await g.close()
    asyncio.run(go())


def test_a_full_cache_writes_its_oldest_chunk_back_and_a_fua_write_takes_what_it_held_of_its_chunk() -> None:
    async def go() -> None:
        dev, _g, layer, run = await cached_run(0, FRAME, cache=2 * C.UNIT)
        await run.step(("write", 0, UB, False))                        # write 1, chunk 0: cached
        await run.step(("write", CB, UB, False))                       # write 2, chunk 1: cached, the cache full
        assert list(layer._dirty) == [0, 1] and layer._dirty_units == 2 and run.soon_writes == 2
        out = layer.bytes_out
        await run.step(("write", 2 * CB, UB, False))                   # write 3: the oldest chunk goes first
        assert list(layer._dirty) == [1, 2] and layer.bytes_out > out
        await run.step(("write", 2 * CB + UB, UB, True))               # write 4, FUA, chunk 2
        assert list(layer._dirty) == [1]                               # it took the chunk's cached unit along
        # the power goes now, with no flush: the FUA write and what was cached of its chunk are on the device,
        # what the cache held of chunk 1 is gone (it was volatile, as any write not yet flushed may be)
        _, again = await stack(dev, fresh=False)
        got = await read_all(again)
        assert got[2 * CB:2 * CB + 2 * UB] == [3] * UB + [4] * UB
        assert got[CB:CB + UB] == [0] * UB
    asyncio.run(go())


SEEDS = int(os.environ.get("COMPRESS_CRASH_SEEDS", "0"))


@pytest.mark.soak
@pytest.mark.skipif(not SEEDS, reason="COMPRESS_CRASH_SEEDS=N runs N more workloads")
def test_power_cuts_soak() -> None:
    points, failures = asyncio.run(sweep(range(1000, 1000 + SEEDS), 120))
    print(f"{points} crash points")
    assert not failures, "\n".join(failures)
    points, failures = asyncio.run(sweep(range(2000, 2000 + SEEDS), 120, fast=True))
    print(f"{points} crash points with the fast path")
    assert not failures, "\n".join(failures)


def test_the_stack_refuses_compression_below_encryption_and_encryption_that_keeps_unmaps(tmp_path: object) -> None:
    from pathlib import Path

    from openvsan.volume.crypt import CryptError, open_crypt

    key = Path(str(tmp_path)) / "k"
    key.write_bytes(b"a passphrase")
    crypt = {"type": "crypt", "key_file": str(key), "kdf": "pbkdf2", "kdf_iterations": 1000}

    async def go() -> None:
        g, layer = await stack(RamDevice((META + (40 << 20)) // BS, BS), fresh=True)
        with pytest.raises(CryptError, match="encryption over compression is the wrong order"):
            await open_crypt(crypt, layer, name="v")
        lv = await g.create("w", (16 << 20) + C.backing_size(1 << 20, CHUNK))
        over = await open_crypt(crypt, lv, name="w")
        with pytest.raises(CompressError, match="needs encryption.allow_discards = true"):
            await open_compress({"type": "compress"}, over, name="w")
        over = await open_crypt({**crypt, "allow_discards": True}, lv, name="w")
        squeeze = await open_compress({"type": "compress", "chunk_size": CHUNK}, over, name="w")
        data = block(7, 0) * CB          # one chunk, in the crypt layer's 4096-byte sectors
        await squeeze.write(0, data, fua=True)
        assert squeeze.block_size == 4096 and bytes(await squeeze.read(0, CHUNK // 4096)) == data
    asyncio.run(go())


@pytest.mark.parametrize("cache", [0, CACHE])
def test_a_rollback_under_the_layer_is_read_anew(cache: int) -> None:
    """A snapshot of the thin volume under a compress layer, a rollback to it through Volume.change_contents
    (as `vsan snapshot rollback` does): the layer reads its chunks again and serves what the snapshot held. With
    the write cache, what it held when the snapshot came is in the snapshot (Volume.write_back first, as `vsan
    snapshot create` does), and what it held when the rollback came is gone with the rest."""
    from openvsan.volume.volume import Volume

    async def go() -> None:
        dev = ram()
        g, layer = await stack(dev, fresh=True, cache=cache)
        vol = Volume(layer, name="v")
        was = bytearray(b"".join(block(1, b) for b in range(2 * CB)))
        await vol.write(0, bytes(was))
        mid = b"".join(block(3, b) for b in range(UB, 2 * UB))
        await vol.write(UB, mid)                       # in the cache, where the layer has one
        assert bool(layer._dirty) == bool(cache)
        was[UB * BS:2 * UB * BS] = mid
        old = bytes(was)
        await vol.write_back()
        await g.snapshot("v", "before")
        await vol.write_zeroes(CB, CB)
        assert bytes(await vol.read(0, 2 * CB)) != old
        for u in range(7):                             # past three quarters of the cache: its cleaner starts
            await vol.write(u * UB, b"".join(block(2, b) for b in range(u * UB, (u + 1) * UB)))
        assert not cache or (layer._cleaner is not None and not layer._cleaner.done())

        async def rollback() -> None:
            await g.rollback("v", "before")
            await asyncio.sleep(0.01)                  # a rollback on a real device takes turns of the loop

        await vol.change_contents(rollback)
        assert not layer._dirty
        assert bytes(await vol.read(0, 2 * CB)) == old
        await vol.flush()
        await g.close()
        _, again = await stack(dev, fresh=False)
        assert bytes(await again.read(0, 2 * CB)) == old
    asyncio.run(go())


def test_a_snapshot_reads_through_the_layer_as_it_was_and_takes_no_write() -> None:
    """A snapshot taken between a chunk's new version and the flush that frees its old slot holds both
    versions: read through a layer of its own, it serves the newest, unmaps nothing (it is read-only), and a
    write to it is ReadOnly before anything changes."""
    from openvsan.block.errors import ReadOnly

    async def go() -> None:
        dev = ram()
        g, layer = await stack(dev, fresh=True)
        old = b"".join(block(1, b) for b in range(2 * CB))
        await layer.write(0, old)
        await layer.flush()
        new = b"".join(block(2, b) for b in range(CB))
        await layer.write(0, new)          # chunk 0: a new version, the old one not yet unmapped
        await g.snapshot("v", "s")
        mapped = g.info("s")["mapped"]
        snap = await open_compress({"type": "compress", "algorithm": "lz4", "chunk_size": CHUNK}, g.volume("s"),
                                   name="s")
        assert snap.read_only and bytes(await snap.read(0, 2 * CB)) == new + old[CB * BS:]
        with pytest.raises(ReadOnly):
            await snap.write(0, old[:BS])
        with pytest.raises(ReadOnly):
            await snap.unmap(0, CB)
        assert g.info("s")["mapped"] == mapped and bytes(await snap.read(0, 2 * CB)) == new + old[CB * BS:]
        await g.close()
    asyncio.run(go())


def test_a_layout_of_other_chunks_or_plain_data_is_refused_and_left_as_it_is() -> None:
    """A compressed volume opened with another chunk size (its config changed), or a thin volume of plain data
    opened as compressed: CompressError before anything is unmapped; opened as it was written, it reads back."""

    def layer(lv: BlockDevice, chunk: int) -> Any:
        return open_compress({"type": "compress", "algorithm": "lz4", "chunk_size": chunk}, lv, name="v")

    async def go() -> None:
        dev = RamDevice((16 << 20) // BS, BS)
        g = await VolumeGroup.format(dev, cluster_size=CS, metadata_size=META)
        lv = await g.create("v", C.backing_size(1 << 20, 64 << 10))
        data = b"".join(block(3, b) for b in range(512 << 10 >> 9))
        big = await layer(lv, 64 << 10)
        await big.write(0, data)
        await big.flush()
        mapped = g.info("v")["mapped"]
        with pytest.raises(CompressError, match="its chunks are 64 KiB, not 16 KiB"):
            await layer(lv, 16 << 10)
        assert g.info("v")["mapped"] == mapped
        assert bytes(await (await layer(lv, 64 << 10)).read(0, len(data) // BS)) == data

        plain = await g.create("p", 8 << 20)
        noise = os.urandom(6 << 20)
        await plain.write(0, noise)
        mapped = g.info("p")["mapped"]
        with pytest.raises(CompressError, match="slots hold data that is not a 16 KiB chunk of this layer"):
            await layer(plain, 16 << 10)
        assert g.info("p")["mapped"] == mapped and bytes(await plain.read(0, len(noise) // BS)) == noise
        await g.close()
    asyncio.run(go())


def test_a_write_during_a_flush_does_not_overwrite_what_the_flush_made_durable() -> None:
    """Version A of a chunk written, a flush under way (the device below flushed, the layer not yet done), then
    version B of the same chunk written: A is durable now, so B must go to the other slot. The power is cut
    before the next flush with half of B's blocks written back (B torn): A reads back, not the version before
    it. (Writing B over A in place, as the layer did before it knew of flushes under way, lost A.)"""

    async def one(seed: int) -> None:
        dev = PowerCut(ram(), 0.5, random.Random(seed))
        _, layer = await stack(dev, fresh=True)
        rnd = random.Random(seed)
        v1, a, b = (rnd.randbytes(CHUNK) for _ in range(3))      # incompressible: versions of 40 blocks
        await layer.write(0, v1, fua=True)
        await layer.write(0, a)
        lv, gate, entered = layer.below, asyncio.Event(), asyncio.Event()
        plain_flush = lv.flush

        async def gated() -> None:
            await plain_flush()
            entered.set()
            await gate.wait()           # flushed below; the layer's flush is not done yet
        lv.flush = gated  # type: ignore[method-assign]
        flushing = asyncio.ensure_future(layer.flush())
        await entered.wait()
        lv.flush = plain_flush  # type: ignore[method-assign]
        writing = asyncio.ensure_future(layer.write(0, b))
        await asyncio.sleep(0.01)
        gate.set()
        await flushing
        await writing
        dev.crash()                         # B not flushed: half of its blocks reach the medium
        await dev.restart()
        _, again = await stack(dev, fresh=False)
        got = bytes(await again.read(0, CB))
        assert got in (a, b), f"seed {seed}: the flushed version A is lost ({'v1' if got == v1 else '?'})"

    async def go() -> None:
        for seed in range(8):
            await one(seed)
    asyncio.run(go())
