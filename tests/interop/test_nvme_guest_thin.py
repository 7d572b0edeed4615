"""A thin namespace under the Linux kernel's NVMe/TCP host (nvme_tcp + nvme-cli in the QEMU guest of
test_guest_kernel.py): Identify Namespace says thin (NSFEAT THINP) and counts what is allocated (NUSE), which
grows with writes and falls back when `blkdiscard` deallocates (Dataset Management); deallocated blocks read
zero, as DLFEAT says."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from test_guest_kernel import run_guest
from vsan_harness import GUEST_WAIT_NS, VsanServer

pytestmark = [pytest.mark.interop, pytest.mark.slow]

NQN = "nqn.2026-11.org.openvsan:thin0"
MiB = 1 << 20

CONFIG = """
[node]
name = "thin-nvme"

[[devices]]
name = "dev0"
type = "file"
path = "{path}"
size = "512MiB"

[[volumes]]
name = "disk0"
device = "dev0"
size = "256MiB"

[iscsi]
portals = ["127.0.0.1:3260"]

[[iscsi.targets]]
iqn = "iqn.2026-11.org.openvsan:thin0"
luns = [{{ lun = 0, volume = "disk0" }}]

[nvme]
portals = ["127.0.0.1:4420"]

[[nvme.subsystems]]
nqn = "{nqn}"
namespaces = [{{ nsid = 1, volume = "disk0" }}]
"""

SCRIPT = r"""
fail() { echo "@@FAIL $*"; dmesg | grep -i -E 'nvme|tcp' | tail -25; exit 1; }
""" + GUEST_WAIT_NS + r"""idns() { echo "@@IDNS $1 $(nvme id-ns $DEV | grep -E '^(nsze|nuse|nsfeat|dlfeat) ' | tr -d ' ' | tr '\n' ' ')"; }
modprobe -a nvme_tcp crc32c_generic || fail modprobe
nvme connect -t tcp -a $NVME_A -s $NVME_S -n "$NVME_NQN" || fail connect
DEV=$(wait_ns) || fail "no namespace"
echo "@@DISCARD $(cat /sys/block/${DEV#/dev/}/queue/discard_max_bytes)"
idns fresh
dd if=/dev/urandom of=$DEV bs=1M count=32 oflag=direct 2>/dev/null || fail write
idns written
blkdiscard $DEV || fail blkdiscard
idns discarded
dd if=$DEV bs=1M count=32 iflag=direct 2>/dev/null | cmp -n 33554432 - /dev/zero || fail "discarded blocks do not read zero"
nvme disconnect -n "$NVME_NQN" || fail disconnect
echo "@@PASS"
"""


def idns(text: str, when: str) -> dict[str, int]:
    m = re.search(rf"@@IDNS {when} (.*)", text)
    assert m, f"no Identify Namespace line for {when}"
    return {k: int(v, 0) for k, v in (kv.split(":", 1) for kv in m.group(1).split())}


@pytest.mark.timeout(1200)
def test_thin_namespace_reports_and_gives_back_its_space(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    server = vsan("file", "512MiB", start=False)
    server.write_example(CONFIG.format(path=tmp_path / "dev0.img", nqn=NQN))
    script = tmp_path / "thin-nvme.sh"
    script.write_text(SCRIPT)
    text = run_guest(server, tmp_path, GUEST_SCRIPT=str(script), NVME_ADDR="127.0.0.1",
                     NVME_PORT=str(server.nvme_port), NVME_NQN=NQN)
    fresh, written, discarded = idns(text, "fresh"), idns(text, "written"), idns(text, "discarded")
    block = 512
    assert fresh["nsze"] == 256 * MiB // block
    assert fresh["nsfeat"] & 1, fresh                    # THINP
    assert fresh["dlfeat"] & 7 == 1, fresh               # deallocated blocks read zero
    assert fresh["nuse"] < 2 * MiB // block, fresh       # what mkfs-free Linux probing touched, at most
    assert written["nuse"] >= 32 * MiB // block, written
    assert discarded["nuse"] <= fresh["nuse"], discarded
    assert re.search(r"@@DISCARD [1-9]", text), "the kernel did not enable discard on the namespace"
