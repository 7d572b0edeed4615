"""The Linux kernel's initiators (open-iscsi + iscsi_tcp, nvme-tcp) in a QEMU guest, writing and verifying
with fio, while `vsan serve --workers 2` moves their volumes between its worker processes
(`vsan workers move`, node/workers.py). Each move suspends the session or the controller's queues where they
stand and resumes them in the other worker: the kernel must see no connection error, no session recovery,
no controller reset or reconnect, and fio no I/O error; what was written before reads back the same.

One guest (tests/interop/test_guest_kernel.py run_guest): v0 over iSCSI and v1 over NVMe/TCP, one worker
each at start; the host moves them back and forth while fio runs on both."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_guest_kernel import ISCSI_NODE, guest_reached, run_guest
from vsan_harness import VSAN, free_port

pytestmark = [pytest.mark.interop, pytest.mark.slow]

IQN = "iqn.2026-12.org.openvsan.test:moves"
NQN = "nqn.2026-12.org.openvsan.test:moves"
MOVES = 8

SCRIPT = r"""
fail() { echo "@@FAIL $*"; dmesg | tail -40; exit 1; }
modprobe -a iscsi_tcp sd_mod nvme_tcp crc32c_generic || fail modprobe
mkdir -p /run/lock/iscsi
iscsid || fail iscsid
""" + ISCSI_NODE.lstrip("\n") + r"""iscsiadm -m node -T "$IQN" -p $PORTAL --login || fail login
for i in $(seq 100); do
    for b in /sys/class/iscsi_session/session*/device/target*/*/block/*; do [ -b "/dev/${b##*/}" ] && break 2; done
    sleep 0.1
done
DEV_I=/dev/${b##*/}
[ -b "$DEV_I" ] || fail "no iSCSI disk"
nvme connect -t tcp -a "$NVME_A" -s "$NVME_S" -n "$NVME_NQN" || fail "nvme connect"
for i in $(seq 100); do [ -b /dev/nvme0n1 ] && break; sleep 0.1; done
DEV_N=/dev/nvme0n1
[ -b "$DEV_N" ] || fail "no NVMe namespace"
for d in $DEV_I $DEV_N; do
    dd if=/dev/urandom of=/tmp/before bs=1M count=8 2>/dev/null
    dd if=/tmp/before of=$d bs=1M oflag=direct conv=fsync 2>/dev/null || fail "write $d"
    echo "$(sha256sum /tmp/before | cut -d' ' -f1)" > /tmp/sum.${d##*/}
done
dmesg -c > /dev/null
echo "@@READY_FOR_MOVES"
fio --name=iscsi --filename=$DEV_I --offset=16M --size=48M --name=nvme --filename=$DEV_N --offset=16M --size=48M \
    --rw=randwrite --bsrange=4k-256k --direct=1 --ioengine=libaio --iodepth=8 --time_based --runtime=$FIO_SECS \
    --verify=crc32c --verify_backlog=64 --verify_fatal=1 --do_verify=1 > /tmp/fio.out 2>&1 \
    || { cat /tmp/fio.out; fail "fio across the moves"; }
grep -E 'err=|write: IOPS' /tmp/fio.out
grep -q 'err= 0' /tmp/fio.out || { cat /tmp/fio.out; fail "fio reported an error"; }
for d in $DEV_I $DEV_N; do
    S=$(dd if=$d bs=1M count=8 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
    [ "$S" = "$(cat /tmp/sum.${d##*/})" ] || fail "what was written before the moves changed on $d"
done
echo "@@CHECKSUMS_OK"
dmesg > /tmp/dmesg.after
cat /tmp/dmesg.after | tail -20
grep -iE 'conn error|connection.*(failed|error)|recover|reinstat|reset|reconnect|I/O error|timeout' /tmp/dmesg.after \
    && fail "the kernel noticed the moves"
echo "@@KERNEL_QUIET"
nvme disconnect -n "$NVME_NQN" > /dev/null || fail "nvme disconnect"
iscsiadm -m node -T "$IQN" -p $PORTAL --logout || fail logout
echo "@@PASS"
"""


def config(workdir: Path, iscsi_port: int, nvme_port: int) -> Path:
    path = workdir / "vsan.toml"
    path.write_text("\n".join([
        "[node]", 'name = "moves"', "workers = 2", "",
        "[[devices]]", 'name = "d0"', 'type = "ram"', 'size = "256MiB"', "",
        "[[devices]]", 'name = "d1"', 'type = "ram"', 'size = "256MiB"', "",
        "[[volumes]]", 'name = "v0"', 'device = "d0"', "",
        "[[volumes]]", 'name = "v1"', 'device = "d1"', "",
        "[iscsi]", f'portals = ["127.0.0.1:{iscsi_port}"]', "",
        "[[iscsi.targets]]", f'iqn = "{IQN}"', 'luns = [{ lun = 0, volume = "v0" }]', "",
        "[nvme]", f'portals = ["127.0.0.1:{nvme_port}"]', "",
        "[[nvme.subsystems]]", f'nqn = "{NQN}"', 'namespaces = [{ nsid = 1, volume = "v1" }]', "",
    ]))
    path.chmod(0o600)
    return path


def owners(data_dir: Path) -> dict[str, int]:
    import json

    out = subprocess.run([str(VSAN), "workers", "--data-dir", str(data_dir), "--json"], capture_output=True,
                         text=True, timeout=30, check=True)
    return {v: int(r["worker"]) for r in json.loads(out.stdout) for v in r["volumes"]}


@pytest.mark.timeout(1500)
def test_the_kernel_initiators_see_nothing_while_their_volumes_move(tmp_path: Path) -> None:
    iscsi_port, nvme_port = free_port(), free_port()
    data_dir = tmp_path / "data"
    cfg = config(tmp_path, iscsi_port, nvme_port)
    server = SimpleNamespace(port=iscsi_port, command=lambda: [str(VSAN), "serve", "--config", str(cfg),
                                                               "--data-dir", str(data_dir), "--log-level", "debug"])
    script = tmp_path / "moves.sh"
    script.write_text(SCRIPT)
    said: list[str] = []

    def move_while_fio_runs(guest_log: Path, target_log: Path) -> None:
        if not guest_reached(guest_log, "@@READY_FOR_MOVES"):
            return  # run_guest reports it
        time.sleep(4)   # fio is writing on both
        for i in range(MOVES):
            volume = ("v0", "v1")[i % 2]
            to = 1 - owners(data_dir)[volume]
            out = subprocess.run([str(VSAN), "workers", "move", volume, "--to", str(to), "--data-dir", str(data_dir)],
                                 capture_output=True, text=True, timeout=120, check=False)
            said.append(out.stdout + out.stderr)
            assert out.returncode == 0, out
            time.sleep(2)

    text = run_guest(server, tmp_path, during=move_while_fio_runs, GUEST_SCRIPT=str(script), NVME_ADDR="127.0.0.1",
                     NVME_PORT=str(nvme_port), NVME_NQN=NQN, FIO_SECS="45")
    assert "@@CHECKSUMS_OK" in text and "@@KERNEL_QUIET" in text
    assert len(said) == MOVES, said
    for i, line in enumerate(said):
        # v0: one iSCSI session; v1: one NVMe controller, its admin queue and its I/O queues (one per guest cpu)
        want = r"1 connection\(s\)" if i % 2 == 0 else r"[2-9] connection\(s\)"
        assert re.search(rf"volume v{i % 2} moved from worker \d to worker \d; {want} went with it", line), said
    target = (tmp_path / "target.log").read_text(errors="replace")
    assert "moved here with its volume" in target and "moved here with its subsystem" in target, target[-3000:]
