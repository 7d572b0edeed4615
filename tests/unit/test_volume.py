"""The Volume handle (volume/volume.py): bounds and alignment checked once, the fast path and its decline,
identity, swap() under concurrent I/O (nothing lost or duplicated, ordering, Busy), resize() and listeners.

No clock: I/O "in flight" is a layer that yields to the loop (sleep(0)) or waits on an Event."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from openvsan.block import Busy, FaultDevice, FileDevice, Layer, NullDevice, OutOfRange, RamDevice
from openvsan.block.capabilities import Capabilities
from openvsan.block.device import BlockDevice, Buffer
from openvsan.protocol.scsi.inquiry import COMPANY_ID, naa6
from openvsan.volume import Volume

BS = 512
BLOCKS = 64
U = uuid.UUID("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class Recorder(Layer):
    """Records every call that reaches it."""

    type_name = "recorder"

    def __init__(self, below: BlockDevice) -> None:
        super().__init__(below)
        self.calls: list[str] = []

    async def read(self, lba: int, blocks: int) -> Buffer:
        self.calls.append("read")
        return await self.below.read(lba, blocks)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        self.calls.append("write")
        await self.below.write(lba, data, fua=fua)

    async def flush(self) -> None:
        self.calls.append("flush")

    async def unmap(self, lba: int, blocks: int) -> None:
        self.calls.append("unmap")

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        self.calls.append("write_zeroes")

    async def lba_status(self, lba: int, blocks: int) -> Any:
        self.calls.append("lba_status")
        return []


class Yielding(Layer):
    """Reads and writes give the loop away a few times before and after the device: truly in flight."""

    def __init__(self, below: BlockDevice, seed: int) -> None:
        super().__init__(below)
        self.rng = random.Random(seed)

    async def _pause(self) -> None:
        for _ in range(self.rng.randrange(4)):
            await asyncio.sleep(0)

    async def read(self, lba: int, blocks: int) -> Buffer:
        await self._pause()
        data = bytes(await self.below.read(lba, blocks))
        await self._pause()
        return data

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        await self._pause()
        await self.below.write(lba, data, fua=fua)
        await self._pause()


class WriteCounter(Layer):
    """Notes the id (first 8 bytes) of every block write that passes it, and which stack it belongs to.
    Once closed (swapped out), any I/O on it is an error: the swap should have drained it."""

    def __init__(self, below: BlockDevice, seen: list[tuple[int, int]], generation: int) -> None:
        super().__init__(below)
        self.seen, self.generation = seen, generation
        self.closed = False

    async def read(self, lba: int, blocks: int) -> Buffer:
        assert not self.closed, "a read arrived at a stack swapped out"
        data = await self.below.read(lba, blocks)
        assert not self.closed, "a read was still in flight on a stack swapped out"
        return data

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        assert not self.closed, "a write arrived at a stack swapped out"
        self.seen.append((int.from_bytes(bytes(data[:8]), "big"), self.generation))
        await self.below.write(lba, data, fua=fua)
        assert not self.closed, "a write was still in flight on a stack swapped out"

    async def close(self) -> None:
        self.closed = True


class Gate(Layer):
    """Writes wait at a gate the test opens; each step goes to a shared log. The fast path passes."""

    def __init__(self, below: BlockDevice, log: list[str], tag: str) -> None:
        super().__init__(below)
        self.log, self.tag = log, tag
        self.gate = asyncio.Event()

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        self.log.append(f"{self.tag}: write {lba} in")
        await self.gate.wait()
        await self.below.write(lba, data, fua=fua)
        self.log.append(f"{self.tag}: write {lba} done")

    def write_now(self, lba: int, data: Buffer) -> bool:
        return bool(self.below.write_now(lba, data))  # type: ignore[attr-defined]   # no gate: never waits


async def settle(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# --- bounds and alignment, at the volume, before anything reaches the stack -----------------------------

@pytest.mark.parametrize("method", ["read", "unmap", "write_zeroes", "lba_status", "write"])
@pytest.mark.parametrize("lba,blocks", [(-1, 1), (0, -1), (BLOCKS, 1), (BLOCKS - 1, 2), (0, BLOCKS + 1)])
def test_out_of_range_is_refused_for_every_method(method: str, lba: int, blocks: int) -> None:
    rec = Recorder(RamDevice(BLOCKS, BS))
    vol = Volume(rec, name="v")

    async def go() -> None:
        call = (vol.write(lba, bytes(max(blocks, 0) * BS)) if method == "write"
                else getattr(vol, method)(lba, blocks))
        with pytest.raises(OutOfRange, match="volume v"):
            await call
    if method == "write" and blocks < 0:
        return   # a write's length is its data's: never negative
    run(go())
    assert rec.calls == []


def test_in_range_calls_reach_the_stack_at_the_edges() -> None:
    rec = Recorder(RamDevice(BLOCKS, BS))
    vol = Volume(rec, name="v")

    async def go() -> None:
        await vol.write(BLOCKS - 1, b"e" * BS)
        assert await vol.read(BLOCKS - 1, 1) == b"e" * BS
        await vol.read(0, BLOCKS)
        await vol.read(BLOCKS, 0)
        await vol.unmap(0, BLOCKS)
        await vol.write_zeroes(BLOCKS - 1, 1)
        await vol.lba_status(0, BLOCKS)
        await vol.flush()
    run(go())
    assert rec.calls == ["write", "read", "read", "read", "unmap", "write_zeroes", "lba_status", "flush"]


@pytest.mark.parametrize("n", [1, BS - 1, BS + 1, 3 * BS + 7])
def test_a_write_not_a_multiple_of_the_block_size_is_refused(n: int) -> None:
    rec = Recorder(RamDevice(BLOCKS, BS))
    vol = Volume(rec, name="v")
    with pytest.raises(ValueError, match=f"write of {n} bytes is not a multiple of the block size 512"):
        run(vol.write(0, bytes(n)))
    assert rec.calls == []


# --- the fast path ---------------------------------------------------------------------------------------

def test_the_fast_path_is_the_stacks_when_capabilities_allow() -> None:
    dev = RamDevice(BLOCKS, BS)
    vol = Volume(Layer(Layer(dev)), name="v")
    assert vol.read_now.__wrapped__ == dev.read_now and vol.write_now.__wrapped__ == dev.write_now  # metered
    assert vol.write_now(2, b"f" * BS) is True and bytes(vol.read_now(2, 1) or b"") == b"f" * BS


class NoFastPath(Layer):
    @property
    def capabilities(self) -> Capabilities:
        return super().capabilities.but(sync_read=False, sync_write=False)


@pytest.mark.parametrize("make", [lambda: NullDevice(BLOCKS, BS), lambda: NoFastPath(RamDevice(BLOCKS, BS)),
                                  lambda: FaultDevice(RamDevice(BLOCKS, BS))])
def test_the_fast_path_declines_when_capabilities_do_not_allow(make: Any) -> None:
    stack = make()
    vol = Volume(stack, name="v")
    assert vol.read_now(0, 1) is None
    assert vol.write_now(0, b"x" * BS) is False
    assert run(vol.read(0, 1)) == bytes(BS)   # nothing was written by the declined write


# --- identity ---------------------------------------------------------------------------------------------

def test_identity_derives_from_the_uuid_and_is_stable() -> None:
    a = Volume(RamDevice(BLOCKS, BS), name="a", uuid=U)
    b = Volume(NullDevice(2 * BLOCKS, 4096), name="other", uuid=U)
    for v in (a, b):
        assert v.nguid == U.bytes                                            # NGUID: the uuid itself
        assert v.eui64 == hashlib.sha256(b"eui64:" + U.bytes).digest()[:8]   # as Namespace had it
        assert v.naa == naa6(U)
    # pinned: an initiator knows a volume by these, so they must never change for a uuid
    assert a.eui64.hex() == "26389e5cdd56daaa"
    assert a.naa.hex() == "6" + f"{COMPANY_ID:06x}" + U.hex[-25:] == "60a4f56c4b5a69788796a5b4c3d2e1f0"
    assert a.serial == b.serial == U.hex[:16]
    # no uuid given: one derived from the name, the same every time
    assert Volume(NullDevice(8), name="x").uuid == Volume(NullDevice(8), name="x").uuid
    assert Volume(NullDevice(8), name="x").uuid != Volume(NullDevice(8), name="y").uuid
    assert Volume(NullDevice(8), name="x", serial="S1").serial == "S1"
    c = Volume(RamDevice(BLOCKS, BS), name="c", uuid=uuid.uuid4())
    assert c.nguid != a.nguid and c.eui64 != a.eui64 and c.naa != a.naa


def test_size_layers_device_and_config() -> None:
    dev = RamDevice(BLOCKS, BS)
    top = Layer(dev)
    vol = Volume(top, name="v", uuid=U)
    assert vol.size == BLOCKS * BS and vol.layers == [top, dev] and vol.device is dev
    assert vol.to_config() == {"name": "v", "uuid": str(U), "layers": [{"type": "layer"}]}


# --- swap() under concurrent I/O ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_swap_under_concurrent_io_loses_and_duplicates_nothing(seed: int) -> None:
    """Tasks write and read random blocks (each task its own blocks, so a model knows every answer) while
    the stack is swapped several times over the same RamDevice. Every write passes exactly one counter,
    once; every read sees the last acknowledged write; the device holds them all at the end."""
    tasks_n, ops, swaps = 8, 60, 6
    rng = random.Random(seed)
    ram = RamDevice(BLOCKS, BS)
    seen: list[tuple[int, int]] = []
    vol = Volume(WriteCounter(Yielding(ram, seed), seen, 0), name="v")
    model: dict[int, int] = {}
    issued: list[int] = []
    swapped_with_io_in_flight = 0

    def block(write_id: int) -> bytes:
        return write_id.to_bytes(8, "big") * (BS // 8)

    async def worker(t: int) -> None:
        mine = [lba for lba in range(BLOCKS) if lba % tasks_n == t]
        r = random.Random(seed * 100 + t)
        for i in range(ops):
            lba = r.choice(mine)
            if r.random() < 0.6:
                wid = (t << 32) | (i + 1)
                issued.append(wid)
                await vol.write(lba, block(wid))
                model[lba] = wid
            else:
                got = await vol.read(lba, 1)
                assert bytes(got) == (block(model[lba]) if lba in model else bytes(BS)), (t, i, lba)

    async def swapper() -> None:
        nonlocal swapped_with_io_in_flight
        for g in range(1, swaps + 1):
            await settle(rng.randrange(1, 20))
            swapped_with_io_in_flight += vol._inflight > 0
            old = await vol.swap(WriteCounter(Yielding(ram, seed + g), seen, g))
            assert isinstance(old, WriteCounter) and old.generation == g - 1
            await old.close()

    async def go() -> None:
        await asyncio.gather(swapper(), *(worker(t) for t in range(tasks_n)))
        for lba in range(BLOCKS):
            assert bytes(await vol.read(lba, 1)) == (block(model[lba]) if lba in model else bytes(BS)), lba
    run(go())
    ids = [wid for wid, _ in seen]
    assert sorted(ids) == sorted(issued) and len(set(ids)) == len(ids)   # each write counted exactly once
    assert {g for _, g in seen} == set(range(swaps + 1))                 # every stack took writes
    assert swapped_with_io_in_flight, "no swap found I/O in flight: the test proves nothing"
    assert vol._inflight == 0 and vol._held is None


def test_swap_waits_for_in_flight_io_and_holds_new_io() -> None:
    async def go() -> None:
        ram = RamDevice(BLOCKS, BS)
        log: list[str] = []
        old, new = Gate(ram, log, "old"), Gate(ram, log, "new")
        new.gate.set()
        vol = Volume(old, name="v")
        a = asyncio.create_task(vol.write(1, b"a" * BS))
        await settle()
        assert log == ["old: write 1 in"]

        async def swap() -> None:
            await vol.swap(new)
            log.append("swapped")
        s = asyncio.create_task(swap())
        await settle()
        assert not s.done(), "swap did not wait for the write in flight"
        b = asyncio.create_task(vol.write(2, b"b" * BS))
        r = asyncio.create_task(vol.read(1, 1))
        await settle()
        assert log == ["old: write 1 in"], "new I/O reached a stack during the swap"
        assert not b.done() and not r.done()
        old.gate.set()
        await asyncio.gather(a, s, b)
        assert bytes(await r) == b"a" * BS        # held, then run after the write it waited behind
        assert log == ["old: write 1 in", "old: write 1 done", "swapped", "new: write 2 in", "new: write 2 done"]
        assert vol.stack is new
    run(go())


def test_a_swap_that_cannot_drain_in_time_is_busy_and_changes_nothing() -> None:
    async def go() -> None:
        ram = RamDevice(BLOCKS, BS)
        log: list[str] = []
        old, new = Gate(ram, log, "old"), Gate(ram, log, "new")
        vol = Volume(old, name="v")
        events: list[str] = []
        vol.listen(events.append)
        a = asyncio.create_task(vol.write(1, b"a" * BS))
        await settle()
        with pytest.raises(Busy, match="volume v: 1 I/O still in flight .* nothing was changed"):
            await vol.swap(new, timeout=0)
        assert vol.stack is old and events == [] and vol._held is None
        assert vol.read_now.__wrapped__ == ram.read_now                       # the fast path is back
        b = asyncio.create_task(vol.write(2, b"b" * BS))          # I/O goes on, on the old stack
        await settle()
        assert log == ["old: write 1 in", "old: write 2 in"]
        old.gate.set()
        await asyncio.gather(a, b)
        assert await vol.read(1, 2) == b"a" * BS + b"b" * BS
    run(go())


def test_the_fast_path_is_declined_during_a_swap_and_back_after() -> None:
    async def go() -> None:
        ram, ram2 = RamDevice(BLOCKS, BS), RamDevice(BLOCKS, BS)
        log: list[str] = []
        old = Gate(ram, log, "old")
        vol = Volume(old, name="v")
        assert vol.write_now(5, b"1" * BS) and vol.read_now.__wrapped__ == ram.read_now
        a = asyncio.create_task(vol.write(1, b"a" * BS))
        await settle()
        s = asyncio.create_task(vol.swap(Layer(ram2)))
        await settle()
        assert vol.read_now(5, 1) is None
        assert vol.write_now(5, b"2" * BS) is False
        assert await ram.read(5, 1) == b"1" * BS and await ram2.read(5, 1) == bytes(BS)
        old.gate.set()
        await asyncio.gather(a, s)
        assert vol.read_now.__wrapped__ == ram2.read_now and vol.write_now.__wrapped__ == ram2.write_now
        assert vol.write_now(5, b"3" * BS) and await ram2.read(5, 1) == b"3" * BS
    run(go())


def test_swap_tells_the_listeners_and_refuses_another_block_size() -> None:
    async def go() -> None:
        vol = Volume(RamDevice(BLOCKS, BS), name="v")
        events: list[str] = []
        vol.listen(events.append)
        with pytest.raises(ValueError, match="4096-byte blocks cannot replace one of 512-byte blocks"):
            await vol.swap(RamDevice(BLOCKS, 4096))
        assert events == []
        await vol.swap(NoFastPath(RamDevice(BLOCKS, BS)))
        assert events == ["stack"] and vol.read_now(0, 1) is None and not vol.capabilities.sync_read
        await vol.swap(RamDevice(2 * BLOCKS, BS))
        assert events == ["stack", "stack", "resized"] and vol.num_blocks == 2 * BLOCKS
        assert vol.capabilities.sync_read and vol.read_now(0, 1) == bytes(BS)
    run(go())


# --- resize() and listeners --------------------------------------------------------------------------------

def _file(folder: Path) -> BlockDevice:
    return FileDevice(folder / "disk.img", size=BLOCKS * BS, block_size=BS)


@pytest.mark.parametrize("make", [lambda f: RamDevice(BLOCKS, BS), _file, lambda f: NullDevice(BLOCKS, BS)],
                         ids=["ram", "file", "null"])
def test_resize_grows_the_device_keeps_the_data_and_tells_the_listeners(make: Any) -> None:
    async def go(folder: Path) -> None:
        dev = make(folder)
        vol = Volume(Layer(dev), name="v")
        events: list[str] = []
        vol.listen(events.append)
        await vol.write(BLOCKS - 1, b"k" * BS)
        with pytest.raises(OutOfRange):
            await vol.read(BLOCKS, 1)
        await vol.resize(3 * BLOCKS)
        assert events == ["resized"]
        assert vol.num_blocks == dev.num_blocks == 3 * BLOCKS and vol.size == 3 * BLOCKS * BS
        await vol.write(3 * BLOCKS - 1, b"z" * BS)
        if not isinstance(dev, NullDevice):
            assert await vol.read(BLOCKS - 1, 1) == b"k" * BS
            assert await vol.read(3 * BLOCKS - 1, 1) == b"z" * BS
            assert await vol.read(BLOCKS, 1) == bytes(BS)
        await vol.resize(3 * BLOCKS)                 # the size it has: nothing to tell
        assert events == ["resized"]
        await dev.close()

    with tempfile.TemporaryDirectory() as d:
        run(go(Path(d)))


def test_resize_of_a_device_that_cannot_is_one_clear_error() -> None:
    async def go() -> None:
        dev = FaultDevice(RamDevice(BLOCKS, BS))
        vol = Volume(dev, name="v")
        events: list[str] = []
        vol.listen(events.append)
        with pytest.raises(ValueError, match=r"^volume v: its device \(FaultDevice\) cannot be resized$"):
            await vol.resize(2 * BLOCKS)
        with pytest.raises(ValueError, match="a size of 0 blocks"):
            await Volume(RamDevice(BLOCKS, BS), name="w").resize(0)
        assert vol.num_blocks == dev.num_blocks == BLOCKS and events == []
        assert vol._held is None
    run(go())


def test_resize_waits_for_in_flight_io() -> None:
    async def go() -> None:
        ram = RamDevice(BLOCKS, BS)
        log: list[str] = []
        gate = Gate(ram, log, "g")
        vol = Volume(gate, name="v")
        vol.listen(lambda what: log.append(what))
        a = asyncio.create_task(vol.write(1, b"a" * BS))
        await settle()
        r = asyncio.create_task(vol.resize(2 * BLOCKS))
        await settle()
        assert not r.done() and ram.num_blocks == BLOCKS
        gate.gate.set()
        await asyncio.gather(a, r)
        assert log == ["g: write 1 in", "g: write 1 done", "resized"] and ram.num_blocks == 2 * BLOCKS
    run(go())


@pytest.mark.parametrize("change", ["resize", "swap"])
def test_io_held_across_a_shrink_is_checked_against_the_new_size(change: str) -> None:
    async def go() -> None:
        ram = RamDevice(BLOCKS, BS)
        log: list[str] = []
        gate = Gate(ram, log, "g")
        vol = Volume(gate, name="v")
        a = asyncio.create_task(vol.write(1, b"a" * BS))
        await settle()
        c = asyncio.create_task(vol.resize(BLOCKS // 2) if change == "resize"
                                else vol.swap(RamDevice(BLOCKS // 2, BS)))
        await settle()
        late = asyncio.create_task(vol.read(BLOCKS - 1, 1))      # in range when it came, held, then not
        fits = asyncio.create_task(vol.read(BLOCKS // 2 - 1, 1))
        await settle()
        gate.gate.set()
        await asyncio.gather(a, c)
        with pytest.raises(OutOfRange):
            await late
        assert await fits == bytes(BS)
        assert vol.num_blocks == BLOCKS // 2
    run(go())


def test_listen_unlisten_and_a_failing_listener(caplog: pytest.LogCaptureFixture) -> None:
    vol = Volume(RamDevice(BLOCKS, BS), name="v")
    first: list[str] = []
    last: list[str] = []

    def broken(what: str) -> None:
        raise RuntimeError("listener bug")

    vol.listen(first.append)
    vol.listen(broken)
    stop = vol.listen(last.append)
    with caplog.at_level(logging.ERROR, logger="openvsan.volume"):
        run(vol.resize(2 * BLOCKS))
    assert first == last == ["resized"]
    assert "volume v: a listener failed on resized" in caplog.text
    stop()
    stop()   # twice: harmless
    run(vol.resize(3 * BLOCKS))
    assert first == ["resized", "resized"] and last == ["resized"]


def test_an_open_write_window_is_io_in_flight_for_a_swap_and_a_resize() -> None:
    async def go() -> None:
        ram, ram2 = RamDevice(BLOCKS, BS), RamDevice(BLOCKS, BS)
        vol = Volume(ram, name="v")
        view = vol.open_window(4, 2)
        assert view is not None and len(view) == 2 * BS
        view[:] = b"w" * (2 * BS)                                   # the data arrives straight in the device
        s = asyncio.create_task(vol.swap(Layer(ram2)))
        await settle()
        assert not s.done(), "the swap did not wait for the open window"
        assert vol.open_window(8, 1) is None                        # no new window while it drains
        vol.close_window()
        await s
        assert await ram.read(4, 2) == b"w" * (2 * BS)
        assert vol.open_window(8, 1) is not None                   # the new stack's device lends one too
        vol.close_window()
        w = vol.open_window(0, 1)
        assert w is not None
        with pytest.raises(Busy):
            await vol.resize(2 * BLOCKS, timeout=0)                 # nothing changes under an open window
        vol.close_window()
        await vol.resize(2 * BLOCKS)
        assert vol.num_blocks == 2 * BLOCKS
        with pytest.raises(OutOfRange):
            vol.open_window(2 * BLOCKS - 1, 2)
    run(go())


def test_no_write_window_through_a_layer_or_a_device_without_one() -> None:
    ram = RamDevice(BLOCKS, BS)
    assert Volume(Recorder(ram), name="a").open_window(0, 1) is None   # Recorder changes write()
    assert Volume(NullDevice(BLOCKS, BS), name="b").open_window(0, 1) is None
    assert Volume(FaultDevice(ram), name="c").open_window(0, 1) is None
    v = Volume(Layer(ram), name="d")                                  # an empty layer forwards it
    assert v.open_window(0, 1) is not None and v._inflight == 1
    v.close_window()
    assert v._inflight == 0
