"""Who is connected to this node (or to this worker): one entry per connection of its iSCSI, NVMe/TCP and NBD
servers, with the address it comes from and what it logged in as, and to what. `vsan sessions`, the REST
API's /api/v1/sessions and the console's sessions page show them; a node with worker processes asks each
worker (`worker.sessions`) and names the worker on each entry."""

from __future__ import annotations

from typing import Any


def _iscsi(c: Any) -> dict[str, Any]:
    s = getattr(c, "session", None)
    if s is None:
        return {"state": "logging in"}
    return {"state": "discovery" if s.target is None else "logged in", "initiator": s.initiator_name,
            "target": s.target.iqn if s.target is not None else None, "isid": s.isid.hex(), "tsih": s.tsih,
            "commands": len(s.tasks)}


def _nvme(c: Any) -> dict[str, Any]:
    ctrl = getattr(c, "ctrl", None)
    if ctrl is None:
        return {"state": "connecting"}
    return {"state": "connected", "host": ctrl.hostnqn, "subsystem": ctrl.subsystem.nqn, "controller": ctrl.cntlid,
            "queue": getattr(c, "qid", 0)}


def _nbd(c: Any) -> dict[str, Any]:
    export = getattr(c, "export", None)
    if export is None:
        return {"state": "negotiating"}
    return {"state": "transmission", "export": export.name, "read_only": bool(export.read_only),
            "tls": getattr(c, "transport", None) is not None and c.transport.get_extra_info("ssl_object") is not None}


def connections(node: Any) -> list[dict[str, Any]]:
    """Every connection of `node`'s protocol servers, in a stable order."""
    out = []
    for server, kind, what in ((node.server, "iscsi", _iscsi), (node.nvme_server, "nvme", _nvme),
                               (node.nbd_server, "nbd", _nbd)):
        for c in list(getattr(server, "connections", ())):
            if getattr(c, "_closed", False):
                continue
            out.append({"protocol": kind, "peer": getattr(c, "peer", "?"), **what(c)})
    out.sort(key=lambda e: (e["protocol"], e["peer"]))
    return out
