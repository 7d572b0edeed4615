"""A Linux kernel NVMe/TCP host (nvme_tcp in a QEMU guest) sees a live node change under it: a namespace added
to the subsystem it is connected to (`vsan export add nvme`) appears as a new block device, and a volume
resized (`vsan volume resize`) shows its new size, with no reconnect; then the namespace goes away again
(`vsan export remove nvme ... --nsid 2`). The guest learns of each through the Namespace Attribute Changed
event and the Changed Namespace List (NVMe Base 2.0 §5.27.1.8), as it would from any NVMe target.

The host side changes the node when the guest log says the guest is ready for the next step (a marker line),
and the guest waits for the change with a timeout, so neither side sleeps a fixed time.
"""

from __future__ import annotations

import contextlib
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
    REPO,
    RUN_TARGET,
    SHARED_PEERS,
    VSAN,
    VsanServer,
    check_target_log,
    guest_forward_env,
    require_root,
    require_tools,
)

pytestmark = [pytest.mark.interop, pytest.mark.slow]

GUEST = SHARED_PEERS / "linux-guest" / "run-guest-test.sh"
EXAMPLE = REPO / "examples" / "single-node.toml"
NQN = "nqn.2026-11.org.openvsan:disk0"
MiB = 1 << 20

GUEST_SCRIPT = r"""
fail() { echo "@@FAIL $*"; dmesg | grep -i -E 'nvme' | tail -25; exit 1; }
ns_dev() {  # the block device of namespace $1 of the connected controller, once it is there
    for i in $(seq 600); do
        for b in /sys/class/nvme/nvme*/nvme*n$1 /sys/class/nvme-subsystem/nvme-subsys*/nvme*n$1; do
            [ -e "$b" ] && [ -b "/dev/${b##*/}" ] && { echo "${b##*/}"; return 0; }
        done
        sleep 0.1
    done; return 1
}
modprobe -a nvme_tcp || fail modprobe
nvme connect -t tcp -a $NVME_A -s $NVME_S -n "$NVME_NQN" || fail connect
N1=$(ns_dev 1) || fail "no namespace 1"
echo "@@CONNECTED $N1 $(cat /sys/block/$N1/size)"
N2=$(ns_dev 2) || fail "namespace 2 never appeared"
echo "@@NS2 $N2 $(cat /sys/block/$N2/size)"
dd if=/dev/urandom of=/tmp/pattern bs=1M count=4 2>/dev/null
dd if=/tmp/pattern of=/dev/$N2 bs=1M count=4 oflag=direct 2>/dev/null || fail "write to namespace 2"
for i in $(seq 600); do [ "$(cat /sys/block/$N2/size)" != "131072" ] && break; sleep 0.1; done
echo "@@RESIZED $(cat /sys/block/$N2/size)"
cmp -n $((4 << 20)) /tmp/pattern /dev/$N2 || fail "data changed across the resize"
echo "@@DATA_OK"
for i in $(seq 600); do [ -e /sys/block/$N2 ] || break; sleep 0.1; done
[ -e /sys/block/$N2 ] && fail "namespace 2 was not removed"
echo "@@NS2_GONE $(ls /sys/block | grep -c nvme)"
nvme disconnect -n "$NVME_NQN" || fail disconnect
echo "@@PASS"
"""


def serial_log(log: Path, proc: subprocess.Popen[bytes], timeout: float = 120) -> Path:
    """The guest's serial console, written as it runs (run-guest-test.sh copies it into its own log only at
    the end): the script names it when it boots the guest."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"serial log: (\S+)", log.read_text(errors="replace"))
        if m:
            return Path(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop(proc)
    pytest.fail(f"the guest did not boot; log {log}:\n{log.read_text(errors='replace')[-6000:]}", pytrace=False)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End the guest script and what it started (QEMU, the target): SIGTERM to its session lets its own
    cleanup run; SIGKILL if it does not go."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def wait_for(serial: Path, marker: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = serial.read_text(errors="replace") if serial.exists() else ""
        for line in text.splitlines():
            if marker + " " in line + " ":
                return line[line.index(marker):].strip()
        if "@@FAIL" in text or proc.poll() is not None:
            break
        time.sleep(0.2)
    stop(proc)
    text = serial.read_text(errors="replace") if serial.exists() else ""
    pytest.fail(f"guest never said {marker!r}; serial log {serial}:\n{text[-6000:]}", pytrace=False)


@pytest.mark.timeout(900)
def test_linux_host_sees_a_namespace_added_resized_and_removed(vsan: Callable[..., VsanServer],
                                                                tmp_path: Path) -> None:
    require_root("the guest script runs QEMU with user networking")
    require_tools("qemu-system-x86_64", "debootstrap", "socat", "cpio", "ss")
    if not GUEST.exists():
        pytest.fail(f"{GUEST} is missing: CI clones the repo with ../shared beside it", pytrace=False)
    server = vsan(start=False)
    text = EXAMPLE.read_text() + ('\n[[devices]]\nname = "live1-dev"\ntype = "ram"\nsize = "64MiB"\n'
                                  '\n[[volumes]]\nname = "live1"\ndevice = "live1-dev"\n')
    server.write_example(text)
    port = server.nvme_port
    target_log = tmp_path / "target.log"
    target_cmd = shlex.join([sys.executable, str(RUN_TARGET), "--log", str(target_log), "--", *server.command()])
    script = tmp_path / "guest.sh"
    script.write_text(GUEST_SCRIPT)
    env = {"TARGET_CMD": target_cmd, "TGT_PORT": str(port), "NVME_ADDR": "127.0.0.1", "NVME_PORT": str(port),
           "NVME_NQN": NQN, "NVME_SELFTEST": "0", "GUEST_SCRIPT": str(script)}
    out_path = tmp_path / "guest.log"

    def cli(*args: str) -> None:
        p = subprocess.run([str(VSAN), *args, "--data-dir", str(server.data_dir)], capture_output=True, text=True,
                           timeout=60, check=False)
        assert p.returncode == 0, (args, p.stdout, p.stderr)

    with open(out_path, "wb") as out:
        proc = subprocess.Popen(["bash", str(GUEST)], env={**os.environ, **guest_forward_env(), **env}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            serial = serial_log(out_path, proc, 600)
            first = wait_for(serial, "@@CONNECTED", proc, 600)
            assert first.split()[-1] == str((1 << 30) // 512), first        # disk0: 1 GiB in 512-byte sectors
            cli("export", "add", "nvme", NQN, "--volume", "live1", "--nsid", "2")
            added = wait_for(serial, "@@NS2", proc, 90)
            assert added.split()[-1] == str(64 * MiB // 512), added
            cli("volume", "resize", "live1", "--size", "96MiB")
            resized = wait_for(serial, "@@RESIZED", proc, 90)
            assert resized.split()[-1] == str(96 * MiB // 512), resized
            wait_for(serial, "@@DATA_OK", proc, 60)
            cli("export", "remove", "nvme", NQN, "--nsid", "2")
            wait_for(serial, "@@NS2_GONE", proc, 90)
            proc.wait(timeout=300)
        finally:
            stop(proc)
    text = out_path.read_text(errors="replace")
    assert proc.returncode == 0 and "@@PASS" in text, text[-6000:]
    check_target_log(target_log)
