"""The Linux kernel initiator through two paths to one volume, with a path cut while fio writes and verifies:
iSCSI with dm-multipath (prio alua, group_by_prio, hardware_handler "1 alua") and NVMe/TCP with native
multipath (one namespace device, two controllers).

Today one `vsan serve` in one node namespace exports the volume on two portals (two addresses of that node);
the guest (../shared/peers/linux-guest, with multipath-tools) reaches them through a router namespace on the
Lab bridge (tests/support/guest_lab.py). After the guest prints @@FIO_RUNNING the host drops every packet
between the guest and the second portal's address; fio (random writes, verified as it goes) must finish
with no error, the path must show as failed while the other stays active, a payload written before the cut
must read back, and `e2fsck -fn` must be clean. Replicated volumes will put each portal on its own node.

The guest scripts are tests/interop/guest/*.sh. The first run builds the multipath guest (debootstrap with
multipath-tools, ~2 minutes, ~1.2 GB, cached in ~/.cache/openvsan-guest-multipath); each test then boots
it once (~1-2 minutes under TCG).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from guest_lab import GuestLab, build_guest, require_guest, serve_config

pytestmark = [pytest.mark.interop, pytest.mark.slow]

HERE = Path(__file__).with_name("guest")
IQN = "iqn.2026-11.org.openvsan:mpath0"
NQN = "nqn.2026-11.org.openvsan:mpath0"
ISCSI_PORT, NVME_PORT = 3260, 4420
FIO_SECS = 25
CUT_AFTER = 5  # seconds of fio through both paths before the cut


def guest_script(name: str) -> str:
    return (HERE / "common.sh").read_text() + "\n" + (HERE / name).read_text()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[GuestLab]:
    require_guest()
    build_guest()
    with GuestLab(["n1"], workdir=tmp_path) as gl:
        yield gl


def one_node_two_portals(gl: GuestLab, tmp_path: Path) -> tuple[str, str]:
    """`vsan serve` in n1 on two addresses (iSCSI and NVMe/TCP on each); returns the two addresses."""
    a, b = gl.lab.addr["n1"], gl.add_address("n1", 1)
    iscsi = [f"{a}:{ISCSI_PORT}", f"{b}:{ISCSI_PORT}"]
    nvme = [f"{a}:{NVME_PORT}", f"{b}:{NVME_PORT}"]
    gl.serve("n1", serve_config("n1", iscsi, nvme, iqn=IQN, nqn=NQN), tmp_path / "n1", iscsi + nvme)
    return a, b


def cut_during_fio(gl: GuestLab, script: str, env: dict[str, str], cut: str, tmp_path: Path) -> str:
    t0 = time.monotonic()
    run = gl.boot(script, tmp_path / "guest", {**env, "FIO_SECS": str(FIO_SECS)})
    run.wait_marker("@@FIO_RUNNING")
    time.sleep(CUT_AFTER)
    gl.cut_path(cut)
    out = run.finish()
    print(out[-6000:])
    print(f"@@WALL {time.monotonic() - t0:.1f} s")
    return out


@pytest.mark.timeout(1200)
def test_iscsi_dm_multipath_survives_a_path_cut(lab: GuestLab, tmp_path: Path) -> None:
    a, b = one_node_two_portals(lab, tmp_path)
    env = {"PORTAL_A": f"{a}:{ISCSI_PORT}", "PORTAL_B": f"{b}:{ISCSI_PORT}", "IQN": IQN}
    out = cut_during_fio(lab, guest_script("iscsi_multipath.sh"), env, b, tmp_path)
    for marker in ("@@MPATH_TWO_PATHS", "@@FIO_OK", "@@MPATH_PATH_FAILED", "@@PAYLOAD_OK", "@@FSCK_CLEAN"):
        assert marker in out, f"the guest never printed {marker}"
    for s in lab.serves:
        s.stop()


@pytest.mark.timeout(1200)
def test_nvme_native_multipath_survives_a_path_cut(lab: GuestLab, tmp_path: Path) -> None:
    a, b = one_node_two_portals(lab, tmp_path)
    env = {"NVME_A_ADDR": a, "NVME_B_ADDR": b, "NVME_PORT": str(NVME_PORT), "NQN": NQN}
    out = cut_during_fio(lab, guest_script("nvme_multipath.sh"), env, b, tmp_path)
    for marker in ("@@NVME_TWO_PATHS", "@@FIO_OK", "@@NVME_PATH_FAILED", "@@PAYLOAD_OK", "@@FSCK_CLEAN"):
        assert marker in out, f"the guest never printed {marker}"
    for s in lab.serves:
        s.stop()
