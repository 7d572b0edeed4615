"""Our NVMe/TCP initiator's fast paths over real NVMe/TCP on loopback (an in-process target over a RAM volume):
read_soon and write_soon send the very capsules read() and write() send for the same request (CIDs aside),
and read_soon hands back what read() returns; both decline, sending nothing, where read()/write() would have
to wait (no association, no free slot) or the request is not one command."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Sequence
from typing import Any

from vsan_harness import free_port

from openvsan.block import RamDevice
from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.nvme_tcp import NvmeTcpServer
from openvsan.initiator.nvme_tcp import NvmeOptions, NvmeTcpInitiator
from openvsan.volume import Volume

NQN = "nqn.2026-11.org.openvsan:soon"
BS = 512
BLOCKS = 8192


def _without_cid(parts: Sequence[Any]) -> bytes:
    raw = bytearray(b"".join(bytes(p) for p in parts))
    raw[10:12] = b"\0\0"            # the SQE's CID, after the 8-byte common header and opcode, flags
    return bytes(raw)


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
            wire = q._batch.transport
            assert wire is not None

            class Spy:
                """The queue's transport, keeping what each send puts on the wire."""

                def write(self, b: Any) -> None:
                    sent.append(_without_cid([b]))
                    wire.write(b)

                def writelines(self, parts: Sequence[Any]) -> None:
                    sent.append(_without_cid(parts))
                    wire.writelines(parts)

                def is_closing(self) -> bool:
                    return wire.is_closing()

            q._batch.transport = Spy()  # type: ignore[assignment]
            rng = random.Random(2)
            loop = asyncio.get_running_loop()
            for _ in range(20):
                blocks = rng.choice((1, 8, 64))
                lba = rng.randrange(BLOCKS - blocks)
                want = bytes(await dev.read(lba, blocks))
                fut: asyncio.Future[bytes] = loop.create_future()
                assert dev.read_soon(lba, blocks, lambda d, e, f=fut: f.set_exception(e) if e else
                                     f.set_result(bytes(d)))  # type: ignore[arg-type]
                assert await fut == want == ram.read_now(lba, blocks)
                assert len(sent) == 2 and sent[0] == sent[1], "read_soon sent another capsule than read()"
                sent.clear()
                data = rng.randbytes(8 * BS)
                await dev.write(lba, data)
                done: asyncio.Future[None] = loop.create_future()
                assert dev.write_soon(lba, data, False, lambda e, f=done: f.set_exception(e) if e else
                                      f.set_result(None))
                await done
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
