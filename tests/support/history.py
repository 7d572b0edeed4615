"""A Jepsen-style history of block writes, and the checks run on it after a nemesis (issue 12, "Tests").

Writers record every write they attempt; afterwards every block is read back and judged against the history:

    rec = Recorder(dev.block_size, log=tmp_path / "history.jsonl")   # the log outlives a failed run
    writers = [Writer(dev, rec, w, extents) for w, extents in enumerate(stripe(0, 4096, writers=4))]
    ...  # run the writers (Writer.run) while a nemesis (nemesis.py) runs its cycles, then stop them
    report = await check_device(rec.history(), dev)
    assert report.ok, str(report)

The payload format: every block written says which write it is. A block is a 32-byte header (magic, writer
id, LBA, generation, block size), a filler derived from the header (BLAKE2b of it, repeated), and a 16-byte
BLAKE2b checksum of everything before it. A block read back is thus exactly one write of the history, or
zeros (never written), or detected: TORN (checksum wrong: sectors of two writes, or bit rot), GARBAGE (no
magic: not ours), FOREIGN (another LBA's or another writer's block: misdirected I/O), or UNKNOWN (a write
nobody attempted).

The rule (per block): the value read must be a write with generation >= the last ACKED write of that block,
and that write must have been attempted (acked, failed or still in flight: a failed or unfinished write is
"indeterminate", as Jepsen calls it, and may or may not have landed). Older than the last ack: LOST ACK.
A Writer never starts a block's next write before the previous call returned, so a write that failed can
never rightly land after a later one was acked; if it does, it was resurrected (a stale primary's write
getting through after failover) and the check reports the ack it overwrote as lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

MAGIC = b"OVHIST01"
HEADER = struct.Struct(">8sIQQI")  # magic, writer id, lba, generation, block size: 32 bytes
DIGEST = 16  # BLAKE2b-128 of header + filler, at the end of the block
MAX_EXAMPLES = 10

Status = Literal["pending", "acked", "failed"]
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


# -- the payload --------------------------------------------------------------------------------------------


def make_block(writer: int, lba: int, gen: int, block_size: int) -> bytes:
    header = HEADER.pack(MAGIC, writer, lba, gen, block_size)
    fill_len = block_size - HEADER.size - DIGEST
    seed = hashlib.blake2b(header, digest_size=64).digest()
    body = header + (seed * (fill_len // 64 + 1))[:fill_len]
    return body + hashlib.blake2b(body, digest_size=DIGEST).digest()


def make_payload(writer: int, lba: int, blocks: int, gen: int, block_size: int) -> bytes:
    return b"".join(make_block(writer, lba + i, gen, block_size) for i in range(blocks))


@dataclass(frozen=True)
class Decoded:
    """What one block read back is. kind: "zero", "data" (writer/lba/gen valid), "torn", "garbage"."""

    kind: Literal["zero", "data", "torn", "garbage"]
    writer: int = -1
    lba: int = -1
    gen: int = -1


def decode_block(block: bytes | bytearray | memoryview, block_size: int) -> Decoded:
    data = bytes(block)
    if len(data) != block_size:
        return Decoded("garbage")
    if not any(data):
        return Decoded("zero")
    if data[:8] != MAGIC:
        return Decoded("garbage")
    _, writer, lba, gen, bs = HEADER.unpack_from(data)
    if bs != block_size or hashlib.blake2b(data[:-DIGEST], digest_size=DIGEST).digest() != data[-DIGEST:]:
        return Decoded("torn", writer, lba, gen)
    if data != make_block(writer, lba, gen, block_size):
        return Decoded("torn", writer, lba, gen)  # a checksum collision, or a writer of another format
    return Decoded("data", writer, lba, gen)


# -- the history --------------------------------------------------------------------------------------------


@dataclass
class Op:
    op: int
    writer: int
    lba: int
    blocks: int
    gen: int
    t_begin: float
    status: Status = "pending"
    t_end: float | None = None
    why: str = ""

    def covers(self, lba: int) -> bool:
        return self.lba <= lba < self.lba + self.blocks


@dataclass
class History:
    """Every op, or with `compact` (a soak's history: millions of ops) only what judging a block needs: per
    writer and extent, the last acked op and every op begun after it. An older op can only be the value a
    block holds if an ack was lost, and its generation says so on its own (a writer's generations of an extent
    run 1, 2, 3 ...: every one up to the highest begun was attempted)."""

    block_size: int
    ops: dict[int, Op] = field(default_factory=dict)
    claims: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # writer -> [(lba, blocks)]
    meta: dict[str, Any] = field(default_factory=dict)
    compact: bool = False
    counts: dict[str, int] = field(default_factory=lambda: {"pending": 0, "acked": 0, "failed": 0})
    # compact: (writer, lba) -> ids of the ops kept for that extent; the highest generation begun there
    _extent: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    _max_gen: dict[tuple[int, int], int] = field(default_factory=dict)

    def attempted(self, writer: int, lba: int, gen: int) -> bool:
        """Whether `writer` began generation `gen` of a write covering `lba` (compact: by the numbering of the
        extent `writer` claimed there, or of the ops kept on it)."""
        if any(o.writer == writer and o.gen == gen and o.covers(lba) for o in self.ops.values()):
            return True
        if not self.compact:
            return False
        starts = [a for a, n in self.claims.get(writer, ()) if a <= lba < a + n]
        starts += [o.lba for o in self.ops.values() if o.writer == writer and o.covers(lba)]
        return any(1 <= gen <= self._max_gen.get((writer, a), 0) for a in starts)

    def apply(self, ev: Mapping[str, Any]) -> None:
        """One JSON-lines event (Recorder writes them, load() replays them)."""
        kind = ev["ev"]
        if kind == "meta":
            self.block_size = int(ev["block_size"])
            self.meta.update(ev.get("meta", {}))
        elif kind == "claim":
            self.claims.setdefault(int(ev["writer"]), []).extend((int(a), int(n)) for a, n in ev["extents"])
        elif kind == "begin":
            op = int(ev["op"])
            if op in self.ops:
                raise ValueError(f"op {op} begun twice")
            o = self.ops[op] = Op(op, int(ev["writer"]), int(ev["lba"]), int(ev["blocks"]), int(ev["gen"]), ev["t"])
            self.counts["pending"] += 1
            if self.compact:
                key = (o.writer, o.lba)
                self._extent.setdefault(key, []).append(op)
                self._max_gen[key] = max(self._max_gen.get(key, 0), o.gen)
        elif kind in ("ack", "fail"):
            o = self.ops.get(int(ev["op"]))
            if o is None:
                raise ValueError(f"{kind} of op {ev['op']}, which was never begun")
            if o.status != "pending":
                raise ValueError(f"{kind} of op {o.op}, already {o.status}")
            o.status, o.t_end, o.why = ("acked" if kind == "ack" else "failed"), ev["t"], ev.get("why", "")
            self.counts["pending"] -= 1
            self.counts[o.status] += 1
            if self.compact and o.status == "acked":
                # what came before this ack on its extent judges nothing any more: the ack outranks it
                key = (o.writer, o.lba)
                keep = []
                for i in self._extent[key]:
                    older = self.ops[i]
                    if older.gen < o.gen and older.status != "pending":
                        del self.ops[i]
                    else:
                        keep.append(i)
                self._extent[key] = keep
        else:
            raise ValueError(f"unknown history event {kind!r}")

    def count(self, status: Status) -> int:
        return self.counts[status]

    def lbas(self) -> list[int]:
        """Every LBA a writer claimed or wrote, in order."""
        out: set[int] = set()
        for extents in self.claims.values():
            for a, n in extents:
                out.update(range(a, a + n))
        for o in self.ops.values():
            out.update(range(o.lba, o.lba + o.blocks))
        return sorted(out)


def load(path: str | os.PathLike[str], *, compact: bool = False) -> History:
    """A history saved by Recorder (log= or save()), read a line at a time; a last line cut short by a killed
    run is ignored. `compact`: keep only what judging needs (History), for histories of millions of ops."""
    hist = History(0, compact=compact)
    bad: tuple[int, str] | None = None
    with open(path) as f:
        for i, line in enumerate(f):
            if bad is not None:
                raise ValueError(f"{path}:{bad[0] + 1}: not a JSON line: {bad[1][:80]!r}")
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                bad = (i, line)     # the last line of a killed run, unless more follow
                continue
            hist.apply(ev)
    return hist


class Recorder:
    """Where writers record what they do. Every call takes a lock and never awaits, so several threads and
    several asyncio tasks may share one. With `log`, each event is appended to that JSON-lines file as it
    happens (a run killed half-way leaves its history behind as a CI artifact)."""

    def __init__(
        self,
        block_size: int = 512,
        *,
        clock: Clock = time.monotonic,
        log: str | os.PathLike[str] | None = None,
        meta: Mapping[str, Any] | None = None,
        keep: bool = True,
    ) -> None:
        self.clock = clock
        self.keep = keep        # False (a soak's writer process): events only go to `log`, nothing stays here
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._hist = History(block_size)
        self._next = 1
        self._log: IO[str] | None = open(log, "a") if log is not None else None  # noqa: SIM115
        self._emit({"ev": "meta", "block_size": block_size, "meta": dict(meta or {})})

    @property
    def block_size(self) -> int:
        return self._hist.block_size

    def _emit(self, ev: dict[str, Any]) -> None:
        # caller holds the lock (or is __init__)
        if self.keep:
            self._hist.apply(ev)
            self._events.append(ev)
        if self._log is not None:
            self._log.write(json.dumps(ev, separators=(",", ":")) + "\n")
            self._log.flush()

    def claim(self, writer: int, extents: Iterable[tuple[int, int]]) -> None:
        """Writer `writer` owns these (lba, blocks) extents: they are checked even if never written."""
        with self._lock:
            self._emit({"ev": "claim", "writer": writer, "extents": [[a, n] for a, n in extents]})

    def begin(self, lba: int, blocks: int, gen: int, *, writer: int = 0) -> int:
        with self._lock:
            op = self._next
            self._next += 1
            self._emit(
                {"ev": "begin", "op": op, "writer": writer, "lba": lba, "blocks": blocks, "gen": gen, "t": self.clock()}
            )
            return op

    def ack(self, op: int) -> None:
        with self._lock:
            self._emit({"ev": "ack", "op": op, "t": self.clock()})

    def fail(self, op: int, why: str) -> None:
        with self._lock:
            self._emit({"ev": "fail", "op": op, "t": self.clock(), "why": why})

    def history(self) -> History:
        """A snapshot: later events do not change it."""
        if not self.keep:
            raise RuntimeError("this Recorder keeps nothing (keep=False): load() its log")
        with self._lock:
            hist = History(self._hist.block_size)
            for ev in self._events:
                hist.apply(ev)
            return hist

    def save(self, path: str | os.PathLike[str]) -> None:
        with self._lock:
            text = "".join(json.dumps(ev, separators=(",", ":")) + "\n" for ev in self._events)
        Path(path).write_text(text)

    def close(self) -> None:
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None


# -- writers ------------------------------------------------------------------------------------------------


def stripe(first: int, count: int, *, writers: int, blocks: int = 1) -> list[list[tuple[int, int]]]:
    """Split LBAs [first, first+count) into extents of `blocks` blocks, dealt round-robin to `writers`
    writers: each writer's set is disjoint from the others' and spread over the whole range."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(writers)]
    for i, lba in enumerate(range(first, first + count - blocks + 1, blocks)):
        out[i % writers].append((lba, blocks))
    return out


class Writer:
    """Writes increasing generations to its own extents of `dev` (any BlockDevice), `concurrency` writes at
    a time, never two to one extent at once, recording each in `recorder`, until stop() (or `max_writes`
    attempts). A write that raises is recorded as failed (indeterminate) and the writer backs off (doubling
    from `backoff` to `max_backoff`, reset by the next ack) and goes on; cancelling run() leaves the writes
    in flight pending in the history, which is just as indeterminate.

    Generations count per extent and are never reused, a failed attempt's included, so a block read back
    names exactly one attempt."""

    def __init__(
        self,
        dev: Any,
        recorder: Recorder,
        writer: int,
        extents: Sequence[tuple[int, int]],
        *,
        concurrency: int = 4,
        fua: bool = False,
        backoff: float = 0.05,
        max_backoff: float = 1.0,
        sleep: Sleep = asyncio.sleep,
        seed: int = 0,
        max_writes: int | None = None,
    ) -> None:
        if not extents:
            raise ValueError(f"writer {writer}: no extents to write")
        taken: set[int] = set()
        for a, n in extents:
            span = set(range(a, a + n))
            if n < 1 or a < 0 or a + n > dev.num_blocks or span & taken:
                raise ValueError(f"writer {writer}: extent ({a}, {n}) overlaps another or leaves the device")
            taken |= span
        if recorder.block_size != dev.block_size:
            raise ValueError(f"recorder block size {recorder.block_size} != device's {dev.block_size}")
        self.dev, self.recorder, self.writer = dev, recorder, writer
        self.extents = list(extents)
        self.concurrency = max(1, min(concurrency, len(self.extents)))
        self.fua, self.backoff, self.max_backoff, self.sleep = fua, backoff, max_backoff, sleep
        self.max_writes = max_writes
        self.rng = random.Random(seed)
        self.gen: dict[int, int] = {a: 0 for a, _ in self.extents}  # extent start -> last generation tried
        self.acked = self.failed = self.attempts = 0
        self._stopping = False
        self._delay = 0.0
        recorder.claim(writer, self.extents)

    def stop(self) -> None:
        """The writes in flight finish (and are recorded); no new one starts."""
        self._stopping = True

    def _more(self) -> bool:
        return not self._stopping and (self.max_writes is None or self.attempts < self.max_writes)

    async def run(self) -> None:
        free: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        order = list(self.extents)
        self.rng.shuffle(order)
        for ext in order:
            free.put_nowait(ext)
        await asyncio.gather(*(self._worker(free) for _ in range(self.concurrency)))

    async def _worker(self, free: asyncio.Queue[tuple[int, int]]) -> None:
        while self._more():
            lba, blocks = await free.get()
            try:
                await self._write_once(lba, blocks)
            finally:
                free.put_nowait((lba, blocks))
            if self._delay:
                await self.sleep(self._delay)
            else:
                await asyncio.sleep(0)  # a device that never blocks must not starve the other tasks

    async def _write_once(self, lba: int, blocks: int) -> None:
        self.attempts += 1
        gen = self.gen[lba] = self.gen[lba] + 1
        data = make_payload(self.writer, lba, blocks, gen, self.dev.block_size)
        op = self.recorder.begin(lba, blocks, gen, writer=self.writer)
        try:
            await self.dev.write(lba, data, fua=self.fua)
        except Exception as e:  # noqa: BLE001  (any error of any initiator: indeterminate, and go on)
            self.failed += 1
            self.recorder.fail(op, f"{type(e).__name__}: {e}")
            self._delay = min(self.max_backoff, max(self.backoff, self._delay * 2))
            return
        self.acked += 1
        self.recorder.ack(op)
        self._delay = 0.0


# -- the checks ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    lba: int
    kind: Literal["lost", "torn", "garbage", "foreign", "unknown", "unreadable"]
    message: str
    gap: int = 0  # for "lost": how many generations behind the last ack the value read is (0: zeros)


@dataclass
class Report:
    lbas: int = 0
    acked: int = 0
    failed: int = 0
    pending: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return sum(1 for f in self.findings if f.kind == "lost")

    @property
    def corrupt(self) -> int:
        return len(self.findings) - self.lost

    @property
    def ok(self) -> bool:
        return not self.findings

    def worst(self, n: int = MAX_EXAMPLES) -> list[Finding]:
        """Lost acks first (zeros, then the largest generation gap), then the rest, by LBA."""
        return sorted(self.findings, key=lambda f: (f.kind != "lost", f.gap != 0, -f.gap, f.lba))[:n]

    def __str__(self) -> str:
        head = (
            f"history check of {self.lbas} LBAs: {self.acked} writes acked, {self.failed} failed, "
            f"{self.pending} in flight (indeterminate): {self.lost} LOST ACK, {self.corrupt} CORRUPT"
        )
        if self.ok:
            return head + "."
        more = len(self.findings) - len(self.worst())
        tail = f"; and {more} more" if more > 0 else ""
        return head + ". " + "; ".join(f"lba {f.lba}: {f.kind}: {f.message}" for f in self.worst()) + tail + "."


def _by_lba(hist: History) -> dict[int, list[Op]]:
    out: dict[int, list[Op]] = {}
    for o in hist.ops.values():
        for lba in range(o.lba, o.lba + o.blocks):
            out.setdefault(lba, []).append(o)
    return out


def _owners(hist: History, by_lba: Mapping[int, list[Op]]) -> dict[int, set[int]]:
    owners: dict[int, set[int]] = {}
    for w, extents in hist.claims.items():
        for a, n in extents:
            for lba in range(a, a + n):
                owners.setdefault(lba, set()).add(w)
    for lba, ops in by_lba.items():
        if lba not in owners:  # no claim recorded: whoever wrote it owns it
            owners[lba] = {o.writer for o in ops}
    return owners


def _judge(
    lba: int, block: bytes | bytearray | memoryview, hist: History, ops: list[Op], owners: set[int]
) -> Finding | None:
    acked = [o for o in ops if o.status == "acked"]
    last = max(acked, key=lambda o: o.gen, default=None)
    d = decode_block(block, hist.block_size)
    if d.kind == "zero":
        if last is None:
            return None
        return Finding(
            lba,
            "lost",
            f"reads zeros, but writer {last.writer} gen {last.gen} was acked (op {last.op}, t={last.t_end:.3f})",
            gap=0,
        )
    if d.kind == "garbage":
        return Finding(lba, "garbage", f"not a history block (starts {bytes(block[:16]).hex()})")
    if d.kind == "torn":
        return Finding(lba, "torn", f"checksum fails (header says writer {d.writer} lba {d.lba} gen {d.gen})")
    if d.lba != lba or d.writer not in owners:
        return Finding(
            lba,
            "foreign",
            f"holds writer {d.writer}'s block for lba {d.lba} gen {d.gen} (lba owned by writer(s) {sorted(owners)})",
        )
    match = [o for o in ops if o.writer == d.writer and o.gen == d.gen]
    if not match and not hist.attempted(d.writer, lba, d.gen):
        return Finding(lba, "unknown", f"holds writer {d.writer} gen {d.gen}, a write never attempted")
    if last is not None and d.gen < last.gen:
        what = f"op {match[0].op}, {match[0].status}" if match else "a write older than the last ack"
        return Finding(
            lba,
            "lost",
            f"reads gen {d.gen} ({what}), but gen {last.gen} was acked (op {last.op}, t={last.t_end:.3f})",
            gap=last.gen - d.gen,
        )
    return None


def check(
    history: History | Recorder,
    read_block: Callable[[int], bytes | bytearray | memoryview],
    *,
    lbas: Iterable[int] | None = None,
) -> Report:
    """Judge every LBA (default: every one claimed or written) by the block `read_block(lba)` returns; a
    read_block that raises makes that LBA "unreadable"."""
    hist = history.history() if isinstance(history, Recorder) else history
    by_lba = _by_lba(hist)
    owners = _owners(hist, by_lba)
    report = Report(acked=hist.count("acked"), failed=hist.count("failed"), pending=hist.count("pending"))
    for lba in hist.lbas() if lbas is None else lbas:
        report.lbas += 1
        try:
            block = read_block(lba)
        except Exception as e:  # noqa: BLE001  (reported, with the others)
            report.findings.append(Finding(lba, "unreadable", f"{type(e).__name__}: {e}"))
            continue
        finding = _judge(lba, block, hist, by_lba.get(lba, []), owners.get(lba, set()))
        if finding is not None:
            report.findings.append(finding)
    return report


def _runs(lbas: Sequence[int], most: int) -> Iterator[tuple[int, int]]:
    """Sorted LBAs as (first, count) runs of consecutive ones, at most `most` long."""
    i = 0
    while i < len(lbas):
        j = i + 1
        while j < len(lbas) and lbas[j] == lbas[j - 1] + 1 and j - i < most:
            j += 1
        yield lbas[i], j - i
        i = j


async def read_blocks(dev: Any, lbas: Iterable[int], *, chunk: int = 256) -> dict[int, bytes | Exception]:
    """Each LBA's block read from `dev` (runs of consecutive LBAs in one read each); an error of a run's read
    is retried block by block, so one bad block does not hide its neighbours."""
    bs = dev.block_size
    out: dict[int, bytes | Exception] = {}
    for first, n in _runs(sorted(set(lbas)), chunk):
        try:
            data = bytes(await dev.read(first, n))
        except Exception:  # noqa: BLE001
            for lba in range(first, first + n):
                try:
                    out[lba] = bytes(await dev.read(lba, 1))
                except Exception as e:  # noqa: BLE001
                    out[lba] = e
            continue
        for i in range(n):
            out[first + i] = data[i * bs : (i + 1) * bs]
    return out


async def check_device(history: History | Recorder, dev: Any, *, lbas: Iterable[int] | None = None) -> Report:
    """check() with every block read from a BlockDevice (a RamDevice, a replica, an initiator)."""
    hist = history.history() if isinstance(history, Recorder) else history
    wanted = hist.lbas() if lbas is None else list(lbas)
    blocks = await read_blocks(dev, wanted)

    def read_block(lba: int) -> bytes:
        b = blocks[lba]
        if isinstance(b, Exception):
            raise b
        return b

    return check(hist, read_block, lbas=wanted)


# -- replicas and epochs ------------------------------------------------------------------------------------

Image = bytes | bytearray | memoryview | str | os.PathLike[str]


@dataclass
class IdenticalReport:
    names: list[str]
    sizes: dict[str, int]
    diffs: list[tuple[int, list[str]]] = field(default_factory=list)  # (first differing offset, who differs)
    differing_chunks: int = 0  # granules (of `granule` bytes) where some image differs from the first

    @property
    def ok(self) -> bool:
        return not self.diffs and len(set(self.sizes.values())) <= 1

    def __str__(self) -> str:
        if self.ok:
            return f"{len(self.names)} images identical ({next(iter(self.sizes.values()), 0)} bytes)"
        parts = [f"images differ from {self.names[0]}:"]
        if len(set(self.sizes.values())) > 1:
            parts.append("sizes " + ", ".join(f"{n}={s}" for n, s in self.sizes.items()) + ";")
        if self.diffs:
            parts.append(
                f"{self.differing_chunks} differing regions, first at "
                + ", ".join(f"offset {off} ({'/'.join(who)})" for off, who in self.diffs)
            )
        return " ".join(parts)


class _Reader:
    def __init__(self, image: Image) -> None:
        self._view: memoryview | None = None
        self._file: IO[bytes] | None = None
        if isinstance(image, (bytes, bytearray, memoryview)):
            self._view = memoryview(image).cast("B")
            self.size = len(self._view)
        else:
            self._file = open(image, "rb")  # noqa: SIM115
            self.size = os.fstat(self._file.fileno()).st_size

    def read(self, offset: int, n: int) -> bytes:
        if self._view is not None:
            return bytes(self._view[offset : offset + n])
        assert self._file is not None
        self._file.seek(offset)
        return self._file.read(n)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _first_diff(a: bytes, b: bytes) -> int:
    lo, hi = 0, min(len(a), len(b))
    while hi - lo > 64:  # bisect on slices (C speed) before the last few bytes
        mid = (lo + hi) // 2
        if a[lo:mid] != b[lo:mid]:
            hi = mid
        else:
            lo = mid
    for i in range(lo, min(len(a), len(b))):
        if a[i] != b[i]:
            return i
    return min(len(a), len(b))


def check_identical(
    images: Sequence[Image] | Mapping[str, Image], *, chunk: int = 1 << 20, granule: int = 4096, max_diffs: int = 8
) -> IdenticalReport:
    """Compare replica images (bytes, or paths of files or block devices) chunk by chunk against the first:
    reports sizes that differ, how many `granule`-byte regions differ, and the first `max_diffs` differing
    offsets (byte exact) with the images that differ there."""
    named = dict(images) if isinstance(images, Mapping) else {f"image{i}": im for i, im in enumerate(images)}
    if len(named) < 2:
        raise ValueError("check_identical needs at least two images")
    readers = {n: _Reader(im) for n, im in named.items()}
    try:
        names = list(readers)
        report = IdenticalReport(names, {n: r.size for n, r in readers.items()})
        ref_name = names[0]
        chunk -= chunk % granule
        end = max(r.size for r in readers.values())
        for off in range(0, end, chunk):
            ref = readers[ref_name].read(off, chunk)
            others = {n: readers[n].read(off, chunk) for n in names[1:]}
            if all(o == ref for o in others.values()):
                continue
            for g in range(0, max(len(ref), *(len(o) for o in others.values())), granule):
                part = ref[g : g + granule]
                who = [n for n, o in others.items() if o[g : g + granule] != part]
                if not who:
                    continue
                report.differing_chunks += 1
                if len(report.diffs) < max_diffs:
                    at = min(_first_diff(part, others[n][g : g + granule]) for n in who)
                    report.diffs.append((off + g + at, who))
        return report
    finally:
        for r in readers.values():
            r.close()


@dataclass
class EpochReport:
    acks: int
    epochs: dict[int, dict[str, tuple[int, float, float]]]  # epoch -> node -> (acks, first t, last t)
    conflicts: list[int]  # epochs in which more than one node acknowledged
    inversions: list[str]  # acks in an older epoch after a newer epoch's (with order_slack)

    @property
    def ok(self) -> bool:
        return not self.conflicts and not self.inversions

    def __str__(self) -> str:
        head = f"{self.acks} acks in {len(self.epochs)} epochs"
        if self.ok:
            return head + ": one node per epoch."
        parts = []
        for e in self.conflicts[:MAX_EXAMPLES]:
            nodes = ", ".join(f"{n} ({c} acks, t={a:.3f}..{b:.3f})" for n, (c, a, b) in sorted(self.epochs[e].items()))
            parts.append(f"epoch {e} acked by {nodes}")
        parts += self.inversions[:MAX_EXAMPLES]
        return (
            f"{head}: {len(self.conflicts)} epochs acked by two nodes, {len(self.inversions)} stale acks: "
            + "; ".join(parts)
            + "."
        )


def check_epochs(acks: Iterable[tuple[str, int, float]], *, order_slack: float | None = None) -> EpochReport:
    """No two nodes acknowledged writes in the same epoch, given every node's (node, epoch, time) ack records.
    With `order_slack` (seconds, for the skew of the nodes' logging), also flag an ack in an epoch older than
    one already acknowledged more than order_slack earlier: a primary still acking after its successor did."""
    records = sorted(acks, key=lambda r: r[2])
    epochs: dict[int, dict[str, tuple[int, float, float]]] = {}
    inversions: list[str] = []
    newest: tuple[int, str, float] | None = None  # the highest epoch acked so far: (epoch, node, first t)
    for node, epoch, t in records:
        per = epochs.setdefault(epoch, {})
        c, first, _ = per.get(node, (0, t, t))
        per[node] = (c + 1, first, t)
        if newest is None or epoch > newest[0]:
            newest = (epoch, node, t)
        elif order_slack is not None and epoch < newest[0] and t - newest[2] > order_slack:
            inversions.append(
                f"{node} acked in epoch {epoch} at t={t:.3f}, after {newest[1]} acked in epoch "
                f"{newest[0]} at t={newest[2]:.3f}"
            )
    conflicts = sorted(e for e, per in epochs.items() if len(per) > 1)
    return EpochReport(len(records), epochs, conflicts, inversions)
