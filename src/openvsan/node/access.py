"""One access policy per volume: a volume that one export protects with authentication is not served open by
another, unless the config says so on that export (`allow_unauthenticated = true`).

What authenticates a peer, per protocol (docs/security.md):
- iSCSI: CHAP (`chap`, optionally `mutual_chap`). `allowed_initiators` is only a name the initiator claims.
- NVMe/TCP: DH-HMAC-CHAP for every host that may connect: each host in `allowed_hosts` has a secret under
  `hosts` (with `hosts` and no `allowed_hosts`, only the hosts listed there may connect). A host NQN alone is
  a claimed name.
- NBD: TLS required on the export with client certificates verified against the CA (`[nbd] tls` with
  `verify_client = true`, the export's `tls = "require"`). TLS without client certificates encrypts but does
  not tell one client from another; the export name a client asks for is no secret.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from openvsan.node.config import ConfigError
from openvsan.node.specs import NbdExportSpec, NodeConfig, SubsystemSpec, TargetSpec


@dataclass(frozen=True)
class Export:
    """One way a volume is reached: what it is, where the config declares it, and how it admits peers."""

    what: str            # 'iSCSI target iqn...', 'NVMe/TCP subsystem nqn...', 'NBD export disk0'
    key: str             # the config key path, for one-line errors
    volume: str
    authenticated: bool
    how: str             # 'CHAP', 'DH-HMAC-CHAP', 'TLS client certificates', or why it is open
    allow_unauthenticated: bool


def iscsi_auth(t: TargetSpec) -> tuple[bool, str]:
    if t.chap is not None:
        return True, "mutual CHAP" if t.mutual_chap else "CHAP"
    return False, "no CHAP" + (" (allowed_initiators is a name the initiator claims)" if t.allowed_initiators
                               else "")


def nvme_auth(s: SubsystemSpec) -> tuple[bool, str]:
    with_secret = {h.nqn for h in s.hosts}
    if s.allowed_hosts is None:
        if with_secret:   # then only the hosts under `hosts` may connect (protocol/nvme/subsystem.py allows)
            return True, "DH-HMAC-CHAP" + (" (bidirectional)" if all(h.dhchap_ctrl_secret for h in s.hosts) else "")
        return False, "any host may connect, no DH-HMAC-CHAP"
    without = [h for h in s.allowed_hosts if h not in with_secret]
    if without:
        return False, f"host {without[0]} may connect without DH-HMAC-CHAP"
    if not with_secret:
        return False, "no host can connect" if not s.allowed_hosts else "no DH-HMAC-CHAP"
    return True, "DH-HMAC-CHAP" + (" (bidirectional)" if all(h.dhchap_ctrl_secret for h in s.hosts) else "")


def nbd_auth(e: NbdExportSpec, cfg: NodeConfig) -> tuple[bool, str]:
    if e.tls != "require":
        return False, "TLS not required" if e.tls == "optional" else "no TLS"
    if cfg.nbd_tls is None or not cfg.nbd_tls.verify_client:
        return False, "TLS without client certificates ([nbd] tls verify_client = false)"
    return True, "TLS client certificates"


def exports(cfg: NodeConfig) -> list[Export]:
    out: list[Export] = []
    for i, t in enumerate(cfg.targets):
        ok, how = iscsi_auth(t)
        out += [Export(f"iSCSI target {t.iqn}", f"iscsi.targets[{i}]", lun.volume, ok, how, t.allow_unauthenticated)
                for lun in t.luns]
    for i, s in enumerate(cfg.subsystems):
        ok, how = nvme_auth(s)
        out += [Export(f"NVMe/TCP subsystem {s.nqn}", f"nvme.subsystems[{i}]", ns.volume, ok, how,
                       s.allow_unauthenticated) for ns in s.namespaces]
    for i, e in enumerate(cfg.nbd_exports):
        ok, how = nbd_auth(e, cfg)
        out.append(Export(f"NBD export {e.name}", f"nbd.exports[{i}]", e.volume, ok, how, e.allow_unauthenticated))
    return out


def _mend(x: Export) -> str:
    if x.what.startswith("iSCSI"):
        return 'add chap = { user = "...", secret = "..." }'
    if x.what.startswith("NVMe"):
        return 'list each host under hosts = [{ nqn = "...", dhchap_secret = "DHHC-1:..." }] and in allowed_hosts'
    return 'set tls = "require" with [nbd] tls = { ..., verify_client = true }'


def _open_beside_guarded(cfg: NodeConfig) -> Iterator[tuple[Export, Export]]:
    """(open export, an authenticated export of the same volume), for every volume that has both."""
    by_volume: dict[str, list[Export]] = {}
    for x in exports(cfg):
        by_volume.setdefault(x.volume, []).append(x)
    for xs in by_volume.values():
        guarded = next((x for x in xs if x.authenticated), None)
        if guarded is not None:
            yield from ((x, guarded) for x in xs if not x.authenticated)


def check_access_policy(cfg: NodeConfig) -> None:
    """Refuse a volume that is authenticated on one export and open on another not marked
    allow_unauthenticated; the error names the open export, the protected one and the mend."""
    for x, guarded in _open_beside_guarded(cfg):
        if not x.allow_unauthenticated:
            raise ConfigError(
                f"{x.key}: volume \"{x.volume}\" needs {guarded.how} on {guarded.what}, but {x.what} is open "
                f"({x.how}); {_mend(x)}, or set allow_unauthenticated = true on it to serve it open on purpose")


def open_exports(cfg: NodeConfig) -> list[str]:
    """One line for each export served open on purpose beside an authenticated one of the same volume."""
    return [f"volume {x.volume}: {x.what} is open ({x.how}, allow_unauthenticated = true) while {guarded.what} "
            f"requires {guarded.how}" for x, guarded in _open_beside_guarded(cfg)]
