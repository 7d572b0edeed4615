"""Multipath in our own initiator over real NVMe/TCP and iSCSI on loopback: two in-process targets ("nodes")
export one volume identity (same uuid, so same NGUID/EUI-64 and NAA), each over its own RAM, so the test
can see which node a write landed on. One path is ANA optimized / ALUA active-optimized, the other
inaccessible / standby. A write loop runs while the states flip, or while the optimized node is killed:
no I/O error, and the writes land on the new optimized node. A path of another volume is refused."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from vsan_harness import free_port

from openvsan.block import RamDevice
from openvsan.block.errors import DeviceFailed
from openvsan.frontend.config import IscsiTargetConfig, NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.iscsi import IscsiServer
from openvsan.frontend.nvme_tcp import NvmeTcpServer
from openvsan.frontend.portals import PortalServer
from openvsan.initiator.multipath import MultipathDevice, PathState, open_paths
from openvsan.protocol.nvme import ana
from openvsan.protocol.scsi.alua import AccessState, TargetPortGroup, TargetPortGroups
from openvsan.protocol.scsi.lun import Lun
from openvsan.protocol.scsi.target import ScsiTarget
from openvsan.volume import Volume

NQN = "nqn.2026-11.org.openvsan:replicated"
IQN = "iqn.2026-11.org.openvsan:replicated"
UUID = uuid.UUID("0b0e7a5e-0000-4000-8000-00000000a11a")
OTHER = uuid.UUID("0b0e7a5e-0000-4000-8000-00000000beef")
BS = 512
BLOCKS = 256


def run(body: Callable[[], Awaitable[None]], timeout: float = 60) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout))


def nvme_node(port: int, cntlids: tuple[int, int], vid: uuid.UUID = UUID) -> tuple[NvmeTcpServer, RamDevice]:
    ram = RamDevice(BLOCKS, BS)
    vol = Volume(ram, name="vol", uuid=vid, serial="vol-serial")
    srv = NvmeTcpServer([NvmeSubsystemConfig(NQN, [NvmeNamespaceConfig(1, vol)], [("127.0.0.1", port)],
                                             serial="SN-REPLICATED")])
    sub = srv.subsystem(NQN)
    assert sub is not None
    sub.set_cntlid_range(*cntlids)
    return srv, ram


def iscsi_node(port: int, tag: int, alua: TargetPortGroups, vid: uuid.UUID = UUID) -> tuple[IscsiServer, RamDevice]:
    ram = RamDevice(BLOCKS, BS)
    lun = Lun(Volume(ram, name="vol", uuid=vid, serial="vol-serial"), alua=alua)
    t = IscsiTargetConfig(IQN, ScsiTarget(IQN, {0: lun}), [("127.0.0.1", port)], portal_group_tag=tag)
    return IscsiServer([t]), ram


async def kill(srv: PortalServer) -> None:
    """As a node dying: every connection reset, nothing listening."""
    for c in list(srv.connections):
        if c.transport is not None:
            c.transport.abort()
    await srv.stop()


def block(i: int, gen: int) -> bytes:
    return (f"{i:05d}:{gen:07d}:".encode() * 64)[:BS]


class Writer:
    """Writes block i % BLOCKS with generation i, one after another, and counts what failed."""

    def __init__(self, dev: MultipathDevice) -> None:
        self.dev = dev
        self.done = 0
        self.errors: list[BaseException] = []
        self.stop = False
        self.last: dict[int, int] = {}

    async def loop(self) -> None:
        i = 0
        while not self.stop:
            lba = i % BLOCKS
            try:
                await self.dev.write(lba, block(lba, i))
            except Exception as e:  # noqa: BLE001 - the test counts every error
                self.errors.append(e)
                return
            self.last[lba] = i
            self.done += 1
            i += 1

    async def until(self, n: int) -> None:
        while self.done < n and not self.errors:
            await asyncio.sleep(0.005)


def gen_on(ram: RamDevice, lba: int) -> int | None:
    """The generation of the block at `lba` on `ram` (None: none of ours is there)."""
    data = bytes(ram.read_now(lba, 1) or b"")
    try:
        g = int(data[6:13])
    except ValueError:
        return None
    return g if data == block(lba, g) else None


def lands_on(ram: RamDevice, gens: dict[int, int]) -> bool:
    """Each block holds its recorded generation or a newer one: the writer goes on meanwhile, and past BLOCKS
    writes it writes the same blocks again."""
    return all((g_on := gen_on(ram, lba)) is not None and g_on >= g for lba, g in gens.items())


def nvme_urls(pa: int, pb: int) -> list[str]:
    return [f"nvme+tcp://127.0.0.1:{pa}/{NQN}/1", f"nvme+tcp://127.0.0.1:{pb}/{NQN}/1"]


def states(dev: MultipathDevice) -> list[PathState]:
    return [p.state for p in dev.paths]


async def until_state(dev: MultipathDevice, want: list[PathState]) -> None:
    for _ in range(400):
        if states(dev) == want:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"states {states(dev)}, want {want}")


@pytest.mark.parametrize("how", ["flip", "kill"])
def test_nvme_writes_follow_the_optimized_path(how: str) -> None:
    pa, pb = free_port(), free_port()
    (a, ram_a), (b, ram_b) = nvme_node(pa, (1, 0x7FF)), nvme_node(pb, (0x800, 0xFFF))

    async def body() -> None:
        await a.start()
        await b.start()
        b.set_ana_state(NQN, 1, ana.INACCESSIBLE)
        changes: list[tuple[str, str, str]] = []
        dev = await open_paths(nvme_urls(pa, pb), no_path_retry=10, check_interval=0.2,
                               on_change=lambda p, o, n: changes.append((p.name, o.label, n.label)))
        w = Writer(dev)
        task = asyncio.ensure_future(w.loop())
        try:
            assert states(dev) == [PathState.OPTIMIZED, PathState.STANDBY]
            await w.until(200)
            before = dict(w.last)
            assert lands_on(ram_a, before) and not lands_on(ram_b, before)   # the optimized node only
            # failover: the old primary goes (inaccessible, or killed), then the new one is optimized
            if how == "flip":
                a.set_ana_state(NQN, 1, ana.INACCESSIBLE)
            else:
                await kill(a)
            await asyncio.sleep(0.3)                 # I/O is held meanwhile, not failed
            b.set_ana_state(NQN, 1, ana.OPTIMIZED)
            mark = w.done
            await w.until(mark + 200)
            w.stop = True
            await task
            assert not w.errors, w.errors
            after = {lba: g for lba, g in w.last.items() if g >= mark}
            assert after and lands_on(ram_b, after)
            if how == "flip":
                assert not lands_on(ram_a, after)
            assert dev.paths[1].state == PathState.OPTIMIZED
            assert dev.paths[0].state in (PathState.STANDBY, PathState.FAILED)
            assert dev.paths[0].commands > 0 and dev.paths[1].commands > 0
            assert any(n == "optimized" for name, _, n in changes if name == dev.paths[1].name)
        finally:
            w.stop = True
            await dev.close()
            await a.stop()
            await b.stop()

    run(body)


def test_nvme_path_of_another_volume_is_refused() -> None:
    pa, pb = free_port(), free_port()
    (a, _), (b, _) = nvme_node(pa, (1, 0x7FF)), nvme_node(pb, (0x800, 0xFFF), OTHER)

    async def body() -> None:
        await a.start()
        await b.start()
        try:
            with pytest.raises(DeviceFailed, match="another volume"):
                await open_paths(nvme_urls(pa, pb))
        finally:
            await a.stop()
            await b.stop()

    run(body)


def test_nvme_a_path_down_at_open_joins_later() -> None:
    pa, pb = free_port(), free_port()
    (a, _), (b, ram_b) = nvme_node(pa, (1, 0x7FF)), nvme_node(pb, (0x800, 0xFFF))

    async def body() -> None:
        await a.start()
        a.set_ana_state(NQN, 1, ana.INACCESSIBLE)
        dev = await open_paths(nvme_urls(pa, pb), no_path_retry=10, check_interval=0.1)
        try:
            assert states(dev) == [PathState.STANDBY, PathState.FAILED]
            await b.start()                           # the other node comes up: reconnected in the background
            await until_state(dev, [PathState.STANDBY, PathState.OPTIMIZED])
            await dev.write(3, block(3, 1))
            assert lands_on(ram_b, {3: 1})
        finally:
            await dev.close()
            await a.stop()
            await b.stop()

    run(body)


@pytest.mark.parametrize("how", ["flip", "kill"])
def test_iscsi_writes_follow_alua(how: str) -> None:
    pa, pb = free_port(), free_port()
    # one model for the LU on both nodes (what the cluster keeps in step): target port 1 on node a, 2 on b
    alua = TargetPortGroups([TargetPortGroup(1, frozenset({1}), AccessState.ACTIVE_OPTIMIZED),
                             TargetPortGroup(2, frozenset({2}), AccessState.STANDBY)])
    (a, ram_a), (b, ram_b) = iscsi_node(pa, 1, alua), iscsi_node(pb, 2, alua)
    urls = [f"iscsi://127.0.0.1:{pa}/{IQN}/0", f"iscsi://127.0.0.1:{pb}/{IQN}/0"]

    async def body() -> None:
        await a.start()
        await b.start()
        dev = await open_paths(urls, no_path_retry=10, check_interval=0.2)
        w = Writer(dev)
        task = asyncio.ensure_future(w.loop())
        try:
            assert states(dev) == [PathState.OPTIMIZED, PathState.STANDBY]
            await w.until(200)
            before = dict(w.last)
            assert lands_on(ram_a, before) and not lands_on(ram_b, before)
            if how == "flip":
                alua.set_states({1: AccessState.TRANSITIONING, 2: AccessState.TRANSITIONING})
            else:
                await kill(a)
            await asyncio.sleep(0.3)
            alua.set_states({1: AccessState.STANDBY, 2: AccessState.ACTIVE_OPTIMIZED})
            mark = w.done
            await w.until(mark + 200)
            w.stop = True
            await task
            assert not w.errors, w.errors
            after = {lba: g for lba, g in w.last.items() if g >= mark}
            assert after and lands_on(ram_b, after)
            if how == "flip":
                assert not lands_on(ram_a, after)
            assert dev.paths[1].state == PathState.OPTIMIZED
        finally:
            w.stop = True
            await dev.close()
            await a.stop()
            await b.stop()

    run(body)


def test_iscsi_path_of_another_volume_is_refused() -> None:
    pa, pb = free_port(), free_port()
    (a, _), (b, _) = (iscsi_node(pa, 1, TargetPortGroups.single()),
                      iscsi_node(pb, 2, TargetPortGroups.single(), OTHER))

    async def body() -> None:
        await a.start()
        await b.start()
        try:
            with pytest.raises(DeviceFailed, match="another volume"):
                await open_paths([f"iscsi://127.0.0.1:{pa}/{IQN}/0", f"iscsi://127.0.0.1:{pb}/{IQN}/0"])
        finally:
            await a.stop()
            await b.stop()

    run(body)


def test_bench_with_two_paths_rides_through_a_failover() -> None:
    """`vsan bench --target A --target B`: a write run while the optimized node hands over, 0 I/O errors."""
    import json
    import threading

    from typer.testing import CliRunner

    from openvsan.cli.main import app

    pa, pb = free_port(), free_port()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)  # type: ignore[arg-type]

    async def make() -> tuple[NvmeTcpServer, NvmeTcpServer]:
        (a, _), (b, _) = nvme_node(pa, (1, 0x7FF)), nvme_node(pb, (0x800, 0xFFF))
        await a.start()
        await b.start()
        b.set_ana_state(NQN, 1, ana.INACCESSIBLE)
        return a, b

    a, b = on_loop(make())

    async def failover() -> None:
        await asyncio.sleep(0.6)
        a.set_ana_state(NQN, 1, ana.INACCESSIBLE)
        await asyncio.sleep(0.2)
        b.set_ana_state(NQN, 1, ana.OPTIMIZED)

    try:
        moved = asyncio.run_coroutine_threadsafe(failover(), loop)
        ua, ub = nvme_urls(pa, pb)
        r = CliRunner().invoke(app, ["bench", "--target", ua, "--target", ub, "-p", "4k-randwrite", "-q", "4",
                                     "-d", "1.5", "--warmup", "0", "--json", "--no-path-retry", "10"])
        moved.result(5)
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        (run_,) = doc["runs"]
        assert run_["errors"]["io"] == 0 and run_["target"] == f"{ua} {ub}"
    finally:
        async def down() -> None:
            await a.stop()
            await b.stop()
        on_loop(down())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
