"""The replica's epoch fence over real NVMe/TCP on loopback: an in-process target serves a replica namespace
whose reservations are an EpochFence (replication/fence.py), and two of our NVMe/TCP initiators play the
old and the new primary (two host NQNs): the new epoch preempts the old one, whose writes are then refused
with Reservation Conflict, as are its attempts to come back with its epoch; the floor survives a restart."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import pytest
from vsan_harness import free_port

from openvsan.block import RamDevice
from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.nvme_tcp import NvmeTcpServer
from openvsan.initiator.nvme_tcp import NvmeCommandError, NvmeOptions, NvmeTcpInitiator
from openvsan.protocol.nvme.reservations import WRITE_EXCLUSIVE
from openvsan.replication.fence import EpochFence
from openvsan.volume import Volume

NQN = "nqn.2026-11.org.openvsan:replica:vol"
OLD_HOST = "nqn.2026-11.org.openvsan:node:a"
NEW_HOST = "nqn.2026-11.org.openvsan:node:b"
PREEMPT = 1
CONFLICT = 0x83            # Base 2.0 Figure 102: Reservation Conflict (SCT 0)


def run(body: Callable[[], Awaitable[None]], timeout: float = 30) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout))


def replica(port: int, fence: EpochFence) -> NvmeTcpServer:
    vol = Volume(RamDevice(2048, 512), name="vol", uuid=uuid.UUID(int=7))
    srv = NvmeTcpServer([NvmeSubsystemConfig(NQN, [NvmeNamespaceConfig(1, vol)], [("127.0.0.1", port)])])
    sub = srv.subsystem(NQN)
    assert sub is not None
    sub.namespaces[1].reservations = fence
    return srv


async def primary(port: int, host: str) -> NvmeTcpInitiator:
    dev = NvmeTcpInitiator("127.0.0.1", port, NQN, 1, NvmeOptions(hostnqn=host))
    await dev.open()
    return dev


def conflict(e: pytest.ExceptionInfo[NvmeCommandError]) -> bool:
    return e.value.status & 0xFF == CONFLICT


def test_a_new_epoch_fences_the_old_primary_over_nvme_tcp() -> None:
    port = free_port()
    floors: list[int] = []
    fence = EpochFence(persist=floors.append)
    srv = replica(port, fence)

    async def body() -> None:
        await srv.start()
        old = new = None
        try:
            old, new = await primary(port, OLD_HOST), await primary(port, NEW_HOST)
            with pytest.raises(NvmeCommandError) as e:            # nobody writes before an epoch holds it
                await old.write(0, b"o" * 512)
            assert conflict(e)
            await old.reservation_register(5)
            await old.reservation_acquire(5, WRITE_EXCLUSIVE)
            await old.write(0, b"o" * 512)
            await new.reservation_register(9)
            with pytest.raises(NvmeCommandError) as e:            # registered, but epoch 5 holds the replica
                await new.write(0, b"n" * 512)
            assert conflict(e)
            await new.reservation_acquire(9, WRITE_EXCLUSIVE, action=PREEMPT, prkey=5)
            assert floors == [5, 9]
            await new.write(0, b"n" * 512)
            with pytest.raises(NvmeCommandError) as e:            # the old primary, woken, writes again
                await old.write(0, b"o" * 512)
            assert conflict(e)
            for key in (5, 8):                                    # and tries to come back below the floor
                with pytest.raises(NvmeCommandError) as e:
                    await old.reservation_register(key)
                assert conflict(e)
            assert bytes(await old.read(0, 1)) == b"n" * 512     # reads stay open (Write Exclusive)
            assert fence.refused >= 4
        finally:
            for d in (old, new):
                if d is not None:
                    await d.close()
            await srv.stop()

    run(body)

    # the replica restarts with the floor it saved: epoch 5 is still refused, 9 holds it again
    port2 = free_port()
    srv2 = replica(port2, EpochFence(floor=floors[-1]))

    async def again() -> None:
        await srv2.start()
        old = new = None
        try:
            old, new = await primary(port2, OLD_HOST), await primary(port2, NEW_HOST)
            with pytest.raises(NvmeCommandError) as e:
                await old.reservation_register(5)
            assert conflict(e)
            with pytest.raises(NvmeCommandError) as e:            # no registrant after the restart: still fenced
                await old.write(0, b"o" * 512)
            assert conflict(e)
            await new.reservation_register(9)
            await new.reservation_acquire(9, WRITE_EXCLUSIVE)
            await new.write(0, b"n" * 512)
        finally:
            for d in (old, new):
                if d is not None:
                    await d.close()
            await srv2.stop()

    run(again)
