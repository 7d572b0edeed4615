"""NullDevice: zeroes out, writes dropped, bounds still checked."""

from __future__ import annotations

import asyncio

import pytest

from openvsan.block import BlockDevice, NullDevice, OutOfRange
from openvsan.volume import Volume


def test_null_device() -> None:
    async def go() -> None:
        dev = NullDevice(1000, 4096, name="n0")
        assert isinstance(dev, BlockDevice)
        await dev.write(0, b"\xff" * 8192, fua=True)
        assert bytes(await dev.read(0, 2)) == bytes(8192)
        assert len(await dev.read(10, 1)) == 4096
        vol = Volume(dev, name="v")   # bounds and alignment: checked by the volume
        with pytest.raises(OutOfRange):
            await vol.read(999, 2)
        with pytest.raises(OutOfRange):
            await vol.write(1000, bytes(4096))
        with pytest.raises(ValueError):
            await vol.write(0, bytes(10))
        await dev.unmap(0, 1000)
        await dev.write_zeroes(0, 1)
        await dev.flush()
        await dev.close()
        assert dev.to_config() == {"type": "null", "name": "n0", "size": 4096000, "block_size": 4096}

    asyncio.run(go())


def test_null_rejects_bad_geometry() -> None:
    with pytest.raises(ValueError):
        NullDevice(0)
    with pytest.raises(ValueError):
        NullDevice(10, 520)


def test_null_config_round_trip() -> None:
    dev = NullDevice(8, 4096, name="n")
    assert NullDevice.from_config(dev.to_config()).to_config() == dev.to_config()
