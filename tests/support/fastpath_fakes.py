"""What the fast-versus-normal byte-equivalence tests of the three frontends share (tests/unit/test_iscsi_fastpath.py,
test_nvme_fastpath.py, test_nbd_fastpath.py): a transport that keeps what the target sends, the same RAM with its
fast path taken away by its capabilities, and RAM that counts the commands its fast path answered."""

from __future__ import annotations

from typing import Any

from openvsan.block.device import Buffer
from openvsan.block.ram import RamDevice


class Wire:
    """A transport that keeps what the target sends (and how many sends it took)."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.writes = 0

    def writelines(self, parts: list[Buffer]) -> None:
        self.writes += 1
        for p in parts:
            self.out += p

    def write(self, data: Buffer) -> None:
        self.writes += 1
        self.out += data

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class AsyncOnly:
    """The same RAM, without a fast path (capabilities say so): every command takes the normal path."""

    def __init__(self, inner: RamDevice) -> None:
        self.inner = inner
        self.block_size, self.num_blocks = inner.block_size, inner.num_blocks
        self.capabilities = inner.capabilities.but(sync_read=False, sync_write=False)

    def __getattr__(self, name: str) -> Any:
        if name in ("read_now", "write_now"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class Counting(RamDevice):
    """RAM that counts the reads and writes its fast path answered."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.fast = 0

    def read_now(self, lba: int, blocks: int) -> Buffer:
        self.fast += 1
        return super().read_now(lba, blocks)

    def write_now(self, lba: int, data: Buffer) -> bool:
        self.fast += 1
        return super().write_now(lba, data)
