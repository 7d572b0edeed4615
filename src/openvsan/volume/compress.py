"""The compression layer: a volume's data compressed with lz4 (default) or zstd, in fixed chunks (64 KiB by
default), stored in a thin volume (volume/thin) whose clusters are small enough (4 KiB) that a chunk takes
only the clusters its compressed bytes need.

    [[volumes]]
    name = "logs"
    device = "d0"              # a device or pool whose volume group has 4 KiB clusters (cluster_size)
    size = "100GiB"
    compression = "lz4"        # or "zstd", "zstd:9"

**Layout.** The thin volume below is addressed in slots of chunk + 4 KiB bytes, two per chunk: chunk i owns
slots 2i and 2i+1 (the thin volume's virtual size is about twice the volume's: it costs nothing until
written). A slot holds one version of its chunk: a 64-byte header (magic, version, algorithm, chunk size,
chunk index, generation, payload length, CRC32C of the payload, CRC32C of the header) and the payload (the
chunk compressed, or raw when compression would not save a 4 KiB unit, or nothing for a chunk of zeros),
rounded up to 4 KiB; what lies past it in the slot is unmapped, so the thin volume holds no clusters there.

**Frames.** With `frame_size` (4 to 32 KiB; 0, the default, keeps each chunk one stream) a chunk is compressed
in frames, each on its own: the payload is a table (each frame's stored length, then each frame's CRC32C)
and the frames one after another; a frame of zeros stores nothing (length 0), one that does not compress is
stored raw (length = the frame size). The header carries the frame size (its log2, in the field that is 0 for
an unframed version) and, as payload checksum, the table's CRC32C. A read decodes and checks only the frames
it covers; a write of part of the chunk encodes only the frames it touches and copies the others as they are
stored, with their checksums (a damaged frame stays detectably damaged, it is never re-encoded as good).
Framing costs a few per cent of the ratio (each frame is compressed without the context of the others) and
saves most of the codec's work on small I/O. Each version says how it was written, so a volume may hold
versions of both kinds, and a change of the frame size (or algorithm) applies to the versions written after.

**Crash safety, without a map of its own.** The slots are the metadata: on open, every mapped slot is read
and the chunk's newest valid version (header and payload checksums right, its own index and chunk size) is
the one served. A write of a chunk never touches the slot holding its newest *durable* version: it goes to
the other slot (a newer version not yet durable there is overwritten in place). Once a flush (or the FUA
write itself) has made the new version durable, the old slot is unmapped; a chunk written as zeros is
unmapped altogether one flush later (its zero header stays until the old slot's unmap is durable, so a crash
can never bring the old data back). The thin volume's own rule (data, then flush, then mapping commit)
makes a version durable whole or not at all, and the payload checksum catches a version torn by a crash in
its middle; the older one is then served. Like the thin volume below, the layer has a volatile write cache:
what a flush or FUA write completed before a crash reads back; newer unflushed writes may or may not.

**Write cache.** Writes of whole 4 KiB units within a chunk (not FUA) wait in memory (`compression_cache`, 32
MiB by default): each chunk's units become one new version when a flush, a FUA or other write of the chunk, or
the cleaner (oldest chunks first, past three quarters full) comes, so a chunk written several times in
between is encoded and stored once. Reads see them over the stored version. They are volatile as the
unflushed versions are; a close writes them back and flushes.

**Order in the stack.** Compression goes above encryption (ciphertext does not compress): a crypt layer over
a compress layer is refused (volume/crypt.py), and so is a compress layer over a crypt layer that drops
unmaps (the space would never return).

The ratio reported (`vsan volume show`, stats()) is the bytes the chunks hold in plain over the bytes their
versions take in the thin volume (4 KiB units), for the chunks that hold data."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import crc32c
import numpy as np

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import BlockDevice, Buffer, WriteDone
from openvsan.block.errors import MediumError, ReadOnly
from openvsan.block.layer import Layer, read_only_stack, stack_of
from openvsan.volume.registry import register_layer, register_opener

log = logging.getLogger("openvsan.volume.compress")

DEFAULT_CHUNK = 64 << 10
CHUNKS = (16 << 10, 32 << 10, 64 << 10, 128 << 10)
UNIT = 4096                   # a version takes whole units of the slot; the slot is one unit more than a chunk
CACHE_CHUNKS = 64             # plain chunks kept in memory (a partial write reads none back; reads hit it)
TABLE_CHUNKS = 16384          # framed versions whose header and frame table read_now keeps (about 0.3 KiB each)
SCAN_CHUNKS = 16              # chunks read per request while opening
# Small writes are kept in memory, in 4 KiB units, until a flush or the cleaner writes them back: each chunk's
# units written together, so that a chunk written several times between two write-backs is re-encoded once
# (ZFS keeps its dirty data so between transaction groups). What the cache holds is volatile, as the layer's
# unflushed versions always were: a flush (or a FUA write) makes it durable. 0 turns it off.
DEFAULT_CACHE = 32 << 20
CLEAN_TURN = 0.001            # seconds the cleaner writes back at a time before the loop's other callbacks run
# A chunk written since the last flush holds both its slots (its durable version stays until the new one is
# durable), and a version write_now wrote keeps the other slot mapped until a flush too: the next version goes
# there in place, with no cluster to provision. With no flush from the initiator (fio without fsync, a database
# that trusts its FUA writes) every chunk rewritten would so hold two slots, and a volume of incompressible data
# take twice its size, until the group ran out of space. So the layer flushes itself ("reclaims": the versions
# made durable, the slots they superseded unmapped) when its group's free clusters fall below RECLAIM_FREE of
# them, and once it has written nothing for RECLAIM_AFTER seconds. Not sooner: a reclaim makes each chunk's next
# version provision its slot again (measured: half the 4 KiB random write rate with a reclaim every 256 chunks).
RECLAIM_FREE = 0.25
RECLAIM_AFTER = 5.0

MAGIC = b"VSZC"
VERSION = 1
RAW, LZ4, ZSTD, ZERO = 0, 1, 2, 3
LZ4F, ZSTDF = 4, 5                        # lz4 and zstd in frames (each frame compressed on its own)
ALGOS = {"lz4": LZ4, "zstd": ZSTD}
FRAMED = {LZ4: LZ4F, ZSTD: ZSTDF}
ALGO_NAMES = {RAW: "raw", LZ4: "lz4", ZSTD: "zstd", ZERO: "zero", LZ4F: "lz4 in frames", ZSTDF: "zstd in frames"}
# 0, each chunk one stream, by default: frames made small random I/O a little faster (4K random writes +17 %,
# reads +5 %) and large I/O slower (1 MiB sequential writes -25 %, reads -16 %) (docs/benchmarks.md, "Frames
# within chunks"), and compression suits data written in large pieces
DEFAULT_FRAME = 0
FRAME_SIZES = (0, 4096, 8192, 16384, 32768)   # 0: the chunk is one stream


def check_frame(frame: int, chunk: int) -> str | None:
    """Why `frame` cannot be the frame size of `chunk`-byte chunks (one line), or None."""
    if frame not in FRAME_SIZES or (frame and frame >= chunk):
        return (f"frame size {frame}: use 0 (each chunk one stream) or "
                f"{', '.join(str(f >> 10) + ' KiB' for f in FRAME_SIZES[1:] if f < chunk)} (smaller than the "
                f"{chunk >> 10} KiB chunk)")
    return None
ZSTD_LEVELS = (1, 19)
HEADER = struct.Struct("<4sBBHIQQII")     # magic, version, algo, frame shift, chunk size, index, generation,
                                          # payload length, payload crc (of a framed payload: of its table)
HEADER_BYTES = 64                         # the header, its own CRC32C after it, zeros to 64


class CompressError(ValueError):
    """The compressed volume cannot be set up as asked; str() is one line for the user."""


def parse_compression(value: str) -> tuple[str, int]:
    """'lz4', 'zstd' or 'zstd:N' -> (algorithm, level); ValueError with one line otherwise."""
    name, _, level = value.partition(":")
    if name not in ALGOS:
        raise ValueError(f"compression {value!r}: use \"lz4\", \"zstd\" or \"zstd:LEVEL\"")
    if name == "lz4":
        if level:
            raise ValueError(f"compression {value!r}: lz4 takes no level")
        return name, 0
    if not level:
        return name, 3
    if not level.isdigit() or not ZSTD_LEVELS[0] <= int(level) <= ZSTD_LEVELS[1]:
        raise ValueError(f"compression {value!r}: a zstd level is {ZSTD_LEVELS[0]} to {ZSTD_LEVELS[1]}")
    return name, int(level)


def slot_bytes(chunk: int) -> int:
    return chunk + UNIT


def backing_size(size: int, chunk: int = DEFAULT_CHUNK) -> int:
    """The thin volume's size under a compressed volume of `size` bytes: two slots per chunk."""
    return -(-size // chunk) * 2 * slot_bytes(chunk)


def _running(task: asyncio.Task[None] | None, work: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task[None] | None:
    """`task` where it is still running, else a new task of work() (`task` as it is where no loop runs)."""
    if task is not None and not task.done():
        return task
    try:
        return asyncio.get_running_loop().create_task(work())
    except RuntimeError:
        return task


def _units(n: int) -> int:
    return -(-n // UNIT) * UNIT


class _Codec:
    """The chunk's bytes to a version's (algo, payload) and back; lz4 and zstd are their C libraries.

    With frames (frame > 0; 0 is the default), a version's payload is the chunk's frames each compressed on
    its own, after a table of their stored lengths and CRC32Cs (see the module's docstring): a read decodes
    only the frames it covers, and a small write re-encodes only the frames it changes, the others' stored
    bytes copied as they are. Without (frame 0) the chunk is one stream: it compresses a little better."""

    def __init__(self, algo: str, level: int, chunk: int, frame: int = 0) -> None:
        self.algo, self.level, self.chunk, self.frame = ALGOS[algo], level, chunk, frame
        self.framed = FRAMED[self.algo] if frame else 0            # the algo code of a framed version
        self.shift = frame.bit_length() - 1 if frame else 0
        self.frames = chunk // frame if frame else 0
        self.table = _table(self.frames) if frame else None
        self._zc: Any = None
        self._zd: Any = None

    def _squeeze(self, plain: Buffer) -> bytes:
        if self.algo == LZ4:
            import lz4.block  # type: ignore[import-untyped,unused-ignore]

            return bytes(lz4.block.compress(plain, store_size=False))
        if self._zc is None:
            import zstandard

            self._zc = zstandard.ZstdCompressor(level=self.level)
        return bytes(self._zc.compress(plain))

    def _expand(self, algo: int, payload: Buffer, size: int) -> bytes:
        if algo in (LZ4, LZ4F):
            import lz4.block  # type: ignore[import-untyped,unused-ignore]

            out = bytes(lz4.block.decompress(payload, uncompressed_size=size))
        else:
            if self._zd is None:
                import zstandard

                self._zd = zstandard.ZstdDecompressor()
            out = bytes(self._zd.decompress(payload, max_output_size=size))
        if len(out) != size:
            raise ValueError(f"a chunk or frame decompressed to {len(out)} bytes, not {size}")
        return out

    def encode(self, plain: bytes) -> tuple[int, bytes]:
        if _zero(plain):
            return ZERO, b""
        if self.frame:
            fs = self.frame
            return self.assemble([self.frame_of(memoryview(plain)[i * fs:(i + 1) * fs]) for i in range(self.frames)],
                                 lambda: plain)
        packed = self._squeeze(plain)
        if _units(HEADER_BYTES + len(packed)) >= _units(HEADER_BYTES + self.chunk):
            return RAW, plain       # it would take as many units as the chunk raw: kept raw, read back free
        return self.algo, packed

    # ---- frames

    def frame_of(self, piece: Buffer) -> Frame:
        """One frame's stored form: (length, CRC32C, bytes); length 0 for zeros, the frame's size for raw."""
        if _zero(piece):
            return 0, 0, b""
        packed = self._squeeze(piece)
        if len(packed) >= self.frame:
            packed = bytes(piece)
        return len(packed), crc32c.crc32c(packed), packed

    def plain_of(self, algo: int, f: Frame, size: int = 0) -> bytes:
        """A stored frame back to its plain bytes (`algo`: the version's, LZ4F or ZSTDF; `size`: its frame size,
        0 for this codec's); ValueError where its checksum fails or it does not decode."""
        size = size or self.frame
        n, crc, stored = f
        if not n:
            return bytes(size)
        if crc32c.crc32c(stored) != crc:
            raise ValueError("a frame's checksum does not match")
        if n == size:
            return bytes(stored)
        return self._expand(algo, stored, size)

    def assemble(self, frames: list[Frame], plain: Callable[[], bytes]) -> tuple[int, bytes]:
        """A version from its frames: ZERO when all are zeros, RAW (plain() the chunk) when the frames would
        take as many units as the chunk raw, else the table and the frames."""
        return self.assemble_parts([f[0] for f in frames], [f[1] for f in frames], [f[2] for f in frames], plain)

    def assemble_parts(self, lens: list[int], crcs: list[int], parts: list[Buffer],
                       plain: Callable[[], bytes]) -> tuple[int, bytes]:
        """assemble() from the frames' lengths and checksums and their stored bytes in order, in `parts` (a part
        may hold several frames: a run copied from an older version)."""
        if not any(lens):
            return ZERO, b""
        table = self.table.pack(*lens, *crcs)  # type: ignore[union-attr]
        size = len(table) + sum(lens)
        if _units(HEADER_BYTES + size) >= _units(HEADER_BYTES + self.chunk):
            return RAW, plain()
        return self.framed, b"".join([table, *parts])

    def decode(self, algo: int, payload: Buffer, shift: int = 0) -> bytes:
        """The plain chunk (bytes of its own: `payload` may be a view of the device's memory)."""
        if algo == RAW:
            return bytes(payload)
        if algo == ZERO:
            return bytes(self.chunk)
        if algo in (LZ4F, ZSTDF):
            return self.decode_part(algo, payload, shift, 0, self.chunk)
        return self._expand(algo, payload, self.chunk)

    def decode_part(self, algo: int, payload: Buffer, shift: int, start: int, n: int) -> bytes:
        """Bytes [start, start+n) of a framed version's chunk, decoding only the frames they cover; ValueError
        where a frame's checksum or decoding fails."""
        lens, crcs, starts = frame_table(payload, self.chunk >> shift)
        return self.decode_frames(algo, shift, (lens, crcs, starts), payload, 0, start, n)

    def decode_frames(self, algo: int, shift: int, table: FrameTable, data: Buffer, base: int, start: int,
                      n: int) -> bytes:
        """decode_part from the version's table and `data`, bytes of its payload from offset `base` on that
        hold the frames the range covers."""
        fs = 1 << shift
        lens, crcs, starts = table
        first, last = start >> shift, (start + n - 1) >> shift
        view = memoryview(data)
        out = []
        for i in range(first, last + 1):
            k, at = lens[i], starts[i] - base
            try:
                out.append(self.plain_of(algo, (k, crcs[i], view[at:at + k]), fs))
            except ValueError as e:
                raise ValueError(f"frame {i}: {e}") from None
        whole = out[0] if len(out) == 1 else b"".join(out)
        skip = start - (first << shift)
        return whole if skip == 0 and len(whole) == n else whole[skip:skip + n]


Frame = tuple[int, int, Buffer]     # a frame as stored: (length, CRC32C, bytes)
FrameTable = tuple[tuple[int, ...], tuple[int, ...], list[int]]   # lengths, CRC32Cs, starts in the payload


@functools.cache
def _table(frames: int) -> struct.Struct:
    return struct.Struct(f"<{frames}H{frames}I")


def frame_table(payload: Buffer, frames: int) -> FrameTable:
    """A framed payload's table: each frame's stored length and CRC32C, and where its bytes start."""
    t = _table(frames)
    fields = t.unpack_from(payload)
    lens, crcs = fields[:frames], fields[frames:]
    starts, at = [], t.size
    for k in lens:
        starts.append(at)
        at += k
    return lens, crcs, starts


def framed_ok(payload: Buffer, pcrc: int, shift: int, chunk: int) -> bool:
    """A framed payload whose table checksum (the header's) and every frame's checksum hold, and whose
    lengths add up to it."""
    frames = chunk >> shift
    t = _table(frames)
    if len(payload) < t.size or crc32c.crc32c(memoryview(payload)[:t.size]) != pcrc:
        return False
    lens, crcs, starts = frame_table(payload, frames)
    if any(k > (1 << shift) for k in lens) or t.size + sum(lens) != len(payload):
        return False
    view = memoryview(payload)
    return all(not k or crc32c.crc32c(view[at:at + k]) == crc for k, crc, at in zip(lens, crcs, starts))


class _Flush:
    """A flush under way: the write sequence it covers, and whether (done) the device below flushed (ok)."""

    def __init__(self, cut: int) -> None:
        self.cut, self.ok, self.done = cut, False, asyncio.Event()


_ZEROS: dict[int, bytes] = {}


def _zero(buf: Buffer) -> bool:
    """All zeros: compared with as many zero bytes (memcmp; a frame, a chunk or a slot: few sizes)."""
    view = memoryview(buf)
    if view.format != "B":
        view = view.cast("B")
    n = view.nbytes
    zeros = _ZEROS.get(n)
    if zeros is None:
        zeros = _ZEROS[n] = bytes(n)
    return view == zeros


def pack_header(algo: int, chunk: int, index: int, gen: int, payload: bytes, shift: int = 0) -> bytes:
    """A version's header; `shift`: log2 of a framed version's frame size (0 unframed)."""
    crc = crc32c.crc32c(memoryview(payload)[:_table(chunk >> shift).size] if shift else payload)
    h = HEADER.pack(MAGIC, VERSION, algo, shift, chunk, index, gen, len(payload), crc)
    return (h + struct.pack("<I", crc32c.crc32c(h))).ljust(HEADER_BYTES, b"\0")


def _header_fields(raw: Buffer) -> tuple[Any, ...] | None:
    """A slot's first bytes as a header of this format and version whose own checksum holds (magic, version,
    algo, 0, chunk size, index, generation, length, payload crc), of any chunk; None where they are not."""
    b = bytes(raw[:HEADER_BYTES])
    if len(b) < HEADER_BYTES or b[:4] != MAGIC:
        return None
    (hcrc,) = struct.unpack_from("<I", b, HEADER.size)
    if crc32c.crc32c(b[:HEADER.size]) != hcrc or b[4] != VERSION:
        return None
    return HEADER.unpack_from(b)


def read_header(raw: Buffer, chunk: int, index: int) -> tuple[int, int, int, int, int] | None:
    """(algo, generation, payload length, payload crc, frame shift) of a slot's first bytes, or None where they
    are not a valid header of this chunk (zeros, noise, a torn write, another chunk size)."""
    f = _header_fields(raw)
    if f is None:
        return None
    _, _, algo, shift, csize, idx, gen, length, pcrc = f
    if (algo not in ALGO_NAMES or csize != chunk or idx != index or length > chunk or (algo == ZERO and length)
            or (algo == RAW and length != chunk)):
        return None
    if algo in (LZ4F, ZSTDF):
        if (1 << shift) not in FRAME_SIZES[1:] or (1 << shift) >= chunk or length < _table(chunk >> shift).size:
            return None
    elif shift:
        return None
    return algo, gen, length, pcrc, shift


def payload_ok(algo: int, shift: int, payload: Buffer, pcrc: int, chunk: int) -> bool:
    """A version's payload checks against its header: its CRC32C, or a framed one's table and frames."""
    if algo in (LZ4F, ZSTDF):
        return framed_ok(payload, pcrc, shift, chunk)
    return crc32c.crc32c(payload) == pcrc


@register_layer
class CompressLayer(Layer):
    type_name = "compress"

    def __init__(self, below: BlockDevice, settings: dict[str, Any]) -> None:
        super().__init__(below, name=f"compress:{getattr(below, 'name', '?')}")
        self.settings = settings
        algo, level = parse_compression(str(settings.get("algorithm", "lz4")))
        self.chunk = int(settings.get("chunk_size", DEFAULT_CHUNK))
        if self.chunk not in CHUNKS:
            raise CompressError(f"chunk size {self.chunk}: use one of {', '.join(str(c >> 10) + ' KiB' for c in CHUNKS)}")
        bbs = below.block_size
        if UNIT % bbs:
            raise CompressError(f"the device's {bbs}-byte blocks do not divide {UNIT}")
        frame = settings.get("frame_size")
        self.frame = self._frame_size(None if frame is None else int(frame))
        self.codec = _Codec(algo, level, self.chunk, self.frame)
        self.slot = slot_bytes(self.chunk)
        self._bbs = bbs
        self._per = self.chunk // bbs                  # layer blocks per chunk (the layer's block is the device's)
        # over a snapshot (served read-only): read as it is, stale versions left where they are
        self.read_only = read_only_stack(below)
        self._below_read_now = getattr(below, "read_now", None) if below.capabilities.sync_read else None
        self._below_write_now = getattr(below, "write_now", None) if below.capabilities.sync_write else None
        # where the device can say beforehand whether write_now would write (a thin volume), write_now asks it
        # before it encodes
        self._below_can_write_now = getattr(below, "can_write_now", None)
        # the blocks a framed version's header and table take at most (4 KiB frames)
        self._head_blocks = -(-(HEADER_BYTES + _table(self.chunk // FRAME_SIZES[1]).size) // bbs)
        self._upu = UNIT // bbs                        # blocks per 4 KiB unit of the write cache
        self._cache_limits(int(settings.get("cache_size", DEFAULT_CACHE)))
        self._cleaner: asyncio.Task[None] | None = None
        self._reclaimer: asyncio.Task[None] | None = None
        self._reclaim_timer: asyncio.TimerHandle | None = None
        self._reclaim_seq = -1                         # the write sequence when the idle timer was armed
        self._free_share: Callable[[], float] | None = getattr(below, "free_share", None)
        self.reclaims = 0                              # flushes the layer made itself (RECLAIM_*)
        self._fresh()

    def _cache_limits(self, size: int) -> None:
        """The most bytes of small writes kept in memory (whole 4 KiB units; 0: none): past three quarters of
        it the cleaner writes the oldest chunks back, down to half; a write that would pass it goes to the
        device at once, with what the cache held of its chunk."""
        if size < 0:
            raise CompressError(f"cache size {size}: use 0 (no cache) or more")
        self.cache_size = size - size % UNIT
        self._cap = self.cache_size // UNIT
        self._soft, self._low = self._cap * 3 // 4, self._cap // 2

    def set_cache(self, size: int | None) -> None:
        """Another write cache size (None: the default) while the volume serves: what the cache holds past it
        goes to the device (the cleaner), all of it for 0."""
        self._cache_limits(DEFAULT_CACHE if size is None else size)
        self.settings = {**{k: v for k, v in self.settings.items() if k != "cache_size"},
                         **({"cache_size": size} if size is not None else {})}
        if self._dirty_units > self._soft:
            self._kick()

    def _fresh(self) -> None:
        """State for a device not read yet: no chunk holds anything."""
        n = self.chunks
        self.cur = np.full(n, -1, dtype=np.int8)       # the slot of the newest version (-1: none, reads zeros)
        self.dur = np.full(n, -1, dtype=np.int8)       # the slot of the newest durable version (-1: none)
        self.gen = np.zeros(n, dtype=np.uint64)        # the newest version's generation
        self.algo = np.full(n, ZERO, dtype=np.uint8)   # the newest version's algorithm
        self.held = np.zeros((n, 2), dtype=np.uint32)  # bytes each slot may hold mapped (whole units)
        self._written: dict[int, int] = {}             # chunk -> write sequence of its newest version, not durable
        self._zeroed: dict[int, int] = {}              # chunk -> sequence at which its old slot's unmap was issued
        self._seq = 0
        self._flushed = 0                        # the write sequence the last completed flush covered
        self._tidy: dict[int, int] = {}   # chunk -> bytes of the durable version write_now wrote: at the next
                                          # flush its other slot goes, and its own clusters past those bytes
        self._locks: dict[int, list[Any]] = {}   # chunk -> [lock, users]
        self._flushes: list[_Flush] = []         # flushes under way
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        # chunk -> (generation, slot, algo, payload length, frame shift, table) of a framed version read_now
        # read, its table's checksum checked: a small read of it then reads only its frames. A later version has
        # another generation, so an entry is only ever used for the version it was read from.
        self._tables: OrderedDict[int, tuple[int, int, int, int, int, FrameTable]] = OrderedDict()
        # the write cache: chunk -> {4 KiB unit in the chunk: its bytes}, oldest chunk first; newer than every
        # version of the chunk. A chunk's units leave together, under its lock, when its version is written
        self._dirty: OrderedDict[int, dict[int, bytes]] = OrderedDict()
        self._dirty_units = 0
        self.bytes_in = self.bytes_out = 0             # plain and stored bytes written since open (for stats)
        self._foreign = self._noise = 0                # what load() found that is not of this layout

    # ---- what it states

    @property
    def chunks(self) -> int:
        return (self.below.num_blocks * self._bbs) // (2 * self.slot)

    @property
    def num_blocks(self) -> int:
        return self.chunks * self._per

    @property
    def capabilities(self) -> Capabilities:
        caps = self.below.capabilities
        return caps.but(sync_write=self._below_write_now is not None, write_window=False, unmap_reads_zero=True,
                        write_zeroes=True, extents=True, thin=True, volatile_cache=True,
                        atomic_write=0)

    def allocated_blocks(self) -> int:
        """Blocks of chunks that hold data (NVMe NUSE, SCSI provisioning): the plain size, not the stored."""
        live = (self.cur >= 0) & (self.algo != ZERO)
        return (int(np.count_nonzero(live)) + sum(1 for c in self._dirty if not live[c])) * self._per

    def stats(self) -> dict[str, Any]:
        """What `vsan volume show` says of it (as compress_stats)."""
        live = (self.cur >= 0) & (self.algo != ZERO)
        chunks = int(np.count_nonzero(live))
        stored = int(self.held[live, :].sum()) if chunks else 0
        plain = chunks * self.chunk
        return {"algorithm": self.settings.get("algorithm", "lz4"), "chunk_size": self.chunk, "frame_size": self.frame,
                "chunks": chunks, "plain_bytes": plain, "stored_bytes": stored,
                "ratio": round(plain / stored, 2) if stored else 1.0,
                "raw_chunks": int(np.count_nonzero(live & (self.algo == RAW))),
                "cache_size": self.cache_size, "cached_bytes": self._dirty_units * UNIT,
                "cached_chunks": len(self._dirty), "reclaims": self.reclaims}

    # ---- opening: every mapped slot read, each chunk's newest valid version chosen

    async def load(self) -> None:
        """Reads what the device holds (slots a thin volume reports unmapped are skipped); stale slots are
        unmapped, then (one flush later) zero versions. What the device holds is flushed first: a version read
        here is taken as durable (the stack may be opened again over a volume that is serving)."""
        await self.below.flush()
        n = self.chunks
        todo = self._mapped_chunks(await self._extents()) if self.below.capabilities.extents else range(n)
        stale: list[tuple[int, int]] = []
        batch: list[int] = []

        async def scan(batch: list[int]) -> None:
            # runs of consecutive chunks read in one request each
            start = 0
            while start < len(batch):
                end = start + 1
                while end < len(batch) and batch[end] == batch[end - 1] + 1:
                    end += 1
                first, count = batch[start], end - start
                raw = await self.below.read(first * 2 * self.slot // self._bbs, count * 2 * self.slot // self._bbs)
                for k in range(count):
                    self._choose(first + k, memoryview(raw)[k * 2 * self.slot:(k + 1) * 2 * self.slot], stale)
                start = end

        for c in todo:
            batch.append(c)
            if len(batch) >= SCAN_CHUNKS:
                await scan(batch)
                batch = []
        if batch:
            await scan(batch)
        self.dur[:] = self.cur
        self._layout_check(n)
        if self.read_only:
            log.info("%s: %d chunks hold data (%s; read-only)", self.name, int(np.count_nonzero(self.cur >= 0)),
                     self.settings.get("algorithm", "lz4"))
            return
        zeros = [c for c in range(n) if self.cur[c] >= 0 and self.algo[c] == ZERO] if n else []
        for c, s in stale:
            await self._unmap_slot(c, s, 0)
        if stale and zeros:
            await self.below.flush()
        for c in zeros:
            await self._unmap_slot(c, int(self.cur[c]), 0)
            self.cur[c] = self.dur[c] = -1
        if zeros:
            await self.below.flush()
        log.info("%s: %d chunks hold data (%s), %d stale versions dropped", self.name,
                 int(np.count_nonzero(self.cur >= 0)), self.settings.get("algorithm", "lz4"), len(stale))

    def _layout_check(self, n: int) -> None:
        """CompressError, before anything is unmapped, where what the slots hold is not this layer's layout: a
        header of another chunk size (compression_chunk changed), or far more slots of data without a valid
        header than a crash can tear (the volume was written uncompressed, or in other chunks). A crash tears
        at most the versions in flight, which load() then unmaps."""
        valid = int(np.count_nonzero(self.cur >= 0)) if n else 0
        if self._foreign:
            raise CompressError(f"{self.name}: its chunks are {self._foreign >> 10} KiB, not {self.chunk >> 10} KiB "
                                "(a compression chunk changed in the config?); nothing was changed")
        if self._noise > max(256, valid // 4):
            raise CompressError(f"{self.name}: {self._noise} slots hold data that is not a {self.chunk >> 10} KiB "
                                f"chunk of this layer ({valid} are): not written compressed, or in other chunks; "
                                "nothing was changed")

    async def reload(self) -> None:
        """The data below changed as a whole (a rollback to a snapshot): read it anew (I/O is drained; what the
        write cache held was written before the change, and goes with the data it was written over)."""
        await self._stop_cleaner()
        await self._stop_reclaimer()
        self._fresh()
        await self.load()

    async def _extents(self) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        lba, end = 0, self.below.num_blocks
        while lba < end:
            runs = await self.below.lba_status(lba, end - lba)  # type: ignore[attr-defined]
            if not runs:
                break
            out += runs
            lba = runs[-1][0] + runs[-1][1]
        return out

    def _mapped_chunks(self, runs: list[tuple[int, int, int]]) -> list[int]:
        span = 2 * self.slot // self._bbs
        seen: set[int] = set()
        for lba, blocks, state in runs:
            if state == 0:   # mapped
                seen.update(range(lba // span, min(self.chunks, -(-(lba + blocks) // span))))
        return sorted(seen)

    def _choose(self, c: int, pair: memoryview, stale: list[tuple[int, int]]) -> None:
        best: tuple[int, int, int] | None = None     # (gen, slot, algo)
        valid = []
        for s in (0, 1):
            raw = pair[s * self.slot:(s + 1) * self.slot]
            h = read_header(raw, self.chunk, c)
            if h is None:
                if not _zero(raw):
                    stale.append((c, s))   # noise or a torn version: its clusters go back
                    self._noise += 1
                    f = _header_fields(raw)
                    if f is not None and f[4] != self.chunk:
                        self._foreign = f[4]
                continue
            algo, gen, length, pcrc, shift = h
            if not payload_ok(algo, shift, raw[HEADER_BYTES:HEADER_BYTES + length], pcrc, self.chunk):
                stale.append((c, s))
                continue
            self.held[c, s] = _units(HEADER_BYTES + length)
            valid.append(s)
            if best is None or gen > best[0]:
                best = (gen, s, algo)
        if best is None:
            return
        gen, s, algo = best
        self.cur[c], self.gen[c], self.algo[c] = s, gen, algo
        for o in valid:
            if o != s:
                stale.append((c, o))

    # ---- I/O

    @contextlib.asynccontextmanager
    async def _chunk(self, c: int) -> AsyncIterator[None]:
        entry = self._locks.get(c)
        if entry is None:
            entry = self._locks[c] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[c]

    def _pieces(self, lba: int, blocks: int) -> list[tuple[int, int, int]]:
        """(chunk, first block in it, blocks) over [lba, lba+blocks)."""
        out = []
        while blocks:
            c, off = divmod(lba, self._per)
            n = min(blocks, self._per - off)
            out.append((c, off, n))
            lba, blocks = lba + n, blocks - n
        return out

    def _span(self, c: int, s: int) -> tuple[int, int]:
        """(lba, blocks) of what slot s of chunk c holds mapped, on the device below."""
        return (c * 2 + s) * self.slot // self._bbs, int(self.held[c, s]) // self._bbs

    def _plain_known(self, c: int) -> bytes | None:
        """The chunk in plain where no read is needed (the cache, or a chunk of zeros); else None."""
        hit = self._cache.get(c)
        if hit is not None:
            self._cache.move_to_end(c)
            return hit
        if self.cur[c] < 0 or self.algo[c] == ZERO:
            return bytes(self.chunk)
        return None

    async def _plain(self, c: int) -> bytes:
        """The chunk's newest version in plain (its lock held)."""
        known = self._plain_known(c)
        if known is not None:
            return known
        s = int(self.cur[c])
        raw = await self.below.read(*self._span(c, s))
        return self._decoded(c, s, raw)

    def _head(self, c: int, s: int, raw: Buffer) -> tuple[int, int, int, int]:
        """(algo, payload length, payload crc, frame shift) of chunk c's newest version from the first bytes
        read from slot s; MediumError where they are not its header."""
        h = read_header(raw, self.chunk, c)
        if h is None or h[1] != int(self.gen[c]):
            raise MediumError(f"{self.name}: chunk {c}: its version in slot {s} does not read back", c * self._per)
        return h[0], h[2], h[3], h[4]

    def _frames(self, c: int, s: int, payload: memoryview, pcrc: int, shift: int) -> FrameTable:
        """A framed version's table from the start of its payload, its checksum checked (MediumError)."""
        size = _table(self.chunk >> shift).size
        if len(payload) < size or crc32c.crc32c(payload[:size]) != pcrc:
            raise MediumError(f"{self.name}: chunk {c}: checksum mismatch in slot {s}", c * self._per)
        return frame_table(payload, self.chunk >> shift)

    def _decoded(self, c: int, s: int, raw: Buffer, start: int = 0, n: int = 0) -> bytes:
        """Bytes [start, start+n) of the chunk (n 0: all of it, then kept in the cache) from its newest version
        as read from slot s; MediumError where it does not read back whole. Both read paths end here (read_now
        over a framed version reads only the frames it needs, then decodes them with the same call). Of a
        framed version only the frames the range covers are checked and decoded; else the whole payload."""
        algo, length, pcrc, shift = self._head(c, s, raw)
        payload = memoryview(raw)[HEADER_BYTES:HEADER_BYTES + length]
        framed = algo in (LZ4F, ZSTDF)
        if framed and n:
            if len(payload) != length:
                raise MediumError(f"{self.name}: chunk {c}: its version in slot {s} is cut short", c * self._per)
            return self._frames_decoded(c, algo, shift, self._frames(c, s, payload, pcrc, shift), payload, 0,
                                        start, n)
        if not payload_ok(algo, shift, payload, pcrc, self.chunk):
            raise MediumError(f"{self.name}: chunk {c}: checksum mismatch in slot {s}", c * self._per)
        try:
            plain = self.codec.decode(algo, payload, shift)
        except Exception as e:   # noqa: BLE001 - a payload whose checksum holds but does not decode
            raise MediumError(f"{self.name}: chunk {c}: {e}", c * self._per) from None
        self._keep(c, plain)
        return plain[start:start + n] if n else plain

    def _frames_decoded(self, c: int, algo: int, shift: int, table: FrameTable, data: Buffer, base: int,
                        start: int, n: int) -> bytes:
        try:
            return self.codec.decode_frames(algo, shift, table, data, base, start, n)
        except Exception as e:   # noqa: BLE001 - a frame whose checksum fails or that does not decode
            raise MediumError(f"{self.name}: chunk {c}: {e}", c * self._per) from None

    def read_now(self, lba: int, blocks: int) -> Buffer | None:
        """read() in the caller's turn, within one chunk that nobody holds (a write holds its chunk across its
        awaits; this path has none), from the cache or the device's own fast path; else None. Of a framed
        version it reads the header and table (kept for the next read of that version: _tables), then only the
        frames the read covers."""
        per = self._per
        c, off = divmod(lba, per)
        if off + blocks > per or c in self._locks:
            return None
        d = self._dirty.get(c)
        if d is None:
            return self._stored_now(c, off, blocks)
        bs = self._bbs
        start, n = off * bs, blocks * bs
        u0, u1 = start // UNIT, (start + n - 1) // UNIT
        held = [u in d for u in range(u0, u1 + 1)]
        if not any(held):                                # none of it in the write cache
            return self._stored_now(c, off, blocks)
        if all(held):                                    # all of it
            whole = d[u0] if u0 == u1 else b"".join([d[u] for u in range(u0, u1 + 1)])
            skip = start - u0 * UNIT
            return whole if skip == 0 and len(whole) == n else whole[skip:skip + n]
        base = self._stored_now(c, off, blocks)
        return None if base is None else bytes(_overlaid(base, start, d))

    def _stored_now(self, c: int, off: int, blocks: int) -> Buffer | None:
        """read_now of blocks [off, off+blocks) of chunk c as its newest version holds them (not the cache)."""
        bs = self._bbs
        lba = c * self._per + off
        plain = self._cache.get(c)
        if plain is not None:
            self._cache.move_to_end(c)
            return plain[off * bs:(off + blocks) * bs]
        s = int(self.cur[c])
        algo = self.algo[c]
        if s < 0 or algo == ZERO:
            return bytes(blocks * bs)
        fn = self._below_read_now
        if fn is None:
            return None
        at = (c * 2 + s) * self.slot // bs
        if algo != LZ4F and algo != ZSTDF:
            raw = fn(at, int(self.held[c, s]) // bs)
            return None if raw is None else self._decoded(c, s, raw, off * bs, blocks * bs)
        gen = int(self.gen[c])
        known = self._tables.get(c)
        if known is not None and known[0] == gen and known[1] == s:
            _, _, algo, length, shift, table = known
            self._tables.move_to_end(c)
        else:
            head = fn(at, self._head_blocks)
            if head is None:
                return None
            algo, length, pcrc, shift = self._head(c, s, head)
            table = self._frames(c, s, memoryview(head)[HEADER_BYTES:], pcrc, shift)
            self._tables[c] = (gen, s, algo, length, shift, table)
            if len(self._tables) > TABLE_CHUNKS:
                self._tables.popitem(last=False)
        lens, _, starts = table
        start, n = off * bs, blocks * bs
        first, last = start >> shift, (start + n - 1) >> shift
        lo = (HEADER_BYTES + starts[first]) // bs          # the blocks of the version that hold those frames
        hi = -(-(HEADER_BYTES + starts[last] + lens[last]) // bs)
        if starts[last] + lens[last] > length:
            raise MediumError(f"{self.name}: chunk {c}: its table in slot {s} does not fit its payload", lba)
        body = fn(at + lo, max(1, hi - lo))
        if body is None:
            return None
        return self._frames_decoded(c, algo, shift, table, body, lo * bs - HEADER_BYTES, start, n)

    def _keep(self, c: int, plain: bytes) -> None:
        self._cache[c] = plain
        self._cache.move_to_end(c)
        while len(self._cache) > CACHE_CHUNKS:
            self._cache.popitem(last=False)

    async def read(self, lba: int, blocks: int) -> Buffer:
        """Each chunk by read_now where it answers (no lock: it does not wait), else under the chunk's lock."""
        bs = self._bbs
        if blocks <= self._per and lba // self._per == (lba + blocks - 1) // self._per:
            fast = self.read_now(lba, blocks)
            if fast is not None:
                return fast
            c, off = divmod(lba, self._per)
            return await self._read_locked(c, off, blocks)
        out = bytearray(blocks * bs)
        at = 0
        for c, off, n in self._pieces(lba, blocks):
            piece = self.read_now(c * self._per + off, n)
            if piece is None:
                piece = await self._read_locked(c, off, n)
            out[at:at + n * bs] = piece
            at += n * bs
        return out

    async def _read_locked(self, c: int, off: int, blocks: int) -> Buffer:
        """Blocks [off, off+blocks) of chunk c under its lock: its newest version, under what the write cache
        holds of it."""
        bs = self._bbs
        async with self._chunk(c):
            plain = await self._plain(c)
            piece = plain[off * bs:(off + blocks) * bs]
            d = self._dirty.get(c)
            return piece if d is None else _overlaid(piece, off * bs, d)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        if not fua and self._takes(lba, data):
            # the cache full: its oldest chunks go first, as the cleaner would take them, then this write joins it
            while self._dirty and self._dirty_units + len(data) // UNIT > self._cap:
                await self._write_back(next(iter(self._dirty)))
            if self._cached(lba, data):
                return
        bs = self._bbs
        view = memoryview(data)
        at = 0
        for c, off, n in self._pieces(lba, len(view) // bs):
            piece = view[at:at + n * bs]
            at += n * bs
            await self._rewrite(c, off, n, piece, fua)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        for c, off, n in self._pieces(lba, blocks):
            await self._rewrite(c, off, n, None, False)

    async def unmap(self, lba: int, blocks: int) -> None:
        await self.write_zeroes(lba, blocks)

    async def _rewrite(self, c: int, off: int, n: int, piece: memoryview | None, fua: bool) -> None:
        """The chunk's new version (blocks [off, off+n) of it replaced by piece, None: zeros) written to the slot
        that does not hold its newest durable version."""
        if self.read_only:
            raise ReadOnly(f"{self.name} is a snapshot (read-only)")
        bs = self._bbs
        async with self._chunk(c):
            await self._store(c, [(off * bs, n * bs, piece)], fua)

    async def _store(self, c: int, runs: list[Run], fua: bool) -> None:
        """Chunk c's new version (its lock held): `runs` (start, bytes, piece; None: zeros) over its newest
        version, after what the write cache holds of it (older), which goes with it; runs [] writes back only
        that. A whole-chunk run replaces what the cache held."""
        d = self._dirty.pop(c, None)
        if d:
            self._dirty_units -= len(d)
            if not (len(runs) == 1 and runs[0][1] == self.chunk):
                runs = _unit_runs(d) + runs
        if not runs:
            return
        try:
            await self._store_runs(c, runs, fua)
        except BaseException:
            if d:
                self._undirty(c, d)     # not stored: the cache holds it again, under what was cached since
            raise

    async def _store_runs(self, c: int, runs: list[Run], fua: bool) -> None:
        bs = self._bbs
        await self._settle(c)
        whole = len(runs) == 1 and runs[0][1] == self.chunk
        s = int(self.cur[c])
        stored: Buffer | None = None          # the newest version as stored, where it is in this codec's frames
        old: bytes | None = None              # else the chunk in plain, where the new version needs it
        if self.codec.frame and not whole and s >= 0 and self.algo[c] == self.codec.framed:
            stored = await self.below.read(*self._span(c, s))
        elif not whole:
            old = await self._plain(c)
        algo, payload, plain = self._encoded(c, s, runs, stored, old)
        if s < 0 and algo == ZERO:
            return     # zeros over zeros: nothing to store
        t = self._target(c)
        gen, body = self._version(c, algo, payload)
        size = len(body)
        at = (c * 2 + t) * self.slot
        self._cache.pop(c, None)
        before = int(self.held[c, t])
        if size > before > 0:
            # longer than what the slot holds: its clusters go first, so that the thin volume provisions the
            # version as one run (write_now writes over physically consecutive clusters only); what the slot
            # held is never the chunk's durable version
            await self.below.unmap(at // bs, before // bs)
            self.held[c, t] = before = 0
        self.held[c, t] = max(before, size)     # a write that fails may have taken clusters: unmapped later
        await self.below.write(at // bs, body, fua=fua)
        if before > size:     # what an older, longer version left past it
            await self.below.unmap((at + size) // bs, (before - size) // bs)
        self.held[c, t] = size
        self._tidy.pop(c, None)
        self._installed(c, t, gen, algo, size, plain)
        if fua:
            await self._durable(c)

    def write_now(self, lba: int, data: Buffer) -> bool:
        """write() in the caller's turn, durable on return (block/device.py SyncWrite), or False with nothing
        written. It takes a write within one chunk that nobody holds, while no flush is under way, where the slot
        its new version goes to (never the one of its newest durable version) still holds clusters enough for
        it, which the device below writes at once and durably (the thin volume's own fast path: clusters it
        alone holds, their mapping committed). That version is then the chunk's durable one, so the next write
        of the chunk goes to the other slot: between flushes a chunk written again and again alternates between
        its two slots, each write in place over the older version. What a version written here leaves (the
        other slot's, and its own slot's clusters past it) goes at the next flush (_tidy), as a version made
        durable by a flush gives its other slot back. The encoding is write()'s (_encoded, _version, _installed);
        the old version comes from the plain-chunk cache or the device's own fast path."""
        if self._takes(lba, data):
            return False    # for the write cache: write_soon (or write) knows whether the write is FUA
        return self._write_durable(lba, data)

    def _write_durable(self, lba: int, data: Buffer) -> bool:
        """write_now's work, for any write (write_soon's FUA writes, and those the cache does not take)."""
        bs, per = self._bbs, self._per
        c, off = divmod(lba, per)
        view = memoryview(data).cast("B") if isinstance(data, memoryview) and data.format != "B" else memoryview(data)
        n = len(view) // bs
        if off + n > per or c in self._dirty:
            return False
        return self._version_now(c, [(off * bs, n * bs, view)])

    def _version_now(self, c: int, runs: list[Run]) -> bool:
        """Chunk c's new version (the runs over its newest) written in the caller's turn and durable, as write_now
        writes one, or False with nothing written."""
        write, read = self._below_write_now, self._below_read_now
        if write is None or read is None or c in self._locks or self._flushes or self.read_only:
            return False
        bs = self._bbs
        s = int(self.cur[c])
        seq = self._written.get(c)
        if s < 0 or (seq is not None and seq <= self._flushed):
            return False    # nothing stored yet, or a completed flush covers it and must settle it first
        t = self._target(c)
        room = int(self.held[c, t])
        at = (c * 2 + t) * self.slot // bs
        if not room or (self._below_can_write_now is not None and not self._below_can_write_now(at, room // bs)):
            return False    # the slot's clusters are to be provisioned, or their mapping committed: write()
        whole = len(runs) == 1 and runs[0][1] == self.chunk
        stored: Buffer | None = None
        old: bytes | None = None
        try:
            if self.codec.frame and not whole and self.algo[c] == self.codec.framed:
                stored = read(*self._span(c, s))
                if stored is None:
                    return False
            elif not whole:
                old = self._plain_now(c)
                if old is None:
                    return False
            algo, payload, plain = self._encoded(c, s, runs, stored, old)
        except MediumError:
            return False    # write() meets it again and reports it
        if algo == ZERO:
            return False    # a chunk of zeros: write() stores it and gives its slots back
        gen, body = self._version(c, algo, payload)
        size = len(body)
        if size > room or not write(at, body):
            return False
        self._cache.pop(c, None)
        self._installed(c, t, gen, algo, size, plain, durable=True)
        self._tidy[c] = size
        self._superseded()
        return True

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
        """A write done in the caller's turn (block/device.py WriteSoon; `done` is called before it returns):
        into the write cache unless it is FUA, else (or where the cache does not take it) as write_now writes.
        False: nothing was done (write() does it). A write the cache would not take at all, write_now has taken
        or declined already (the frontends ask it first): declined here at once, not encoded twice."""
        if not self._takes(lba, data):
            return False
        if (not fua and self._cached(lba, data)) or self._write_durable(lba, data):
            done(None)
            return True
        return False

    # ---- the write cache

    def _takes(self, lba: int, data: Buffer) -> bool:
        """Whether the cache takes a write of `data` at `lba` by its shape: the cache on, the layer writable,
        whole 4 KiB units within one chunk, less than all of it (a whole chunk is encoded at once: nothing to
        gain by waiting)."""
        if not self._cap or self.read_only:
            return False
        off, n, upu = lba % self._per, len(data) // self._bbs, self._upu
        return not (off % upu or n % upu) and off + n <= self._per and n < self._per

    def _cached(self, lba: int, data: Buffer) -> bool:
        """A write the cache takes (_takes, which the caller asked) kept in it (done: as durable as a write
        without FUA), or False where the cache is full and its oldest chunk cannot go in this turn (then the
        write goes to the device, with what the cache holds of its chunk)."""
        k = len(data) // UNIT
        while self._dirty_units + k > self._cap:
            # full: its oldest chunk goes in this turn where it can (as write_now writes), else the cleaner's
            if not self._dirty or not self._write_back_now(next(iter(self._dirty))):
                self._kick()
                return False
        c, off = divmod(lba, self._per)
        d = self._dirty.get(c)
        if d is None:
            d = self._dirty[c] = {}
        u = off // self._upu
        if k == 1:
            if u not in d:
                self._dirty_units += 1
            d[u] = bytes(data)
        else:
            view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
            for i in range(k):
                if u + i not in d:
                    self._dirty_units += 1
                d[u + i] = bytes(view[i * UNIT:(i + 1) * UNIT])
        if self._dirty_units >= self._soft:
            self._kick()
        return True

    def _undirty(self, c: int, d: dict[int, bytes]) -> None:
        """Units of chunk c taken from the cache and not stored: back in it (first to go), under newer ones."""
        newer = self._dirty.get(c) or {}
        merged = {**d, **newer}
        self._dirty_units += len(merged) - len(newer)
        self._dirty[c] = merged
        self._dirty.move_to_end(c, last=False)

    def _kick(self) -> None:
        """The cleaner started, where it is not running (and there is a loop to run it)."""
        self._cleaner = _running(self._cleaner, self._clean)

    async def _clean(self) -> None:
        """The oldest chunks written back until the cache holds half of what it may, for at most CLEAN_TURN
        seconds at a time: requests go on between (the loop's other callbacks run)."""
        try:
            while self._dirty and self._dirty_units > self._low:
                until = time.perf_counter() + CLEAN_TURN
                while self._dirty and self._dirty_units > self._low and time.perf_counter() < until:
                    await self._write_back(next(iter(self._dirty)))
                await asyncio.sleep(0)
        except Exception as e:  # noqa: BLE001 - the units stay cached; the next flush reports the failure
            log.error("%s: writing its cache back failed: %s", self.name, e)

    def _write_back_now(self, c: int) -> bool:
        """What the cache holds of chunk c written in the caller's turn (_version_now), or False with nothing
        done."""
        d = self._dirty.get(c)
        if d is None:
            return True
        if not self._version_now(c, _unit_runs(d)):
            return False
        del self._dirty[c]
        self._dirty_units -= len(d)
        return True

    async def _write_back(self, c: int) -> None:
        """What the cache holds of chunk c written: in the caller's turn where it can be, else under its lock."""
        if self._write_back_now(c):
            return
        async with self._chunk(c):
            if c in self._dirty:
                await self._store(c, [], False)

    async def write_back(self) -> None:
        """What the write cache holds, written to the device (not flushed: a flush does that too). A reclaim under
        way is finished and none is left armed: the data below may change as a whole next (a rollback), and a
        reclaim would then unmap slots of the new data (one is armed again by the next version written)."""
        await self._write_back_all()
        await self._stop_reclaimer()

    async def _write_back_all(self) -> None:
        for c in list(self._dirty):
            await self._write_back(c)

    async def _stop_cleaner(self) -> None:
        t, self._cleaner = self._cleaner, None
        if t is not None and not t.done():
            t.cancel()
            await asyncio.wait([t])

    async def close(self) -> None:
        """What the write cache holds goes to the device, flushed (the layer may go on serving: a stack rebuilt
        over it keeps it)."""
        await self._stop_cleaner()
        await self._stop_reclaimer()
        if self._dirty:
            await self.flush()

    # ---- reclaiming the slots of superseded versions without a flush from the initiator (RECLAIM_*)

    def _superseded(self) -> None:
        """A chunk's newest version is not durable yet, or its other slot still held (_written, _tidy): reclaim
        now if the group runs low on free clusters, else once the layer is idle (where none is armed or running)."""
        if self._reclaimer is not None and not self._reclaimer.done():
            return
        if self._free_share is not None and self._free_share() < RECLAIM_FREE:
            self._reclaim()
        elif self._reclaim_timer is None:
            self._arm_idle()

    def _arm_idle(self) -> None:
        try:
            self._reclaim_timer = asyncio.get_running_loop().call_later(RECLAIM_AFTER, self._idle)
        except RuntimeError:
            return
        self._reclaim_seq = self._seq

    def _disarm(self) -> None:
        if self._reclaim_timer is not None:
            self._reclaim_timer.cancel()
            self._reclaim_timer = None

    def _idle(self) -> None:
        """The idle timer: a reclaim if no version was written since it was armed, else armed again (nothing
        where a flush from above has given everything back meanwhile)."""
        self._reclaim_timer = None
        if not (self._written or self._tidy):
            return
        if self._seq != self._reclaim_seq:
            self._arm_idle()
        else:
            self._reclaim()

    def _reclaim(self) -> None:
        """A flush of the versions written (not of the write cache: its units are no versions yet) started."""
        self._disarm()
        self._reclaimer = _running(self._reclaimer, self._reclaiming)

    async def _reclaiming(self) -> None:
        self.reclaims += 1
        try:
            await self._flush_versions()
        except Exception as e:  # noqa: BLE001 - the slots stay held; the next flush reports the failure
            log.warning("%s: flushing its versions to give superseded slots back failed: %s", self.name, e)

    async def _stop_reclaimer(self) -> None:
        """No reclaim armed, and the one under way (if any) finished, not cancelled: a flush is not cut."""
        self._disarm()
        t, self._reclaimer = self._reclaimer, None
        if t is not None and not t.done():
            await asyncio.wait([t])

    def _target(self, c: int) -> int:
        """The slot chunk c's next version goes to: not the one of its newest durable version."""
        d = int(self.dur[c])
        return 1 - d if d >= 0 else max(0, int(self.cur[c]))

    def _encoded(self, c: int, s: int, runs: list[Run], stored: Buffer | None,
                 old: bytes | None) -> tuple[int, bytes, bytes | None]:
        """(algo, payload, the plain chunk where it is at hand) of chunk c's new version: each run (start, bytes,
        piece; None: zeros) written over the chunk in order, over its newest version in slot s as stored
        (`stored`, where that is in this codec's frames) or in plain (`old`; None for a write of the whole chunk,
        or nothing stored)."""
        whole = len(runs) == 1 and runs[0][1] == self.chunk
        if self.codec.frame and not whole:
            return self._reframed(c, s, runs, stored, old)
        plain = _patched(None if whole else old, runs, self.chunk)
        algo, payload = self.codec.encode(plain)
        return algo, payload, plain

    def _version(self, c: int, algo: int, payload: bytes) -> tuple[int, bytes]:
        """(generation, bytes in whole units) of chunk c's next version."""
        gen = int(self.gen[c]) + 1
        head = pack_header(algo, self.chunk, c, gen, payload, self.codec.shift if algo in (LZ4F, ZSTDF) else 0)
        n = HEADER_BYTES + len(payload)
        return gen, b"".join([head, payload, _ZEROS.get(_units(n) - n) or bytes(_units(n) - n)])

    def _installed(self, c: int, t: int, gen: int, algo: int, size: int, plain: bytes | None,
                   durable: bool = False) -> None:
        """Chunk c's newest version is now the one written to slot t (durable, or not yet). (A framed version's
        table is not kept for the next read here: measured, keeping it cost writes more than it saved.)"""
        self.cur[c], self.gen[c], self.algo[c] = t, gen, algo
        if plain is not None:
            self._keep(c, plain)
        self._seq += 1
        if durable:
            self.dur[c] = t
            self._written.pop(c, None)
        else:
            self._written[c] = self._seq
            self._superseded()
        self._zeroed.pop(c, None)
        self.bytes_in += self.chunk
        self.bytes_out += size

    def _plain_now(self, c: int) -> bytes | None:
        """_plain() in the caller's turn: from the cache or the device's fast path; None where neither answers."""
        known = self._plain_known(c)
        if known is not None or self._below_read_now is None:
            return known
        s = int(self.cur[c])
        raw = self._below_read_now(*self._span(c, s))
        return None if raw is None else self._decoded(c, s, raw)

    def _frame_plain(self, c: int, i: int, f: Frame) -> bytes:
        try:
            return self.codec.plain_of(self.codec.framed, f)
        except ValueError as e:
            raise MediumError(f"{self.name}: chunk {c}: frame {i}: {e}", c * self._per) from None

    def _reframed(self, c: int, s: int, runs: list[Run], stored: Buffer | None,
                  old_plain: bytes | None) -> tuple[int, bytes, bytes | None]:
        """(algo, payload, the plain chunk where it was at hand) of chunk c's new version in frames, the runs
        written over it in order. The frames no run touches are copied as stored (with their checksums) from its
        newest version in slot s where that is in this codec's frames (`stored`, as read): each stretch of them
        between touched frames in one piece. Only the frames the runs touch are encoded, after decoding the old
        frame where they cover part of it. `old_plain`: the chunk in plain where its version is not in these
        frames."""
        codec = self.codec
        fs = codec.frame
        touched = sorted({i for at, n, _ in runs for i in range(at // fs, (at + n - 1) // fs + 1)})
        lens: list[int]
        crcs: list[int]
        if stored is not None:
            algo, length, shift, table = self._table_of(c, s, stored)
            if algo == codec.framed and shift == codec.shift:
                kept = memoryview(stored)[HEADER_BYTES:HEADER_BYTES + length]
                was_lens, was_crcs, starts = table
                lens, crcs = list(was_lens), list(was_crcs)
                fresh: dict[int, Buffer] = {}
                parts: list[Buffer] = []
                nxt = 0                      # the first frame not in parts yet
                for i in touched:
                    f = self._frame_over(c, i, runs, (was_lens[i], was_crcs[i], kept[starts[i]:starts[i] + was_lens[i]]))
                    lens[i], crcs[i], fresh[i] = f
                    if i > nxt:
                        parts.append(kept[starts[nxt]:starts[i]])
                    parts.append(f[2])
                    nxt = i + 1
                if nxt < codec.frames:
                    parts.append(kept[starts[nxt]:])

                def spliced() -> bytes:   # kept raw: every frame decoded (a copied one checked first)
                    return b"".join(
                        self._frame_plain(c, i, (lens[i], crcs[i], fresh[i] if i in fresh
                                                 else kept[starts[i]:starts[i] + lens[i]]))
                        for i in range(codec.frames))

                algo, payload = codec.assemble_parts(lens, crcs, parts, spliced)
                return algo, payload, (payload if algo == RAW else None)
            old_plain = self._decoded(c, s, stored)
        frames: list[Frame] = []
        hit = set(touched)
        for i in range(codec.frames):
            a = i * fs
            if i not in hit:
                frames.append(codec.frame_of(old_plain[a:a + fs]) if old_plain else (0, 0, b""))
                continue
            frames.append(self._frame_over(c, i, runs, old_plain[a:a + fs] if old_plain else None))

        def plain() -> bytes:     # kept raw: every frame decoded
            return b"".join(self._frame_plain(c, i, f) for i, f in enumerate(frames))

        algo, payload = codec.assemble(frames, plain)
        return algo, payload, (payload if algo == RAW else None)

    def _frame_over(self, c: int, i: int, runs: list[Run], was: Frame | bytes | None) -> Frame:
        """Frame i of the new version: the runs (start, bytes, piece; None: zeros) written in order over the old
        frame `was` (as stored, decoded only where the runs cover part of the frame; or in plain; None: zeros)."""
        fs = self.codec.frame
        a, b = i * fs, (i + 1) * fs
        over = [(start, n, piece) for start, n, piece in runs if start < b and start + n > a]
        if len(over) == 1 and over[0][0] <= a and over[0][0] + over[0][1] >= b:
            start, _, piece = over[0]
            return self.codec.frame_of(piece[a - start:b - start] if piece is not None else bytes(fs))
        old = bytes(fs) if was is None else self._frame_plain(c, i, was) if isinstance(was, tuple) else was
        return self.codec.frame_of(_patched(old, [(start - a, n, piece) for start, n, piece in over], fs))

    def _table_of(self, c: int, s: int, stored: Buffer) -> tuple[int, int, int, FrameTable]:
        """(algo, payload length, frame shift, frame table: a framed version's, else empty) of chunk c's newest
        version as read whole from slot s: from _tables where read_now kept them for this version, else from its
        header and table (checked: MediumError)."""
        known = self._tables.get(c)
        if known is not None and known[0] == int(self.gen[c]) and known[1] == s:
            return known[2], known[3], known[4], known[5]
        algo, length, pcrc, shift = self._head(c, s, stored)
        if len(stored) < HEADER_BYTES + length:
            raise MediumError(f"{self.name}: chunk {c}: its version in slot {s} is cut short", c * self._per)
        if algo not in (LZ4F, ZSTDF):
            return algo, length, shift, ((), (), [])
        return algo, length, shift, self._frames(c, s, memoryview(stored)[HEADER_BYTES:HEADER_BYTES + length], pcrc,
                                                 shift)

    async def _durable(self, c: int) -> None:
        """The chunk's newest version is durable (its lock held): the other slot's version goes."""
        s = int(self.cur[c])
        self._written.pop(c, None)
        self.dur[c] = s
        o = 1 - s
        if self.held[c, o]:
            await self._unmap_slot(c, o, 0)
        if self.algo[c] == ZERO:
            self._seq += 1
            self._zeroed[c] = self._seq   # its own slot goes once this unmap is durable (a later flush)

    async def _unmap_slot(self, c: int, s: int, keep: int) -> None:
        at = (c * 2 + s) * self.slot + keep
        await self.below.unmap(at // self._bbs, (self.slot - keep) // self._bbs)
        self.held[c, s] = keep

    async def _settle(self, c: int) -> None:
        """Before a new version of chunk c (its lock held): if a flush under way covers its newest version, that
        version is durable once the flush is done below, and must not be overwritten in place; wait for it and
        make it the durable one, so the new version goes to the other slot. Likewise where a flush that completed
        covers it and has not made it durable yet (_flushed)."""
        seq = self._written.get(c)
        if seq is None:
            return
        if seq <= self._flushed:
            # a flush that completed covers it, and its own pass over the chunks has not come here yet (it
            # yields at each unmap): durable now, as that pass would make it
            await self._durable(c)
            return
        for f in list(self._flushes):
            if f.cut >= seq:
                await f.done.wait()
                if f.ok and self._written.get(c) == seq:
                    await self._durable(c)
                return

    async def flush(self) -> None:
        await self._write_back_all()    # what the cache held when the flush came, in versions it then covers
        await self._flush_versions()

    async def _flush_versions(self) -> None:
        """The versions written so far made durable below, and what they superseded given back."""
        f = _Flush(self._seq)
        self._flushes.append(f)
        try:
            await self.below.flush()
            f.ok = True
            self._flushed = max(self._flushed, f.cut)
        finally:
            f.done.set()
            self._flushes.remove(f)
        cut = f.cut
        # zero versions whose old slot's unmap was issued before this flush: they go too (durable at the next)
        for c in [c for c, seq in self._zeroed.items() if seq <= cut]:
            async with self._chunk(c):
                if self._zeroed.get(c, cut + 1) <= cut and c not in self._written:
                    s = int(self.cur[c])
                    del self._zeroed[c]
                    await self._unmap_slot(c, s, 0)
                    self.cur[c] = self.dur[c] = -1
                    self.gen[c] += 1        # a later version must outrank any copy of this one left behind
        for c in [c for c, seq in self._written.items() if seq <= cut]:
            async with self._chunk(c):
                if self._written.get(c, cut + 1) <= cut:
                    await self._durable(c)
        for c in list(self._tidy):          # what durable versions write_now wrote left behind
            async with self._chunk(c):
                size = self._tidy.pop(c, None)
                d = int(self.dur[c])
                if size is None or d < 0 or int(self.cur[c]) != d:
                    continue
                if self.held[c, 1 - d]:
                    await self._unmap_slot(c, 1 - d, 0)
                if self.held[c, d] > size:
                    await self._unmap_slot(c, d, size)

    async def lba_status(self, lba: int, blocks: int) -> list[tuple[int, int, int]]:
        """(lba, blocks, 0 mapped | 1 deallocated) runs, a chunk at a time (zeros are deallocated)."""
        end = min(lba + blocks, self.num_blocks)
        out: list[tuple[int, int, int]] = []
        while lba < end:
            c = lba // self._per
            state = 0 if (self.cur[c] >= 0 and self.algo[c] != ZERO) or c in self._dirty else 1
            stop = min(end, (c + 1) * self._per)
            if out and out[-1][2] == state:
                a, n, _ = out[-1]
                out[-1] = (a, n + stop - lba, state)
            else:
                out.append((lba, stop - lba, state))
            lba = stop
        return out

    async def resize(self, num_blocks: int) -> None:
        chunks = -(-num_blocks // self._per)
        if chunks < self.chunks and (bool((self.cur[chunks:] >= 0).any()) or any(c >= chunks for c in self._dirty)):
            from openvsan.block.errors import BlockError

            raise BlockError(f"{self.name}: chunks past the new end hold data")
        await self.below.resize(chunks * 2 * self.slot // self._bbs)  # type: ignore[attr-defined]
        self._grow(self.chunks)

    def _grow(self, n: int) -> None:
        old = len(self.cur)
        if n == old:
            return
        def fit(a: np.ndarray, fill: int) -> np.ndarray:
            out = np.full((n,) + a.shape[1:], fill, dtype=a.dtype)
            k = min(n, old)
            out[:k] = a[:k]
            return out
        self.cur, self.dur = fit(self.cur, -1), fit(self.dur, -1)
        self.gen, self.algo, self.held = fit(self.gen, 0), fit(self.algo, ZERO), fit(self.held, 0)

    def _frame_size(self, frame: int | None) -> int:
        """The frame size asked (None: the default), or CompressError where it does not fit the chunk."""
        size = DEFAULT_FRAME if frame is None else frame
        why = check_frame(size, self.chunk)
        if why:
            raise CompressError(why)
        return size

    def set_algorithm(self, value: str, frame: int | None = None) -> None:
        """Another algorithm or frame size (None: the default) for the versions written from now on (each
        version says how it was written)."""
        algo, level = parse_compression(value)
        size = self._frame_size(frame)
        self.codec = _Codec(algo, level, self.chunk, size)
        self.frame = size
        self.settings = {**{k: v for k, v in self.settings.items() if k != "frame_size"}, "algorithm": value,
                         **({"frame_size": frame} if frame is not None else {})}

    # ---- its place in the desired state

    def layer_config(self) -> dict[str, Any]:
        return dict(self.settings)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], below: BlockDevice) -> Layer:
        raise CompressError("a compressed volume is opened by reading its chunks (volume/compress.py "
                            "open_compress), not from its settings alone")


Run = tuple[int, int, "Buffer | None"]   # (start, bytes, piece; None: zeros) of a write within a chunk


def _patched(old: bytes | None, runs: list[Run], size: int) -> bytes:
    """`size` bytes: old (None: the one run covers them whole) with each run written over it in order (runs
    may start before 0 or end past `size`: only what falls within is written)."""
    if old is None:
        _, n, piece = runs[0]
        return bytes(piece) if piece is not None else bytes(n)
    out = bytearray(old)
    for start, n, piece in runs:
        lo, hi = max(0, start), min(size, start + n)
        out[lo:hi] = piece[lo - start:hi - start] if piece is not None else bytes(hi - lo)
    return bytes(out)


def _unit_runs(d: dict[int, bytes]) -> list[Run]:
    """The write cache's units of a chunk as runs, consecutive units joined."""
    out: list[Run] = []
    us = sorted(d)
    i = 0
    while i < len(us):
        j = i + 1
        while j < len(us) and us[j] == us[j - 1] + 1:
            j += 1
        out.append((us[i] * UNIT, (j - i) * UNIT, d[us[i]] if j == i + 1 else b"".join([d[u] for u in us[i:j]])))
        i = j
    return out


def _overlaid(base: Buffer, start: int, d: dict[int, bytes]) -> bytearray:
    """Bytes [start, start+len(base)) of a chunk, `base` under the write cache's units `d` of it."""
    n = len(base)
    out = bytearray(base)
    for u in range(start // UNIT, (start + n - 1) // UNIT + 1):
        p = d.get(u)
        if p is not None:
            lo, hi = max(u * UNIT, start), min((u + 1) * UNIT, start + n)
            out[lo - start:hi - start] = p[lo - u * UNIT:hi - u * UNIT]
    return out


def check_below(below: BlockDevice) -> None:
    """CompressError unless the stack below can give space back: a thin volume, reached with unmaps."""
    for d in stack_of(below):
        if getattr(d, "type_name", None) == "crypt" and not getattr(d, "settings", {}).get("allow_discards"):
            raise CompressError("compression over encryption needs encryption.allow_discards = true (else the "
                                "space of every old version stays allocated)")
    if not any(d.capabilities.thin for d in stack_of(below)):
        raise CompressError("compression needs a volume carved from a device or pool (give it a size): the thin "
                            "volume below is what gives the saved space back")


async def open_compress(cfg: dict[str, Any], below: BlockDevice, *, name: str = "", **_: Any) -> CompressLayer:
    settings = {k: v for k, v in cfg.items() if k != "type"}
    who = f"volume {name}: " if name else ""
    try:
        check_below(below)
        layer = CompressLayer(below, settings)
    except (CompressError, ValueError) as e:
        raise CompressError(f"{who}{e}") from None
    await layer.load()
    return layer


register_opener("compress", open_compress)
