"""`vsan initiator attach URL FILE`: the remote volume as a file through FUSE, then the kernel's loop
driver, mkfs.ext4 and mount on top, with no iSCSI or NVMe/TCP kernel module.

attach → losetup → mkfs.ext4 → mount → write files → umount → detach → attach again → mount → verify
checksums → restart the target while attached (the initiator logs in again) → verify → detach.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_fuse_ext4 import loop_device, mounted, read_sums, write_files
from vsan_harness import IQN, VSAN, VsanServer, require_root, require_tools, run

pytestmark = pytest.mark.interop

MiB = 1 << 20


@contextmanager
def attached(url: str, path: Path, size: int, log: Path) -> Iterator[Path]:
    """`vsan initiator attach` in the background until the file shows the volume's size; SIGTERM after."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(VSAN), "initiator", "attach", url, str(path)], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (path.exists() and path.stat().st_size == size):
            if proc.poll() is not None:
                pytest.fail(f"vsan initiator attach exited {proc.returncode}:\n{log.read_text()}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"attach of {size} bytes did not appear at {path}:\n{log.read_text()}", pytrace=False)
            time.sleep(0.1)
        yield path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # flush, unmount, log out
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, check=False)
                pytest.fail(f"attach did not exit after SIGTERM:\n{log.read_text()}", pytrace=False)
            if rc != 0:
                pytest.fail(f"attach exited {rc} after SIGTERM:\n{log.read_text()}", pytrace=False)
        text = log.read_text()
        if "Traceback" in text:
            pytest.fail(f"attach logged a Traceback:\n{text}", pytrace=False)


def ext4_over_attach(url: str, size: int, tmp_path: Path, restart: Callable[[], None]) -> None:
    require_root("losetup and mount")
    require_tools("fusermount3", "losetup", "mkfs.ext4", "e2fsck", "mount", "umount")
    if not Path("/dev/fuse").exists():
        pytest.fail("/dev/fuse is missing (modprobe fuse; in a container, pass --device /dev/fuse)", pytrace=False)
    disk, mnt, log = tmp_path / "volume", tmp_path / "mnt", tmp_path / "attach.log"
    with attached(url, disk, size, log), loop_device(disk) as dev:
        run(["mkfs.ext4", "-F", "-q", dev], timeout=300)
        with mounted(dev, mnt):
            sums = write_files(mnt, seed=3)
            assert read_sums(mnt, sums) == sums
        run(["e2fsck", "-fn", dev], timeout=300)
    # a second attach sees what the first one wrote: it is on the target, not in a cache of ours
    with attached(url, disk, size, log), loop_device(disk) as dev:
        with mounted(dev, mnt):
            assert read_sums(mnt, sums) == sums
        restart()  # the initiator logs in again by itself
        run(["e2fsck", "-fn", dev], timeout=300)
        with mounted(dev, mnt):
            assert read_sums(mnt, sums) == sums
            (mnt / "after-restart").write_bytes(b"y" * 200_000)
            os.sync()
        run(["e2fsck", "-fn", dev], timeout=300)


def test_iscsi_attach_ext4(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    server = vsan("file", "128MiB")
    url = f"iscsi://127.0.0.1:{server.port}/{IQN}/0?queue_depth=16"
    ext4_over_attach(url, 128 * MiB, tmp_path, server.restart)
