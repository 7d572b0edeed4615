"""The Linux guest (../shared/peers/linux-guest/run-guest-test.sh, QEMU) on the network of a netns Lab, so that
one guest reaches target addresses that live in several node namespaces, and a test can cut any of its paths
while the guest runs.

    with GuestLab(["n1", "n2"]) as gl:
        serve = gl.serve("n1", config_text, tmp_path / "n1")     # `vsan serve` inside n1's namespace
        run = gl.boot(guest_script, tmp_path / "guest", env={...})
        run.wait_marker("@@FIO_RUNNING"); gl.cut_path(gl.lab.addr["n1"])  # or gl.lab.isolate("n1")
        run.finish()                                              # fails the test unless the guest said @@PASS

Layout. The guest script boots QEMU with NET=tap in a namespace of its own ("vmtest-PID": tap0 198.18.0.1/24,
the guest 198.18.0.2/24 with its default route via 198.18.0.1) and runs TARGET_CMD inside it first. Our
TARGET_CMD is this file's `wire` command: it joins that namespace to the Lab's bridge with a veth (the last
address of the Lab's subnet), makes it a router between the guest and the nodes, and adds an nftables table
whose forward chain drops what goes to or comes from any address in the set `cut` (a path cut: the guest's
packets vanish as on a broken link; nothing answers). Each node namespace gets a route to 198.18.0.0/24 via
that router. The script waits for something to listen on TGT_PORT in its namespace before it boots QEMU: the
`wire` command listens there (it never accepts) once the wiring is done, and the guest never connects to it.
Everything lives in namespaces made here or by the guest script; the host's own network is never touched.

The guest build with multipath-tools is cached in its own VMDIR (MULTIPATH_VMDIR), so it never rebuilds the
standard guest's cache that the other guest tests use.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import pytest
from netns import Lab

REPO = Path(__file__).resolve().parents[2]
VSAN = REPO / ".venv" / "bin" / "vsan"
GUEST = (REPO.parent / "shared" / "peers" / "linux-guest" / "run-guest-test.sh").resolve()
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
MULTIPATH_VMDIR = CACHE / "openvsan-guest-multipath"
# what the guest needs for dm-multipath (../shared/peers/README.md "A Linux kernel initiator"): the tools, the
# checker and prioritizer plugins multipathd loads by name (tur, alua, const), and the kernel's dm-multipath;
# and for dm-crypt (tests/interop/test_guest_crypt.py): cryptsetup, dm-crypt, XTS, and the kernel crypto API's
# user interface (cryptsetup encrypts keyslots through AF_ALG)
MULTIPATH_GUEST = {
    "GUEST_PACKAGES": "multipath-tools,cryptsetup-bin",
    "GUEST_BINARIES": " ".join([
        "/usr/sbin/multipath", "/usr/sbin/multipathd", "/usr/sbin/dmsetup", "/usr/sbin/cryptsetup",
        *(f"/usr/lib/multipath/lib{p}.so"
          for p in ("checktur", "checkdirectio", "prioalua", "prioconst", "priosysfs", "prioana", "foreign-nvme")),
    ]),
    "GUEST_MODULES": "dm_mod dm_multipath dm_round_robin dm_service_time scsi_dh_alua dm_crypt xts ecb af_alg "
                     "algif_skcipher",
}

GUEST_NET = ipaddress.IPv4Network("198.18.0.0/24")  # run-guest-test.sh NET=tap
GUEST_ROUTER = "198.18.0.1"  # tap0 in the script's namespace, the guest's default route
GUEST_ADDR = "198.18.0.2"
TABLE = "openvsan_guest"
ROUTER_IFACE = "lab0"  # in the guest's namespace: its veth to the Lab bridge


def _sh(argv: Sequence[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def require_guest() -> None:
    """Fail (never skip) without root, the guest script, or the host tools the guest build needs."""
    if os.geteuid() != 0:
        pytest.fail("must run as root: network namespaces, QEMU on a tap, debootstrap (CI runs as root)",
                    pytrace=False)
    if not GUEST.exists():
        pytest.fail(f"{GUEST} is missing: CI clones the repo with ../shared beside it", pytrace=False)
    from vsan_harness import require_tools  # tests/interop is on sys.path (tests/conftest.py)

    require_tools("qemu-system-x86_64", "debootstrap", "socat", "cpio", "ss")
    if not VSAN.exists():
        pytest.fail(f"{VSAN} is missing: run `make install`", pytrace=False)


# ------------------------------------------------------------------ targets in node namespaces
@dataclass
class NodeServe:
    """One `vsan serve` inside a Lab node's namespace; `portals` are the (addr, port) it must listen on."""

    lab: Lab
    node: str
    config: Path
    data_dir: Path
    log: Path
    portals: list[tuple[str, int]]
    proc: subprocess.Popen[bytes] | None = None
    killed: bool = False

    def start(self, timeout: float = 30) -> None:
        with open(self.log, "ab") as log:
            self.proc = self.lab.popen(self.node, [VSAN, "serve", "--config", self.config, "--data-dir", self.data_dir],
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not all(self.listening(a, p) for a, p in self.portals):
            if self.proc.poll() is not None:
                pytest.fail(f"vsan serve in {self.node} exited {self.proc.returncode}:\n{self.log_tail()}",
                            pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"vsan serve in {self.node} not listening on {self.portals} in {timeout}s:\n"
                            f"{self.log_tail()}", pytrace=False)
            time.sleep(0.1)

    def listening(self, addr: str, port: int) -> bool:
        out = self.lab.run(self.node, ["ss", "-ltnH", f"src {addr}:{port}"], check=False).stdout
        return "LISTEN" in out

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.killed = True

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM: exit 0, no Traceback in the log; anything else fails the test."""
        if self.proc is None or self.killed:
            return
        if self.proc.poll() is not None:
            pytest.fail(f"vsan serve in {self.node} died on its own (exit {self.proc.returncode}):\n"
                        f"{self.log_tail()}", pytrace=False)
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            pytest.fail(f"vsan serve in {self.node} did not exit within {timeout}s of SIGTERM:\n{self.log_tail()}",
                        pytrace=False)
        if rc != 0:
            pytest.fail(f"vsan serve in {self.node} exited {rc} after SIGTERM:\n{self.log_tail()}", pytrace=False)
        text = self.log.read_text(errors="replace")
        if "Traceback" in text:
            i = text.index("Traceback")
            pytest.fail(f"vsan serve in {self.node} logged a Traceback:\n{text[max(0, i - 1500):i + 3000]}",
                        pytrace=False)

    def log_tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def serve_config(name: str, iscsi: Sequence[str], nvme: Sequence[str], *, iqn: str, nqn: str,
                 size: str = "192MiB") -> str:
    """A node config: one RAM volume `disk0`, LUN 0 of `iqn` on the `iscsi` portals and namespace 1 of `nqn`
    on the `nvme` portals (each "addr:port"); SendTargets and the discovery log page report every portal."""
    q = json.dumps
    return "\n".join([
        "# written by tests/support/guest_lab.py",
        f"[node]\nname = {q(name)}\n",
        f'[[devices]]\nname = "ram0"\ntype = "ram"\nsize = {q(size)}\nblock_size = 512\n',
        '[[volumes]]\nname = "disk0"\ndevice = "ram0"\n',
        f"[iscsi]\nportals = {q(list(iscsi))}\n",
        f'[[iscsi.targets]]\niqn = {q(iqn)}\nluns = [{{ lun = 0, volume = "disk0" }}]\n',
        f"[nvme]\nportals = {q(list(nvme))}\n",
        f'[[nvme.subsystems]]\nnqn = {q(nqn)}\nnamespaces = [{{ nsid = 1, volume = "disk0" }}]\n',
    ])


# ------------------------------------------------------------------ the guest
@dataclass
class GuestRun:
    """A running run-guest-test.sh: its output (our log), and the guest's serial log, which it names."""

    proc: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.monotonic)
    serial: Path | None = None
    _reader: threading.Thread | None = None

    def _read(self, out: IO[bytes]) -> None:
        with open(self.log, "ab") as f:
            for line in out:
                f.write(line)
                f.flush()
                m = re.search(rb"serial log: (\S+)", line)
                if m and self.serial is None:
                    self.serial = Path(m.group(1).decode())

    def text(self) -> str:
        """What the guest printed so far (its serial console)."""
        if self.serial is None or not self.serial.exists():
            return ""
        return self.serial.read_text(errors="replace").replace("\r", "")

    def wait_marker(self, marker: str, timeout: float = 400) -> str:
        """Wait until the guest prints a line starting with `marker`; returns that line."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.text().splitlines():
                if line.startswith(marker):
                    return line
            if self.proc.poll() is not None or "@@FAIL" in self.text() or time.monotonic() > deadline:
                self.finish(timeout=30)  # fails with the whole story
                pytest.fail(f"the guest ended without printing {marker}:\n{self.tail()}", pytrace=False)
            time.sleep(0.2)

    def tail(self, chars: int = 8000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def finish(self, timeout: float = 600) -> str:
        """Wait for the script; fail unless the guest printed @@PASS. Returns the script's whole output (which
        ends with the guest's serial log, each line as `  guest| ...`)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its cleanup trap stops QEMU and deletes its namespace
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
            pytest.fail(f"the guest run timed out after {timeout}s; log {self.log}:\n{self.tail()}", pytrace=False)
        if self._reader is not None:
            self._reader.join(timeout=10)
        out = self.log.read_text(errors="replace")
        if rc != 0 or not re.search(r"^\s*guest\| @@PASS", out, re.MULTILINE):
            pytest.fail(f"guest test failed (exit {rc}); log {self.log}:\n{out[-10000:]}", pytrace=False)
        return out

    def abort(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class GuestLab:
    """A Lab of node namespaces, and the guest on its bridge through a router namespace (see the module doc)."""

    def __init__(self, nodes: Sequence[str], *, workdir: Path) -> None:
        self.lab = Lab(nodes)
        self.workdir = workdir
        self.router_addr = ""  # the router's address on the Lab subnet
        self.state = workdir / "guest-net.json"
        self.serves: list[NodeServe] = []
        self.runs: list[GuestRun] = []

    def start(self) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lab.start()
        try:
            assert self.lab.net is not None
            self.router_addr = str(self.lab.net.broadcast_address - 1)
            for name in self.lab.names:
                _sh(["ip", "-n", self.lab.ns(name), "route", "add", str(GUEST_NET), "via", self.router_addr])
        except BaseException:
            self.lab.close()
            raise
        return self

    def close(self) -> None:
        try:
            for run in self.runs:
                run.abort()
            for s in self.serves:
                s.kill9()
        finally:
            self.lab.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- nodes --

    def add_address(self, node: str, index: int) -> str:
        """A second address for `node` (the `index`-th host of the subnet after the nodes'), on its eth0: two
        portals of one process, two paths for the guest."""
        assert self.lab.net is not None
        addr = str(self.lab.net.network_address + 100 + index)
        _sh(["ip", "-n", self.lab.ns(node), "addr", "add", f"{addr}/{self.lab.net.prefixlen}", "dev", "eth0"])
        return addr

    def serve(self, node: str, config: str, workdir: Path, portals: Sequence[str]) -> NodeServe:
        """Start `vsan serve` with `config` in `node`'s namespace; ready when it listens on every portal."""
        workdir.mkdir(parents=True, exist_ok=True)
        cfg = workdir / "vsan.toml"
        cfg.write_text(config)
        cfg.chmod(0o600)
        parsed = [(p.rsplit(":", 1)[0], int(p.rsplit(":", 1)[1])) for p in portals]
        s = NodeServe(self.lab, node, cfg, workdir / "data", workdir / "vsan.log", parsed)
        self.serves.append(s)
        s.start()
        return s

    def isolate(self, node: str) -> None:
        """`node`'s only link down (Lab.isolate): it reaches nobody, the guest included."""
        self.lab.isolate(node)

    def rejoin(self, node: str) -> None:
        """The link up again, and the route to the guest that link-down took with it."""
        self.lab.rejoin(node)
        _sh(["ip", "-n", self.lab.ns(node), "route", "replace", str(GUEST_NET), "via", self.router_addr])

    # -- the guest's paths --

    def guest_ns(self) -> str:
        """The guest's (the script's) namespace, once `wire` has run in it."""
        return str(json.loads(self.state.read_text())["ns"])

    def _nft(self, script: str) -> None:
        p = subprocess.run(["ip", "netns", "exec", self.guest_ns(), "nft", "-f", "-"], input=script, text=True,
                           capture_output=True, timeout=30, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"nft in {self.guest_ns()}: {p.stderr.strip()}\n{script}")

    def cut_path(self, addr: str) -> None:
        """Drop every packet between the guest and `addr`, both ways (at the router)."""
        self._nft(f"add element inet {TABLE} cut {{ {addr} }}\n")

    def heal_path(self, addr: str) -> None:
        self._nft(f"delete element inet {TABLE} cut {{ {addr} }}\n")

    def boot(self, script: str, workdir: Path, env: Mapping[str, str] | None = None, *,
             guest: Mapping[str, str] = MULTIPATH_GUEST, timeout: float = 420) -> GuestRun:
        """Boot the guest with `script` (busybox sh; it gets GUEST_ENV's variables and `env` as shell
        assignments in front) on this Lab's network; returns at once (the guest runs)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.state.unlink(missing_ok=True)
        latch = 3260  # in the script's own, empty namespace: it cannot collide
        head = "".join(f"{k}={_shq(v)}\n" for k, v in (env or {}).items())
        (workdir / "guest.sh").write_text(head + script)
        wire = [sys.executable, str(Path(__file__).resolve()), "wire", "--bridge-ns", self.lab.bridge_ns,
                "--addr", f"{self.router_addr}/{self.lab.net.prefixlen if self.lab.net else 24}",
                "--port", str(latch), "--state", str(self.state)]
        full_env = {**os.environ, **guest, "VMDIR": str(MULTIPATH_VMDIR), "NET": "tap", "NVME_SELFTEST": "0",
                    "TARGET_CMD": " ".join(_shq(a) for a in wire), "TGT_PORT": str(latch),
                    "GUEST_SCRIPT": str(workdir / "guest.sh"), "GUEST_TIMEOUT": str(int(timeout))}
        log = workdir / "guest.log"
        log.write_bytes(b"")
        proc = subprocess.Popen(["bash", str(GUEST)], env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        run = GuestRun(proc, log)
        assert proc.stdout is not None
        run._reader = threading.Thread(target=run._read, args=(proc.stdout,), daemon=True)
        run._reader.start()
        self.runs.append(run)
        return run


def build_guest(guest: Mapping[str, str] = MULTIPATH_GUEST, timeout: float = 900) -> None:
    """Build (or find cached) the multipath guest: `run-guest-test.sh build` in MULTIPATH_VMDIR."""
    env = {**os.environ, **guest, "VMDIR": str(MULTIPATH_VMDIR)}
    MULTIPATH_VMDIR.mkdir(parents=True, exist_ok=True)
    with open(MULTIPATH_VMDIR / ".lock", "w") as lock:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)  # two tests (or .ci/run) may build at once
        p = subprocess.run(["bash", str(GUEST), "build"], env=env, capture_output=True, text=True, timeout=timeout,
                           check=False)
    if p.returncode != 0:
        pytest.fail(f"guest build failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}", pytrace=False)


def _shq(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


# ------------------------------------------------------------------ `wire`: runs inside the guest's namespace
def _wire(args: argparse.Namespace) -> int:
    ns = _sh(["ip", "netns", "identify", str(os.getpid())]).stdout.strip()
    peer = f"g{os.getpid() % 100000}"
    _sh(["ip", "link", "add", ROUTER_IFACE, "type", "veth", "peer", "name", peer, "netns", args.bridge_ns])
    _sh(["ip", "-n", args.bridge_ns, "link", "set", peer, "master", "br0"])
    _sh(["ip", "-n", args.bridge_ns, "link", "set", peer, "up"])
    _sh(["ip", "addr", "add", args.addr, "dev", ROUTER_IFACE])
    _sh(["ip", "link", "set", ROUTER_IFACE, "up"])
    _sh(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
    table = (f"table inet {TABLE} {{\n"
             "  set cut { type ipv4_addr; }\n"
             "  chain forward { type filter hook forward priority -10; policy accept;\n"
             "    ip saddr @cut drop; ip daddr @cut drop; }\n"
             "}\n")
    _sh_in = subprocess.run(["nft", "-f", "-"], input=table, text=True, capture_output=True, timeout=30, check=False)
    if _sh_in.returncode != 0:
        print(f"wire: nft: {_sh_in.stderr.strip()}", file=sys.stderr)
        return 1
    Path(args.state).write_text(json.dumps({"ns": ns, "router": args.addr}))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # the readiness latch run-guest-test.sh waits for (it never accepts: the guest never connects)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((GUEST_ROUTER, args.port))
        s.listen(1)
        print(f"wire: {ns}: {ROUTER_IFACE} {args.addr} on {args.bridge_ns}/br0; routing {GUEST_NET}", flush=True)
        while not stop.wait(0.5):
            pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wire", help="(inside the guest's namespace) join it to a Lab bridge as a router")
    w.add_argument("--bridge-ns", required=True)
    w.add_argument("--addr", required=True, help="this router's address on the Lab subnet, with /prefix")
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--state", required=True)
    args = ap.parse_args(argv)
    return _wire(args)


if __name__ == "__main__":
    sys.exit(main())
