"""A Linux kernel initiator (open-iscsi + iscsi_tcp) in a QEMU guest against `vsan serve`.

../shared/peers/linux-guest/run-guest-test.sh boots a Debian 6.1 kernel under QEMU (TCG) and, inside the
guest, discovers, logs in, runs mkfs.ext4, mounts, writes, remounts, checks sha256, runs fio and logs out.
The guest build (debootstrap, ~1 minute, ~1.2 GB) is cached in VMDIR (default ~/.cache/openvsan-guest).
The target listens on a free host port (TGT_PORT); the guest always sees it as 10.0.2.100:3260.
These tests run one after the other (each boots a guest; two at once would only fight for the CPUs).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from vsan_harness import (
    RUN_TARGET,
    SHARED_PEERS,
    VsanServer,
    check_target_log,
    guest_forward_env,
    require_root,
    require_tools,
)

pytestmark = [pytest.mark.interop, pytest.mark.slow]

GUEST = SHARED_PEERS / "linux-guest" / "run-guest-test.sh"

# Busybox sh in the guest: the first target SendTargets lists, as a node record ($IQN).
ISCSI_NODE = r"""
iscsiadm -m discovery -t sendtargets -p $PORTAL > /tmp/disc || fail discovery
IQN=$(awk '{print $2; exit}' /tmp/disc)
[ -n "$IQN" ] || fail "no target discovered"
iscsiadm -m node -T "$IQN" -p $PORTAL >/dev/null 2>&1 || iscsiadm -m node -o new -T "$IQN" -p $PORTAL >/dev/null
"""

# Busybox sh in the guest: header and data digests (libiscsi never offers DataDigest, so only this
# initiator checks them), then fio writing with verification through the raw disk, then a clean logout.
DIGEST_SCRIPT = r"""
fail() { echo "@@FAIL $*"; exit 1; }
modprobe -a iscsi_tcp sd_mod crc32c_generic || fail modprobe
mkdir -p /run/lock/iscsi
iscsid || fail iscsid
""" + ISCSI_NODE.lstrip("\n") + r"""for k in HeaderDigest DataDigest; do
    iscsiadm -m node -T "$IQN" -p $PORTAL -o update -n "node.conn[0].iscsi.$k" -v CRC32C || fail "set $k"
done
iscsiadm -m node -T "$IQN" -p $PORTAL --login || fail login
for i in $(seq 100); do
    for b in /sys/class/iscsi_session/session*/device/target*/*/block/*; do [ -b "/dev/${b##*/}" ] && break 2; done
    sleep 0.1
done
DEV=/dev/${b##*/}
[ -b "$DEV" ] || fail "no iSCSI disk"
for c in /sys/class/iscsi_connection/connection*; do
    echo "@@DIGESTS header=$(cat $c/header_digest) data=$(cat $c/data_digest)"
    [ "$(cat $c/header_digest)" = 1 ] && [ "$(cat $c/data_digest)" = 1 ] || fail "digests not negotiated"
done
fio --name=verify --filename=$DEV --size=48M --rw=randwrite --bsrange=4k-1m --direct=1 --ioengine=libaio \
    --iodepth=8 --verify=crc32c --verify_fatal=1 --do_verify=1 > /tmp/fio.out 2>&1 || { cat /tmp/fio.out; fail fio; }
grep -E 'write: IOPS|read: IOPS|verify' /tmp/fio.out | head -4
iscsiadm -m node -T "$IQN" -p $PORTAL --logout || fail logout
echo "@@PASS"
"""


def run_guest(
    server: VsanServer, tmp_path: Path, during: Callable[[Path, Path], None] | None = None, **env: str
) -> str:
    """Run the guest script against `vsan serve`; during(guest_log, target_log) runs while the guest does."""
    require_root("the guest script runs QEMU with user networking and needs root for its set-up")
    require_tools("qemu-system-x86_64", "debootstrap", "socat", "cpio", "ss")
    if not GUEST.exists():
        pytest.fail(f"{GUEST} is missing: CI clones the repo with ../shared beside it", pytrace=False)
    target_log = tmp_path / "target.log"
    target_cmd = shlex.join([sys.executable, str(RUN_TARGET), "--log", str(target_log), "--", *server.command()])
    env = {"TARGET_CMD": target_cmd, "TGT_PORT": str(server.port), "NVME_SELFTEST": "0", **env}
    out_path = tmp_path / "guest.log"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            ["bash", str(GUEST)],
            env={**os.environ, **guest_forward_env(), **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            if during is not None:
                during(out_path, target_log)
            rc = proc.wait(timeout=1000)
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)  # the script's own clean-up stops QEMU and the target
            proc.wait(timeout=60)
            print(out_path.read_text(errors="replace")[-6000:])
            raise
    text = out_path.read_text(errors="replace")
    print(text[-4000:])
    if rc != 0 or "@@PASS" not in text:
        pytest.fail(f"guest test failed (exit {rc}); log {out_path}:\n{text[-8000:]}", pytrace=False)
    check_target_log(target_log)
    return text


def guest_reached(guest_log: Path, mark: str, timeout: float = 900) -> bool:
    """Wait until the guest's serial log shows `mark` (True) or "@@FAIL" (False: run_guest reports it)."""
    deadline = time.monotonic() + timeout
    serial: Path | None = None
    while True:
        if time.monotonic() > deadline:
            pytest.fail(f"the guest never said {mark}", pytrace=False)
        if serial is None:
            m = re.search(r"serial log: (\S+)", guest_log.read_text(errors="replace"))
            serial = Path(m.group(1)) if m else None
        if serial is not None and serial.exists():
            text = serial.read_text(errors="replace")
            if "@@FAIL" in text:
                return False
            if mark in text:
                return True
        time.sleep(0.2)


@pytest.mark.timeout(1200)
def test_linux_kernel_initiator(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    """The script's own test: discovery, login, mkfs.ext4, mount, checksum across remount, fio, logout."""
    server = vsan("ram", "1GiB", start=False)
    text = run_guest(server, tmp_path)
    assert "@@CHECKSUM_OK" in text


@pytest.mark.timeout(1200)
def test_linux_kernel_initiator_with_digests(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    server = vsan("ram", "256MiB", start=False)
    script = tmp_path / "digests.sh"
    script.write_text(DIGEST_SCRIPT)
    text = run_guest(server, tmp_path, GUEST_SCRIPT=str(script))
    assert "@@DIGESTS header=1 data=1" in text


# Busybox sh in the guest: write, then keep I/O going while the host restarts `vsan serve` (SIGTERM, start);
# the kernel initiator must notice, log in again (session reinstatement, ERL 0) and retry, with no I/O error
# reaching fio and nothing written before the restart lost.
RESTART_SCRIPT = r"""
fail() { echo "@@FAIL $*"; grep -iE 'error|re-open|bind|login|connect' /tmp/iscsid.log | head -40; exit 1; }
modprobe -a iscsi_tcp sd_mod crc32c_generic || fail modprobe
mkdir -p /run/lock/iscsi
# iscsid in the foreground with its reconnects logged, shown if the session does not ride through
(iscsid -f -d 3 > /tmp/iscsid.log 2>&1 &)
for i in $(seq 50); do iscsiadm -m session >/dev/null 2>&1; [ $? -ne 20 ] && break; sleep 0.1; done  # 20: no iscsid yet
iscsiadm -m discovery -t sendtargets -p $PORTAL > /tmp/disc || fail discovery
IQN=$(awk '{print $2; exit}' /tmp/disc)
[ -n "$IQN" ] || fail "no target discovered"
iscsiadm -m node -T "$IQN" -p $PORTAL >/dev/null 2>&1 || iscsiadm -m node -o new -T "$IQN" -p $PORTAL >/dev/null
iscsiadm -m node -T "$IQN" -p $PORTAL -o update -n node.session.timeo.replacement_timeout -v 90
iscsiadm -m node -T "$IQN" -p $PORTAL --login || fail login
for i in $(seq 100); do
    for b in /sys/class/iscsi_session/session*/device/target*/*/block/*; do [ -b "/dev/${b##*/}" ] && break 2; done
    sleep 0.1
done
DEV=/dev/${b##*/}
[ -b "$DEV" ] || fail "no iSCSI disk"
dd if=/dev/urandom of=/tmp/a bs=1M count=16 2>/dev/null
dd if=/tmp/a of=$DEV bs=1M oflag=direct conv=fsync 2>/dev/null || fail "write before the restart"
S1=$(sha256sum /tmp/a | cut -d' ' -f1)
echo "@@READY_FOR_RESTART"
fio --name=span --filename=$DEV --offset=64M --size=32M --rw=randwrite --bs=64k --direct=1 --ioengine=libaio \
    --iodepth=4 --time_based --runtime=25 > /tmp/fio.out 2>&1 || { cat /tmp/fio.out; fail "I/O across the restart"; }
grep -E 'write: IOPS|err=' /tmp/fio.out | head -2
dmesg | grep -iE 'conn error|recover|reinstat|session' | tail -6
S2=$(dd if=$DEV bs=1M count=16 iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
[ "$S1" = "$S2" ] || fail "data written before the restart changed: $S1 $S2"
echo "@@CHECKSUM_OK $S1"
fio --name=after --filename=$DEV --offset=128M --size=16M --rw=write --bs=256k --direct=1 --ioengine=libaio \
    --verify=crc32c --do_verify=1 --verify_fatal=1 > /tmp/fio2.out 2>&1 || { cat /tmp/fio2.out; fail "I/O after"; }
iscsiadm -m node -T "$IQN" -p $PORTAL --logout || fail logout
echo "@@PASS"
"""


@pytest.mark.timeout(1200)
def test_linux_kernel_initiator_rides_through_a_restart(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    server = vsan("file", "256MiB", start=False)
    script = tmp_path / "restart.sh"
    script.write_text(RESTART_SCRIPT)

    def restart_when_ready(guest_log: Path, target_log: Path) -> None:
        if not guest_reached(guest_log, "@@READY_FOR_RESTART"):
            return  # the guest failed before the restart; run_guest reports it
        time.sleep(5)  # fio is writing now
        wrapper = re.search(r"@@WRAPPER pid=(\d+)", target_log.read_text())
        assert wrapper, target_log.read_text()
        os.kill(int(wrapper.group(1)), signal.SIGHUP)

    text = run_guest(server, tmp_path, during=restart_when_ready, GUEST_SCRIPT=str(script))
    assert "@@CHECKSUM_OK" in text
    target = (tmp_path / "target.log").read_text()
    assert target.count("@@START ") == 2, f"the target was not restarted:\n{target[-3000:]}"
