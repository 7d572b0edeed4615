"""FileDevice: sparse files, bounds, FUA/flush, hole punching, O_DIRECT, size rules."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from openvsan.block import BlockDevice, DeviceFailed, FileDevice, OutOfRange
from openvsan.block import file as file_mod
from openvsan.volume import Volume

MiB = 1 << 20


def run(coro):
    return asyncio.run(coro)


def test_creates_sparse_file(tmp_path: Path) -> None:
    p = tmp_path / "disk.img"

    async def go() -> None:
        dev = FileDevice(p, size=64 * MiB, name="d0")
        assert isinstance(dev, BlockDevice)
        assert dev.num_blocks == 64 * MiB // 512
        assert await dev.read(0, 8) == bytes(4096)
        await dev.close()

    run(go())
    st = p.stat()
    assert st.st_size == 64 * MiB
    assert st.st_blocks * 512 < MiB  # nothing allocated
    assert st.st_mode & 0o777 == 0o600


def test_write_read_roundtrip_and_reopen(tmp_path: Path) -> None:
    p = tmp_path / "disk.img"
    pattern = os.urandom(4096 * 3)

    async def write() -> None:
        dev = FileDevice(p, size=MiB, block_size=4096)
        await dev.write(10, pattern)
        await dev.write(0, memoryview(bytearray(b"\x01" * 4096)), fua=True)
        await dev.flush()
        await dev.close()

    async def read() -> None:
        dev = FileDevice(p, block_size=4096)  # size comes from the file now
        assert dev.num_blocks == MiB // 4096
        assert bytes(await dev.read(10, 3)) == pattern
        assert bytes(await dev.read(0, 1)) == b"\x01" * 4096
        await dev.close()

    run(write())
    run(read())


def test_bounds_and_alignment(tmp_path: Path) -> None:
    """Checked once, by the volume over the file (volume/volume.py), not again by the file device."""
    async def go() -> None:
        dev = Volume(FileDevice(tmp_path / "d", size=8 * 512), name="v")
        with pytest.raises(OutOfRange):
            await dev.read(7, 2)
        with pytest.raises(OutOfRange):
            await dev.write(8, bytes(512))
        with pytest.raises(OutOfRange):
            await dev.write_zeroes(-1, 1)
        with pytest.raises(ValueError):
            await dev.write(0, bytes(100))
        assert await dev.read(8, 0) == b""
        await dev.device.close()

    run(go())


def test_missing_file_needs_size(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        FileDevice(tmp_path / "nope")
    with pytest.raises(ValueError):
        FileDevice(tmp_path / "x", size=1000)  # not a multiple of 512
    with pytest.raises(ValueError):
        FileDevice(tmp_path / "x", size=4096, block_size=1024)


def test_grows_short_file_keeps_data(tmp_path: Path) -> None:
    p = tmp_path / "d"
    p.write_bytes(b"\xaa" * 1024)

    async def go() -> None:
        dev = FileDevice(p, size=8192)
        assert dev.num_blocks == 16
        assert bytes(await dev.read(0, 2)) == b"\xaa" * 1024
        assert bytes(await dev.read(2, 1)) == bytes(512)
        await dev.close()

    run(go())
    assert p.stat().st_size == 8192


def test_unmap_punches_hole_and_reads_zero(tmp_path: Path) -> None:
    p = tmp_path / "d"

    async def go() -> None:
        dev = FileDevice(p, size=8 * MiB)
        await dev.write(0, os.urandom(8 * MiB))
        await dev.flush()
        before = p.stat().st_blocks
        await dev.unmap(0, 4 * MiB // 512)
        await dev.write_zeroes(4 * MiB // 512, 1)
        await dev.flush()
        assert bytes(await dev.read(0, 4 * MiB // 512 + 1)) == bytes(4 * MiB + 512)
        assert bytes(await dev.read(4 * MiB // 512 + 1, 1)) != bytes(512)
        assert p.stat().st_blocks < before
        await dev.close()

    run(go())


def test_zeroes_fall_back_to_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_mod, "_fallocate", None)
    monkeypatch.setattr(file_mod, "_ZERO_CHUNK", 4096)  # several chunks

    async def go() -> None:
        dev = FileDevice(tmp_path / "d", size=64 * 1024)
        await dev.write(0, b"\xff" * 65536)
        await dev.write_zeroes(3, 50)
        data = bytes(await dev.read(0, 128))
        assert data[:1536] == b"\xff" * 1536
        assert data[1536:1536 + 50 * 512] == bytes(50 * 512)
        assert data[1536 + 50 * 512:] == b"\xff" * (65536 - 1536 - 50 * 512)
        await dev.close()

    run(go())


def test_fua_without_rwf_dsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(file_mod.os, "fdatasync", lambda fd: (calls.append(fd), real(fd))[1])

    async def go() -> None:
        dev = FileDevice(tmp_path / "d", size=4096)
        dev._rwf_dsync = 0
        await dev.write(0, b"x" * 512, fua=True)
        assert calls  # durable before returning
        calls.clear()
        await dev.write(1, b"y" * 512)
        assert not calls
        await dev.flush()
        assert calls
        await dev.close()

    run(go())


def test_concurrent_io_off_the_loop(tmp_path: Path) -> None:
    async def go() -> None:
        dev = FileDevice(tmp_path / "d", size=MiB, io_threads=3)
        blocks = [bytes([i]) * 512 for i in range(64)]
        await asyncio.gather(*(dev.write(i, b) for i, b in enumerate(blocks)))
        got = await asyncio.gather(*(dev.read(i, 1) for i in range(64)))
        assert [bytes(g) for g in got] == blocks
        await dev.close()
        with pytest.raises(DeviceFailed):
            await dev.read(0, 1)

    run(go())


def test_direct_io(tmp_path: Path) -> None:
    p = tmp_path / "direct.img"
    try:
        dev = FileDevice(p, size=MiB, block_size=4096, direct=True)
    except (OSError, ValueError) as e:  # tmpfs and some others refuse O_DIRECT
        pytest.skip(f"O_DIRECT not available on {tmp_path}: {e}")

    async def go() -> None:
        data = os.urandom(3 * 4096)
        await dev.write(5, memoryview(data)[:], fua=True)  # caller's buffer is not aligned; the device copes
        assert bytes(await dev.read(5, 3)) == data
        await dev.write_zeroes(6, 1)
        assert bytes(await dev.read(6, 1)) == bytes(4096)
        await dev.close()

    run(go())
    assert dev.to_config()["direct"] is True


def test_to_config(tmp_path: Path) -> None:
    dev = FileDevice(tmp_path / "d", size=4096, name="f0")
    assert dev.to_config() == {"type": "file", "name": "f0", "path": str(tmp_path / "d"), "size": 4096,
                               "block_size": 512, "direct": False}
    run(dev.close())


def test_host_block_device(tmp_path: Path) -> None:
    """A loop device stands in for a disk: size from the device, punch/zero, O_DIRECT."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("losetup"):
        pytest.skip("needs root and losetup to make a loop device")
    img = tmp_path / "lo.img"
    img.write_bytes(b"\xee" * (4 * MiB))
    r = subprocess.run(["losetup", "-f", "--show", str(img)], check=False, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no loop device here: {r.stderr.strip()}")
    loop = r.stdout.strip()
    try:
        async def go() -> None:
            dev = FileDevice(loop)
            assert dev.is_block_device and dev.num_blocks == 4 * MiB // 512
            with pytest.raises(ValueError):
                FileDevice(loop, size=8 * MiB)  # cannot grow a disk
            await dev.write(3, b"a" * 512, fua=True)
            await dev.unmap(0, 2)
            await dev.write_zeroes(4, 1)
            got = bytes(await dev.read(0, 6))
            assert got == bytes(1024) + b"\xee" * 512 + b"a" * 512 + bytes(512) + b"\xee" * 512
            await dev.flush()
            await dev.close()
            d2 = FileDevice(loop, block_size=4096, direct=True, size=MiB)
            assert d2.num_blocks == 256
            data = os.urandom(4096)
            await d2.write(1, data)
            assert bytes(await d2.read(1, 1)) == data
            await d2.close()

        run(go())
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


def test_config_round_trip(tmp_path: Path) -> None:
    dev = FileDevice(tmp_path / "d", size=8192, block_size=4096, name="f1")
    again = FileDevice.from_config(dev.to_config())
    assert again.to_config() == dev.to_config()
    run(dev.close())
    run(again.close())


def test_read_now_from_the_page_cache_matches_read(tmp_path: Path) -> None:
    from openvsan.block.device import SyncRead, SyncWrite

    async def go() -> None:
        dev = FileDevice(tmp_path / "d.img", size=1 << 20)
        assert isinstance(dev, SyncRead) and isinstance(dev, SyncWrite)
        if not dev.memory_backed:
            assert not dev.write_now(0, bytes(512))   # a disk file's writes take the pool (durability, blocking)
        data = os.urandom(64 * 512)
        await dev.write(8, data)
        got = dev.read_now(8, 64)   # just written: in the page cache
        assert got is not None and bytes(got) == data == bytes(await dev.read(8, 64))
        hole = dev.read_now(1000, 8)  # never written: a hole reads as zeroes, no disk to wait for
        assert hole is not None and bytes(hole) == bytes(8 * 512)
        assert dev.read_now(0, 2048) is None   # past NOWAIT_MAX: declined, read() does it
        await dev.close()
        assert dev.read_now(8, 1) is None      # closed: declined, read() reports it

    asyncio.run(go())


def test_a_file_in_memory_is_read_and_written_at_once() -> None:
    import tempfile

    from openvsan.block.file import fs_type

    if fs_type(os.stat("/dev/shm").st_dev) != "tmpfs":
        pytest.fail("/dev/shm is not a tmpfs here: the test needs one (every Linux has it)")

    async def go() -> None:
        with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
            dev = FileDevice(f.name, size=1 << 20)
            assert dev.memory_backed
            data = os.urandom(8 * 512)
            assert dev.write_now(16, data)
            assert bytes(dev.read_now(16, 8) or b"") == data == bytes(await dev.read(16, 8))
            await dev.close()

    asyncio.run(go())


# --- backing files someone else could read or change (issue 10) -----------------------------------------

def _need_root(why: str) -> None:
    if os.geteuid() != 0:
        pytest.fail(f"must run as root: {why} (CI runs as root)", pytrace=False)


def test_a_symlink_is_refused_not_followed(tmp_path: Path) -> None:
    real = tmp_path / "real.img"
    real.write_bytes(bytes(4096))
    real.chmod(0o600)
    link = tmp_path / "link.img"
    link.symlink_to(real)
    with pytest.raises(file_mod.UnsafeFile, match="is a symbolic link") as e:
        FileDevice(link)
    assert e.value.filename == str(link)
    # a dangling link where a new file is to be made: never created through the link
    dangling = tmp_path / "dangling.img"
    dangling.symlink_to(tmp_path / "victim.img")
    with pytest.raises(file_mod.UnsafeFile, match="is a symbolic link"):
        FileDevice(dangling, size=MiB)
    assert not (tmp_path / "victim.img").exists()
    # trusting foreign files does not make a link safe
    with pytest.raises(file_mod.UnsafeFile, match="is a symbolic link"):
        FileDevice(link, trust_foreign=True)


def test_a_file_others_may_write_is_refused_unless_trusted(tmp_path: Path) -> None:
    p = tmp_path / "shared.img"
    p.write_bytes(bytes(8192))
    p.chmod(0o666)
    with pytest.raises(file_mod.UnsafeFile) as e:
        FileDevice(p)
    text = f"{e.value.filename}: {e.value.strerror}"
    assert str(p) in text and "mode 0666" in text and "chmod go-w" in text and "trust_foreign_files" in text
    p.chmod(0o620)   # group-writable is as bad
    with pytest.raises(file_mod.UnsafeFile, match="writable by group or others"):
        FileDevice(p, size=8192)
    dev = FileDevice(p, trust_foreign=True)
    assert dev.num_blocks == 16
    run(dev.close())
    p.chmod(0o644)   # others may read (the admin's choice), nobody else may write: fine
    run(FileDevice(p).close())


def test_a_file_owned_by_another_user_is_refused_unless_trusted(tmp_path: Path) -> None:
    _need_root("chown a file to uid 65534")
    p = tmp_path / "foreign.img"
    p.write_bytes(bytes(8192))
    p.chmod(0o600)
    os.chown(p, 65534, 65534)
    with pytest.raises(file_mod.UnsafeFile, match="owned by uid 65534, not by the serving user") as e:
        FileDevice(p, size=8192)
    assert e.value.filename == str(p) and "chown" in e.value.strerror
    dev = FileDevice(p, trust_foreign=True)
    run(dev.close())


def test_a_new_file_is_made_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        dev = FileDevice(tmp_path / "new.img", size=MiB)
    finally:
        os.umask(old)
    run(dev.close())
    assert (tmp_path / "new.img").stat().st_mode & 0o7777 == 0o600


def test_the_device_fd_is_close_on_exec(tmp_path: Path) -> None:
    import fcntl

    dev = FileDevice(tmp_path / "d.img", size=MiB)
    assert fcntl.fcntl(dev._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    run(dev.close())
