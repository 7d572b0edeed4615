"""Real NBD clients against `vsan serve`: libnbd's nbdinfo and nbdcopy, QEMU's NBD driver, fio's nbd engine,
and the same volume written over iSCSI and read back over NBD (and the other way round)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from vsan_harness import VsanServer, qemu_io, require_tools, run

pytestmark = pytest.mark.interop

KiB, MiB = 1024, 1024 * 1024

# (offset, length) of non-overlapping patterns: aligned, unaligned (QEMU read-modify-writes whole blocks,
# keeping to the minimum block size we advertise), large (several requests), and the last blocks
RANGES = [
    (0, 512),
    (7 * 512, 4 * KiB),
    (64 * KiB - 512, 1 * KiB),
    (1 * MiB + 3 * 512, 128 * KiB + 512),
    (3 * MiB - 4 * KiB, 4 * MiB),
    (9 * MiB + 1000, 3000),
    (20 * MiB + 512, 2 * MiB - 1024),
    (64 * MiB - 8 * KiB, 8 * KiB),
]


def writes(seed: int, *, fua: bool = False) -> list[str]:
    flag = "-f " if fua else ""
    return [f"write {flag}-P {(seed + i) % 255 + 1} {off} {n}" for i, (off, n) in enumerate(RANGES)]


def reads(seed: int) -> list[str]:
    return [f"read -P {(seed + i) % 255 + 1} {off} {n}" for i, (off, n) in enumerate(RANGES)]


@pytest.fixture
def server(vsan: Callable[..., VsanServer]) -> VsanServer:
    """One 64 MiB RAM volume: LUN 0 over iSCSI and export "disk0" over NBD."""
    return vsan(nbd=True)


def test_nbdinfo(server: VsanServer) -> None:
    require_tools("nbdinfo")
    info = json.loads(run(["nbdinfo", "--json", server.nbd_url()]).stdout)
    (e,) = info["exports"]
    assert info["protocol"] == "newstyle-fixed" and info["TLS"] is False
    assert e["export-name"] == "disk0" and e["export-size"] == 64 * MiB
    assert e["block_size_minimum"] == 512 and e["block_size_maximum"] == 32 * MiB
    for flag in ("can_flush", "can_fua", "can_multi_conn", "can_trim", "can_zero", "can_cache", "can_df"):
        assert e[flag] is True, (flag, e)
    assert e["is_read_only"] is False and "base:allocation" in e["contexts"]
    listed = run(["nbdinfo", "--list", f"nbd://127.0.0.1:{server.nbd_port}"]).stdout
    assert 'export="disk0"' in listed, listed
    mapped = run(["nbdinfo", "--map", server.nbd_url()]).stdout
    assert re.search(r"^\s*0\s+67108864\s+0\s+data\s*$", mapped, re.MULTILINE), mapped
    bad = run(["nbdinfo", f"nbd://127.0.0.1:{server.nbd_port}/nope"], check=False)
    assert bad.returncode != 0 and "nope" in bad.stdout, bad.stdout


@pytest.mark.parametrize("connections", [1, 4])
def test_nbdcopy_to_and_from(server: VsanServer, tmp_path: Path, connections: int) -> None:
    """nbdcopy uses several connections when the export says CAN_MULTI_CONN (4 here)."""
    require_tools("nbdcopy")
    src, back = tmp_path / "src.raw", tmp_path / "back.raw"
    src.write_bytes(os.urandom(64 * MiB))
    args = [f"--connections={connections}", f"--threads={connections}", "--requests=16"]  # threads cap connections
    before = server.log_text().count("NBD export disk0")
    run(["nbdcopy", *args, "--flush", src, server.nbd_url()])
    # each connection logs its handshake: the copy to the export really ran over `connections` connections
    assert server.log_text().count("NBD export disk0") - before == connections, server.log_tail()
    run(["nbdcopy", *args, server.nbd_url(), back])
    assert back.read_bytes() == src.read_bytes()


def test_qemu_img_convert_to_and_from(server: VsanServer, tmp_path: Path) -> None:
    require_tools("qemu-img")
    out = run(["qemu-img", "info", "-f", "raw", server.nbd_url()]).stdout
    assert "virtual size: 64 MiB (67108864 bytes)" in out, out
    src, back = tmp_path / "src.raw", tmp_path / "back.raw"
    src.write_bytes(os.urandom(24 * MiB + 4096))
    run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, server.nbd_url()])
    out = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", src, server.nbd_url()]).stdout
    assert "Images are identical." in out, out
    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", server.nbd_url(), back])
    data = back.read_bytes()
    assert len(data) == 64 * MiB and data[: len(src.read_bytes())] == src.read_bytes()


def test_qemu_io_patterns(server: VsanServer) -> None:
    url = server.nbd_url()
    qemu_io(url, *writes(1))
    qemu_io(url, *reads(1), "read -P 0 40M 1M")  # a fresh process: nothing can come from QEMU's memory
    qemu_io(url, *writes(50, fua=True)[::2], "flush")
    qemu_io(url, *reads(50)[::2], *reads(1)[1::2])
    # write -z: NBD_CMD_WRITE_ZEROES (-u lets it punch); discard: NBD_CMD_TRIM
    qemu_io(url, "write -P 0x5a 30M 4M", "write -z 31M 1M", "write -z -u 32M 512k", "discard 33M 1M")
    qemu_io(url, "read -P 0x5a 30M 1M", "read -P 0 31M 1M", "read -P 0 32M 512k", "read -P 0x5a 33280k 512k")


def test_fio_nbd_engine(server: VsanServer, tmp_path: Path) -> None:
    """fio's nbd engine (libnbd) at queue depth 16: random writes with checksums, then verified reads."""
    require_tools("fio")
    argv = [
        "fio",
        "--name=nbd",
        "--ioengine=nbd",
        f"--uri={server.nbd_url()}",
        "--size=32M",
        "--bs=4k",
        "--iodepth=16",
        "--rw=randwrite",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--do_verify=1",
        "--verify_state_save=0",
        "--output-format=json",
        f"--output={tmp_path / 'fio.json'}",
    ]
    run(argv, timeout=180)
    job = json.loads((tmp_path / "fio.json").read_text())["jobs"][0]
    assert job["error"] == 0, job
    assert job["write"]["io_bytes"] == 32 * MiB and job["read"]["io_bytes"] == 32 * MiB, job


def test_iscsi_and_nbd_see_one_volume(server: VsanServer, tmp_path: Path) -> None:
    """Written over iSCSI, read back identical over NBD; written over NBD, read back over iSCSI."""
    require_tools("qemu-img", "qemu-io")
    qemu_io(server.url(), *writes(3))
    qemu_io(server.nbd_url(), *reads(3))
    qemu_io(server.nbd_url(), *writes(90, fua=True))
    qemu_io(server.url(), *reads(90))
    src = tmp_path / "src.raw"
    src.write_bytes(os.urandom(8 * MiB))
    run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, server.url()])
    out = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", server.url(), server.nbd_url()]).stdout
    assert "Images are identical." in out, out


def test_4096_byte_blocks(vsan: Callable[..., VsanServer]) -> None:
    """A 4 KiB-block volume advertises a 4 KiB minimum block; QEMU aligns its unaligned I/O to it."""
    require_tools("nbdinfo")
    server = vsan(block_size=4096, nbd=True)
    info = json.loads(run(["nbdinfo", "--json", server.nbd_url()]).stdout)
    assert info["exports"][0]["block_size_minimum"] == 4096
    qemu_io(server.nbd_url(), "write -P 0x33 1000 5000", "write -P 0x44 8192 4096")
    qemu_io(server.nbd_url(), "read -P 0x33 1000 5000", "read -P 0 0 1000", "read -P 0x44 8192 4096")
