"""What the fast-versus-normal byte-equivalence tests of the three frontends share (tests/unit/test_iscsi_fastpath.py,
test_nvme_fastpath.py, test_nbd_fastpath.py, test_nvme_ana.py): a transport that keeps what the target sends, the
same RAM with its fast path taken away by its capabilities, RAM that counts the commands its fast path answered,
RAM whose writes wait on others (answered by write_soon's callback, or by write() alone), and an NVMe/TCP
controller brought up over two such transports."""

from __future__ import annotations

import asyncio
from typing import Any

from nvme_host import HostReader, capsule, connect_cmd, connect_data, icreq, sqe

from openvsan.block.device import Buffer
from openvsan.block.errors import MediumError
from openvsan.block.ram import RamDevice
from openvsan.frontend.nvme_tcp import Connection, NvmeTcpServer


class Wire:
    """A transport that keeps what the target sends (and how many sends it took)."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.writes = 0
        self.paused = False

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
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_write_buffer_size(self) -> int:
        return 0


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


class SlowRam(RamDevice):
    """RAM with no write_now, whose write() takes two loop turns (as a mirror's does while its peers answer),
    then writes, or fails with a medium error if it touches BAD (blocks)."""

    BAD = range(100, 116)

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.capabilities = self.capabilities.but(sync_write=False, write_window=False)

    def _finish(self, lba: int, data: bytes) -> BaseException | None:
        if lba < self.BAD.stop and self.BAD.start < lba + len(data) // self.block_size:
            return MediumError("injected", lba=lba, write=True)
        RamDevice.write_now(self, lba, data)
        return None

    async def write(self, lba: int, data: Any, *, fua: bool = False) -> None:
        data = bytes(data)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        e = self._finish(lba, data)
        if e is not None:
            raise e


class SoonRam(SlowRam):
    """The same, with a write_soon that ends in the same turn as write() would: every write it takes answered by
    its callback."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.soon = 0

    def write_soon(self, lba: int, data: Any, fua: bool, done: Any) -> bool:
        self.soon += 1
        loop = asyncio.get_running_loop()
        data = bytes(data)
        loop.call_soon(loop.call_soon, lambda: done(self._finish(lba, data)))
        return True


def last_response(wire: Wire) -> Any:
    """The last CapsuleResp the target sent on `wire`."""
    return [p for p in HostReader().feed(bytes(wire.out)) if p.type == 5][-1]


async def nvme_controller(srv: NvmeTcpServer, portal: tuple[str, int], nqn: str, *,
                          sq_flow_off: bool = False) -> tuple[Connection, Connection, Wire, Wire]:
    """An admin and an I/O queue of one controller of `nqn`, connected and enabled over in-memory transports:
    (admin, io, admin's wire, io's wire)."""
    admin, io = Connection(srv, portal), Connection(srv, portal)
    aw, iw = Wire(), Wire()
    admin.connection_made(aw)  # type: ignore[arg-type]
    admin.data_received(icreq())
    admin.data_received(capsule(connect_cmd(1, 0, 31), connect_data(nqn)))
    cntlid = last_response(aw).u32(8) & 0xFFFF
    # Property Set CC: EN, IOSQES 6, IOCQES 4 (NVMe-oF 1.1 §3.4.2)
    admin.data_received(capsule(sqe(0x7F, 2, 0x00, cdw11=0x14, cdw12=1 | (6 << 16) | (4 << 20))))
    await asyncio.sleep(0)
    assert last_response(aw).status == 0
    io.connection_made(iw)  # type: ignore[arg-type]
    io.data_received(icreq())
    io.data_received(capsule(connect_cmd(1, 1, 63, cattr=4 if sq_flow_off else 0), connect_data(nqn, cntlid=cntlid)))
    assert last_response(iw).status == 0 and io.ctrl is not None
    return admin, io, aw, iw


def chunks(data: bytes, sizes: list[int]) -> list[bytes]:
    """`data` cut into receives of `sizes` bytes (cycled)."""
    out, pos, i = [], 0, 0
    while pos < len(data):
        out.append(data[pos:pos + sizes[i % len(sizes)]])
        pos, i = pos + sizes[i % len(sizes)], i + 1
    return out


async def spin(turns: int = 6) -> None:
    """Let what the last receive started run its course (tasks a few loop turns deep)."""
    import asyncio

    for _ in range(turns):
        await asyncio.sleep(0)
