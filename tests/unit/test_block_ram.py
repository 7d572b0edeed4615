"""RamDevice: round trips, bounds, and that unmap/write_zeroes really zero (large ranges give pages back)."""

import asyncio

import pytest

from openvsan.block import OutOfRange
from openvsan.block.ram import RamDevice


@pytest.fixture(params=["anonymous", "shm"])
def backing(request, tmp_path):
    if request.param == "anonymous":
        yield None
        return
    path = f"/dev/shm/openvsan-test-{tmp_path.name}"
    yield path
    import os
    os.unlink(path)


@pytest.mark.parametrize("blocks", [1, 7, 1000])
def test_write_zeroes_zeroes_small_and_large_ranges(backing, blocks):
    async def go():
        d = RamDevice(1 << 14, backing=backing)
        await d.write(0, b"\xa5" * (512 * 2048))
        await d.write_zeroes(3, blocks)
        got = await d.read(0, 3 + blocks + 1)
        assert got[:512 * 3] == b"\xa5" * 512 * 3
        assert got[512 * 3:512 * (3 + blocks)] == bytes(512 * blocks)
        assert got[-512:] == b"\xa5" * 512
        await d.unmap(1500, 500)
        assert await d.read(1500, 500) == bytes(512 * 500)
        await d.close()
    asyncio.run(go())


def test_backing_file_survives_reopen(tmp_path):
    path = f"/dev/shm/openvsan-test-{tmp_path.name}-reopen"
    async def go():
        d = RamDevice(64, backing=path)
        await d.write(5, b"x" * 512)
        await d.close()
        d = RamDevice(64, backing=path)
        assert await d.read(5, 1) == b"x" * 512
        with pytest.raises(OutOfRange):
            await d.read(63, 2)
        await d.close()
    try:
        asyncio.run(go())
    finally:
        import os
        os.unlink(path)
