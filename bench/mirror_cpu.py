#!/usr/bin/env python3
"""CPU per replicated 4K write: MirrorLayer over a RAM device, its one peer our NVMe/TCP initiator to a replica
server (a RAM device behind an EpochFence) in the same process, on loopback. 20,000 random 4K writes at QD32
after both devices were written once and 2,000 writes of warm-up; prints CPU µs per write (primary, initiator and
replica server together) and IOPS, through the mirror's write() (a coroutine per write) and through its fast path
write_soon() (callbacks), one after the other. Run it before and after a change to the replication path
(docs/benchmarks.md, "Replication")."""

import asyncio
import random
import socket
import time
import uuid

from openvsan.block import RamDevice
from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.nvme_tcp import NvmeTcpServer
from openvsan.node.memstore import MemoryState, MemoryStateStore
from openvsan.replication import record as R
from openvsan.replication.fence import EpochFence
from openvsan.replication.mirror import MirrorLayer
from openvsan.replication.peer import connect_peer, replica_nqn
from openvsan.volume import Volume


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


async def main(n: int = 20000, qd: int = 32) -> None:
    port = free_port()
    dev_b = RamDevice(262144, 512, name="b")
    replica = Volume(dev_b, name="v", uuid=uuid.UUID(int=1))
    srv = NvmeTcpServer([NvmeSubsystemConfig(replica_nqn("v"), [NvmeNamespaceConfig(1, replica)],
                                             [("127.0.0.1", port)])])
    srv.subsystem(replica_nqn("v")).namespaces[1].reservations = EpochFence()
    await srv.start()
    store = MemoryStateStore(MemoryState())
    await R.create(store, "v", ["a", "b"])
    lease = await store.grant_lease(60)
    view = await R.claim_primary(store, "v", "a", lease)
    peer = await connect_peer("127.0.0.1", port, "v", "a", view.epoch)
    local = RamDevice(262144, 512, name="a")
    m = MirrorLayer(local, me="a", view=view, store=store, peers={"b": peer})
    data = b"x" * 4096
    rng = random.Random(1)
    lbas = [rng.randrange(0, 262144 - 8) // 8 * 8 for _ in range(n)]
    sem = asyncio.Semaphore(qd)
    loop = asyncio.get_running_loop()
    declined = [0]

    async def one(lba: int) -> None:
        async with sem:
            await m.write(lba, data)

    async def one_soon(lba: int) -> None:
        async with sem:
            fut = loop.create_future()
            if m.write_soon(lba, data, False, lambda e: fut.set_exception(e) if e else fut.set_result(None)):
                await fut
            else:
                declined[0] += 1          # as a frontend does: the normal path
                await m.write(lba, data)
    # every page of both RAM devices written once (a first write faults its page in: not the path measured),
    # then a warm-up
    chunk = b"\0" * (1 << 20)
    for lba in range(0, 262144, len(chunk) // 512):
        await m.write(lba, chunk)
    for name, fn in (("write", one), ("write_soon", one_soon)) * 2:
        await asyncio.gather(*(fn(l) for l in lbas[:2000]))
        declined[0] = 0
        c0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(fn(l) for l in lbas))
        c1, t1 = time.process_time(), time.perf_counter()
        print(f"{name}: {n} writes QD{qd}: {1e6 * (c1 - c0) / n:.1f} µs CPU/write (client+server in one process), "
              f"{n / (t1 - t0):.0f} IOPS" + (f", {declined[0]} declined" if fn is one_soon else ""))
    await peer.close()
    await srv.stop()


if __name__ == "__main__":
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
