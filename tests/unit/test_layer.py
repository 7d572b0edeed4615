"""The Layer base (block/layer.py): an empty layer is the device below, byte for byte and method for method
(the fast path included); a layer that changes one thing forwards the rest; capabilities survive a stack."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openvsan.block import Capabilities, FileDevice, Layer, NullDevice, RamDevice
from openvsan.block.device import BlockDevice, Buffer
from openvsan.block.layer import stack_of

BLOCKS = 64
BS = 512
KINDS = ("ram", "file", "null")


class Empty(Layer):
    type_name = "empty"


class ReadsCounted(Layer):
    """Overrides read() only."""

    def __init__(self, below: BlockDevice) -> None:
        super().__init__(below)
        self.reads = 0

    async def read(self, lba: int, blocks: int) -> Buffer:
        self.reads += 1
        return await self.below.read(lba, blocks)


class NoSyncWrite(Layer):
    """States one capability differently from the device below: writes never at once."""

    @property
    def capabilities(self) -> Capabilities:
        return super().capabilities.but(sync_write=False, max_transfer=1 << 20)

    def write_now(self, lba: int, data: Buffer) -> bool:
        return False


def open_device(kind: str, folder: Path) -> BlockDevice:
    if kind == "ram":
        return RamDevice(BLOCKS, BS)
    if kind == "file":
        return FileDevice(folder / "disk.img", size=BLOCKS * BS, block_size=BS)
    return NullDevice(BLOCKS, BS)


@pytest.fixture
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


# --- byte-identical (hypothesis): the same operations on a bare device and on an empty layer over a twin ---

lbas = st.integers(0, BLOCKS - 1)
op = st.one_of(
    st.tuples(st.just("write"), lbas, st.integers(1, 8), st.binary(min_size=1, max_size=1), st.booleans()),
    st.tuples(st.just("write_now"), lbas, st.integers(1, 8), st.binary(min_size=1, max_size=1)),
    st.tuples(st.just("read"), lbas, st.integers(0, 8)),
    st.tuples(st.just("read_now"), lbas, st.integers(1, 8)),
    st.tuples(st.just("unmap"), lbas, st.integers(0, 16)),
    st.tuples(st.just("write_zeroes"), lbas, st.integers(0, 16)),
    st.tuples(st.just("flush"),),
)


async def apply(dev: Any, step: tuple[Any, ...]) -> object:
    name = step[0]
    if name == "flush":
        return await dev.flush()
    lba = step[1]
    blocks = min(step[2], BLOCKS - lba)
    if name in ("write", "write_now"):
        data = step[3] * (blocks * BS)
        if name == "write":
            return await dev.write(lba, data, fua=step[4])
        return dev.write_now(lba, data) if hasattr(dev, "write_now") else False   # no fast path: declined
    if name == "read":
        return bytes(await dev.read(lba, blocks))
    if name == "read_now":
        got = dev.read_now(lba, blocks) if hasattr(dev, "read_now") else None
        return None if got is None else bytes(got)
    return await getattr(dev, name)(lba, blocks)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(steps=st.lists(op, max_size=25))
def test_an_empty_layer_is_byte_identical_to_its_device(kind: str, steps: list[tuple[Any, ...]]) -> None:
    async def go(folder: Path) -> None:
        (folder / "bare").mkdir()
        (folder / "twin").mkdir()
        bare = open_device(kind, folder / "bare")
        twin = open_device(kind, folder / "twin")
        layer = Empty(twin)
        try:
            for step in steps:
                got, want = await apply(layer, step), await apply(bare, step)
                if kind == "file" and step[0] == "read_now" and None in (got, want):
                    continue   # a file on a disk declines when the page cache lacks a block: each file its own
                assert got == want, step
            assert bytes(await layer.read(0, BLOCKS)) == bytes(await bare.read(0, BLOCKS))
            assert bytes(await twin.read(0, BLOCKS)) == bytes(await bare.read(0, BLOCKS))
        finally:
            await bare.close()
            await twin.close()

    with tempfile.TemporaryDirectory() as d:
        asyncio.run(go(Path(d)))


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_layer_binds_every_method_straight_to_the_device(kind: str, folder: Path) -> None:
    dev = open_device(kind, folder)
    layer = Empty(dev)
    for method in ("read", "write", "flush", "unmap", "write_zeroes"):
        assert getattr(layer, method) == getattr(dev, method), method   # the device's own bound method
    if kind == "null":
        # nothing to bind: the layer declines as a device without a fast path would
        assert layer.read_now(0, 1) is None and layer.write_now(0, bytes(BS)) is False
    else:
        assert layer.read_now == dev.read_now and layer.write_now == dev.write_now
    assert layer.capabilities is dev.capabilities
    assert (layer.block_size, layer.num_blocks) == (dev.block_size, dev.num_blocks)
    asyncio.run(dev.close())


def test_a_layer_follows_the_device_below_as_it_grows() -> None:
    async def go() -> None:
        dev = RamDevice(BLOCKS, BS)
        layer = Empty(dev)
        await layer.resize(2 * BLOCKS)
        assert dev.num_blocks == layer.num_blocks == 2 * BLOCKS
        await dev.close()
    asyncio.run(go())


def test_a_layer_that_overrides_read_only_forwards_the_rest() -> None:
    async def go() -> None:
        dev = RamDevice(BLOCKS, BS)
        layer = ReadsCounted(dev)
        for method in ("write", "flush", "unmap", "write_zeroes", "write_now", "write_window"):
            assert getattr(layer, method) == getattr(dev, method), method
        assert layer.read != dev.read
        await layer.write(3, b"r" * BS)
        assert await layer.read(3, 1) == b"r" * BS and layer.reads == 1
        # its own read() must not be gone around: the fast read declines, and says so in the capabilities
        assert layer.read_now(3, 1) is None
        assert layer.capabilities == dev.capabilities.but(sync_read=False)
        assert layer.capabilities.sync_write and layer.write_now(4, b"w" * BS)
        assert await dev.read(4, 1) == b"w" * BS
        await dev.close()
    asyncio.run(go())


class WritesCounted(Layer):
    """Changes write() only, as a replica's or QoS's layer does."""

    writes = 0

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        self.writes += 1
        await self.below.write(lba, data, fua=fua)


def test_a_layer_that_changes_write_takes_the_write_window_away() -> None:
    async def go() -> None:
        dev = RamDevice(BLOCKS, BS)
        assert dev.capabilities.write_window and len(dev.write_window(2, 3)) == 3 * BS
        layer = WritesCounted(dev)
        # data received into the device's memory would go around the layer's write: no window, no fast write
        assert layer.write_window(2, 3) is None and layer.write_now(2, bytes(BS)) is False
        assert layer.capabilities == dev.capabilities.but(sync_write=False, write_window=False)
        await layer.write(2, b"x" * BS)
        assert layer.writes == 1 and await dev.read(2, 1) == b"x" * BS
        await dev.close()
    asyncio.run(go())


def test_stack_of_lists_the_stack_top_down() -> None:
    dev = NullDevice(BLOCKS, BS)
    a = Empty(dev)
    b = ReadsCounted(a)
    c = Empty(b)
    assert stack_of(c) == [c, b, a, dev]
    assert stack_of(dev) == [dev]
    assert [x.to_config()["type"] for x in (c, b, a)] == ["empty", "layer", "empty"]


def test_a_changed_capability_survives_the_layers_above() -> None:
    dev = RamDevice(BLOCKS, BS)
    changed = NoSyncWrite(dev)
    top = Empty(Empty(changed))
    # a layer with writes of its own also takes the write window away: data received there would go around it
    want = dev.capabilities.but(sync_write=False, write_window=False, max_transfer=1 << 20)
    assert changed.capabilities == top.capabilities == want
    assert top.capabilities.sync_read and top.read_now == dev.read_now   # the rest is still the device's
    assert top.write_now(0, bytes(BS)) is False
    assert top.write_window(0, 1) is None
    asyncio.run(dev.close())
