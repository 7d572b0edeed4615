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


# --- reads: pages that hold memory are copied from the mapping, the others read with pread ----------------

class _Preads:
    """Counts the device's pread calls (a read of a page that holds no memory) and passes them on."""

    def __init__(self, monkeypatch):
        from openvsan.block import ram
        self.calls = 0
        real = ram.os.pread

        def counted(fd, n, off):
            self.calls += 1
            return real(fd, n, off)
        monkeypatch.setattr(ram.os, "pread", counted)


def _allocated(d: RamDevice) -> int:
    import os
    return os.fstat(d._fd).st_blocks


def test_reads_of_written_pages_copy_from_memory_and_others_use_pread(backing, monkeypatch):
    async def go():
        d = RamDevice(1 << 12, 4096, backing=backing)      # 16 MiB of 4 KiB blocks
        preads = _Preads(monkeypatch)
        await d.write(10, b"\x5a" * 4096 * 3)
        assert d.read_now(10, 3) == b"\x5a" * 4096 * 3 and preads.calls == 0
        assert await d.read(11, 1) == b"\x5a" * 4096 and preads.calls == 0
        assert d.read_now(12, 2) == b"\x5a" * 4096 + bytes(4096) and preads.calls == 1   # 13 never written
        # never written: zeros, by pread, and no memory taken for them
        before = _allocated(d)
        for lba in range(100, 1100, 4):
            assert d.read_now(lba, 3) == bytes(3 * 4096)
            assert await d.read(lba + 3, 1) == bytes(4096)
        assert _allocated(d) == before
        # pages given back by write_zeroes read as zeros again, by pread, and stay given back
        await d.write(2000, b"\x77" * 4096 * 64)
        await d.write_zeroes(2000, 64)
        calls = preads.calls
        assert d.read_now(2000, 8) == bytes(8 * 4096) and preads.calls == calls + 1
        assert _allocated(d) == before                # only blocks 10-12 hold memory, as before
        # grown: the new pages hold nothing yet; shrunk and grown back: nor do those cut off
        await d.resize(1 << 13)
        assert d.read_now((1 << 13) - 1, 1) == bytes(4096)
        await d.resize(11)
        await d.resize(1 << 12)
        calls = preads.calls
        assert d.read_now(10, 1) == b"\x5a" * 4096 and preads.calls == calls
        assert d.read_now(11, 1) == bytes(4096) and preads.calls == calls + 1
        await d.close()
    asyncio.run(go())


def test_a_reopened_backing_knows_its_written_pages(tmp_path, monkeypatch):
    path = f"/dev/shm/openvsan-test-{tmp_path.name}-held"
    async def go():
        d = RamDevice(256, 4096, backing=path)
        await d.write(3, b"\x01" * 4096)
        await d.write(200, b"\x02" * 4096 * 2)
        await d.close()
        preads = _Preads(monkeypatch)
        d = RamDevice(256, 4096, backing=path)
        assert d.read_now(3, 1) == b"\x01" * 4096
        assert d.read_now(200, 2) == b"\x02" * 8192
        assert preads.calls == 0
        assert d.read_now(4, 1) == bytes(4096) and preads.calls == 1
        await d.close()
    try:
        asyncio.run(go())
    finally:
        import os
        os.unlink(path)
