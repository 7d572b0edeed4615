"""Several targets and LUNs in one `vsan serve`: discovery lists them all, and each LUN keeps its own data."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from vsan_harness import TEST_INITIATOR, VsanServer, qemu_io, require_tools, run

pytestmark = pytest.mark.interop

IQN_A = "iqn.2026-11.org.openvsan:a"
IQN_B = "iqn.2026-11.org.openvsan:b"


def config(port: int) -> str:
    return f"""
[node]
name = "many"

[[devices]]
name = "r0"
type = "ram"
size = "32MiB"

[[devices]]
name = "r1"
type = "ram"
size = "16MiB"
block_size = 4096

[[devices]]
name = "r2"
type = "ram"
size = "8MiB"

[[volumes]]
name = "v0"
device = "r0"

[[volumes]]
name = "v1"
device = "r1"

[[volumes]]
name = "v2"
device = "r2"

[iscsi]
portals = ["127.0.0.1:{port}"]

[[iscsi.targets]]
iqn = "{IQN_A}"
luns = [{{ lun = 0, volume = "v0" }}, {{ lun = 3, volume = "v1" }}]

[[iscsi.targets]]
iqn = "{IQN_B}"
luns = [{{ lun = 0, volume = "v2" }}]
"""


def test_two_targets_three_luns(vsan: Callable[..., VsanServer]) -> None:
    require_tools("iscsi-ls", "iscsi-readcapacity16", "qemu-io")
    server = vsan(start=False, iqn=IQN_A)
    server.config.write_text(config(server.port))
    server.start()
    listed = run(["iscsi-ls", "-s", "-i", TEST_INITIATOR, server.portal_url()]).stdout
    for iqn in (IQN_A, IQN_B):
        assert f"Target:{iqn} Portal:127.0.0.1:{server.port}" in listed, listed
    assert len(re.findall(r"^Lun:0\s+Type:DIRECT_ACCESS", listed, re.MULTILINE)) == 2, listed
    assert re.search(r"^Lun:3\s+Type:DIRECT_ACCESS", listed, re.MULTILINE), listed

    base = f"iscsi://127.0.0.1:{server.port}"
    urls = {"a0": f"{base}/{IQN_A}/0", "a3": f"{base}/{IQN_A}/3", "b0": f"{base}/{IQN_B}/0"}
    sizes = {"a0": 32 << 20, "a3": 16 << 20, "b0": 8 << 20}
    for key, url in urls.items():
        out = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, "-s", url]).stdout
        assert out.strip() == str(sizes[key]), (key, out)
    block = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, urls["a3"]]).stdout
    assert "LOGICAL BLOCK LENGTH IN BYTES:4096" in block, block
    # the same offsets on each LUN, different patterns: nothing leaks from one volume to another
    for i, url in enumerate(urls.values()):
        qemu_io(url, f"write -P {0x10 + i} 0 1M", f"write -P {0x20 + i} 4M 64k")
    for i, (key, url) in enumerate(urls.items()):
        if key == "a3":
            # QEMU 7.2 (Debian 12) aborts on reads of 32 KiB and more from a 4096-byte-block LUN with LBPRZ=1:
            # iscsi_co_readv asks for the block status of BDRV_REQUEST_MAX_BYTES (0x7ffffe00, not a multiple
            # of 4096) and asserts alignment (block/iscsi.c:711). Smaller reads take another path.
            qemu_io(
                url,
                *[f"read -P {0x10 + i} {off} 16k" for off in range(0, 1 << 20, 16 << 10)],
                *[f"read -P {0x20 + i} {off} 16k" for off in range(4 << 20, (4 << 20) + (64 << 10), 16 << 10)],
            )
        else:
            qemu_io(url, f"read -P {0x10 + i} 0 1M", f"read -P {0x20 + i} 4M 64k")
    # a LUN number the target does not have
    bad = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, f"{base}/{IQN_B}/3"], check=False)
    assert bad.returncode != 0, bad.stdout
