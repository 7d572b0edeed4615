"""The fault lab itself (tests/support/netns.py): namespaces reach each other over the bridge, cut() stops
traffic both ways, cut_one_way() one way only, isolate() takes the link down, heal()/rejoin() restore it, and
nothing is left behind: no namespace, no nft element, no table but ours.

Probes are one-shot child processes inside the namespaces: a TCP listener that accepts once and echoes, a UDP
receiver that waits for one datagram; each reports on its exit status.
"""

from __future__ import annotations

import subprocess
import sys
import time

import netns
from netns import Lab

TCP_PORT, UDP_PORT = 7000, 7001
WAIT = 1.0  # seconds a probe waits: traffic that is cut never comes

LISTEN = """
import socket, sys
kind, port, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port))
s.settimeout(wait)
if kind == "tcp":
    s.listen()
print("ready", flush=True)
try:
    if kind == "tcp":
        c, _ = s.accept()
        c.settimeout(wait)
        c.sendall(c.recv(100))
    else:
        data, _ = s.recvfrom(100)
        assert data == b"ping"
except OSError as e:
    print(e)
    sys.exit(1)
"""

SEND = """
import socket, sys
kind, host, port, wait = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
try:
    if kind == "tcp":
        c = socket.create_connection((host, port), timeout=wait)
        c.sendall(b"ping")
        assert c.recv(100) == b"ping"
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(5):
            s.sendto(b"ping", (host, port))
except OSError as e:
    print(e)
    sys.exit(1)
"""


def reaches(lab: Lab, src: str, dst: str, kind: str) -> bool:
    """Does a TCP exchange (connect, echo) or a UDP datagram from src arrive at dst?"""
    port = TCP_PORT if kind == "tcp" else UDP_PORT
    listener = lab.popen(
        dst, [sys.executable, "-c", LISTEN, kind, str(port), str(WAIT)], stdout=subprocess.PIPE, text=True
    )
    assert listener.stdout is not None and listener.stdout.readline() == "ready\n"
    sent = lab.run(src, [sys.executable, "-c", SEND, kind, lab.addr[dst], str(port), str(WAIT)], check=False)
    got = listener.wait(timeout=WAIT + 10) == 0
    return got and sent.returncode == 0


def test_cut_one_way_isolate_heal_and_no_leaks() -> None:
    netns.require_lab_tools()
    # a namespace of a crashed run (its pid is dead) is removed when the next Lab starts
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.NS_PREFIX}{dead.pid}x0-old"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    root_links = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
    t0 = time.monotonic()
    with Lab(["a", "b"]) as lab:
        assert stale not in netns.lab_namespaces()
        names = [lab.ns("a"), lab.ns("b"), lab.bridge_ns]
        assert set(names) <= set(netns.lab_namespaces())
        assert lab.nft_tables("a") == [f"inet {netns.TABLE}"]

        for kind in ("tcp", "udp"):
            assert reaches(lab, "a", "b", kind) and reaches(lab, "b", "a", kind), kind

        lab.cut("a", "b")
        assert not reaches(lab, "a", "b", "tcp")
        assert not reaches(lab, "b", "a", "tcp")
        assert not reaches(lab, "b", "a", "udp")
        lab.heal("a", "b")
        assert reaches(lab, "a", "b", "tcp") and reaches(lab, "b", "a", "tcp")

        lab.cut_one_way("a", "b")  # a's packets to b dropped, b's to a pass
        assert not reaches(lab, "a", "b", "tcp")  # the SYN is lost
        assert not reaches(lab, "a", "b", "udp")
        assert reaches(lab, "b", "a", "udp")  # the other way still arrives
        lab.heal("a", "b")
        assert reaches(lab, "a", "b", "udp") and reaches(lab, "a", "b", "tcp")

        lab.isolate("a")
        assert not reaches(lab, "a", "b", "tcp") and not reaches(lab, "b", "a", "udp")
        lab.rejoin("a")
        assert reaches(lab, "a", "b", "tcp") and reaches(lab, "b", "a", "udp")

        # healing removed exactly what the cuts added
        assert lab.cut_from("a") == set() and lab.cut_from("b") == set()
        lab.cut("a", "b")
        lab.heal_all()
        assert lab.cut_from("a") == set() and reaches(lab, "b", "a", "tcp")
    assert not set(names) & set(netns.lab_namespaces()), "the Lab left namespaces behind"
    after = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
    assert after.count("\n") == root_links.count("\n"), "the root namespace's links changed"
    assert time.monotonic() - t0 < 30
