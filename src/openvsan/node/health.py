"""The node's health report: `vsan health` and the REST API's /api/v1/health, in the spirit of Storage Spaces'
Get-StorageHealthReport: what is not right, why it matters, and what to do, worst first.

It is built from what the node's own commands report (pool.list, volume.list, volume.status, workers.list),
so it says nothing the other views do not show; it only reads them for the administrator. Severity:
`critical` (data is offline or one step from loss, or the node is not serving what it should), `warning`
(redundancy or room is short, or something failed and came back), `info` (work under way: a rebuild, a
resync). The status is the worst finding's, or `healthy`.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from openvsan.node.control import RequestError

Control = Callable[[str, dict[str, Any]], Awaitable[Any]]
SEVERITIES = ("critical", "warning", "info")
FULL_PERCENT = 95          # a volume group this full (or more) is critical: thin volumes are about to fail writes
METADATA_WARN = 0.8        # a volume group's metadata area this full is a warning
CERT_WARN_DAYS = 30


def finding(code: str, severity: str, obj: str, what: str, why: str, action: str) -> dict[str, str]:
    """`code` names the rule: with `object`, what stays the same while the condition lasts (the event log
    raises an alert when the pair appears and clears it when it goes, node/events.py)."""
    return {"code": code, "severity": severity, "object": obj, "what": what, "why": why, "action": action}


def pool_findings(pools: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for p in pools:
        name, state = p["name"], p["state"]
        obj = f"pool {name}"
        if state == "failed":
            out.append(finding("pool-failed", "critical", obj, f"pool {name} has failed (RAID {p['level']})",
                               "more members are missing than its redundancy allows: its volume is offline",
                               f"bring the missing members back (`vsan pool status {name}` names them) and restart "
                               "the node; if they are lost, restore the volume from a backup"))
        elif state == "degraded":
            out.append(finding("pool-degraded", "critical" if p["level"] in (0, 1, 5, 10) else "warning", obj,
                               f"pool {name} is degraded (RAID {p['level']}): a member is missing or failed",
                               "it runs without its full redundancy: another member's failure may lose data",
                               f"`vsan pool replace {name} SLOT DEVICE` with a new device, or `vsan pool add-spare "
                               f"{name} DEVICE` so a rebuild starts by itself"))
        elif state == "rebuilding":
            done = p.get("rebuild_progress")
            out.append(finding("pool-rebuilding", "warning", obj, f"pool {name} is rebuilding ({done:.1f} % done)" if done is not None
                               else f"pool {name} is rebuilding",
                               "until the rebuild ends, it runs without its full redundancy",
                               f"nothing to do; follow it with `vsan pool status {name}`"))
        if p.get("resync_progress") is not None:
            out.append(finding("pool-resyncing", "info", obj, f"pool {name} is resyncing ({p['resync_progress']:.1f} % done)",
                               "it stopped uncleanly: the stripes written then are checked and made whole",
                               "nothing to do"))
    return out


def volume_findings(volumes: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    seen: set[str] = set()
    for v in volumes:
        if "stats_error" in v:
            out.append(finding("volume-unreachable", "critical", f"volume {v['name']}", f"volume {v['name']} does not answer",
                               f"its worker did not report: {v['stats_error']}",
                               "look at the node's log; `vsan workers list` shows its worker"))
        g = v.get("volume_group")
        if not g:
            continue
        where = f"pool {v['pool']}" if v.get("pool") else f"device {v.get('device')}"
        if where in seen:
            continue
        seen.add(where)
        used = 100.0 * g["used"] / g["capacity"] if g.get("capacity") else 0.0
        threshold = g.get("soft_threshold")
        if used >= FULL_PERCENT:
            out.append(finding("group-full", "critical", f"volume group {where}", f"volume group {where} is {used:.0f} % full",
                               "when it is full, writes to thin volumes' new clusters fail (out of space)",
                               "free space (delete snapshots or volumes there, `vsan snapshot delete`), or grow "
                               "the pool or device"))
        elif threshold is not None and used >= threshold:
            out.append(finding("group-threshold", "warning", f"volume group {where}",
                               f"volume group {where} is {used:.0f} % full (soft threshold {threshold} %)",
                               f"its thin volumes are over-committed {g.get('overcommit', 0):.2f}x: they can "
                               "promise more than it holds", "free space or grow it before it fills"))
        if g.get("metadata_used", 0) >= METADATA_WARN:
            out.append(finding("group-metadata", "warning", f"volume group {where}",
                               f"volume group {where}'s metadata area is {100 * g['metadata_used']:.0f} % used",
                               "when it is full, no new mapping can be recorded",
                               "delete snapshots there, or move volumes to another group"))
    return out


def replication_findings(name: str, st: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    obj = f"volume {name}"
    mirror = st.get("mirror") or {}
    if mirror.get("fenced"):
        out.append(finding("primary-fenced", "critical", obj, f"volume {name}: this node was its primary and is fenced",
                           "another node took the volume's epoch: this node acknowledges no more writes",
                           "nothing to do if the other node serves it; `vsan volume status` there"))
    for node, since in (st.get("out_of_sync") or {}).items():
        peer = (st.get("peers") or {}).get(node, {})
        regions = peer.get("dirty_regions")
        state = "resyncing" if peer.get("resyncing") else ("not connected" if peer.get("connected") is False
                                                          else "waiting to resync")
        out.append(finding("replica-out-of-sync", "warning", obj, f"volume {name}: replica on {node} is out of sync since epoch {since} "
                           f"({state}{f', {regions} regions to copy' if regions is not None else ''})",
                           "the volume has one copy fewer than it should until the replica is in sync again",
                           f"bring node {node} back; its resync starts by itself (`vsan volume status {name}`)"))
    if st.get("role") == "standby" and not st.get("primary"):
        out.append(finding("no-primary", "critical", obj, f"volume {name} has no primary",
                           "no node holds its lease: initiators' I/O is suspended or failing",
                           "check the cluster (`vsan cluster status`): etcd quorum and the other nodes"))
    return out


def worker_findings(workers: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for w in workers:
        obj = f"worker {w['worker']}"
        if not w.get("serving"):
            out.append(finding("worker-down", "critical", obj, f"worker {w['worker']} is not serving",
                               f"its volumes ({', '.join(w.get('volumes') or ()) or 'none'}) get no I/O",
                               "look at the node's log; the supervisor starts it again"))
        elif w.get("restarts"):
            out.append(finding("worker-restarted", "warning", obj, f"worker {w['worker']} was restarted {w['restarts']} time(s)",
                               f"it ended unexpectedly ({w.get('last_exit') or 'no exit recorded'}); its volumes "
                               "paused meanwhile", "look at the node's log around the restart"))
    return out


def certificate_findings(cert: Path | None, now: datetime.datetime | None = None) -> list[dict[str, str]]:
    if cert is None:
        return []
    from cryptography import x509

    obj = "api certificate"
    try:
        not_after = x509.load_pem_x509_certificate(cert.read_bytes()).not_valid_after_utc
    except (OSError, ValueError) as e:
        return [finding("cert-unreadable", "warning", obj, f"the API certificate {cert} cannot be read", str(e),
                        "put a PEM certificate there and restart the node")]
    now = now or datetime.datetime.now(datetime.UTC)
    days = (not_after - now).total_seconds() / 86400
    if days < 0:
        return [finding("cert-expired", "critical", obj, f"the API certificate expired on {not_after:%Y-%m-%d}",
                        "clients that check it refuse the console and the API", "renew it and restart the node")]
    if days < CERT_WARN_DAYS:
        return [finding("cert-expiring", "warning", obj, f"the API certificate expires in {days:.0f} days ({not_after:%Y-%m-%d})",
                        "then clients that check it refuse the console and the API", "renew it before then")]
    return []


async def report(control: Control, *, cert: Path | None, replicated: list[str]) -> dict[str, Any]:
    """The health report of the node whose commands `control` answers."""
    findings = pool_findings(await control("pool.list", {}))
    findings += volume_findings(await control("volume.list", {}))
    for name in replicated:
        st = await control("volume.status", {"name": name})
        if st.get("replicated"):
            findings += replication_findings(name, st)
    with contextlib.suppress(RequestError):     # a node in one process has no workers
        findings += worker_findings(await control("workers.list", {}))
    findings += certificate_findings(cert)
    findings.sort(key=lambda f: SEVERITIES.index(f["severity"]))
    worst = findings[0]["severity"] if findings else None
    status = "healthy" if worst is None or worst == "info" else worst
    return {"status": status, "findings": findings}
