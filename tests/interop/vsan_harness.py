"""Run a real `vsan serve` and real third-party tools from tests.

Imported by tests/conftest.py (which puts this folder on sys.path) and by the interop and fault tests.
Nothing here imports openvsan: these tests see the target only from the outside, as users do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VSAN = REPO / ".venv" / "bin" / "vsan"
# CI clones the repo with ../shared beside it; so does the development checkout.
SHARED_PEERS = (REPO.parent / "shared" / "peers").resolve()

IQN = "iqn.2026-11.org.openvsan:disk0"
# A name of its own, so the readiness probe's logout cannot race a test's login.
PROBE_INITIATOR = "iqn.2026-11.org.openvsan.test:probe"
TEST_INITIATOR = "iqn.2026-11.org.openvsan.test:init1"

# Executable -> the Debian package that ships it (what `.ci/run` installs).
TOOL_PACKAGES = {
    "iscsi-ls": "libiscsi-bin",
    "iscsi-inq": "libiscsi-bin",
    "iscsi-readcapacity16": "libiscsi-bin",
    "iscsi-test-cu": "libiscsi-bin",
    "sg_inq": "sg3-utils",
    "qemu-img": "qemu-utils",
    "qemu-io": "qemu-utils",
    "qemu-storage-daemon": "qemu-system-common",
    "qemu-system-x86_64": "qemu-system-x86",
    "mkfs.ext4": "e2fsprogs",
    "e2fsck": "e2fsprogs",
    "losetup": "mount",
    "mount": "mount",
    "umount": "mount",
    "fusermount3": "fuse3",
    "tshark": "tshark",
    "fio": "fio",
    "debootstrap": "debootstrap",
    "socat": "socat",
    "cpio": "cpio",
    "ss": "iproute2",
    "nbdinfo": "libnbd-bin",
    "nbdcopy": "libnbd-bin",
}
# QEMU's iscsi:// driver is a loadable module, not part of qemu-utils.
QEMU_ISCSI_MODULE = Path("/usr/lib/x86_64-linux-gnu/qemu/block-iscsi.so")


def require_tools(*names: str) -> None:
    """Fail (never skip) when a tool a test needs is missing, naming the package that provides it."""
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pkgs = sorted({TOOL_PACKAGES.get(n, "?") for n in missing})
        pytest.fail(
            f"missing {', '.join(missing)}: apt-get install {' '.join(pkgs)} (or run `sudo bash .ci/run`)",
            pytrace=False,
        )
    if {"qemu-img", "qemu-io", "qemu-storage-daemon"} & set(names) and not QEMU_ISCSI_MODULE.exists():
        pytest.fail("QEMU has no iscsi:// driver: apt-get install qemu-block-extra", pytrace=False)


def require_root(why: str) -> None:
    if os.geteuid() != 0:
        pytest.fail(f"must run as root: {why} (CI runs as root)", pytrace=False)


def _bench_common() -> Any:
    """bench/_common.py (the bench scripts run without the package, so their helpers live there), loaded under a
    name of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("openvsan_bench_common", REPO / "bench" / "_common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# a loopback port free now and not handed out before in this process (bench/_common.py: free_port)
free_port: Callable[[], int] = _bench_common().free_port


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    timeout: float = 120,
    check: bool = True,
    input: bytes | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a tool; on a non-zero exit (with check) fail with the command line and everything it printed."""
    argv = [str(a) for a in argv]
    try:
        p = subprocess.run(
            argv,
            check=False,
            input=input,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            env=None if env is None else {**os.environ, **env},
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")
        pytest.fail(f"timed out after {timeout}s: {' '.join(argv)}\n{out}", pytrace=False)
    out = p.stdout.decode(errors="replace")
    result = subprocess.CompletedProcess(argv, p.returncode, out, "")
    if check and p.returncode != 0:
        pytest.fail(f"exit {p.returncode}: {' '.join(argv)}\n{out}", pytrace=False)
    return result


@dataclass
class Device:
    """The one device behind LUN 0. kind: ram | shm (RAM kept in a /dev/shm file) | file | null."""

    kind: str = "ram"
    size: str = "64MiB"
    block_size: int = 512
    path: Path | None = None  # the file of a file device, or the /dev/shm backing of a shm device

    def toml(self) -> list[str]:
        kind = "ram" if self.kind == "shm" else self.kind
        lines = [
            "[[devices]]",
            'name = "dev0"',
            f'type = "{kind}"',
            f'size = "{self.size}"',
            f"block_size = {self.block_size}",
        ]
        if self.kind == "shm":
            lines.append(f"backing = {json.dumps(str(self.path))}")
        elif self.kind == "file":
            lines.append(f"path = {json.dumps(str(self.path))}")
        return lines


@dataclass
class VsanServer:
    """One `vsan serve` with one target and one LUN, configured like examples/single-node.toml."""

    workdir: Path
    port: int
    device: Device = field(default_factory=Device)
    iqn: str = IQN
    chap: tuple[str, str] | None = None
    mutual_chap: tuple[str, str] | None = None
    allowed_initiators: list[str] | None = None
    probe_initiator: str = PROBE_INITIATOR
    nbd: bool = False  # also export disk0 over NBD, as export "disk0" on nbd_port
    # disk0 carved from dev0 (volume/thin) at this size instead of being all of it; thin unless thick
    carve: str | None = None
    thick: bool = False
    # more volumes carved from dev0: (name, size, thin), LUN 1, 2... and NBD exports of their names
    carved: list[tuple[str, str, bool]] = field(default_factory=list)
    cluster: str | None = None  # dev0's cluster size when carved
    compression: str | None = None  # disk0 compressed (volume/compress.py): "lz4", "zstd"...; needs carve
    workers: int | None = None  # [node] workers (default: one per core)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    killed: bool = False  # the test killed it with SIGKILL on purpose

    def __post_init__(self) -> None:
        # examples/single-node.toml also listens on NVMe/TCP 4420 and NBD 10809; write_example moves those too
        self.nvme_port = free_port()
        self.nbd_port = free_port()
        self.api_port = free_port()     # the REST API ([api]): its own port, never the default 8080
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config = self.workdir / "vsan.toml"
        self.data_dir = self.workdir / "data"
        self.log = self.workdir / "vsan.log"
        self.write_config()

    # ---------------------------------------------------------------- config
    def write_config(self) -> None:
        lines = ["# written by tests/interop/vsan_harness.py", "[node]", 'name = "test-node"']
        if self.workers is not None:
            lines.append(f"workers = {self.workers}")
        # before the device and target tables: a test may append keys to the file's last table
        lines += ["", "[api]", f'listen = "127.0.0.1:{self.api_port}"']
        lines.append("")
        lines += self.device.toml()
        if self.cluster is not None:
            lines.append(f'cluster = "{self.cluster}"')
        lines += ["", "[[volumes]]", 'name = "disk0"', 'device = "dev0"']
        if self.carve is not None:
            lines += [f'size = "{self.carve}"', f"thin = {'false' if self.thick else 'true'}"]
        if self.compression is not None:
            lines.append(f'compression = "{self.compression}"')
        for name, size, thin in self.carved:
            lines += ["", "[[volumes]]", f'name = "{name}"', 'device = "dev0"', f'size = "{size}"',
                      f"thin = {'true' if thin else 'false'}"]
        luns = ", ".join(f'{{ lun = {i}, volume = "{v}" }}' for i, v in enumerate(self.volume_names))
        lines += [
            "",
            "[iscsi]",
            f'portals = ["127.0.0.1:{self.port}"]',
            "",
            "[[iscsi.targets]]",
            f"iqn = {json.dumps(self.iqn)}",
            f"luns = [{luns}]",
        ]
        if self.allowed_initiators is not None:
            lines.append(f"allowed_initiators = {json.dumps(self.allowed_initiators)}")
        if self.chap:
            lines.append(f"chap = {{ user = {json.dumps(self.chap[0])}, secret = {json.dumps(self.chap[1])} }}")
        if self.mutual_chap:
            u, s = self.mutual_chap
            lines.append(f"mutual_chap = {{ user = {json.dumps(u)}, secret = {json.dumps(s)} }}")
        if self.nbd:
            lines += ["", "[nbd]", f'portals = ["127.0.0.1:{self.nbd_port}"]']
            for v in self.volume_names:
                lines += ["", "[[nbd.exports]]", f'name = "{v}"', f'volume = "{v}"']
        self.config.write_text("\n".join(lines) + "\n")
        self.config.chmod(0o600)  # it may hold CHAP secrets: serve warns about a config others can read

    @property
    def volume_names(self) -> list[str]:
        return ["disk0", *(name for name, _, _ in self.carved)]

    def write_example(self, text: str) -> None:
        """Serve a config written for the well-known ports (examples/single-node.toml: iSCSI 3260, NVMe/TCP
        4420, NBD 10809, the REST API 8080) on this server's free ports instead, so a developer's `make run` cannot collide."""
        for well_known, port in ((3260, self.port), (4420, self.nvme_port), (10809, self.nbd_port),
                                 (8080, self.api_port)):
            text = text.replace(f'"127.0.0.1:{well_known}"', f'"127.0.0.1:{port}"')
        self.config.write_text(text)

    def command(self) -> list[str]:
        return [str(VSAN), "serve", "--config", str(self.config), "--data-dir", str(self.data_dir)]

    # ------------------------------------------------------------------ URLs
    @property
    def portal(self) -> str:
        return f"127.0.0.1:{self.port}"

    def portal_url(self, *, user: str | None = None, secret: str | None = None) -> str:
        cred = f"{user}%{secret}@" if user is not None else ""
        return f"iscsi://{cred}127.0.0.1:{self.port}"

    def nbd_url(self, export: str = "disk0") -> str:
        """NBD URI (libnbd's nbd:// scheme, which QEMU and fio's nbd engine read too)."""
        return f"nbd://127.0.0.1:{self.nbd_port}/{export}"

    def url(self, lun: int = 0, *, user: str | None = None, secret: str | None = None, **args: str) -> str:
        """libiscsi URL; args become URL arguments (header_digest=crc32c, target_user=..., target_password=...)."""
        if user is None and self.chap:
            user, secret = self.chap
        if self.mutual_chap and "target_user" not in args:
            args = {"target_user": self.mutual_chap[0], "target_password": self.mutual_chap[1], **args}
        query = ("?" + "&".join(f"{k}={v}" for k, v in args.items())) if args else ""
        return f"{self.portal_url(user=user, secret=secret)}/{self.iqn}/{lun}{query}"

    # ------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 30) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        require_tools("iscsi-readcapacity16")
        if not VSAN.exists():
            pytest.fail(f"{VSAN} is missing: run `make install`", pytrace=False)
        self.starts += 1
        self.killed = False
        with open(self.log, "ab") as log:
            log.write(f"\n==== start #{self.starts}: {' '.join(self.command())}\n".encode())
            log.flush()
            # its own process group: a test can kill it (and anything it spawns) without touching pytest
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Ready = a login and READ CAPACITY(16) succeed; a listening port is not enough."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(
                    f"vsan serve exited {self.proc.returncode} while starting:\n{self.log_tail()}", pytrace=False
                )
            try:
                p = subprocess.run(
                    ["iscsi-readcapacity16", "-i", self.probe_initiator, self.url()],
                    check=False,
                    capture_output=True,
                    timeout=5,
                )
                if p.returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                self.kill9()
                pytest.fail(
                    f"vsan serve did not serve {self.url()} within {timeout}s:\n{self.log_tail()}", pytrace=False
                )
            time.sleep(0.2)

    def wait_api(self, timeout: float = 30) -> str:
        """The REST API's base URL once it answers /healthz (it loads after the node serves its volumes)."""
        base = f"http://127.0.0.1:{self.api_port}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{base}/healthz", timeout=2) as r:
                    if r.status == 200:
                        return base
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the REST API did not answer on {base} within {timeout}s:\n{self.log_tail()}",
                            pytrace=False)
            time.sleep(0.1)

    def first_api_token(self) -> str:
        """The admin token the node printed at its first start (api/server.py)."""
        m = re.search(r"the first admin token \(shown once.*?\): (vsan_\S+)", self.log_text())
        if m is None:
            pytest.fail(f"no first API token in the log:\n{self.log_tail()}", pytrace=False)
        return m.group(1)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM: drain, flush, exit 0. Anything else is a failure of the target."""
        if self.proc is None or self.killed:
            return
        if self.proc.poll() is not None:
            rc = self.proc.returncode
            pytest.fail(
                f"vsan serve died on its own (exit {rc}) before it was stopped:\n{self.log_tail()}", pytrace=False
            )
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            pytest.fail(f"vsan serve did not exit within {timeout}s of SIGTERM:\n{self.log_tail()}", pytrace=False)
        if rc != 0:
            pytest.fail(f"vsan serve exited {rc} after SIGTERM (want 0):\n{self.log_tail()}", pytrace=False)
        self.check_log()

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.killed = True

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def check_log(self) -> None:
        text = self.log_text()
        if "Traceback" in text:
            i = text.index("Traceback")
            pytest.fail(
                f"vsan serve logged a Traceback ({self.log}):\n{text[max(0, i - 2000) : i + 4000]}", pytrace=False
            )

    def cleanup(self) -> None:
        """Teardown: stop (asserting a clean exit), check the log, remove a /dev/shm backing."""
        try:
            if self.running:
                self.stop()
            self.check_log()
        finally:
            self.kill9()
            if self.device.kind == "shm" and self.device.path is not None:
                self.device.path.unlink(missing_ok=True)


def make_device(kind: str, workdir: Path, size: str = "64MiB", block_size: int = 512) -> Device:
    if kind == "shm":
        return Device("shm", size, block_size, Path(f"/dev/shm/openvsan-test-{uuid.uuid4().hex[:12]}"))
    if kind == "file":
        return Device("file", size, block_size, workdir / "dev0.img")
    return Device(kind, size, block_size)


# ----------------------------------------------- targets started by a peer's harness
# The suite and guest scripts start and stop the target themselves; run_target.py records how each run ended.
RUN_TARGET = Path(__file__).with_name("run_target.py")
# a socat for QEMU's guestfwd rules that keeps its messages off the guest's socket (see the script)
GUEST_FORWARD = Path(__file__).with_name("guest") / "forward"


def guest_forward_env() -> dict[str, str]:
    """PATH for ../shared/peers/linux-guest/run-guest-test.sh with NET=user: its guestfwd socat is ours."""
    return {"PATH": f"{GUEST_FORWARD}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


# for guest scripts (shared/peers/linux-guest): prints the first NVMe namespace's block device once the
# kernel has made it, within 10 s; fails otherwise
GUEST_WAIT_NS = r"""wait_ns() {
    for i in $(seq 100); do
        for b in /sys/class/nvme-subsystem/nvme-subsys*/nvme*n1 /sys/class/nvme/nvme*/nvme*n1; do
            [ -e "$b" ] && [ -b "/dev/${b##*/}" ] && { echo "/dev/${b##*/}"; return 0; }
        done
        sleep 0.1
    done; return 1
}
"""


def check_target_log(log: Path, settle: float = 20) -> None:
    """Every start of the target ended in a clean exit after SIGTERM, with no Traceback on the way.

    A harness may return while the last target is still draining (it waited for a shell, not for the
    wrapper), so give the last exit up to `settle` seconds to be recorded.
    """
    deadline = time.monotonic() + settle
    while True:
        text = log.read_text(errors="replace")
        starts = text.count("@@START ")
        exits = re.findall(r"^@@EXIT rc=(-?\d+) (after|without) SIGTERM", text, re.MULTILINE)
        if len(exits) >= starts or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    crashes = [f"rc={rc}" for rc, how in exits if how == "without"]
    unclean = [f"rc={rc}" for rc, how in exits if how == "after" and rc != "0"]
    problems = []
    if len(exits) != starts:
        # the harness SIGKILLed it after its grace period: a hung event loop, usually; a next start that
        # fails with "address already in use" is the same event seen a second later
        problems.append(f"{starts - len(exits)} of {starts} runs never exited after SIGTERM (hung, then killed)")
    if crashes:
        problems.append(f"vsan serve exited on its own {len(crashes)} time(s): {crashes}")
    if unclean:
        problems.append(f"vsan serve exited non-zero after SIGTERM: {unclean}")
    if "Traceback" in text:
        i = text.index("Traceback")
        problems.append("a Traceback in the target's log:\n" + text[max(0, i - 1500) : i + 3000])
    if problems:
        pytest.fail(f"{log}:\n" + "\n".join(problems), pytrace=False)


# ------------------------------------------------------------------- QEMU
def qemu_io(
    target: str, *commands: str, image_opts: bool = False, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """qemu-io on an iscsi:// URL (or --image-opts string); fails on any error, including a pattern mismatch."""
    require_tools("qemu-io")
    argv = ["qemu-io"]
    argv += ["--image-opts", target] if image_opts else ["-f", "raw", target]
    for c in commands:
        argv += ["-c", c]
    p = run(argv, check=False, timeout=timeout)
    bad = p.returncode != 0 or "Pattern verification failed" in p.stdout or "failed:" in p.stdout
    if check and bad:
        pytest.fail(f"qemu-io exit {p.returncode}: {' '.join(argv)}\n{p.stdout}", pytrace=False)
    return p


def qemu_iscsi_opts(server: VsanServer, **extra: str) -> str:
    """A QEMU --blockdev/--image-opts string for LUN 0 of server (QEMU's own iSCSI initiator, via libiscsi)."""
    opts = {
        "driver": "iscsi",
        "transport": "tcp",
        "portal": server.portal,
        "target": server.iqn,
        "lun": "0",
        "initiator-name": TEST_INITIATOR,
    }
    if server.chap:
        opts["user"], opts["password"] = server.chap
    opts.update(extra)
    return ",".join(f"{k}={v}" for k, v in opts.items())
