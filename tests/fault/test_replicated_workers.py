"""A replicated volume on two nodes that each run `vsan serve` with two worker processes (node/workers.py):
worker 0 is the node's member of the cluster and serves the replicated volume (pinned there); connections
the kernel gives to worker 1 are handed to worker 0 at login or Connect. Writes reach both replicas, `vsan
volume status` and `move-primary` go through the supervisor to worker 0, a switchover and a killed primary
(SIGKILL to its supervisor: its workers stop with it) fail over to the other node with every write there."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from etcd_cluster import EtcdCluster
from replica_nodes import ReplicaCluster

from openvsan.initiator import open_url

pytestmark = []

BS = 512
ROUNDS = 8


def block(tag: str, i: int) -> bytes:
    return f"{tag} {i}".encode().ljust(BS, b".")


def vsan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "openvsan.cli.main", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_replicated_volume_on_nodes_with_two_workers(tmp_path: Path) -> None:
    with EtcdCluster(tmp_path / "etcd", ["e1"]) as etcd:
        cluster = ReplicaCluster(tmp_path, etcd.endpoints, ["a", "b"], size="8MiB", workers=2,
                                 log_level="debug")
        try:
            cluster.start_all()
            p = cluster.wait_primary()
            cluster.wait_in_sync()
            s = "b" if p == "a" else "a"
            for n in ("a", "b"):
                rows = json.loads(vsan("workers", "--data-dir", str(cluster[n].data_dir), "--json").stdout)
                assert [r["volumes"] for r in rows] == [["v1"], []], rows    # worker 0 holds it

            async def write(url: str, tag: str) -> None:
                for i in range(ROUNDS):              # new connections: the kernel spreads them over both workers
                    dev = await open_url(url)
                    try:
                        await dev.write(i, block(tag, i), fua=True)
                    finally:
                        await dev.close()

            async def read(url: str, tag: str) -> None:
                dev = await open_url(url)
                try:
                    got = bytes(await dev.read(0, ROUNDS))
                finally:
                    await dev.close()
                assert got == b"".join(block(tag, i) for i in range(ROUNDS)), tag

            asyncio.run(write(cluster[p].iscsi_url, "iscsi"))
            asyncio.run(write(cluster[p].nvme_url, "nvme"))
            log = cluster[p].log.read_text(errors="replace")
            assert re.search(r"w1 frontend: [^\n]*: (iSCSI target|NVMe subsystem) \S+ is served by worker 0: handed to",
                             log), log[-3000:]
            status = cluster[p].status()
            assert status is not None and status["role"] == "primary" and set(status["in_sync"]) == {"a", "b"}
            # the whole cluster from a member's own commands (the REST API's /api/v1/cluster): via worker 0
            from openvsan.node.control import call

            whole = call(cluster[s].data_dir, "cluster.status")
            assert {(n["name"], n["up"]) for n in whole["nodes"]} == {("a", True), ("b", True)}
            assert [(v["volume"], v["primary"]) for v in whole["volumes"]] == [("v1", p)]

            moved = vsan("volume", "move-primary", "v1", "--data-dir", str(cluster[p].data_dir))
            assert moved.returncode == 0, moved.stderr
            assert cluster.wait_primary(not_=p, timeout=30) == s
            asyncio.run(read(cluster[s].nvme_url, "nvme"))           # every write is on the other node too

            cluster.wait_in_sync()
            cluster[s].kill()                                        # SIGKILL to the supervisor
            assert cluster.wait_primary(not_=s, timeout=60) == p
            asyncio.run(read(cluster[p].iscsi_url, "nvme"))
            started = time.monotonic()
            cluster[s].start()
            cluster.wait_in_sync(timeout=90)
            print(f"{s} back in sync {time.monotonic() - started:.1f} s after its restart")
            for n in ("a", "b"):
                log = cluster[n].log.read_text(errors="replace")
                assert "Traceback" not in log, log[-3000:]
        finally:
            cluster.stop_all()
