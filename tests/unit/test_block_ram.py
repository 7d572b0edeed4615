"""RamDevice: round trips, bounds, and that unmap/write_zeroes really zero (large ranges give pages back)."""

import asyncio

import pytest

from openvsan.block import OutOfRange
from openvsan.block.ram import RamDevice
from openvsan.volume import Volume


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
            await Volume(d, name="v").read(63, 2)
        await d.close()
    try:
        asyncio.run(go())
    finally:
        import os
        os.unlink(path)


# --- a backing file someone else could read or change (issue 10) ----------------------------------------

def test_a_symlinked_backing_is_refused(tmp_path):
    from openvsan.block.file import UnsafeFile

    target = tmp_path / "victim"
    link = tmp_path / "backing"
    link.symlink_to(target)
    with pytest.raises(UnsafeFile, match="is a symbolic link"):
        RamDevice(64, backing=str(link))
    assert not target.exists(), "the backing was created through the link"


def test_a_backing_others_may_write_or_another_user_owns_is_refused(tmp_path):
    import os

    from openvsan.block.file import UnsafeFile

    p = tmp_path / "backing"
    p.write_bytes(bytes(64 * 512))
    p.chmod(0o666)
    with pytest.raises(UnsafeFile, match="mode 0666"):
        RamDevice(64, backing=str(p))
    asyncio.run(RamDevice(64, backing=str(p), trust_foreign=True).close())
    if os.geteuid() != 0:
        pytest.fail("must run as root: chown a file to uid 65534 (CI runs as root)", pytrace=False)
    p.chmod(0o600)
    os.chown(p, 65534, 65534)
    with pytest.raises(UnsafeFile, match="owned by uid 65534"):
        RamDevice(64, backing=str(p))
    asyncio.run(RamDevice(64, backing=str(p), trust_foreign=True).close())


def test_a_new_backing_is_made_0600(tmp_path):
    import os

    p = tmp_path / "new-backing"
    old = os.umask(0)
    try:
        d = RamDevice(64, backing=str(p))
    finally:
        os.umask(old)
    asyncio.run(d.close())
    assert p.stat().st_mode & 0o7777 == 0o600
