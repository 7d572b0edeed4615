"""The node's events: alerts and changes, newest last, for `vsan events`, /api/v1/events and the console.

- **Alerts** are the health report's findings (node/health.py) as they come and go: every WATCH_INTERVAL
  seconds the node's report is taken again, and a finding whose (code, object) was not there is raised
  ("pool p0 is degraded", "replica on n2 is out of sync", "volume group ... is 85 % full", "the API
  certificate expires in 20 days"), one that went is cleared. So an alert says no more than the health
  report, and the report is the one place the rules live.
- **Changes** are the commands that changed the node (a volume created, an export removed, a pool member
  failed), from the control socket, the REST API and the console alike: the node's command handler is
  wrapped here, once, for all of them.

Each event has an id (increasing), a time, a kind ("alert", "cleared", "change"), a severity, the object
and a message. They are kept in memory (the last MAX_KEPT) and appended to `<data_dir>/events.jsonl`
(replaced by `events.jsonl.1` past MAX_FILE bytes), so a restart keeps the history.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from openvsan.node.control import READ_COMMANDS

log = logging.getLogger("openvsan.node.events")

Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]
EVENTS_FILE = "events.jsonl"
MAX_KEPT = 1000
MAX_FILE = 1 << 20
WATCH_INTERVAL = 5.0


class EventLog:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / EVENTS_FILE
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_KEPT)
        self._load()
        self.next_id = self.events[-1]["id"] + 1 if self.events else 1
        self.active: dict[tuple[str, str], dict[str, str]] = {}    # alerts raised and not cleared
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()

    def _load(self) -> None:
        for path in (self.path.with_name(EVENTS_FILE + ".1"), self.path):
            try:
                lines = path.read_text().splitlines()
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("events: cannot read %s: %s", path, e)
                continue
            for line in lines:
                with contextlib.suppress(ValueError):
                    self.events.append(json.loads(line))

    def record(self, kind: str, severity: str, obj: str, message: str, **more: Any) -> dict[str, Any]:
        ev = {"id": self.next_id, "time": time.time(), "kind": kind, "severity": severity, "object": obj,
              "message": message, **more}
        self.next_id += 1
        self.events.append(ev)
        try:
            if self.path.exists() and self.path.stat().st_size > MAX_FILE:
                os.replace(self.path, self.path.with_name(EVENTS_FILE + ".1"))
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, (json.dumps(ev) + "\n").encode())
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("events: cannot write %s: %s", self.path, e)
        log.log(logging.WARNING if kind == "alert" and severity != "info" else logging.INFO, "event %s: %s: %s",
                kind, obj, message)
        self.changed.set()
        self.changed = asyncio.Event()
        return ev

    def since(self, after: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """Events with an id above `after`, oldest first, at most the last `limit` of them."""
        out = [e for e in self.events if e["id"] > after]
        return out[-limit:] if limit > 0 else out

    # ---- alerts from the health report

    def findings(self, findings: list[dict[str, str]]) -> None:
        """The health report now: raise what is new, clear what went."""
        now = {(f["code"], f["object"]): f for f in findings if "code" in f}
        for key, f in now.items():
            if key not in self.active:
                self.record("alert", f["severity"], f["object"], f["what"], code=f["code"], action=f["action"])
        for key, f in list(self.active.items()):
            if key not in now:
                self.record("cleared", "info", f["object"], f"cleared: {f['what']}", code=f["code"])
        self.active = now

    def watch(self, handler: Handler, interval: float = WATCH_INTERVAL) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(handler, interval))

    async def _watch(self, handler: Handler, interval: float) -> None:
        # an alert left raised by the run before this one is not raised again: start from what it left
        for e in self.events:
            key = (str(e.get("code")), str(e["object"]))
            if e["kind"] == "alert":
                self.active[key] = {"code": key[0], "object": key[1], "what": e["message"],
                                    "severity": e["severity"], "action": e.get("action", "")}
            elif e["kind"] == "cleared":
                self.active.pop(key, None)
        while True:
            try:
                report = await handler("node.health", {})
                self.findings(report["findings"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the node is starting or stopping: look again later
                log.debug("events: health report failed: %s", e)
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ---- changes, whoever asked

    def wrap(self, handler: Handler) -> Handler:
        """`handler` that records each command that changed something (not a dry run, not a read)."""

        async def recorded(cmd: str, args: dict[str, Any]) -> Any:
            out = await handler(cmd, args)
            if cmd not in READ_COMMANDS and not args.get("dry_run") and not cmd.startswith("worker."):
                changes = out.get("changes") if isinstance(out, dict) else None
                if changes != []:
                    what = "; ".join(changes) if changes else _describe(cmd, args)
                    self.record("change", "info", _object(cmd, args), what, command=cmd)
            return out

        return recorded


def _object(cmd: str, args: dict[str, Any]) -> str:
    kind = cmd.split(".")[0]
    name = args.get("name") or args.get("volume") or args.get("pool") or ""
    return f"{kind} {name}".strip()


def _describe(cmd: str, args: dict[str, Any]) -> str:
    shown = {k: v for k, v in args.items() if k not in ("document", "limits") and v not in (None, False, "")}
    return f"{cmd} " + " ".join(f"{k}={v}" for k, v in shown.items())
