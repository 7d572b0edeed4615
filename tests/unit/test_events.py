"""The event log (node/events.py): alerts raised and cleared as health findings come and go, changes recorded
from the command handler (not reads, not dry runs), kept across a restart of the node."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from openvsan.node.events import EVENTS_FILE, EventLog


def f(code: str, obj: str, what: str, severity: str = "warning") -> dict[str, str]:
    return {"code": code, "object": obj, "what": what, "severity": severity, "why": "", "action": "do it"}


def test_findings_raise_once_and_clear_when_they_go(tmp_path: Path) -> None:
    log = EventLog(tmp_path)
    log.findings([f("pool-degraded", "pool p0", "pool p0 is degraded", "critical")])
    log.findings([f("pool-degraded", "pool p0", "pool p0 is degraded", "critical"),
                  f("pool-rebuilding", "pool p0", "pool p0 is rebuilding (10 %)")])
    log.findings([f("pool-rebuilding", "pool p0", "pool p0 is rebuilding (60 %)")])   # the same alert, further on
    log.findings([])
    assert [(e["kind"], e.get("code"), e["severity"]) for e in log.since()] == [
        ("alert", "pool-degraded", "critical"), ("alert", "pool-rebuilding", "warning"),
        ("cleared", "pool-degraded", "info"), ("cleared", "pool-rebuilding", "info")]
    assert [e["id"] for e in log.since(2)] == [3, 4] and [e["id"] for e in log.since(0, 1)] == [4]


def test_changes_are_recorded_whoever_asks_but_not_reads_or_dry_runs(tmp_path: Path) -> None:
    log = EventLog(tmp_path)

    async def node(cmd: str, args: dict[str, Any]) -> Any:
        if not cmd.startswith("volume."):
            return {"state": "rebuilding"}
        return {"changes": [] if args.get("size") == "same" else [f"+ volume {args.get('name')}"]}

    handler = log.wrap(node)

    async def run() -> None:
        await handler("volume.create", {"name": "v1", "size": "1GiB"})
        await handler("volume.create", {"name": "v2", "size": "1GiB", "dry_run": True})
        await handler("volume.list", {})
        await handler("volume.resize", {"name": "v1", "size": "same"})       # nothing changed
        await handler("pool.fail", {"name": "p0", "member": 1})             # no list of changes: described

    asyncio.run(run())
    assert [(e["object"], e["message"]) for e in log.since()] == [
        ("volume v1", "+ volume v1"), ("pool p0", "pool.fail name=p0 member=1")]


def test_the_history_and_the_raised_alerts_outlive_a_restart(tmp_path: Path) -> None:
    first = EventLog(tmp_path)
    first.findings([f("group-full", "volume group device d0", "volume group device d0 is 97 % full", "critical")])
    second = EventLog(tmp_path)
    assert [e["id"] for e in second.since()] == [1] and second.next_id == 2
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert json.loads(lines[0])["code"] == "group-full"

    async def health(cmd: str, args: dict[str, Any]) -> Any:
        assert cmd == "node.health"
        return {"findings": [f("group-full", "volume group device d0", "volume group device d0 is 98 % full")]}

    async def watch_once() -> None:
        second.watch(health, interval=0.01)
        await asyncio.sleep(0.05)
        await second.stop()

    asyncio.run(watch_once())
    assert [e["id"] for e in second.since()] == [1]      # still raised: not raised again
