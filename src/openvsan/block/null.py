"""NullDevice: reads zeroes, drops writes. For benchmarks of everything above the block layer."""

from __future__ import annotations

from typing import Any

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import Buffer


class NullDevice:
    def __init__(self, num_blocks: int, block_size: int = 512, *, name: str = "null") -> None:
        if block_size not in (512, 4096):
            raise ValueError(f"block_size must be 512 or 4096, not {block_size}")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, not {num_blocks}")
        self.name = name
        self.block_size = block_size
        self.num_blocks = num_blocks
        # one shared read-only buffer of zeroes, grown on demand, so a read costs no allocation
        self._zeroes = b""
        self.capabilities = Capabilities(resizable=True)

    async def read(self, lba: int, blocks: int) -> Buffer:
        n = blocks * self.block_size
        if len(self._zeroes) < n:
            self._zeroes = bytes(n)
        return memoryview(self._zeroes)[:n]

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        return None

    async def flush(self) -> None:
        return None

    async def unmap(self, lba: int, blocks: int) -> None:
        return None

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        return None

    async def resize(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    async def close(self) -> None:
        return None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> NullDevice:
        bs = cfg.get("block_size", 512)
        return cls(cfg["size"] // bs, bs, name=cfg.get("name", "null"))

    def to_config(self) -> dict[str, Any]:
        return {"type": "null", "name": self.name, "size": self.num_blocks * self.block_size,
                "block_size": self.block_size}
