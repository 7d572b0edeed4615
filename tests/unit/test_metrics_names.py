"""/metrics' families (api/metrics.py) from a node's reports, and the Grafana dashboard in docs/: every metric
the dashboard queries is one the node exports (so the dashboard cannot silently rot)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from openvsan.api.metrics import (
    group_families,
    pool_families,
    replication_families,
    volume_families,
    worker_families,
)
from openvsan.volume.meter import IoMeter

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-openvsan.json"


class Made:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self) -> list:
        return self.families


def exposition() -> str:
    meter = IoMeter()
    meter.read.add(4096, 3000)
    meter.write.add(8192, 70_000)
    m = {"volumes": {"v1": {"size": 1 << 30, "stack": ["QosLayer", "RamDevice"], "io": meter.report(),
                            "qos_stats": {"throttled": 2, "wait_seconds": 0.5}, "group": "device d0",
                            "replication": {"role": "primary", "epoch": 7, "nodes": ["a", "b"], "in_sync": ["a"],
                                            "fenced_refused": 0, "writes": 10, "peer_failures": 1,
                                            "resync_bytes": 1 << 20, "dirty_regions": {"b": 3},
                                            "region_size": 1 << 20}}},
         "groups": {"device d0": {"capacity": 100, "used": 50, "free": 50, "provisioned": 200, "metadata_used": 0.1}},
         "identities": {"v1": {"uuid": "u", "serial": "s", "read_only": False}}}
    families = volume_families(m) + replication_families(m) + group_families(m["groups"])
    families += pool_families([{"name": "p0", "state": "rebuilding", "size": 10, "members": 2, "spares": 0,
                                "rebuild_progress": 50.0, "resync_progress": None}])
    families += worker_families([{"worker": 0, "serving": True, "restarts": 1, "volumes": ["v1"]}])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Made(families))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_the_exposition_has_what_it_counted() -> None:
    text = exposition()
    assert 'openvsan_volume_read_ops_total{volume="v1"} 1.0' in text
    assert 'openvsan_volume_write_bytes_total{volume="v1"} 8192.0' in text
    assert 'openvsan_volume_write_latency_seconds_bucket{le="6.5536e-05",volume="v1"} 0.0' in text
    assert 'openvsan_volume_write_latency_seconds_bucket{le="0.000262144",volume="v1"} 1.0' in text
    assert 'openvsan_pool_state{pool="p0",state="rebuilding"} 1.0' in text
    assert 'openvsan_pool_rebuild_progress_ratio{pool="p0"} 0.5' in text
    assert 'openvsan_volume_replica_in_sync{node="b",volume="v1"} 0.0' in text
    assert 'openvsan_volume_replica_resync_remaining_bytes{node="b",volume="v1"} 3.145728e+06' in text
    assert 'openvsan_volume_replica_epoch{volume="v1"} 7.0' in text


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    exported = {line.split("{")[0].split(" ")[0] for line in exposition().splitlines() if line and line[0] != "#"}
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {m for q in queries for m in re.findall(r"openvsan_[a-z0-9_]+", q)}
    assert len(used) >= 10
    assert used <= exported, sorted(used - exported)
