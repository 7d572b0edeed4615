"""/metrics: the node in Prometheus' text format (prometheus-client), gathered at each scrape from the node's
commands: node.metrics (one message per worker: each volume's I/O counters and latency histograms,
volume/meter.py, its size, QoS and stack, each volume group's space once), pool.list and workers.list.

Names follow Prometheus' conventions (base units, `_total` counters, node_exporter's `_bytes`/`_seconds`
suffixes); every volume metric has a `volume` label, pool metrics a `pool` label."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from openvsan.node.control import RequestError

Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]

POOL_STATES = ("optimal", "degraded", "rebuilding", "failed", "resyncing")


class _Made:
    """A collector of metric families made before the scrape (they come from async calls)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def _buckets(report: dict[str, Any]) -> list[tuple[str, int]]:
    return [("+Inf" if bound is None else repr(bound), count) for bound, count in report["buckets"]]


def volume_families(m: dict[str, Any]) -> list[Metric]:
    """From node.metrics: {"volumes": {name: {size, stack, io, qos_stats?, group?}}, "groups": {home: space},
    "identities": {name: {uuid, serial, read_only}}}."""
    V = ["volume"]
    size = GaugeMetricFamily("openvsan_volume_size_bytes", "The volume's size", labels=V)
    info = GaugeMetricFamily("openvsan_volume_info", "The volume's identity and stack (always 1)",
                             labels=["volume", "uuid", "serial", "stack", "read_only"])
    ops = {d: CounterMetricFamily(f"openvsan_volume_{d}_ops", f"{d.capitalize()} commands completed", labels=V)
           for d in ("read", "write")}
    nbytes = {d: CounterMetricFamily(f"openvsan_volume_{d}_bytes", f"Bytes {w} by initiators", labels=V)
              for d, w in (("read", "read"), ("write", "written"))}
    other = CounterMetricFamily("openvsan_volume_other_ops", "Flush, unmap and write-zeroes commands completed",
                                labels=V)
    latency = {d: HistogramMetricFamily(f"openvsan_volume_{d}_latency_seconds",
                                        f"Time the volume's stack took for a {d} command", labels=V)
               for d in ("read", "write", "other")}
    throttled = CounterMetricFamily("openvsan_volume_qos_throttled", "Commands QoS made wait", labels=V)
    waited = CounterMetricFamily("openvsan_volume_qos_wait_seconds", "Seconds commands waited for QoS", labels=V)
    plain = GaugeMetricFamily("openvsan_volume_compressed_plain_bytes",
                              "Bytes the chunks of a compressed volume that hold data have in plain", labels=V)
    stored = GaugeMetricFamily("openvsan_volume_compressed_stored_bytes",
                               "Bytes those chunks take in the thin volume below (4 KiB units)", labels=V)
    idents = m.get("identities", {})
    for name, v in sorted(m.get("volumes", {}).items()):
        ident = idents.get(name, {})
        size.add_metric([name], v["size"])
        info.add_metric([name, ident.get("uuid", ""), ident.get("serial", ""), "/".join(v.get("stack", ())),
                         str(bool(ident.get("read_only"))).lower()], 1)
        io = v["io"]
        for d in ("read", "write"):
            ops[d].add_metric([name], io[d]["ops"])
            nbytes[d].add_metric([name], io[d]["bytes"])
        other.add_metric([name], io["other"]["ops"])
        for d in ("read", "write", "other"):
            latency[d].add_metric([name], _buckets(io[d]), io[d]["seconds"])
        q = v.get("qos_stats")
        if q:
            throttled.add_metric([name], q.get("throttled", 0))
            waited.add_metric([name], q.get("wait_seconds", 0.0))
        z = v.get("compress_stats")
        if z:
            plain.add_metric([name], z["plain_bytes"])
            stored.add_metric([name], z["stored_bytes"])
    return [size, info, *ops.values(), *nbytes.values(), other, *latency.values(), throttled, waited, plain, stored]


def replication_families(m: dict[str, Any]) -> list[Metric]:
    """Replicated volumes (replication/): which replicas are in sync, what a resync has copied, what is left."""
    V = ["volume"]
    primary = GaugeMetricFamily("openvsan_volume_replica_primary", "1 on the volume's primary, 0 on a standby",
                                labels=V)
    epoch = GaugeMetricFamily("openvsan_volume_replica_epoch", "The volume's epoch (the primary's fencing token)",
                              labels=V)
    in_sync = GaugeMetricFamily("openvsan_volume_replica_in_sync", "1 for a replica in sync, 0 for one out of sync",
                                labels=["volume", "node"])
    left = GaugeMetricFamily("openvsan_volume_replica_resync_remaining_bytes",
                             "Bytes a replica still misses (dirty regions x region size), on the primary",
                             labels=["volume", "node"])
    copied = CounterMetricFamily("openvsan_volume_replica_resync_bytes", "Bytes copied by resyncs from this primary",
                                 labels=V)
    failures = CounterMetricFamily("openvsan_volume_replica_peer_failures", "Writes a peer replica failed",
                                   labels=V)
    refused = CounterMetricFamily("openvsan_volume_replica_stale_epoch_refused",
                                  "Commands of an older epoch this replica refused (fencing)", labels=V)
    for name, v in sorted(m.get("volumes", {}).items()):
        r = v.get("replication")
        if not r:
            continue
        primary.add_metric([name], 1 if r["role"] == "primary" else 0)
        epoch.add_metric([name], r["epoch"])
        for node in r["nodes"]:
            in_sync.add_metric([name, node], 1 if node in r["in_sync"] else 0)
        for node, regions in (r.get("dirty_regions") or {}).items():
            left.add_metric([name, node], regions * (r.get("region_size") or 0))
        if r.get("resync_bytes") is not None:
            copied.add_metric([name], r["resync_bytes"])
        if r.get("peer_failures") is not None:
            failures.add_metric([name], r["peer_failures"])
        refused.add_metric([name], r["fenced_refused"])
    return [primary, epoch, in_sync, left, copied, failures, refused]


def group_families(groups: dict[str, Any]) -> list[Metric]:
    """The volume groups carved from devices and pools (volume/thin)."""
    G = ["group"]
    fams = {k: GaugeMetricFamily(f"openvsan_volume_group_{k}_bytes", doc, labels=G) for k, doc in (
        ("capacity", "Space the volume group holds"), ("used", "Space in use (data and metadata)"),
        ("free", "Space free"), ("provisioned", "Space promised to its volumes"))}
    meta = GaugeMetricFamily("openvsan_volume_group_metadata_used_ratio", "Metadata area in use (0-1)", labels=G)
    for where, g in sorted(groups.items()):
        for k, fam in fams.items():
            if k in g:
                fam.add_metric([where], g[k])
        if "metadata_used" in g:
            meta.add_metric([where], g["metadata_used"])
    return [*fams.values(), meta]


def pool_families(pools: list[dict[str, Any]]) -> list[Metric]:
    P = ["pool"]
    state = GaugeMetricFamily("openvsan_pool_state", "1 for the pool's state, 0 for the others",
                              labels=["pool", "state"])
    size = GaugeMetricFamily("openvsan_pool_size_bytes", "The pool's usable size", labels=P)
    members = GaugeMetricFamily("openvsan_pool_members", "Member slots", labels=P)
    spares = GaugeMetricFamily("openvsan_pool_spares", "Spare devices", labels=P)
    rebuild = GaugeMetricFamily("openvsan_pool_rebuild_progress_ratio", "Rebuild done (0-1); absent when none runs",
                                labels=P)
    resync = GaugeMetricFamily("openvsan_pool_resync_progress_ratio", "Resync done (0-1); absent when none runs",
                               labels=P)
    for p in pools:
        name = p["name"]
        states = dict.fromkeys((*POOL_STATES, p["state"]), 0)
        states[p["state"]] = 1
        for s, on in states.items():
            state.add_metric([name, s], on)
        size.add_metric([name], p["size"])
        members.add_metric([name], p["members"])
        spares.add_metric([name], p["spares"])
        if p.get("rebuild_progress") is not None:
            rebuild.add_metric([name], p["rebuild_progress"] / 100)
        if p.get("resync_progress") is not None:
            resync.add_metric([name], p["resync_progress"] / 100)
    return [state, size, members, spares, rebuild, resync]


def worker_families(workers: list[dict[str, Any]]) -> list[Metric]:
    W = ["worker"]
    up = GaugeMetricFamily("openvsan_worker_up", "1 while the worker process serves", labels=W)
    restarts = CounterMetricFamily("openvsan_worker_restarts", "Times the worker was started again", labels=W)
    volumes = GaugeMetricFamily("openvsan_worker_volumes", "Volumes the worker serves", labels=W)
    for w in workers:
        i = str(w["worker"])
        up.add_metric([i], 1 if w.get("serving") else 0)
        restarts.add_metric([i], w.get("restarts", 0))
        volumes.add_metric([i], len(w.get("volumes", ())))
    return [up, restarts, volumes]


async def node_metrics(handler: Handler) -> bytes:
    m = await handler("node.metrics", {})
    families = volume_families(m) + replication_families(m) + group_families(m.get("groups", {}))
    families += pool_families(await handler("pool.list", {}))
    with contextlib.suppress(RequestError):    # a node in one process has no workers to list
        families += worker_families(await handler("workers.list", {}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Made(families))
    return generate_latest(registry)
