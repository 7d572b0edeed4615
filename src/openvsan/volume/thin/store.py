"""Making a volume group's state durable (format.py's checkpoint and journal): the records of changes are
appended in memory as they are applied, and committed at a flush or FUA write (data flushed, then the journal
written and flushed) and at least every `commit_interval` seconds; a full journal is folded into a checkpoint,
written to the slot the newest one is not in. Opening reads the newest valid checkpoint and replays the
journal blocks that follow it in sequence."""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from openvsan.block.device import BlockDevice
from openvsan.block.errors import DeviceFailed, NoSpace
from openvsan.volume.thin import format as fmt
from openvsan.volume.thin.format import Superblock
from openvsan.volume.thin.state import GroupState, _filled, _view, _Vol, entries

log = logging.getLogger("openvsan.volume.thin")

COMMIT_INTERVAL = 1.0            # seconds an uncommitted mapping may wait for a flush before it is committed
IO_STEP = 4 << 20                # bytes of metadata per device request


class GroupStore(GroupState):
    def __init__(self, dev: BlockDevice, sb: Superblock) -> None:
        super().__init__(dev, sb)
        self.commit_interval = COMMIT_INTERVAL
        self._pending: list[bytes] = []              # encoded records (committed, appended]
        self._lock = asyncio.Lock()
        self._started = 0                            # commits begun
        self._done = 0                               # commits finished
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: BaseException | None = None
        self.ck_seq = 0
        self.journal_base = 0
        self.journal_pos = 0                         # journal blocks written since the checkpoint
        self.journal_cap = sb.journal_size // fmt.META_BLOCK
        self._torn = False                           # a commit left journal blocks it did not finish
        self.commits = self.checkpoints = 0          # for tests and status

    # ---- metadata I/O

    async def _read_bytes(self, offset: int, length: int) -> bytes:
        bs = self.block_size
        parts = []
        for at in range(offset, offset + length, IO_STEP):
            n = min(IO_STEP, offset + length - at)
            parts.append(bytes(await self.dev.read(at // bs, n // bs)))
        return b"".join(parts)

    async def _write_bytes(self, offset: int, data: bytes) -> None:
        bs = self.block_size
        for at in range(0, len(data), IO_STEP):
            await self.dev.write((offset + at) // bs, data[at:at + IO_STEP])

    # ---- open

    async def _read_checkpoint(self) -> fmt.Checkpoint:
        bs = self.block_size
        found: list[tuple[int, int, int]] = []
        for offset in self.sb.slot_offsets:
            head = await self.dev.read(offset // bs, fmt.META_BLOCK // bs)
            info = fmt.checkpoint_head(head)
            if info is not None and fmt.CHECKPOINT_HEAD + info[1] <= self.sb.slot_size:
                found.append((info[0], offset, info[1]))
        for _, offset, length in sorted(found, reverse=True):
            total = -(-(fmt.CHECKPOINT_HEAD + length) // fmt.META_BLOCK) * fmt.META_BLOCK
            ck = fmt.decode_checkpoint(await self._read_bytes(offset, total))
            if ck is not None:
                return ck
        raise fmt.FormatError("no valid checkpoint in the volume group's metadata (both copies damaged)")

    def _load(self, ck: fmt.Checkpoint) -> None:
        self.ck_seq, self.journal_base, self.next_id = ck.seq, ck.journal_base, ck.next_id
        ref = _view(self.ref)
        for rec, runs in ck.volumes:
            n = self._clusters_of(rec.blocks)
            vcs, ps = [], []
            for v, p, length in runs.tolist():
                self._check_run(rec.name, v, p, length, n)
                vcs.append(np.arange(v, v + length, dtype=np.int64))
                ps.append(np.arange(p, p + length, dtype=np.int64))
            vc, pc = (np.concatenate(vcs), np.concatenate(ps)) if vcs else (np.zeros(0, np.int64),) * 2
            order = np.argsort(vc, kind="stable")     # runs come in order; a damaged list must not matter
            vc, pc = vc[order], pc[order]
            if len(vc) > 1 and not np.all(np.diff(vc)):
                raise fmt.FormatError(f"volume {rec.name}: runs of its mapping overlap")
            np.add.at(ref, pc, 1)
            self.vols[rec.id] = _Vol(rec, *_filled(n, vc, pc), len(pc))
            self.by_name[rec.name] = rec.id
        self.used = int(np.count_nonzero(ref))

    async def _replay(self) -> int:
        """Apply the journal blocks that follow the checkpoint in sequence; how many there were."""
        per = 64
        pos = 0
        while pos < self.journal_cap:
            n = min(per, self.journal_cap - pos)
            raw = await self._read_bytes(self.sb.journal_offset + pos * fmt.META_BLOCK, n * fmt.META_BLOCK)
            for i in range(n):
                recs = fmt.open_journal_block(raw[i * fmt.META_BLOCK:(i + 1) * fmt.META_BLOCK],
                                              self.journal_base + pos + i)
                if recs is None:
                    self.journal_pos = pos + i
                    return pos + i
                try:
                    for rec in recs:
                        self._apply(rec)
                except (KeyError, IndexError, ValueError) as e:
                    raise fmt.FormatError(f"journal block {pos + i} holds a record that does not apply to the "
                                          f"volumes before it ({e!r}); the metadata is damaged") from e
            pos += n
        self.journal_pos = pos
        return pos

    # ---- records

    def _log(self, rec: fmt.Record) -> int:
        """Append a record (its change is already in memory); its number. The timer commits it if no flush does."""
        self._pending.append(fmt.encode_record(rec))
        self._appended += 1
        if self._timer is None and not self._replaying:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return self._appended
            self._timer = loop.call_later(self.commit_interval, self._tick)
        return self._appended

    def _do(self, rec: fmt.Record) -> int:
        self._apply(rec)
        return self._log(rec)

    def _tick(self) -> None:
        self._timer = None
        if self._appended > self._committed and self._failed is None:
            task = asyncio.get_running_loop().create_task(self._background_commit())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _background_commit(self) -> None:
        try:
            await self.commit()
        except Exception as e:  # noqa: BLE001 - the next flush reports it to someone who can act
            log.error("volume group %s: background commit failed: %s", self.sb.uuid, e)

    # ---- commit

    async def commit(self) -> None:
        """Make every acknowledged write durable: data flushed, then the mappings journaled and flushed."""
        want, ticket = self._appended, self._started
        async with self._lock:
            if self._failed is not None:
                raise DeviceFailed(f"volume group {self.sb.uuid}: metadata commit failed earlier: {self._failed}")
            if self._committed >= want and self._done > ticket:
                return   # a commit that began after this call covered it
            try:
                await self._commit_now()
            except BaseException as e:
                if not isinstance(e, asyncio.CancelledError):
                    self._failed = e
                raise

    async def _commit_now(self) -> None:
        self._started += 1
        mine = self._started
        upto = self._appended
        recs = self._pending[:upto - self._committed]
        await self.dev.flush()
        if recs:
            blocks = fmt.journal_blocks(recs, self.journal_base + self.journal_pos)
            if self.journal_pos + len(blocks) > self.journal_cap or self._torn:
                await self._checkpoint_now(mine)
                return
            # Until the flush below returns, these blocks may be on the disk or not. Should this commit not
            # finish (its caller cancelled, say), the next must not write other blocks with the same sequence
            # numbers here: a cut could keep some of each and replay a mix. It writes a checkpoint instead.
            self._torn = True
            await self._write_bytes(self.sb.journal_offset + self.journal_pos * fmt.META_BLOCK, b"".join(blocks))
            await self.dev.flush()
            self._torn = False
            self.journal_pos += len(blocks)
            self.commits += 1
        self._committed = upto
        del self._pending[:len(recs)]
        self._release(upto)
        self._done = mine

    async def checkpoint(self) -> None:
        """Fold the journal into a new checkpoint (at close; a full journal does it by itself)."""
        async with self._lock:
            if self._failed is not None:
                raise DeviceFailed(f"volume group {self.sb.uuid}: metadata commit failed earlier: {self._failed}")
            self._started += 1
            try:
                await self._checkpoint_now(self._started)
            except BaseException as e:
                if not isinstance(e, asyncio.CancelledError):
                    self._failed = e
                raise

    async def _checkpoint_now(self, mine: int = 0) -> None:
        upto = self._appended
        seq, base = self.ck_seq + 1, self.journal_base + max(self.journal_cap, 1)
        body = fmt.encode_checkpoint(seq, base, self.next_id, [(v.rec, *entries(v)) for v in self.vols.values()])
        if len(body) > self.sb.slot_size:   # _admit keeps this from happening
            raise NoSpace(f"volume group {self.sb.uuid}: checkpoint of {len(body)} bytes exceeds its slot")
        await self.dev.flush()
        body = body.ljust(-(-len(body) // fmt.META_BLOCK) * fmt.META_BLOCK, b"\0")
        await self._write_bytes(self.sb.slot_offsets[seq % 2], body)
        await self.dev.flush()
        self.ck_seq, self.journal_base, self.journal_pos = seq, base, 0
        self._torn = False
        del self._pending[:upto - self._committed]
        self._committed = upto
        self._release(upto)
        self._done = max(self._done, mine)
        self.checkpoints += 1
        self._recount()
