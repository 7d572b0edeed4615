"""Jepsen-style: a replicated volume on two real `vsan serve` nodes (n1, n2) with a three-member etcd (one
member on each node's host and one on a witness, w), each in its own network namespace; a client in its
own namespace (c) writes through both nodes' NVMe/TCP paths (our multipath initiator) and records every
write (tests/support/history.py) while a nemesis (tests/support/nemesis.py) runs randomized cycles: SIGKILL
of the primary (and its restart), SIGSTOP of the primary for longer than its lease, link cuts between the
nodes (both ways and one way), a node isolated, an etcd member lost.

Afterwards, with every fault healed and the replicas in sync: every acknowledged write reads back (or a newer
one), the two replica files are identical, no two nodes claimed one epoch, and writes were acknowledged in
more than one epoch (the nemesis did move the primary). CI runs NEMESIS_CYCLES (default 20); `-m soak`
runs 1,000 (test_nemesis_soak)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from etcd_cluster import EtcdCluster
from history import check, check_epochs, check_identical, load
from nemesis import Cut, CutOneWay, EtcdMemberLoss, Isolate, Kill9, Pause, Schedule
from netns import Lab, require_lab_tools
from replica_nodes import ReplicaCluster

NODES = ("n1", "n2")
LEASE_TTL = 3
BS = 512
CLIENT = Path(__file__).parents[1] / "support" / "history_client.py"


def run_nemesis(tmp_path: Path, cycles: int, seed: int) -> None:
    require_lab_tools()
    with Lab([*NODES, "w", "c"]) as lab, EtcdCluster(tmp_path / "etcd", [*NODES, "w"], lab=lab) as etcd:
        cluster = ReplicaCluster(tmp_path, etcd.endpoints, NODES, size="8MiB", lab=lab, lease_ttl=LEASE_TTL,
                                 suspend=4.0)
        client: subprocess.Popen[str] | None = None
        sched: Schedule | None = None
        try:
            cluster.start_all()
            cluster.wait_primary()
            hist_path = tmp_path / "history.jsonl"
            urls = [cluster[n].nvme_url for n in NODES]
            client = lab.popen("c", [sys.executable, str(CLIENT), "--log", str(hist_path), "--count", "8192",
                                     "--no-path-retry", "120", *urls],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert client.stdout is not None
            line = client.stdout.readline()
            assert "@@WRITING" in line, line + client.stdout.read()

            def primary() -> str:
                return cluster.wait_primary(timeout=60)

            def proc_of(name: str):
                return lambda: cluster[name].proc

            def restart(name: str):
                def go() -> None:
                    if not cluster[name].running():
                        cluster[name].start()
                return go

            def actions(rng: random.Random) -> list:
                p = primary()
                s = "n2" if p == "n1" else "n1"
                return [
                    Kill9(proc_of(p), name=p, restart=restart(p)),
                    Kill9(proc_of(s), name=s, restart=restart(s)),
                    Pause(proc_of(p), LEASE_TTL + rng.uniform(1.0, 3.0), name=p),
                    Cut(lab, "n1", "n2"),
                    CutOneWay(lab, p, s),
                    CutOneWay(lab, s, p),
                    Isolate(lab, p),
                    EtcdMemberLoss(etcd, rng.choice([*NODES, "w"])),
                ]

            def progress(cycle: int) -> None:
                # every fault healed: a primary again, and writes acknowledged again before the next cycle
                primary()
                seen = hist_path.stat().st_size
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    with hist_path.open("rb") as f:     # what was logged since (a soak's log grows to gigabytes)
                        f.seek(seen)
                        if b'"ev":"ack"' in f.read():
                            return
                    time.sleep(0.2)
                raise AssertionError(f"cycle {cycle}: no write acknowledged within 60 s after healing")

            sched = Schedule(seed, actions, cycles, hold=(1.0, 4.0), log_path=tmp_path / "nemesis.log")
            sched.run(after=progress, settle=1.0)
            client.send_signal(signal.SIGTERM)
            out, _ = client.communicate(timeout=180)
            assert client.returncode == 0, out
            cluster.wait_in_sync(timeout=120)
        except BaseException:
            for n in NODES:
                print(f"--- {n} log\n{cluster[n].log_tail(3000)}")
            if sched is not None:
                print("\n".join(sched.lines[-10:]))
            raise
        finally:
            if client is not None and client.poll() is None:
                client.kill()
            cluster.stop_all()
            cluster.close()
        history = load(hist_path, compact=True)   # a soak writes millions of ops: keep what judging needs
        image = cluster["n1"].image.read_bytes()
        report = check(history, lambda lba: image[lba * BS:(lba + 1) * BS])
        assert report.ok, f"{sched.where() if sched else ''}: {report}"
        assert report.acked > 100, f"too few writes acknowledged for the test to mean anything: {report}"
        same = check_identical({n: cluster[n].image for n in NODES})
        assert same.ok, str(same)
        claims, acks = [], []
        for n in NODES:
            text = cluster[n].log.read_text(errors="replace")
            claims += [(n, int(e), 0.0) for e in re.findall(r"this node is primary \(epoch (\d+)", text)]
            acks += [(n, int(e), 0.0) for e in re.findall(r"acknowledged its first write in epoch (\d+)", text)]
        epochs = check_epochs(claims)
        assert epochs.ok, str(epochs)
        assert len({e for _, e, _ in acks}) >= 2, f"writes were acknowledged in one epoch only: {acks}"
        print(f"nemesis seed {seed}: {cycles} cycles; {report.acked} writes acknowledged, {report.failed} failed "
              f"(indeterminate), {len(claims)} elections, acknowledged in {len({e for _, e, _ in acks})} epochs; "
              "0 lost, replicas identical")


CYCLES = int(os.environ.get("NEMESIS_CYCLES", "20"))
SOAK_CYCLES = 1000
PER_CYCLE = 20          # seconds a cycle may take at most here (they take about 10): the run's time limit


@pytest.mark.timeout(180 + PER_CYCLE * CYCLES)
def test_nemesis(tmp_path: Path) -> None:
    seed = int(os.environ.get("NEMESIS_SEED", str(random.randrange(1 << 30))))
    run_nemesis(tmp_path, CYCLES, seed)


@pytest.mark.soak
@pytest.mark.timeout(180 + PER_CYCLE * SOAK_CYCLES)
def test_nemesis_soak(tmp_path: Path) -> None:
    run_nemesis(tmp_path, SOAK_CYCLES, int(os.environ.get("NEMESIS_SEED", str(random.randrange(1 << 30)))))
