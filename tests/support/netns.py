"""A network lab for fault tests: N network namespaces on one bridge, and link cuts between any two of them.

    with Lab(["n1", "n2", "n3"]) as lab:
        proc = lab.popen("n1", ["vsan", "serve", ...])      # runs inside n1's namespace
        lab.cut("n1", "n2")                                  # n1 <-> n2 packets dropped, both ways
        lab.cut_one_way("n1", "n3")                          # n1's packets to n3 dropped; n3's to n1 pass
        lab.heal("n1", "n2"); lab.heal("n1", "n3")
        lab.isolate("n3"); lab.rejoin("n3")                  # n3's link down, then up again

Layout: one namespace per node, each with `lo` up and one veth (`eth0`, 10.77.0.<i+1>/24 by default), whose
peer is a port of a bridge that lives in a namespace of its own; the root namespace gets no interface, no
address and no route, so the host's network is never touched. Namespace names carry the pid of the process
that made them (`ovlab<pid>x<seq>-<name>`): parallel runs never collide, and a Lab that finds namespaces of a
dead pid (a crashed run) deletes them, and the processes still inside them, before it builds its own.

Cuts are nftables rules in each node's own table (`inet openvsan_lab`): an input chain drops packets whose
source is in the set `cut_from`. A cut is an element in that set, so heal removes exactly what cut added and
nothing else of the namespace's rules; packets are dropped at the receiver, as a broken network loses them
(the sender sees a timeout, not an error). The kernel here has no netem: delay and loss need a userspace
proxy, not this.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pytest

NS_PREFIX = "ovlab"
NETNS_DIR = Path("/run/netns")
TABLE = "openvsan_lab"
IFACE = "eth0"  # inside each node namespace
BRIDGE = "br0"  # inside the bridge namespace
TOOLS = {"ip": "iproute2", "nft": "nftables"}
SUBNETS = [f"10.{b}.0.0/24" for b in (77, 78, 79)]  # the first one the host does not use

_seq = itertools.count()


def require_lab_tools() -> None:
    """Fail (never skip) when not root or a tool is missing, naming the Debian package."""
    if os.geteuid() != 0:
        pytest.fail("must run as root: network namespaces and nftables (CI runs as root)", pytrace=False)
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pkgs = " ".join(TOOLS[t] for t in missing)
        pytest.fail(f"missing {', '.join(missing)}: apt-get install {pkgs} (or run `sudo bash .ci/run`)", pytrace=False)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def lab_namespaces() -> list[str]:
    """Every namespace a Lab made that still exists (any pid): what a leak check compares with."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NS_PREFIX)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL what still runs in a namespace we made (a child of ours, or of a crashed run of ours)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _delete_ns(ns: str) -> None:
    _kill_inside(ns)
    for _ in range(50):  # a process being killed can hold the namespace busy for a moment
        if _ip("netns", "del", ns, check=False).returncode == 0 or ns not in lab_namespaces():
            return
        time.sleep(0.05)
    _ip("netns", "del", ns)


def remove_stale() -> list[str]:
    """Delete the namespaces of Labs whose process is gone (a crashed or killed run); returns their names."""
    removed = []
    for ns in lab_namespaces():
        m = re.match(rf"{NS_PREFIX}(\d+)x", ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete_ns(ns)
            removed.append(ns)
    return removed


def _host_subnet_free(net: ipaddress.IPv4Network) -> bool:
    """True when the root namespace has no address or route inside `net` (we never add any; this only keeps
    our addresses from looking like the host's own in logs and captures)."""
    text = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    for word in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?", text):
        with contextlib.suppress(ValueError):
            if ipaddress.ip_network(word, strict=False).overlaps(net):
                return False
    return True


class Lab:
    """Namespaces `names` on one bridge; `addr[name]` is each one's IPv4 address (str)."""

    def __init__(self, names: Sequence[str], *, subnet: str | None = None) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"Lab names {list(names)!r}: give distinct names")
        for n in names:
            if not re.fullmatch(r"[a-z0-9]{1,12}", n):
                raise ValueError(f"Lab name {n!r}: 1-12 of a-z, 0-9")
        self.names = list(names)
        self.tag = f"{NS_PREFIX}{os.getpid()}x{next(_seq)}"
        self.bridge_ns = f"{self.tag}-br"
        self._subnet = subnet
        self.net: ipaddress.IPv4Network | None = None
        self.addr: dict[str, str] = {}
        self._procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []

    def ns(self, name: str) -> str:
        """The real namespace name of node `name` (for `ip netns exec` in a shell line)."""
        if name not in self.names:
            raise KeyError(f"no node {name!r} in this Lab: {self.names}")
        return f"{self.tag}-{name}"

    # -- build and tear down --

    def start(self) -> Self:
        require_lab_tools()
        remove_stale()
        candidates = [self._subnet] if self._subnet else SUBNETS
        free = [ipaddress.IPv4Network(c) for c in candidates if _host_subnet_free(ipaddress.IPv4Network(c))]
        if not free:
            raise RuntimeError(f"every lab subnet {candidates} is in use on this host: pass Lab(subnet=...)")
        self.net = free[0]
        hosts = list(self.net.hosts())
        if len(self.names) > len(hosts):
            raise ValueError(f"{len(self.names)} nodes do not fit in {self.net}")
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", BRIDGE, "up")
            for i, name in enumerate(self.names):
                ns = self.ns(name)
                self._add_ns(ns)
                port = f"p{i}"
                # both ends are created straight inside their namespaces: no name ever appears in the root one
                _ip("link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
                _ip("-n", self.bridge_ns, "link", "set", port, "master", BRIDGE)
                _ip("-n", self.bridge_ns, "link", "set", port, "up")
                self.addr[name] = str(hosts[i])
                _ip("-n", ns, "addr", "add", f"{hosts[i]}/{self.net.prefixlen}", "dev", IFACE)
                _ip("-n", ns, "link", "set", IFACE, "up")
                self._nft(name, self._table_text())
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        # IPv4 only: no IPv6 link-local chatter or DAD delay on the veths
        subprocess.run(
            ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"],
            check=False,
            capture_output=True,
            timeout=30,
        )

    def _table_text(self) -> str:
        return (
            f"table inet {TABLE} {{\n"
            "  set cut_from { type ipv4_addr; }\n"
            "  chain input { type filter hook input priority -10; policy accept; ip saddr @cut_from drop; }\n"
            "}\n"
        )

    def close(self) -> None:
        """Stop every process started here, then delete every namespace (which deletes the veths and the
        nft tables with them)."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        problems = []
        for ns in reversed(self._made):
            try:
                _delete_ns(ns)
            except RuntimeError as e:
                problems.append(str(e))
        self._made.clear()
        if problems:
            raise RuntimeError("; ".join(problems))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- processes inside a namespace --

    def argv(self, name: str, argv: Iterable[str | os.PathLike[str]]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(name), *(str(a) for a in argv)]

    def run(
        self, name: str, argv: Iterable[str | os.PathLike[str]], *, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run to completion inside `name`; on a non-zero exit (with check) raise with what it printed."""
        full = self.argv(name, argv)
        proc = subprocess.run(full, check=False, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(full)}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        return proc

    def popen(self, name: str, argv: Iterable[str | os.PathLike[str]], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start inside `name` (`ip netns exec` execs the program: the Popen's pid is the program's own) in a
        session of its own; close() SIGKILLs it if still running."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(name, argv), **kwargs)
        self._procs.append(proc)
        return proc

    # -- faults --

    def _nft(self, name: str, script: str) -> None:
        proc = subprocess.run(
            ["ip", "netns", "exec", self.ns(name), "nft", "-f", "-"],
            check=False,
            input=script,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"nft in {self.ns(name)}: exit {proc.returncode}: {proc.stderr.strip()}\n{script}")

    def _drop_from(self, at: str, src: str, drop: bool) -> None:
        verb = "add" if drop else "delete"
        if not drop and self.addr[src] not in self.cut_from(at):
            return  # deleting an absent element is an error in nft; healing what is whole is not
        self._nft(at, f"{verb} element inet {TABLE} cut_from {{ {self.addr[src]} }}\n")

    def cut_from(self, name: str) -> set[str]:
        """The addresses whose packets `name` drops now."""
        out = self.run(name, ["nft", "list", "set", "inet", TABLE, "cut_from"]).stdout
        _, _, elements = out.partition("elements")
        return set(re.findall(r"\d+\.\d+\.\d+\.\d+", elements))

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between a and b, both ways."""
        self._drop_from(b, a, True)
        self._drop_from(a, b, True)

    def cut_one_way(self, a: str, b: str) -> None:
        """Drop a's packets to b; b's packets to a still arrive (so TCP between them fails both ways, while
        datagrams from b reach a)."""
        self._drop_from(b, a, True)

    def heal(self, a: str, b: str) -> None:
        """Undo cut() and cut_one_way() between a and b, either direction."""
        self._drop_from(b, a, False)
        self._drop_from(a, b, False)

    def heal_all(self) -> None:
        """Every cut healed and every link up: the Lab as start() left it."""
        for name in self.names:
            self._nft(name, f"flush set inet {TABLE} cut_from\n")
            self.rejoin(name)

    def isolate(self, name: str) -> None:
        """`ip link set down` on name's only link: it reaches nobody, and its sends fail at once."""
        _ip("-n", self.ns(name), "link", "set", IFACE, "down")

    def rejoin(self, name: str) -> None:
        _ip("-n", self.ns(name), "link", "set", IFACE, "up")

    def nft_tables(self, name: str) -> list[str]:
        """The nft tables in name's namespace ("family name")."""
        out = self.run(name, ["nft", "list", "tables"]).stdout
        return [line.removeprefix("table ").strip() for line in out.splitlines() if line.startswith("table ")]
