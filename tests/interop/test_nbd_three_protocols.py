"""examples/single-node.toml serves one volume three ways at once: what one protocol writes, the other two
read back identical (iSCSI through QEMU's initiator, NBD through QEMU and libnbd, NVMe/TCP through the test
host in nvme_host.py)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from nvme_host import connect_controller
from vsan_harness import REPO, VsanServer, qemu_io, require_tools, run

pytestmark = pytest.mark.interop

EXAMPLE = REPO / "examples" / "single-node.toml"
NQN = "nqn.2026-11.org.openvsan:disk0"
MiB = 1 << 20
CHUNK = 256  # blocks per NVMe read: 128 KiB


async def nvme_io(port: int, writes: dict[int, bytes], reads: list[tuple[int, int]]) -> list[bytes]:
    """Write {lba: data} (FUA) then read [(lba, blocks)] on namespace 1, over one admin and one I/O queue."""
    admin, (io,) = await connect_controller(port, NQN)
    try:
        for lba, data in writes.items():
            assert await io.write(1, lba, data, fua=True) == 0
        out = []
        for lba, blocks in reads:
            data = b""
            for at in range(lba, lba + blocks, CHUNK):  # within the controller's MDTS
                status, part = await io.read(1, at, min(CHUNK, lba + blocks - at))
                assert status == 0, hex(status)
                data += part
            out.append(data)
        return out
    finally:
        await io.close()
        await admin.close()


def test_one_volume_three_protocols(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    require_tools("qemu-img", "qemu-io", "nbdinfo")
    text = EXAMPLE.read_text()
    for portal in ("127.0.0.1:3260", "127.0.0.1:4420", "127.0.0.1:10809"):
        assert f'"{portal}"' in text, f"the README's tour assumes the example listens on {portal}"
    server = vsan(start=False)
    server.write_example(text)
    server.start()
    assert "export-size: 1073741824" in run(["nbdinfo", server.nbd_url()]).stdout

    # iSCSI writes; NBD and NVMe/TCP read
    src = tmp_path / "src.raw"
    src.write_bytes(os.urandom(4 * MiB))
    run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, server.url()])
    out = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", src, server.nbd_url()]).stdout
    assert "Images are identical." in out, out  # the rest of the 1 GiB volume reads as zeroes
    (got,) = asyncio.run(nvme_io(server.nvme_port, {}, [(0, 4 * MiB // 512)]))
    assert hashlib.sha256(got).digest() == hashlib.sha256(src.read_bytes()).digest()

    # NVMe/TCP writes; iSCSI and NBD read
    asyncio.run(nvme_io(server.nvme_port, {16384: b"\x5e" * 65536}, []))
    qemu_io(server.url(), "read -P 0x5e 8M 64k")
    qemu_io(server.nbd_url(), "read -P 0x5e 8M 64k")

    # NBD writes; iSCSI and NVMe/TCP read
    qemu_io(server.nbd_url(), "write -f -P 0x7a 12M 1M")
    qemu_io(server.url(), "read -P 0x7a 12M 1M")
    (got,) = asyncio.run(nvme_io(server.nvme_port, {}, [(12 * MiB // 512, 2048)]))
    assert got == b"\x7a" * MiB
