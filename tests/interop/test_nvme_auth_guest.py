"""DH-HMAC-CHAP with the Linux kernel NVMe/TCP host (nvme_tcp + nvme-cli 2.4 in the QEMU guest of
../shared/peers/linux-guest) against `vsan serve` with `hosts` on its subsystem.

Debian 12's own 6.1 kernel has `# CONFIG_NVME_AUTH is not set`, so the guest boots bookworm-backports' kernel
(CONFIG_NVME_HOST_AUTH=y), prepared by tests/interop/auth_guest.sh (cached; .ci/run builds it beforehand).
Inside, the kernel host does what a user does: `nvme connect --dhchap-secret` (unidirectional) and with
`--dhchap-ctrl-secret` (bidirectional), writes and reads the namespace back, disconnects; no secret, an
unlisted host NQN and a wrong host secret are refused by the target, and a wrong controller secret is refused
by the host (the controller cannot prove itself): each such `nvme connect` fails and no namespace appears.
Three subsystems on one volume make the kernel use SHA-256 with ffdhe2048, SHA-512 with ffdhe4096 and SHA-384
with no DH; each association reads back what the one before it wrote. One boot: ~1 minute, ~30 s more for
the first build of the guest.
The target's log names the host and its address for every failure and holds no secret.
Our own host covers the rest (the throttle, a queue that skips authentication, a restart): test_nvme_auth_initiator.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_nvme_auth_initiator import BI, BI_SECRET, CTRL_SECRET, NQN, STRANGER, UNI, UNI_SECRET, WRONG, serve
from vsan_harness import (
    GUEST_WAIT_NS,
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
AUTH_GUEST = Path(__file__).with_name("auth_guest.sh")

SCRIPT = r"""
fail() { echo "@@FAIL $*"; dmesg | grep -i -E 'nvme|auth' | tail -25; exit 1; }
ns_present() { ls /sys/block/ | grep -q '^nvme'; }
""" + GUEST_WAIT_NS + r"""conn() { nvme connect -t tcp -a $NVME_A -s $NVME_S -n "$NVME_NQN" "$@" > /tmp/conn 2>&1; r=$?; cat /tmp/conn; return $r; }
refused() {   # $1: what; the rest: nvme connect options
    what=$1; shift
    if conn "$@"; then nvme disconnect -n "$NVME_NQN"; fail "$what: connected"; fi
    sleep 0.5; ns_present && fail "$what: a namespace appeared"
    echo "@@REFUSED $what"
}
echo "@@KERNEL $(uname -r)"
modprobe -a nvme_tcp || fail modprobe
refused "no secret" --hostnqn "$UNI"
refused "unlisted host" --hostnqn "$STRANGER" --dhchap-secret "$UNI_SECRET"
refused "wrong secret" --hostnqn "$UNI" --dhchap-secret "$WRONG"
refused "wrong controller secret" --hostnqn "$BI" --dhchap-secret "$BI_SECRET" --dhchap-ctrl-secret "$WRONG"
# one association per subsystem (each offers other hashes and groups) and mode, all on the same volume: each
# reads back what the one before it wrote, then writes its own
dd if=/dev/urandom of=/tmp/prev bs=64k count=16 2>/dev/null
first=1
for assoc in $ASSOCS; do
    nqn=${assoc%/*} mode=${assoc##*/}
    if [ $mode = uni ]; then set -- --hostnqn "$UNI" --dhchap-secret "$UNI_SECRET"
    else set -- --hostnqn "$BI" --dhchap-secret "$BI_SECRET" --dhchap-ctrl-secret "$CTRL_SECRET"; fi
    nvme connect -t tcp -a $NVME_A -s $NVME_S -n "$nqn" "$@" || fail "connect $assoc"
    DEV=$(wait_ns) || fail "no namespace ($assoc)"
    echo "@@CONNECTED $assoc $DEV"
    if [ $first = 0 ]; then
        dd if=$DEV of=/tmp/back bs=64k count=16 iflag=direct 2>/dev/null || fail "read $assoc"
        [ "$(sha256sum < /tmp/prev)" = "$(sha256sum < /tmp/back)" ] || fail "the data written before differ ($assoc)"
    fi
    dd if=/dev/urandom of=/tmp/prev bs=64k count=16 2>/dev/null
    dd if=/tmp/prev of=$DEV bs=64k count=16 oflag=direct 2>/dev/null || fail "write $assoc"
    dd if=$DEV of=/tmp/back bs=64k count=16 iflag=direct 2>/dev/null || fail "read back $assoc"
    [ "$(sha256sum < /tmp/prev)" = "$(sha256sum < /tmp/back)" ] || fail "data differ ($assoc)"
    echo "@@IO_OK $assoc"
    nvme disconnect -n "$nqn" || fail "disconnect $assoc"
    sleep 0.5; ns_present && fail "namespace still there after disconnect ($assoc)"
    first=0
done
echo "@@PASS"
"""


def prepare_guest() -> Path:
    """tests/interop/auth_guest.sh: the guest with the backports kernel, built or taken from its cache."""
    packages = {"zstd": "zstd", "dpkg-deb": "dpkg", "apt-get": "apt", "flock": "util-linux"}
    missing = [t for t in packages if shutil.which(t) is None]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: apt-get install {' '.join(packages[t] for t in missing)} "
                    "(or run `sudo bash .ci/run`)", pytrace=False)
    p = subprocess.run(["bash", str(AUTH_GUEST)], capture_output=True, text=True, timeout=600, check=False)
    if p.returncode != 0:
        pytest.fail(f"{AUTH_GUEST} failed (exit {p.returncode}):\n{p.stderr[-4000:]}", pytrace=False)
    vmdir = Path(p.stdout.strip().splitlines()[-1])
    assert (vmdir / "build" / "vmlinux").is_file(), p.stdout
    return vmdir


def guest_kernel(vmdir: Path) -> str:
    (config,) = (vmdir / "build" / "kernel" / "boot").glob("config-*")
    assert re.search(r"^CONFIG_NVME_HOST_AUTH=y$", config.read_text(errors="replace"), re.MULTILINE), config
    return config.name.removeprefix("config-")


# What a subsystem offers decides what the kernel uses (the controller picks from the host's lists, NVMe Base
# 2.0 §8.13.5): the first subsystem keeps the defaults; two more on the same volume offer the largest hash and
# group, and no DH at all. Subsystem NQN, dhchap_hashes, dhchap_dhgroups, the hash and group the log shows.
SUBSYSTEMS = [
    (NQN, None, None, "sha256", "ffdhe2048"),
    (f"{NQN}-sha512", ["sha512"], ["ffdhe4096"], "sha512", "ffdhe4096"),
    (f"{NQN}-sha384", ["sha384"], ["null"], "sha384", "null"),
]


def more_subsystems(server: VsanServer) -> None:
    """Append the other subsystems of SUBSYSTEMS to the config serve() wrote (its subsystem comes last)."""
    text = server.config.read_text()
    hosts = text[text.rindex("\nhosts = "):].splitlines()[1]
    for nqn, hashes, groups, _, _ in SUBSYSTEMS[1:]:
        text += (f'\n[[nvme.subsystems]]\nnqn = "{nqn}"\nnamespaces = [{{ nsid = 1, volume = "disk0" }}]\n{hosts}\n'
                 f"dhchap_hashes = {json.dumps(hashes)}\ndhchap_dhgroups = {json.dumps(groups)}\n")
    server.config.write_text(text)


@pytest.mark.timeout(900)
def test_linux_kernel_host_dhchap(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    require_root("the guest build uses chroot; the guest script runs QEMU with user networking")
    require_tools("qemu-system-x86_64", "debootstrap", "socat", "cpio", "ss")
    if not GUEST.exists():
        pytest.fail(f"{GUEST} is missing: CI clones the repo with ../shared beside it", pytrace=False)
    kver = guest_kernel(prepare_guest())
    server = serve(vsan)
    server.stop()                               # the guest script starts it itself (TARGET_CMD)
    more_subsystems(server)
    target_log = tmp_path / "target.log"
    target_cmd = shlex.join([sys.executable, str(RUN_TARGET), "--log", str(target_log), "--", *server.command()])
    assocs = [f"{nqn}/{mode}" for nqn, *_ in SUBSYSTEMS for mode in ("uni", "bi")]
    values = {"UNI": UNI, "BI": BI, "STRANGER": STRANGER, "UNI_SECRET": UNI_SECRET, "BI_SECRET": BI_SECRET,
              "CTRL_SECRET": CTRL_SECRET, "WRONG": WRONG, "ASSOCS": " ".join(assocs)}
    script = tmp_path / "guest.sh"
    script.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items()) + SCRIPT)
    env = {"TARGET_CMD": target_cmd, "TGT_PORT": str(server.nvme_port), "NVME_ADDR": "127.0.0.1",
           "NVME_PORT": str(server.nvme_port), "NVME_NQN": NQN, "NVME_SELFTEST": "0", "GUEST_SCRIPT": str(script),
           "GUEST_TIMEOUT": "400"}
    out_path = tmp_path / "guest.log"
    with open(out_path, "wb") as out:
        try:
            p = subprocess.run(["bash", str(AUTH_GUEST), "run"], env={**os.environ, **guest_forward_env(), **env}, stdout=out,
                               stderr=subprocess.STDOUT, timeout=500, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail(f"guest test timed out; log: {out_path}\n{out_path.read_text(errors='replace')[-6000:]}",
                        pytrace=False)
    text = out_path.read_text(errors="replace")
    print(text[-5000:])
    if p.returncode != 0 or "@@PASS" not in text:
        pytest.fail(f"guest test failed (exit {p.returncode}); log {out_path}:\n{text[-8000:]}", pytrace=False)
    assert f"@@KERNEL {kver}" in text
    for what in ("no secret", "unlisted host", "wrong secret", "wrong controller secret"):
        assert f"@@REFUSED {what}" in text
    for assoc in assocs:
        assert f"@@IO_OK {assoc}" in text
    check_target_log(target_log)
    tlog = target_log.read_text(errors="replace")
    # the kernel authenticates the admin queue and its I/O queue (1 vCPU: one), each in its own transaction
    for nqn, _, _, hash_used, group_used in SUBSYSTEMS:
        for host, how in ((UNI, "unidirectional"), (BI, "bidirectional")):
            for q in (0, 1):
                line = f"host {host} authenticated queue {q} of {nqn} (DH-HMAC-CHAP {hash_used}, {group_used}, {how})"
                assert line in tlog, line
    # every failure names the host and the address it came from: the wrong host secret (the target's verdict)
    # and the wrong controller secret (the host's AUTH_Failure2 after the controller's reply)
    failures = [line for line in tlog.splitlines() if "failed DH-HMAC-CHAP" in line]
    for host in (UNI, BI):
        mine = [line for line in failures if f"host {host} " in line]
        assert mine and all(re.search(r"127\.0\.0\.1:\d+: host", line) for line in mine), (host, failures)
    # the host without a secret leaves after the Connect that asked for authentication: said once, with its name
    assert re.search(rf"127\.0\.0\.1:\d+: closed by the host before DH-HMAC-CHAP authentication: host {re.escape(UNI)}",
                     tlog), tlog[-4000:]
    # the unlisted host is refused at Connect (Connect Invalid Host), and that line names it too
    assert re.search(rf"127\.0\.0\.1:\d+: Connect refused \(status 0x4184\): host '{re.escape(STRANGER)}'", tlog)
    assert f"host {STRANGER} connected" not in tlog
    for secret in (UNI_SECRET, BI_SECRET, CTRL_SECRET, WRONG):
        assert secret.split(":")[2] not in tlog
