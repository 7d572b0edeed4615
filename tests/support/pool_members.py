"""Pool members made of RAM that outlive the pool object, and a pool filled with a known pattern: shared by
tests/unit/test_pool_rebuild.py and tests/integration/test_pool_rebuild_timing.py."""

from __future__ import annotations

import random

from openvsan.block import FaultDevice, RamDevice
from openvsan.pool.raid import Pool

BS = 512
CHUNK = 4096
HEADER = 64 * 1024
ROWS = 64


class Disk(FaultDevice):
    """A member that outlives the pool object (close is a no-op), like a disk that stays in the machine."""

    def __init__(self, name: str, rows: int = ROWS) -> None:
        super().__init__(RamDevice((HEADER + rows * CHUNK) // BS), name=name)

    async def close(self) -> None:
        pass


COUNTS = {1: 2, 10: 4, 5: 4, 6: 5}


async def filled(level: int, **kw: object) -> tuple[Pool, list[Disk], bytearray]:
    ds = [Disk(f"d{i}") for i in range(COUNTS[level])]
    pool = await Pool.create(ds, level, CHUNK, data_offset=HEADER, **kw)  # type: ignore[arg-type]
    model = bytearray(pool.num_blocks * BS)
    await scribble(pool, model, random.Random(level), 60)
    return pool, ds, model


async def scribble(pool: Pool, model: bytearray, rng: random.Random, writes: int) -> None:
    for _ in range(writes):
        lba = rng.randrange(pool.num_blocks)
        blocks = min(rng.randint(1, 30), pool.num_blocks - lba)
        buf = rng.randbytes(blocks * BS)
        await pool.write(lba, buf)
        model[lba * BS:(lba + blocks) * BS] = buf
