"""Thin provisioning over NBD: NBD_CMD_BLOCK_STATUS (base:allocation) over a logical volume of a volume group
(volume/thin) shows its holes, before and after writes, trims and write-zeroes (proto.md "Metadata querying",
NBD_REPLY_TYPE_BLOCK_STATUS, "base:allocation metadata context"), and a write the group has no space for
gets NBD_ENOSPC. No sockets: bytes into the server's Connection, replies read off a fake transport."""

from __future__ import annotations

import asyncio
import itertools
import struct
import uuid
from collections.abc import Awaitable, Callable

from fastpath_fakes import Wire

from openvsan.block.ram import RamDevice
from openvsan.frontend.config import NbdExportConfig
from openvsan.frontend.nbd import Connection, NbdServer
from openvsan.protocol.nbd import Cmd, CmdFlag, Errno
from openvsan.protocol.nbd.transmission import allocation_extents
from openvsan.protocol.nbd.wire import (
    IHAVEOPT,
    REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC,
    STRUCTURED_REPLY_MAGIC,
    Opt,
    ReplyType,
)
from openvsan.volume import Volume
from openvsan.volume.thin import VolumeGroup

BS = 512
CLUSTER = 64 << 10
CB = CLUSTER // BS
SIZE = 16 << 20
PORTAL = ("127.0.0.1", 10809)
HOLE, ZERO = 1, 2
DEALLOCATED = HOLE | ZERO


# --- a client, from proto.md ---------------------------------------------------------------------------------

def _option(opt: int, data: bytes) -> bytes:
    return struct.pack(">QII", IHAVEOPT, opt, len(data)) + data


def _hello(name: str) -> bytes:
    """Client flags (fixed newstyle, no zeroes), structured replies, base:allocation, NBD_OPT_GO."""
    n = struct.pack(">I", len(name)) + name.encode()
    query = b"base:allocation"
    return (struct.pack(">I", 3) + _option(Opt.STRUCTURED_REPLY, b"")
            + _option(Opt.SET_META_CONTEXT, n + struct.pack(">II", 1, len(query)) + query)
            + _option(Opt.GO, n + struct.pack(">H", 0)))


class Client:
    """One connection to one export; each call sends a request and waits for its whole reply."""

    def __init__(self, server: NbdServer, name: str) -> None:
        self.conn = Connection(server, PORTAL)
        self.wire = Wire()
        self.conn.connection_made(self.wire)  # type: ignore[arg-type]
        self.conn.data_received(_hello(name))
        assert self.conn.export is not None and self.conn.export.name == name
        self.cookie = 0

    async def ask(self, cmd: int, offset: int, length: int, flags: int = 0,
                  payload: bytes = b"") -> tuple[int, int, bytes]:
        """(error, reply type (-1: a simple reply), payload) of one request."""
        self.cookie += 1
        start = len(self.wire.out)
        self.conn.data_received(struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, self.cookie, offset, length)
                                + payload)
        for _ in range(1000):
            got = self._reply(bytes(self.wire.out[start:]))
            if got is not None:
                return got
            await asyncio.sleep(0)
        raise AssertionError(f"no reply to command {cmd}")

    def _reply(self, out: bytes) -> tuple[int, int, bytes] | None:
        if len(out) >= 16 and struct.unpack_from(">I", out)[0] == SIMPLE_REPLY_MAGIC:
            _, error, cookie = struct.unpack_from(">IIQ", out)
            assert cookie == self.cookie
            return error, -1, b""
        if len(out) < 20:
            return None
        magic, flags, rtype, cookie, n = struct.unpack_from(">IHHQI", out)
        assert magic == STRUCTURED_REPLY_MAGIC and cookie == self.cookie and flags & 1   # one chunk, DONE
        if len(out) < 20 + n:
            return None
        body = out[20:20 + n]
        error = struct.unpack_from(">I", body)[0] if rtype & 0x8000 else 0
        return error, rtype, body

    async def status(self, offset: int, length: int, flags: int = 0) -> list[tuple[int, int]]:
        """The base:allocation descriptors of one NBD_CMD_BLOCK_STATUS, checked against proto.md's rules."""
        error, rtype, body = await self.ask(Cmd.BLOCK_STATUS, offset, length, flags)
        assert error == 0 and rtype == ReplyType.BLOCK_STATUS, (error, rtype, body)
        assert (len(body) - 4) % 8 == 0 and len(body) >= 12
        descs = [struct.unpack_from(">II", body, 4 + 8 * i) for i in range((len(body) - 4) // 8)]
        assert all(n > 0 for n, _ in descs) and sum(n for n, _ in descs) <= (length or 4096)
        assert all(a[1] != b[1] for a, b in itertools.pairwise(descs))   # neighbours differ
        if flags & CmdFlag.REQ_ONE:
            assert len(descs) == 1
        return descs

    async def write(self, offset: int, data: bytes, flags: int = 0) -> int:
        return (await self.ask(Cmd.WRITE, offset, len(data), flags, data))[0]

    async def read(self, offset: int, length: int) -> bytes:
        error, rtype, body = await self.ask(Cmd.READ, offset, length)
        assert error == 0 and rtype == ReplyType.OFFSET_DATA and struct.unpack_from(">Q", body)[0] == offset
        return body[8:]


def run(fn: Callable[[VolumeGroup, NbdServer], Awaitable[None]], *, device_mib: int = 64,
        thick: bool = True) -> None:
    """fn(group, server): exports "thin" (and "thick") carved from a fresh group on RAM."""
    async def go() -> None:
        group = await VolumeGroup.format(RamDevice((device_mib << 20) // BS, BS), cluster_size=CLUSTER)
        try:
            names = ["thin", "thick"] if thick else ["thin"]
            exports = [NbdExportConfig(name, Volume(await group.create(name, SIZE, thin=name == "thin"), name=name,
                                                    uuid=uuid.uuid5(uuid.NAMESPACE_URL, name)), [PORTAL])
                       for name in names]
            await fn(group, NbdServer(exports))
        finally:
            await group.close()

    asyncio.run(go())


# --- block status ------------------------------------------------------------------------------------------

def test_block_status_shows_the_holes_of_a_thin_volume_before_and_after_writes() -> None:
    async def go(group: VolumeGroup, server: NbdServer) -> None:
        c = Client(server, "thin")
        assert await c.status(0, SIZE) == [(SIZE, DEALLOCATED)]
        assert await c.write(CLUSTER + 2 * BS, b"a" * BS) == 0                # a block of cluster 1
        assert await c.write(5 * CLUSTER - BS, b"b" * 2 * BS) == 0            # the ends of clusters 4 and 5
        whole = [(CLUSTER, DEALLOCATED), (CLUSTER, 0), (2 * CLUSTER, DEALLOCATED), (2 * CLUSTER, 0),
                 (SIZE - 6 * CLUSTER, DEALLOCATED)]
        assert await c.status(0, SIZE) == whole
        # a part of the export: the descriptors cover it from its offset, never past its length
        assert await c.status(CLUSTER // 2, CLUSTER) == [(CLUSTER // 2, DEALLOCATED), (CLUSTER // 2, 0)]
        assert await c.status(CLUSTER + 3 * BS, 8 * BS) == [(8 * BS, 0)]
        assert await c.status(2 * CLUSTER, 3 * CLUSTER) == [(2 * CLUSTER, DEALLOCATED), (CLUSTER, 0)]
        # not aligned to the block: the first and last descriptors take the odd bytes
        assert await c.status(CLUSTER - 100, 300) == [(100, DEALLOCATED), (200, 0)]
        assert await c.status(7, 1000) == [(1000, DEALLOCATED)]
        # NBD_CMD_FLAG_REQ_ONE: the first extent only
        assert await c.status(0, SIZE, CmdFlag.REQ_ONE) == [(CLUSTER, DEALLOCATED)]
        assert await c.status(CLUSTER, SIZE - CLUSTER, CmdFlag.REQ_ONE) == [(CLUSTER, 0)]
        assert await c.status(CLUSTER + BS, BS, CmdFlag.REQ_ONE) == [(BS, 0)]
        # length 0: from the offset on, as much as the server likes (here 4 KiB)
        assert await c.status(CLUSTER, 0) == [(4096, 0)]
        assert await c.status(SIZE - BS, BS) == [(BS, DEALLOCATED)]
        # beyond the export: NBD_EINVAL
        assert (await c.ask(Cmd.BLOCK_STATUS, SIZE - BS, 2 * BS))[0] == Errno.EINVAL

    run(go)


def test_trim_and_write_zeroes_make_holes_and_no_hole_fills_them() -> None:
    async def go(group: VolumeGroup, server: NbdServer) -> None:
        c = Client(server, "thin")
        assert await c.write(0, b"x" * 4 * CLUSTER) == 0
        assert await c.status(0, SIZE) == [(4 * CLUSTER, 0), (SIZE - 4 * CLUSTER, DEALLOCATED)]
        # NBD_CMD_TRIM reaches the volume's unmap: whole clusters become holes, a part of one is zeroed
        assert (await c.ask(Cmd.TRIM, CLUSTER, CLUSTER + BS, CmdFlag.FUA))[0] == 0
        assert await c.status(0, 4 * CLUSTER) == [(CLUSTER, 0), (CLUSTER, DEALLOCATED), (2 * CLUSTER, 0)]
        assert await c.read(CLUSTER, CLUSTER + 2 * BS) == bytes(CLUSTER + BS) + b"x" * BS
        # NBD_CMD_WRITE_ZEROES may punch a hole; with NBD_CMD_FLAG_NO_HOLE it leaves the range allocated
        assert (await c.ask(Cmd.WRITE_ZEROES, 2 * CLUSTER, CLUSTER))[0] == 0
        assert (await c.ask(Cmd.WRITE_ZEROES, 8 * CLUSTER, CLUSTER, CmdFlag.NO_HOLE))[0] == 0
        assert await c.status(0, 10 * CLUSTER) == [(CLUSTER, 0), (2 * CLUSTER, DEALLOCATED), (CLUSTER, 0),
                                                   (4 * CLUSTER, DEALLOCATED), (CLUSTER, 0), (CLUSTER, DEALLOCATED)]
        assert await c.read(2 * CLUSTER, CLUSTER) == bytes(CLUSTER)
        assert await c.read(8 * CLUSTER, CLUSTER) == bytes(CLUSTER)

    run(go)


def test_a_thick_volume_is_all_allocated() -> None:
    async def go(group: VolumeGroup, server: NbdServer) -> None:
        c = Client(server, "thick")
        assert await c.status(0, SIZE) == [(SIZE, 0)]
        assert (await c.ask(Cmd.TRIM, 0, 4 * CLUSTER))[0] == 0
        assert await c.status(0, SIZE, CmdFlag.REQ_ONE) == [(SIZE, 0)]

    run(go)


def test_a_device_without_a_map_reports_every_block_allocated() -> None:
    async def go() -> None:
        vol = Volume(RamDevice(2048, BS), name="ram", uuid=uuid.UUID(int=5))
        c = Client(NbdServer([NbdExportConfig("ram", vol, [PORTAL])]), "ram")
        assert await c.status(0, 2048 * BS) == [(2048 * BS, 0)]
        assert await c.status(100, 1000) == [(1000, 0)]

    asyncio.run(go())


# --- out of space ------------------------------------------------------------------------------------------

def test_a_write_the_group_has_no_space_for_gets_enospc() -> None:
    async def go(group: VolumeGroup, server: NbdServer) -> None:
        c = Client(server, "thin")
        assert await c.write(0, b"k" * BS) == 0
        filler = await group.create("filler", SIZE, thin=True)
        for n in range(group.clusters - group.used):
            await filler.write(n * CB, bytes(CLUSTER))
        assert group.used == group.clusters
        assert await c.write(3 * CLUSTER, b"x" * BS) == Errno.ENOSPC
        assert await c.write(4 * CLUSTER, b"y" * 2 * CLUSTER, CmdFlag.FUA) == Errno.ENOSPC
        assert (await c.ask(Cmd.WRITE_ZEROES, 6 * CLUSTER, BS, CmdFlag.NO_HOLE))[0] == Errno.ENOSPC
        # a hole is where a write may fail; allocated blocks still take writes
        assert await c.status(0, 8 * CLUSTER) == [(CLUSTER, 0), (7 * CLUSTER, DEALLOCATED)]
        assert await c.write(BS, b"m" * BS) == 0
        assert await c.read(0, 2 * BS) == b"k" * BS + b"m" * BS
        # a trim gives space back (here another volume's), and the write goes through
        await filler.unmap(0, CB)
        await group.commit()
        assert await c.write(3 * CLUSTER, b"x" * BS) == 0
        assert await c.status(3 * CLUSTER, CLUSTER) == [(CLUSTER, 0)]

    run(go, device_mib=12, thick=False)


# --- the translation itself ---------------------------------------------------------------------------------

def test_allocation_extents() -> None:
    runs = [(0, 8, 1), (8, 8, 0), (16, 8, 2), (24, 8, 1)]
    assert allocation_extents(0, 32 * BS, BS, runs, reads_zero=True, req_one=False) == \
        [(8 * BS, DEALLOCATED), (16 * BS, 0), (8 * BS, DEALLOCATED)]         # anchored (2) counts as allocated
    assert allocation_extents(0, 32 * BS, BS, runs, reads_zero=False, req_one=False)[0] == (8 * BS, HOLE)
    assert allocation_extents(0, 32 * BS, BS, runs, reads_zero=True, req_one=True) == [(8 * BS, DEALLOCATED)]
    assert allocation_extents(4 * BS + 1, 6 * BS, BS, runs, reads_zero=True, req_one=False) == \
        [(4 * BS - 1, DEALLOCATED), (2 * BS + 1, 0)]
    # a gap, or runs that stop short: an answer for what is known, and no more
    assert allocation_extents(0, 32 * BS, BS, [(0, 8, 1), (10, 8, 0)], reads_zero=True, req_one=False) == \
        [(8 * BS, DEALLOCATED)]
    assert allocation_extents(0, 32 * BS, BS, [(0, 8, 0)], reads_zero=True, req_one=False) == [(8 * BS, 0)]
    # nothing known: one allocated descriptor for the whole request (proto.md: status 0 is always safe)
    assert allocation_extents(BS, 4 * BS, BS, [], reads_zero=True, req_one=False) == [(4 * BS, 0)]
    assert allocation_extents(BS, 4 * BS, BS, [(2, 4, 1)], reads_zero=True, req_one=False) == [(4 * BS, 0)]
