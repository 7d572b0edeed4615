"""A Linux kernel NVMe/TCP host (nvme_tcp + nvme-cli in a QEMU guest) against `vsan serve` of
examples/single-node.toml (disk0 as namespace 1 of nqn.2026-11.org.openvsan:disk0), with the whole session
captured on lo and dissected by Wireshark's nvme-tcp dissector.

../shared/peers/linux-guest/run-guest-test.sh boots the guest; inside it: `nvme discover`, `nvme connect`
with header and data digests, Identify, mkfs.ext4, mount, checksum across a remount, fio writes with
verification at 4 KiB-256 KiB (in-capsule data and R2T/H2CData), disconnect; then a second association with
SQ flow control disabled (so reads end in C2HData with the SUCCESS flag), the checksum again, disconnect.
The guest sees the target as 10.0.2.101:4420 (QEMU forwards it to the host's free port).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from vsan_harness import (
    GUEST_WAIT_NS,
    REPO,
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
EXAMPLE = REPO / "examples" / "single-node.toml"
NQN = "nqn.2026-11.org.openvsan:disk0"

GUEST_SCRIPT = r"""
fail() { echo "@@FAIL $*"; dmesg | grep -i -E 'nvme|tcp' | tail -25; exit 1; }
""" + GUEST_WAIT_NS + r"""modprobe -a nvme_tcp ext4 crc32c_generic || fail modprobe
nvme discover -t tcp -a $NVME_A -s $NVME_S > /tmp/disc 2>&1 || { cat /tmp/disc; fail discover; }
cat /tmp/disc
grep -q "subnqn: *$NVME_NQN" /tmp/disc || fail "subsystem not in the discovery log"
nvme connect -t tcp -a $NVME_A -s $NVME_S -n "$NVME_NQN" --hdr-digest --data-digest || fail connect
DEV=$(wait_ns) || fail "no namespace"
C=$(ls -d /sys/class/nvme/nvme* | head -1); C=${C##*/}
nvme id-ctrl /dev/$C | grep -E '^(sn|mn|cntlid|ver|ioccsz|cntrltype) ' || fail id-ctrl
nvme id-ns $DEV | grep -E '^(nsze|anagrpid|rescap) ' || fail id-ns
nvme ns-descs $DEV | grep -E '^(eui64|nguid|uuid)' || fail ns-descs
echo "@@ANA $(cat /sys/block/nvme*c*n1/ana_state 2>/dev/null | head -1)"   # the path device (multipath)
mkfs.ext4 -q -F $DEV || fail mkfs
mount $DEV /mnt || fail mount
dd if=/dev/urandom of=/mnt/payload bs=1M count=16 2>/dev/null || fail write
S1=$(sha256sum /mnt/payload | cut -d' ' -f1)
umount /mnt || fail umount
echo 3 > /proc/sys/vm/drop_caches
mount $DEV /mnt || fail remount
S2=$(sha256sum /mnt/payload | cut -d' ' -f1)
[ "$S1" = "$S2" ] || fail "checksum mismatch $S1 $S2"
echo "@@CHECKSUM_OK $S1"
fio --name=verify --filename=/mnt/fio.dat --size=32M --rw=randwrite --bsrange=4k-256k --direct=1 \
    --ioengine=libaio --iodepth=16 --verify=crc32c --verify_fatal=1 --do_verify=1 > /tmp/fio.out 2>&1 \
    || { cat /tmp/fio.out; fail fio; }
grep -E 'write: IOPS|read: IOPS' /tmp/fio.out | head -2
umount /mnt || fail umount2
nvme disconnect -n "$NVME_NQN" || fail disconnect
echo "@@DISCONNECTED"
sleep 1
nvme connect -t tcp -a $NVME_A -s $NVME_S -n "$NVME_NQN" --disable-sqflow || fail "connect without SQ flow control"
DEV=$(wait_ns) || fail "no namespace (second association)"
mount $DEV /mnt || fail mount3
S3=$(sha256sum /mnt/payload | cut -d' ' -f1)
[ "$S1" = "$S3" ] || fail "checksum mismatch after reconnect $S1 $S3"
echo "@@CHECKSUM_AGAIN_OK"
umount /mnt
nvme disconnect -n "$NVME_NQN" || fail disconnect2
echo "@@PASS"
"""


def start_capture(port: int, out: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as err:
        # -B: a 64 MiB kernel buffer so bursts of 256 KiB writes over loopback are not dropped
        proc = subprocess.Popen(["dumpcap", "-q", "-i", "lo", "-f", f"tcp port {port}", "-B", "64", "-s", "0",
                                 "-w", str(out)], stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 15
    while "Capturing on" not in log.read_text(errors="replace") or not out.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"dumpcap did not start:\n{log.read_text(errors='replace')}", pytrace=False)
        time.sleep(0.05)
    return proc


def tshark(cap: Path, port: int, display_filter: str, *fields: str) -> list[list[str]]:
    argv = ["tshark", "-r", str(cap), "-d", f"tcp.port=={port},nvme-tcp", "-o", f"nvme-tcp.subsystem_ports:{port}",
            "-o", "nvme-tcp.check_hdgst:TRUE", "-o", "nvme-tcp.check_ddgst:TRUE", "-Y", display_filter,
            "-T", "fields"]
    for f in fields:
        argv += ["-e", f]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True).stdout
    return [line.split("\t") for line in out.splitlines() if line.strip()]


@pytest.mark.timeout(900)
def test_linux_kernel_nvme_host(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    require_root("the guest script runs QEMU with user networking; dumpcap captures on lo")
    require_tools("qemu-system-x86_64", "debootstrap", "socat", "cpio", "ss", "tshark")
    if not GUEST.exists():
        pytest.fail(f"{GUEST} is missing: CI clones the repo with ../shared beside it", pytrace=False)
    server = vsan(start=False)
    server.write_example(EXAMPLE.read_text())
    port = server.nvme_port
    cap, cap_log = tmp_path / "nvme.pcapng", tmp_path / "dumpcap.log"
    dumpcap = start_capture(port, cap, cap_log)
    target_log = tmp_path / "target.log"
    target_cmd = shlex.join([sys.executable, str(RUN_TARGET), "--log", str(target_log), "--", *server.command()])
    script = tmp_path / "guest.sh"
    script.write_text(GUEST_SCRIPT)
    env = {"TARGET_CMD": target_cmd, "TGT_PORT": str(port), "NVME_ADDR": "127.0.0.1", "NVME_PORT": str(port),
           "NVME_NQN": NQN, "NVME_SELFTEST": "0", "GUEST_SCRIPT": str(script)}
    out_path = tmp_path / "guest.log"
    try:
        with open(out_path, "wb") as out:
            try:
                p = subprocess.run(["bash", str(GUEST)], env={**os.environ, **guest_forward_env(), **env}, stdout=out,
                                   stderr=subprocess.STDOUT, timeout=700, check=False)
            except subprocess.TimeoutExpired:
                pytest.fail(f"guest test timed out; log: {out_path}\n"
                            f"{out_path.read_text(errors='replace')[-6000:]}", pytrace=False)
    finally:
        dumpcap.send_signal(signal.SIGTERM)
        dumpcap.wait(timeout=30)
    text = out_path.read_text(errors="replace")
    print(text[-5000:])
    if p.returncode != 0 or "@@PASS" not in text:
        pytest.fail(f"guest test failed (exit {p.returncode}); log {out_path}:\n{text[-8000:]}", pytrace=False)
    assert "@@CHECKSUM_OK" in text and "@@CHECKSUM_AGAIN_OK" in text
    assert "@@ANA optimized" in text
    check_target_log(target_log)
    stats = cap_log.read_text(errors="replace")
    m = re.search(r"Packets received/dropped on interface '[^']*': (\d+)/(\d+)", stats)
    assert m and int(m.group(2)) == 0, f"dumpcap dropped packets, the analysis would be incomplete:\n{stats}"

    # what the session held: every PDU type, digests, in-capsule data, R2T, SUCCESS
    types = {t for row in tshark(cap, port, "nvme-tcp", "nvme-tcp.type") for t in row[0].split(",")}
    assert {"0", "1", "4", "5", "6", "7", "9"} <= types, f"PDU types seen: {sorted(types)}"
    assert tshark(cap, port, "nvme-tcp.type == 9", "nvme-tcp.r2t.length"), "no R2T"
    assert tshark(cap, port, "nvme-tcp.type == 4 && nvme-tcp.plen > 4096 && nvme-tcp.cmd.qid > 0",
                  "frame.number"), "no write with in-capsule data"
    assert tshark(cap, port, "nvme-tcp.flags.pdu.hdgst == 1 && nvme-tcp.flags.pdu.ddgst == 1", "frame.number")
    assert tshark(cap, port, "nvme-tcp.flags.pdu.data_success == 1", "frame.number"), "no C2HData SUCCESS"
    bad = tshark(cap, port, '_ws.malformed || _ws.expert.severity >= "Error" || nvme-tcp.type == 3',
                 "frame.number", "_ws.expert.message")
    assert not bad, f"malformed or error-level frames (frame, message): {bad[:20]}"
    with socket.socket() as s:       # nothing is left listening
        assert s.connect_ex(("127.0.0.1", port)) != 0
