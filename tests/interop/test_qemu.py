"""QEMU's own iSCSI initiator (qemu-img, qemu-io; the iscsi:// driver is in qemu-block-extra)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from vsan_harness import VsanServer, qemu_io, qemu_iscsi_opts, require_tools, run

pytestmark = pytest.mark.interop

KiB, MiB = 1024, 1024 * 1024

# (offset, length): 512 B .. 4 MiB, some straddling 64 KiB / 1 MiB boundaries, some not sector-aligned (QEMU
# then reads, modifies and writes whole sectors), some larger than any sane MaxBurstLength (R2T sequences).
# The ranges do not overlap, so each keeps its own pattern.
RANGES = [
    (0, 512),
    (7 * 512, 4 * KiB),
    (64 * KiB - 512, 1 * KiB),
    (1 * MiB + 3 * 512, 128 * KiB + 512),
    (3 * MiB - 4 * KiB, 4 * MiB),
    (9 * MiB + 1000, 3000),
    (12 * MiB + 12345 * 512 // 16, 1 * MiB + 7),
    (20 * MiB + 512, 2 * MiB - 1024),
    (30 * MiB, 256 * KiB),
    (64 * MiB - 8 * KiB, 8 * KiB),  # the last blocks of the LUN
]


def write_cmds(ranges: list[tuple[int, int]], seed: int, *, fua: bool = False) -> list[str]:
    flag = "-f " if fua else ""
    return [f"write {flag}-P {(seed + i) % 255 + 1} {off} {length}" for i, (off, length) in enumerate(ranges)]


def read_cmds(ranges: list[tuple[int, int]], seed: int) -> list[str]:
    return [f"read -P {(seed + i) % 255 + 1} {off} {length}" for i, (off, length) in enumerate(ranges)]


def test_qemu_img_info(server: VsanServer) -> None:
    require_tools("qemu-img")
    out = run(["qemu-img", "info", "-f", "raw", server.url()]).stdout
    assert "virtual size: 64 MiB (67108864 bytes)" in out, out


def test_qemu_io_patterns(server: VsanServer) -> None:
    url = server.url()
    qemu_io(url, *write_cmds(RANGES, 1))
    # a fresh process (a new session), so nothing can come from QEMU's own memory
    qemu_io(url, *read_cmds(RANGES, 1), "read -P 0 40M 1M")
    # overwrite every other range with FUA writes, then read all of them again
    qemu_io(url, *write_cmds(RANGES[::2], 100, fua=True), "flush")
    qemu_io(url, *read_cmds(RANGES[::2], 100), *[c for i, c in enumerate(read_cmds(RANGES, 1)) if i % 2])


def test_write_zeroes_and_discard(server: VsanServer) -> None:
    """qemu-io `write -z` becomes WRITE SAME (or WRITE with zeroes); `discard` becomes UNMAP."""
    url = server.url()
    qemu_io(url, "write -P 0x5a 0 4M", "write -z 1M 1M", "write -z -u 2M 512k")
    qemu_io(url, "read -P 0x5a 0 1M", "read -P 0 1M 1M", "read -P 0 2M 512k", "read -P 0x5a 2560k 1536k")
    qemu_io(url, "discard 0 1M")  # data after UNMAP is unspecified unless LBPRZ; the command must succeed


def test_qemu_img_convert_and_compare(server: VsanServer, tmp_path: Path) -> None:
    require_tools("qemu-img")
    src = tmp_path / "src.raw"
    src.write_bytes(os.urandom(8 * MiB + 4096))
    run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, server.url()])
    out = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", src, server.url()]).stdout
    assert "Images are identical." in out, out


@pytest.mark.parametrize("device", ["shm", "file"])
def test_pattern_survives_restart(vsan: Callable[..., VsanServer], device: str) -> None:
    """A persistent device keeps what was written across SIGTERM and a fresh `vsan serve`."""
    server = vsan(device)
    qemu_io(server.url(), *write_cmds(RANGES, 7), "flush")
    server.restart()
    qemu_io(server.url(), *read_cmds(RANGES, 7))


def test_qemu_header_digest(server: VsanServer) -> None:
    """QEMU asks for HeaderDigest=CRC32C only; the target must agree, and every PDU then carries a digest.

    (libiscsi never offers DataDigest, so data digests are covered by the guest kernel test.)
    """
    require_tools("qemu-io")
    opts = qemu_iscsi_opts(server, **{"header-digest": "crc32c"})
    argv = ["qemu-io", "--image-opts", opts, "-c", "write -P 0x42 4096 1M", "-c", "read -P 0x42 4096 1M"]
    p = run(argv, env={"LIBISCSI_DEBUG": "6"})
    assert "Pattern verification failed" not in p.stdout, p.stdout
    assert "TargetLoginReply: HeaderDigest=CRC32C" in p.stdout, p.stdout
