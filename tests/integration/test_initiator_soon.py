"""Our initiators' fast paths over real NVMe/TCP and iSCSI on loopback (in-process targets over a RAM volume):
read_soon and write_soon send the very PDUs read() and write() send for the same request (command tags and
sequence numbers aside), and read_soon hands back what read() returns; both decline, sending nothing, where
read()/write() would have to wait (not connected, no free slot) or the request is not one command; a status
other than GOOD comes back as the error read() raises."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Sequence
from typing import Any

from vsan_harness import free_port

from openvsan.block import RamDevice
from openvsan.block.errors import BlockError
from openvsan.frontend.config import IscsiTargetConfig, NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.iscsi import IscsiServer
from openvsan.frontend.nvme_tcp import NvmeTcpServer
from openvsan.initiator.iscsi import IscsiInitiator, IscsiOptions
from openvsan.initiator.nvme_tcp import NvmeOptions, NvmeTcpInitiator
from openvsan.protocol.scsi.lun import Lun
from openvsan.protocol.scsi.target import ScsiTarget
from openvsan.volume import Volume

NQN = "nqn.2026-11.org.openvsan:soon"
IQN = "iqn.2026-11.org.openvsan:soon"
BS = 512
BLOCKS = 8192


class WireSpy:
    """A transport in front of another, keeping what each send puts on the wire (`mask`: the bytes of each PDU
    header that differ between two sends of one command, zeroed)."""

    def __init__(self, wire: Any, sent: list[bytes], mask: Sequence[tuple[int, int]]) -> None:
        self.wire, self.sent, self.mask = wire, sent, mask

    def _keep(self, parts: Sequence[Any]) -> None:
        raw = bytearray(b"".join(bytes(p) for p in parts))
        for a, b in self.mask:
            raw[a:b] = bytes(b - a)
        self.sent.append(bytes(raw))

    def write(self, b: Any) -> None:
        self._keep([b])
        self.wire.write(b)

    def writelines(self, parts: Sequence[Any]) -> None:
        self._keep(parts)
        self.wire.writelines(parts)

    def is_closing(self) -> bool:
        return bool(self.wire.is_closing())


async def soon_read(dev: Any, lba: int, blocks: int) -> bytes:
    """read_soon's data (it must take the request), awaited."""
    fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    assert dev.read_soon(lba, blocks, lambda d, e: fut.set_exception(e) if e else fut.set_result(bytes(d)))
    return await fut


async def soon_write(dev: Any, lba: int, data: bytes) -> None:
    """write_soon of `data` (it must take the request), awaited."""
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    assert dev.write_soon(lba, data, False, lambda e: fut.set_exception(e) if e else fut.set_result(None))
    await fut


def test_read_soon_and_write_soon_send_what_read_and_write_send() -> None:
    port = free_port()
    ram = RamDevice(BLOCKS, BS)
    ram.write_now(0, random.Random(1).randbytes(BLOCKS * BS))
    vol = Volume(ram, name="v", uuid=uuid.UUID(int=3))
    srv = NvmeTcpServer([NvmeSubsystemConfig(NQN, [NvmeNamespaceConfig(1, vol)], [("127.0.0.1", port)])])

    async def body() -> None:
        await srv.start()
        dev = NvmeTcpInitiator("127.0.0.1", port, NQN, 1, NvmeOptions(queue_depth=8))
        try:
            assert not dev.read_soon(0, 8, lambda d, e: None)            # not connected yet: declined
            await dev.open()
            a = dev.assoc
            assert a is not None
            q = a.queues[0]
            sent: list[bytes] = []
            # the SQE's CID (10-11), after the 8-byte common header and opcode, flags
            q._batch.transport = WireSpy(q._batch.transport, sent, ((10, 12),))  # type: ignore[assignment]
            rng = random.Random(2)
            for _ in range(20):
                blocks = rng.choice((1, 8, 64))
                lba = rng.randrange(BLOCKS - blocks)
                want = bytes(await dev.read(lba, blocks))
                assert await soon_read(dev, lba, blocks) == want == ram.read_now(lba, blocks)
                assert len(sent) == 2 and sent[0] == sent[1], "read_soon sent another capsule than read()"
                sent.clear()
                data = rng.randbytes(8 * BS)
                await dev.write(lba, data)
                await soon_write(dev, lba, data)
                assert len(sent) == 2 and sent[0] == sent[1], "write_soon sent another capsule than write()"
                sent.clear()
            assert not dev.read_soon(0, dev.max_io_blocks + 1, lambda d, e: None)   # more than one command
            assert not dev.read_soon(BLOCKS - 1, 2, lambda d, e: None)               # past the end
            slots = a.slots[0]
            while slots.try_acquire():                                            # every slot taken
                pass
            assert not dev.read_soon(0, 1, lambda d, e: None) and not sent
            assert not dev.write_soon(0, bytes(BS), False, lambda e: None) and not sent
        finally:
            await dev.close()
            await srv.stop()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_iscsi_read_soon_and_write_soon_send_what_read_and_write_send() -> None:
    port = free_port()
    ram = RamDevice(BLOCKS, BS)
    ram.write_now(0, random.Random(3).randbytes(BLOCKS * BS))
    lun = Lun(Volume(ram, name="v", uuid=uuid.UUID(int=4)))
    srv = IscsiServer([IscsiTargetConfig(IQN, ScsiTarget(IQN, {0: lun}), [("127.0.0.1", port)])])

    async def body() -> None:
        await srv.start()
        dev = IscsiInitiator("127.0.0.1", port, IQN, 0, IscsiOptions(queue_depth=8))
        try:
            await dev.open()
            session = dev.sessions[0]
            conn = session.conn
            assert conn is not None
            sent: list[bytes] = []
            # ITT (16-19), CmdSN (24-27) and ExpStatSN (28-31) of the SCSI Command BHS
            conn._batch.transport = WireSpy(conn._batch.transport, sent, ((16, 20), (24, 32)))  # type: ignore[assignment]
            rng = random.Random(4)
            loop = asyncio.get_running_loop()
            for _ in range(20):
                blocks = rng.choice((1, 8, 64))
                lba = rng.randrange(BLOCKS - blocks)
                want = bytes(await dev.read(lba, blocks))
                assert await soon_read(dev, lba, blocks) == want == ram.read_now(lba, blocks)
                assert len(sent) == 2 and sent[0] == sent[1], "read_soon sent other PDUs than read()"
                sent.clear()
                data = rng.randbytes(blocks * BS)
                await dev.write(lba, data)
                first = list(sent)
                sent.clear()
                await soon_write(dev, lba, data)
                assert sent == first, "write_soon sent other PDUs than write()"
                sent.clear()
                assert ram.read_now(lba, blocks) == data
            # a status other than GOOD: the error read() raises (here LBA OUT OF RANGE, sent by a read past the
            # end the initiator believes is there)
            dev.num_blocks += 8
            failed: asyncio.Future[BaseException] = loop.create_future()
            assert dev.read_soon(BLOCKS, 8, lambda d, e: failed.set_result(e))  # type: ignore[arg-type]
            err = await failed
            assert isinstance(err, BlockError)
            dev.num_blocks -= 8
            assert not dev.read_soon(0, dev.max_io_blocks + 1, lambda d, e: None)   # more than one command
            sent.clear()
            while session._slots.try_acquire():                                     # every slot taken
                pass
            assert not dev.read_soon(0, 1, lambda d, e: None) and not sent
            assert not dev.write_soon(0, bytes(BS), False, lambda e: None) and not sent
        finally:
            await dev.close()
            await srv.stop()

    asyncio.run(asyncio.wait_for(body(), 30))

