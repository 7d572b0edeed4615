"""The --verify pattern: every logical block written carries its own LBA and a generation number.

A block is one 32-byte header (magic, LBA, generation, block size) repeated to fill the block, so it is
fully determined by (LBA, generation): a read regenerates the block from the header it finds and compares
every byte. Three failures are told apart: a block from another LBA (misdirected I/O), a stale generation
(a lost write), and a pattern mismatch (corruption). A block of zeroes the run never wrote is accepted as
unwritten.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass

MAGIC = b"OVSBENCH"
HEADER = struct.Struct(">8sQQI4x")  # magic, lba, generation, block size, reserved


@dataclass(frozen=True)
class Mismatch:
    lba: int
    kind: str      # "lba" | "generation" | "corrupt" | "no-pattern"
    message: str

    def to_dict(self) -> dict[str, object]:
        return {"lba": self.lba, "kind": self.kind, "message": self.message}


def make_block(lba: int, generation: int, block_size: int) -> bytes:
    return HEADER.pack(MAGIC, lba, generation, block_size) * (block_size // HEADER.size)


def make_buffer(lba: int, blocks: int, generation: int, block_size: int) -> bytes:
    return b"".join(make_block(lba + i, generation, block_size) for i in range(blocks))


class Generations:
    """The generation this worker last wrote to each block of its region (0: not written in this run)."""

    def __init__(self, first: int, blocks: int) -> None:
        self.first = first
        self.gen = array("I", bytes(4 * blocks))

    def get(self, lba: int) -> int:
        return self.gen[lba - self.first]

    def set(self, lba: int, blocks: int, generation: int) -> None:
        i = lba - self.first
        self.gen[i:i + blocks] = array("I", [generation]) * blocks

    def written_runs(self) -> list[tuple[int, int]]:
        """(lba, blocks) of the runs of blocks this run wrote, for the final read-back pass."""
        runs: list[tuple[int, int]] = []
        start = -1
        for i, g in enumerate(self.gen):
            if g and start < 0:
                start = i
            elif not g and start >= 0:
                runs.append((self.first + start, i - start))
                start = -1
        if start >= 0:
            runs.append((self.first + start, len(self.gen) - start))
        return runs


def check_buffer(data: bytes | bytearray | memoryview, lba: int, block_size: int,
                 gens: Generations | None) -> list[Mismatch]:
    view = memoryview(data).cast("B")
    out: list[Mismatch] = []
    zero = bytes(block_size)
    for i in range(len(view) // block_size):
        at = lba + i
        blk = view[i * block_size:(i + 1) * block_size]
        want_gen = gens.get(at) if gens is not None else 0
        if blk[:8] != MAGIC:
            if want_gen == 0 and blk == zero:
                continue  # never written
            out.append(Mismatch(at, "no-pattern", f"LBA {at}: no verify header (expected generation "
                                                  f"{want_gen or 'any'})"))
            continue
        _, got_lba, got_gen, _ = HEADER.unpack_from(blk)
        if got_lba != at and blk == make_block(got_lba, got_gen, block_size):
            out.append(Mismatch(at, "lba", f"LBA {at}: holds the block written for LBA {got_lba}"))
            continue
        if want_gen and got_gen != want_gen and blk == make_block(at, got_gen, block_size):
            out.append(Mismatch(at, "generation", f"LBA {at}: generation {got_gen}, expected {want_gen} "
                                                  "(a write was lost)"))
            continue
        expect = make_block(at, want_gen or got_gen, block_size)
        if blk != expect:
            byte = next(k for k in range(block_size) if blk[k] != expect[k])
            out.append(Mismatch(at, "corrupt", f"LBA {at}: corrupted at byte {byte} of the block "
                                               f"(generation {want_gen or got_gen})"))
    return out
