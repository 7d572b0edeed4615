"""`vsan cluster init|join|leave|status` against a real etcd (one member on loopback): what each prints, what
each refuses, with the exit status the CLI promises (2 refused, 1 etcd not answering)."""

from __future__ import annotations

import json
import subprocess
import sys

from openvsan.cluster.etcd_process import EtcdProcess


def vsan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "openvsan.cli.main", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_cluster_commands(etcd_server: EtcdProcess) -> None:
    e = ["--etcd", etcd_server.endpoint]
    r = vsan("cluster", "status", *e)
    assert r.returncode == 2 and "no openvsan cluster" in r.stderr, r.stderr
    r = vsan("cluster", "join", "n1", "--replication", "10.0.0.1:4430", "--id", "c9", *e)
    assert r.returncode == 2 and "no openvsan cluster yet" in r.stderr, r.stderr
    assert vsan("cluster", "init", "--id", "c9", *e).returncode == 0
    assert vsan("cluster", "init", "--id", "c9", *e).returncode == 0          # again: nothing changes
    r = vsan("cluster", "init", "--id", "other", *e)
    assert r.returncode == 2 and "holds openvsan cluster 'c9', not 'other'" in r.stderr, r.stderr
    r = vsan("cluster", "join", "n1", "--replication", "10.0.0.1:4430", "--id", "c9", *e)
    assert r.returncode == 0 and "member 1" in r.stdout, r.stdout + r.stderr
    r = vsan("cluster", "join", "n2", "--replication", "10.0.0.2:4430", "--id", "other", *e)
    assert r.returncode == 2 and "another cluster" in r.stderr, r.stderr
    assert vsan("cluster", "join", "n2", "--replication", "10.0.0.2:4430", "--id", "c9", *e).returncode == 0
    st = json.loads(vsan("cluster", "status", *e, "--json").stdout)
    assert st["id"] == "c9"
    assert [(n["name"], n["number"], n["up"]) for n in st["nodes"]] == [("n1", 1, False), ("n2", 2, False)]
    assert vsan("cluster", "leave", "n2", *e).returncode == 0
    r = vsan("cluster", "leave", "n2", *e)
    assert r.returncode == 2 and "not a member" in r.stderr, r.stderr
    r = vsan("cluster", "status", "--etcd", "127.0.0.1:1")
    assert r.returncode == 1 and "etcd at 127.0.0.1:1" in r.stderr, r.stderr
