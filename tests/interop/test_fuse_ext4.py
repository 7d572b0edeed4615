"""A kernel filesystem over QEMU's iSCSI initiator, across a restart of `vsan serve`.

qemu-storage-daemon (iscsi blockdev) -> FUSE export -> losetup -> mkfs.ext4 -> mount -> write files ->
checksum -> umount -> stop and restart vsan serve -> mount again -> verify checksums. The machines here have
no iSCSI initiator in their kernel; this gives ext4's real I/O pattern (journal, flushes, FUA) to the target.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from vsan_harness import VsanServer, qemu_iscsi_opts, require_root, require_tools, run

pytestmark = pytest.mark.interop

MiB = 1024 * 1024


@contextmanager
def fuse_export(blockdev: str, mountpoint: Path, size: int, log: Path) -> Iterator[Path]:
    """qemu-storage-daemon exporting one blockdev as a regular file at mountpoint (FUSE mounts over the file)."""
    mountpoint.touch()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                "qemu-storage-daemon",
                "--blockdev",
                f"{blockdev},node-name=lun0",
                "--export",
                f"type=fuse,id=exp0,node-name=lun0,mountpoint={mountpoint},writable=on",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while mountpoint.stat().st_size != size:
            if proc.poll() is not None:
                pytest.fail(f"qemu-storage-daemon exited {proc.returncode}:\n{log.read_text()}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"FUSE export of {size} bytes did not appear:\n{log.read_text()}", pytrace=False)
            time.sleep(0.1)
        yield mountpoint
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # qemu-storage-daemon flushes, closes the export and unmounts
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, check=False)


@contextmanager
def loop_device(image: Path) -> Iterator[str]:
    dev = run(["losetup", "-f", "--show", image]).stdout.strip()
    try:
        yield dev
    finally:
        run(["losetup", "-d", dev], check=False)


@contextmanager
def mounted(dev: str, mnt: Path) -> Iterator[Path]:
    mnt.mkdir(exist_ok=True)
    run(["mount", "-t", "ext4", dev, mnt])
    try:
        yield mnt
    finally:
        if run(["umount", mnt], check=False).returncode != 0:
            run(["umount", "-l", mnt], check=False)
            pytest.fail(f"umount {mnt} failed", pytrace=False)


def write_files(root: Path, seed: int) -> dict[str, str]:
    """About 20 MiB in files of awkward sizes and a few directories; returns path -> sha256."""
    rnd = random.Random(seed)
    sums = {}
    for i in range(24):
        sub = root / f"d{i % 4}" / f"e{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        data = rnd.randbytes(rnd.choice([1, 511, 4096, 65537, 300_000, 1_500_000, 3 * MiB - 7]))
        (sub / f"f{i}.bin").write_bytes(data)
        sums[str((sub / f"f{i}.bin").relative_to(root))] = hashlib.sha256(data).hexdigest()
    os.sync()
    return sums


def read_sums(root: Path, names: dict[str, str]) -> dict[str, str]:
    return {n: hashlib.sha256((root / n).read_bytes()).hexdigest() for n in names}


def fuse_ext4_roundtrip(blockdev: str, size: int, workdir: Path, restart: Callable[[], None]) -> None:
    """The round trip itself; restart() stops and starts the target between the two mounts."""
    require_root("losetup and mount")
    require_tools("qemu-storage-daemon", "fusermount3", "losetup", "mkfs.ext4", "e2fsck", "mount", "umount")
    if not Path("/dev/fuse").exists():
        pytest.fail("/dev/fuse is missing (modprobe fuse; in a container, pass --device /dev/fuse)", pytrace=False)
    image, mnt, qsd_log = workdir / "lun.raw", workdir / "mnt", workdir / "qsd.log"
    with fuse_export(blockdev, image, size, qsd_log), loop_device(image) as dev:
        run(["mkfs.ext4", "-F", "-q", dev], timeout=300)
        with mounted(dev, mnt):
            sums = write_files(mnt, seed=20261101)
            assert read_sums(mnt, sums) == sums
        run(["e2fsck", "-fn", dev], timeout=300)
    restart()
    with fuse_export(blockdev, image, size, qsd_log), loop_device(image) as dev:
        run(["e2fsck", "-fn", dev], timeout=300)  # clean after the restart: nothing was lost or torn
        with mounted(dev, mnt):
            assert read_sums(mnt, sums) == sums
            # the filesystem stays writable after the restart
            (mnt / "after-restart").write_bytes(b"x" * 100_000)
            os.sync()
        run(["e2fsck", "-fn", dev], timeout=300)
    with suppress(FileNotFoundError):
        image.unlink()


def test_fuse_ext4_roundtrip_across_restart(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    server = vsan("file", "128MiB")
    fuse_ext4_roundtrip(qemu_iscsi_opts(server), 128 * MiB, tmp_path, server.restart)
