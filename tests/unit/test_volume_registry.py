"""The device and layer registry (volume/registry.py): a stack is data, and data gives the same stack back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from openvsan.block import FileDevice, Layer, NullDevice, RamDevice
from openvsan.block.device import BlockDevice
from openvsan.block.layer import stack_of
from openvsan.volume import Volume, registry
from openvsan.volume.registry import (
    UnknownType,
    build_stack,
    device_from_config,
    register_device,
    register_layer,
    stack_config,
)


class Tagged(Layer):
    """A test layer with one setting of its own."""

    type_name = "test-tagged"

    def __init__(self, below: BlockDevice, tag: str, weight: int = 1) -> None:
        super().__init__(below)
        self.tag, self.weight = tag, weight

    def layer_config(self) -> dict[str, Any]:
        return {"tag": self.tag, "weight": self.weight}

    @classmethod
    def from_config(cls, cfg: dict[str, Any], below: BlockDevice) -> Tagged:
        return cls(below, cfg["tag"], cfg.get("weight", 1))


@pytest.fixture
def registered() -> Iterator[None]:
    saved = dict(registry.LAYER_TYPES), dict(registry.DEVICE_TYPES), registry._loaded
    register_layer(Tagged)
    yield
    registry.LAYER_TYPES.clear()
    registry.LAYER_TYPES.update(saved[0])
    registry.DEVICE_TYPES.clear()
    registry.DEVICE_TYPES.update(saved[1])
    registry._loaded = saved[2]


def test_a_stack_config_round_trips(registered: None) -> None:
    dev = RamDevice(64)
    layers = [{"type": "test-tagged", "tag": "bottom", "weight": 3}, {"type": "test-tagged", "tag": "top", "weight": 1}]
    top = build_stack(dev, layers)
    stack = stack_of(top)
    assert [type(x) for x in stack] == [Tagged, Tagged, RamDevice]
    assert [x.tag for x in stack[:-1]] == ["top", "bottom"] and stack[-1] is dev   # type: ignore[attr-defined]
    assert stack_config(top) == layers
    again = build_stack(NullDevice(64), stack_config(top))
    assert stack_config(again) == layers
    assert build_stack(dev, []) is dev and stack_config(dev) == []
    assert Volume(top, name="v").to_config()["layers"] == layers
    asyncio.run(dev.close())


def test_an_unknown_layer_type_names_the_known_ones(registered: None) -> None:
    with pytest.raises(UnknownType, match=r"unknown layer type 'cache'; known: .*test-tagged"):
        build_stack(RamDevice(8), [{"type": "test-tagged", "tag": "x"}, {"type": "cache"}])
    with pytest.raises(UnknownType, match=r"unknown layer type None"):
        build_stack(RamDevice(8), [{}])


def test_an_unknown_device_type_names_the_known_ones() -> None:
    with pytest.raises(UnknownType, match=r"^unknown device type 'tape'; known: file, null, ram$"):
        device_from_config({"type": "tape", "size": 4096})
    assert issubclass(UnknownType, ValueError)


def test_device_from_config_for_ram_file_and_null(tmp_path: Path) -> None:
    async def go() -> None:
        ram = device_from_config({"type": "ram", "name": "r", "size": 1 << 20, "block_size": 4096})
        assert isinstance(ram, RamDevice) and (ram.num_blocks, ram.block_size) == (256, 4096)
        null = device_from_config({"type": "null", "size": 1 << 20})
        assert isinstance(null, NullDevice) and (null.num_blocks, null.block_size) == (2048, 512)
        path = tmp_path / "disk.img"
        f = device_from_config({"type": "file", "name": "f", "path": str(path), "size": 1 << 20})
        assert isinstance(f, FileDevice) and f.num_blocks == 2048 and path.stat().st_size == 1 << 20
        await f.write(7, b"p" * 512)
        for dev in (ram, null, f):
            cfg = dev.to_config()
            twin = device_from_config(cfg)
            assert type(twin) is type(dev) and twin.to_config() == cfg
            if dev is f:
                assert await twin.read(7, 1) == b"p" * 512     # the same file, opened again
            await twin.close()
            await dev.close()
    asyncio.run(go())


def test_types_registered_before_first_use_do_not_hide_the_built_in_ones(registered: None) -> None:
    registry.DEVICE_TYPES.clear()
    registry._loaded = False
    register_device("test-blank", lambda cfg: NullDevice(cfg["size"] // 512))
    assert isinstance(device_from_config({"type": "test-blank", "size": 4096}), NullDevice)
    ram = device_from_config({"type": "ram", "size": 4096})
    assert isinstance(ram, RamDevice)
    asyncio.run(ram.close())
