"""The nemesis actions (tests/support/nemesis.py) on real processes and real namespaces: Kill9 and Pause on a
process inside a Lab namespace (its children too), Cut / CutOneWay / Isolate / Partition between namespaces
checked with TCP connects that time out under the fault and work after heal(), EtcdMemberLoss on a 3-member
etcd cluster, and a seeded Schedule that replays the same faults and leaves everything healed each cycle."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from etcd_cluster import EtcdCluster
from nemesis import (
    Compose,
    Cut,
    CutOneWay,
    EtcdMemberLoss,
    Isolate,
    Kill9,
    NemesisError,
    Partition,
    Pause,
    Schedule,
    choose,
)
from netns import Lab, require_lab_tools

from openvsan.cluster.etcd_process import ETCD_PACKAGE, EtcdMissing

PORT = 7100
WAIT = 0.5  # a connect under a cut never completes: this long is enough to call it cut

LISTEN = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(64)
print("ready", flush=True)
while True:
    s.accept()[0].close()
"""

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError as e:
    print(e)
    sys.exit(1)
"""


def state(pid: int) -> str:
    """The process state letter from /proc (R, S, T stopped, Z zombie), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "gone"


def wait_state(pid: int, want: set[str], timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while (s := state(pid)) not in want and time.monotonic() < deadline:
        time.sleep(0.01)
    return s


def listen(lab: Lab, name: str) -> subprocess.Popen[Any]:
    p = lab.popen(name, [sys.executable, "-c", LISTEN, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def connects(lab: Lab, src: str, dst: str) -> bool:
    return (
        lab.run(src, [sys.executable, "-c", CONNECT, lab.addr[dst], str(PORT), str(WAIT)], check=False).returncode == 0
    )


def reaches(lab: Lab, src: str, dst: str, *, settle: float = 5.0) -> bool:
    """A TCP connect src -> dst works (retried for a moment: a link just set up needs its ARP again)."""
    deadline = time.monotonic() + settle
    while not connects(lab, src, dst):
        if time.monotonic() > deadline:
            return False
    return True


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    require_lab_tools()
    with Lab(["n1", "n2", "n3"]) as lab:
        for n in lab.names:
            listen(lab, n)
        yield lab


@pytest.fixture
def healed(lab: Lab) -> Iterator[Lab]:
    yield lab
    lab.heal_all()


class Node:
    """A `sleep` standing in for a node process: proc() is its current Popen, restart() a new one."""

    def __init__(self, lab: Lab, name: str) -> None:
        self.lab, self.name = lab, name
        self.current: subprocess.Popen[Any] | None = None
        self.starts = 0
        self.restart()

    def proc(self) -> subprocess.Popen[Any] | None:
        return self.current

    def restart(self) -> None:
        self.current = self.lab.popen(self.name, ["sleep", "300"])
        self.starts += 1


def test_kill9_kills_the_process_group_and_restart_replaces_it(healed: Lab) -> None:
    lab = healed
    parent = lab.popen("n1", ["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    Kill9(lambda: parent).apply()
    assert parent.returncode == -9
    assert wait_state(child, {"gone", "Z"}) in {"gone", "Z"}  # the sleep in its group died with it

    node = Node(lab, "n1")
    first = node.proc()
    assert first is not None
    kill = Kill9(node.proc, name="n1", restart=node.restart)
    kill.apply()
    assert first.returncode == -9 and kill.killed == first.pid
    kill.heal()
    second = node.proc()
    assert second is not None and second.pid != first.pid and second.poll() is None and node.starts == 2
    deadline = time.monotonic() + 5  # `ip netns exec` enters the namespace, then execs the program
    while Path(f"/proc/{second.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
        time.sleep(0.01)
    ns = subprocess.run(["ip", "netns", "identify", str(second.pid)], capture_output=True, text=True, check=True)
    assert ns.stdout.strip() == lab.ns("n1")  # restarted inside its namespace
    kill.apply()  # a handle whose process is gone already: nothing to do, no error
    kill.restart = None
    kill.apply()
    assert kill.killed is None


def test_pause_stops_for_its_seconds_then_continues(healed: Lab) -> None:
    node = Node(healed, "n2")
    p = node.proc()
    assert p is not None
    seen: list[str] = []

    def sleep(seconds: float) -> None:
        seen.append(wait_state(p.pid, {"T"}))
        time.sleep(seconds)

    pause = Pause(node.proc, 0.3, name="n2")
    assert pause.hold == 0.3 and str(pause) == "pause(n2, 0.30s)"
    t0 = time.monotonic()
    pause.run(sleep=sleep)
    assert seen == ["T"] and time.monotonic() - t0 >= 0.3
    assert wait_state(p.pid, {"S", "R"}) in {"S", "R"} and p.poll() is None
    Kill9(node.proc).apply()
    pause.apply()  # a dead process: nothing stopped, and heal has nothing to continue
    assert pause.stopped is None
    pause.heal()


def test_cut_and_heal_between_namespaces(healed: Lab) -> None:
    lab = healed
    assert reaches(lab, "n1", "n2") and reaches(lab, "n2", "n1")
    cut = Cut(lab, "n1", "n2")
    cut.apply()
    t0 = time.monotonic()
    assert not connects(lab, "n1", "n2")
    assert time.monotonic() - t0 >= WAIT  # timed out (dropped), not refused
    assert not connects(lab, "n2", "n1")
    assert reaches(lab, "n1", "n3") and reaches(lab, "n3", "n2")  # only that pair is cut
    cut.heal()
    assert reaches(lab, "n1", "n2") and reaches(lab, "n2", "n1")

    one = CutOneWay(lab, "n1", "n2")
    one.apply()
    assert lab.cut_from("n2") == {lab.addr["n1"]} and lab.cut_from("n1") == set()
    assert not connects(lab, "n1", "n2")
    one.heal()
    assert lab.cut_from("n2") == set() and reaches(lab, "n1", "n2")


def test_isolate_and_partition(healed: Lab) -> None:
    lab = healed
    iso = Isolate(lab, "n3")
    iso.apply()
    assert not connects(lab, "n3", "n1") and not connects(lab, "n1", "n3")
    iso.heal()
    assert reaches(lab, "n3", "n1") and reaches(lab, "n1", "n3")

    part = Partition(lab, ["n1"])
    assert str(part) == "partition(n1 | n2+n3)"
    both = Compose(Pause(lambda: None, 0.2), part)  # healed in reverse: part first
    assert both.hold == 0.2
    both.apply()
    assert not connects(lab, "n1", "n2") and not connects(lab, "n3", "n1")
    assert reaches(lab, "n2", "n3")  # the majority side still talks
    both.heal()
    assert all(lab.cut_from(n) == set() for n in lab.names)
    assert reaches(lab, "n1", "n2") and reaches(lab, "n3", "n1")


def test_etcd_member_loss_and_return(tmp_path: Path) -> None:
    require_lab_tools()
    members = ["e1", "e2", "e3"]
    with Lab(members) as lab:
        try:
            cluster = EtcdCluster(tmp_path / "etcd", members, lab=lab)
        except EtcdMissing:
            pytest.fail(f"missing etcd: apt-get install {ETCD_PACKAGE} (or run `sudo bash .ci/run`)", pytrace=False)
        with cluster:
            running = {n: m.proc for n, m in cluster.members.items()}
            cluster.start()   # a second start launches nothing: the live processes stay the ones killed below
            assert {n: m.proc for n, m in cluster.members.items()} == running
            loss = EtcdMemberLoss(cluster, "e2")
            before = cluster.members["e2"].proc
            assert before is not None
            loss.apply()
            assert before.returncode == -9
            cluster.wait_healthy(["e1", "e3"])  # the other two keep a quorum
            with pytest.raises(RuntimeError, match="not healthy"):
                cluster.wait_healthy(["e2"], timeout=0.5)
            loss.heal()
            after = cluster.members["e2"].proc
            assert after is not None and after.pid != before.pid and after.poll() is None
            cluster.wait_healthy()
            graceful = EtcdMemberLoss(cluster, "e1", graceful=True)
            graceful.apply()
            stopped = cluster.members["e1"].proc
            assert stopped is not None and stopped.returncode == -15  # etcd dies of the SIGTERM it handled
            graceful.heal()
            cluster.wait_healthy()


def test_schedule_with_a_seed_replays_and_heals_every_cycle(healed: Lab, tmp_path: Path) -> None:
    lab = healed
    node = Node(lab, "n1")
    pairs = [("n1", "n2"), ("n1", "n3"), ("n2", "n3")]

    def factory() -> Any:
        return choose(
            lambda rng: Kill9(node.proc, name="n1", restart=node.restart),
            lambda rng: Pause(node.proc, round(rng.uniform(0.05, 0.2), 3), name="n1"),
            lambda rng: Cut(lab, *rng.choice(pairs)),
            lambda rng: CutOneWay(lab, *rng.sample(lab.names, 2)),
            lambda rng: Isolate(lab, rng.choice(lab.names)),
            lambda rng: [Partition(lab, [n]) for n in lab.names],  # a list: the schedule picks one
        )

    checked: list[int] = []

    def after(cycle: int) -> None:
        p = node.proc()
        assert p is not None and p.poll() is None and state(p.pid) != "T", f"cycle {cycle}: node not running"
        assert all(lab.cut_from(n) == set() for n in lab.names), f"cycle {cycle}: a cut left behind"
        assert reaches(lab, "n1", "n2") and reaches(lab, "n2", "n3"), f"cycle {cycle}: not healed"
        checked.append(cycle)

    log_path = tmp_path / "nemesis.log"
    sched = Schedule(1234, factory(), cycles=10, hold=(0.05, 0.15), log_path=log_path)
    plan = sched.plan()
    assert plan == Schedule(1234, factory(), cycles=10, hold=(0.05, 0.15)).plan()  # reproducible
    assert plan != Schedule(4321, factory(), cycles=10, hold=(0.05, 0.15)).plan()
    assert len({line.split(" hold=")[0].split("(")[0] for line in plan}) >= 3  # several kinds of fault
    sched.run(after=after)
    assert checked == list(range(1, 11))
    applied = [line.split(": ", 1)[1] for line in sched.lines if not line.endswith(" healed")]
    assert applied == plan  # what ran is what the seed planned
    assert sched.lines[0].startswith("nemesis seed=1234 cycle=1/10: ")
    assert len(log_path.read_text().splitlines()) == 20


def test_schedule_failure_names_seed_and_cycle() -> None:
    class Broken:
        hold = None
        healed = False

        def __str__(self) -> str:
            return "broken"

        def apply(self) -> None:
            raise OSError("no such device")

        def heal(self) -> None:
            Broken.healed = True

    ok = Pause(lambda: None, 0.0)
    sched = Schedule(7, lambda rng: [ok, ok, Broken()] if rng.random() < 2 else [], cycles=50, hold=(0, 0))
    with pytest.raises(NemesisError, match=r"seed 7, cycle \d+ of 50 \(broken\): apply failed: OSError") as ei:
        sched.run(sleep=lambda s: None)
    assert Broken.healed and f"cycle {sched.cycle} of 50" in str(ei.value)
