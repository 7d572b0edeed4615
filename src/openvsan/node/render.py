"""A NodeConfig as the TOML document that declares it (the inverse of node/config.py parse_config).

The live node changes desired state by editing this document and parsing it again, so a change made over
the control socket (and later the REST API) passes every check, with the same one-line errors, that a
config file does; `vsan config show` prints it. parse_config(config_document(cfg)) == cfg."""

from __future__ import annotations

from typing import Any

from openvsan.node.specs import (
    DEFAULT_CLUSTER,
    DHCHAP_DHGROUPS,
    DHCHAP_HASHES,
    DeviceSpec,
    NbdExportSpec,
    NodeConfig,
    PoolSpec,
    SubsystemSpec,
    TargetSpec,
    VolumeSpec,
)
from openvsan.node.values import Portal


def _portals(ps: tuple[Portal, ...]) -> list[str]:
    return [str(p) for p in ps]


def _device(d: DeviceSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": d.name, "type": d.type, "block_size": d.block_size}
    if d.size is not None:
        out["size"] = d.size
    if d.backing is not None:
        out["backing"] = str(d.backing)
    if d.path is not None:
        out["path"] = str(d.path)
    if d.type == "file":
        out["direct"] = d.direct
    _group_keys(out, d)
    return out


def _group_keys(out: dict[str, Any], x: DeviceSpec | PoolSpec) -> None:
    """A volume group's settings, when not the defaults (so a document of an older node reads the same)."""
    if x.cluster != DEFAULT_CLUSTER:
        out["cluster"] = x.cluster
    if x.soft_threshold != 80:
        out["soft_threshold"] = x.soft_threshold


def _pool(p: PoolSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": p.name, "level": p.level, "members": list(p.members), "chunk": p.chunk}
    if p.spares:
        out["spares"] = list(p.spares)
    if p.rebuild_rate is not None:
        out["rebuild_rate"] = p.rebuild_rate
    _group_keys(out, p)
    return out


def _volume(v: VolumeSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": v.name, "read_only": v.read_only}
    if v.pool is not None:
        out["pool"] = v.pool
    else:
        out["device"] = v.device
    if v.qos:
        out["qos"] = dict(v.qos)
    if v.replicated:
        out["replicas"] = v.replicas
        out["nodes"] = list(v.nodes)
    if v.size is not None:
        out["size"] = v.size
        out["thin"] = v.thin
    if v.snapshot:
        out["snapshot"] = True
    if v.encryption is not None:    # the key file's path and the settings; never a key
        e = v.encryption
        enc: dict[str, Any] = ({"key_file": str(e.key_file)} if e.key_file is not None
                               else {"key_command": list(e.key_command)} if e.key_command is not None
                               else {"prompt": True})
        defaults = type(e)(key_file=e.key_file, key_command=e.key_command, prompt=e.prompt)
        for f in ("format", "cipher", "key_size", "sector_size", "kdf", "kdf_time", "kdf_memory_kib",
                  "kdf_iterations", "allow_discards"):
            if getattr(e, f) != getattr(defaults, f):
                enc[f] = getattr(e, f)
        out["encryption"] = enc
    if v.compression is not None:
        out["compression"] = v.compression
    if v.compression_chunk is not None:
        out["compression_chunk"] = v.compression_chunk
    if v.compression_frame is not None:
        out["compression_frame"] = v.compression_frame
    if v.compression_cache is not None:
        out["compression_cache"] = v.compression_cache
    return out


def _target(t: TargetSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"iqn": t.iqn, "luns": [{"lun": x.lun, "volume": x.volume} for x in t.luns],
                           "portals": _portals(t.portals), "portal_group_tag": t.portal_group_tag,
                           "allow_unauthenticated": t.allow_unauthenticated}
    if t.advertised_portals:
        out["advertised_portals"] = _portals(t.advertised_portals)
    if t.allowed_initiators is not None:
        out["allowed_initiators"] = list(t.allowed_initiators)
    if t.chap is not None:
        out["chap"] = {"user": t.chap.user, "secret": t.chap.secret}
    if t.mutual_chap is not None:
        out["mutual_chap"] = {"user": t.mutual_chap.user, "secret": t.mutual_chap.secret}
    if t.alias is not None:
        out["alias"] = t.alias
    return out


def _subsystem(s: SubsystemSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"nqn": s.nqn, "namespaces": [{"nsid": n.nsid, "volume": n.volume} for n in s.namespaces],
                           "portals": _portals(s.portals), "model": s.model,
                           "allow_unauthenticated": s.allow_unauthenticated}
    if s.advertised_portals:
        out["advertised_portals"] = _portals(s.advertised_portals)
    if s.allowed_hosts is not None:
        out["allowed_hosts"] = list(s.allowed_hosts)
    if s.serial:
        out["serial"] = s.serial
    if s.hosts:
        out["hosts"] = [{"nqn": h.nqn, "dhchap_secret": h.dhchap_secret,
                         **({"dhchap_ctrl_secret": h.dhchap_ctrl_secret} if h.dhchap_ctrl_secret else {})}
                        for h in s.hosts]
    if s.dhchap_hashes != DHCHAP_HASHES:
        out["dhchap_hashes"] = list(s.dhchap_hashes)
    if s.dhchap_dhgroups != DHCHAP_DHGROUPS:
        out["dhchap_dhgroups"] = list(s.dhchap_dhgroups)
    return out


def _nbd_export(e: NbdExportSpec) -> dict[str, Any]:
    return {"name": e.name, "volume": e.volume, "portals": _portals(e.portals), "read_only": e.read_only,
            "description": e.description, "tls": e.tls, "allow_unauthenticated": e.allow_unauthenticated}


def config_document(cfg: NodeConfig) -> dict[str, Any]:
    n = cfg.node
    node: dict[str, Any] = {"name": n.name, "poll_us": n.poll_us, "poll_max_us": n.poll_max_us,
                            "max_connections": n.max_connections,
                            "max_unauthenticated": n.max_unauthenticated,
                            "max_unauthenticated_per_source": n.max_unauthenticated_per_source,
                            "trust_foreign_files": n.trust_foreign_files, "auth_delay_max": n.auth_delay_max,
                            "auth_lockout_failures": n.auth_lockout_failures,
                            "auth_lockout_seconds": n.auth_lockout_seconds, "workers": n.workers}
    if n.worker_cpus:
        node["worker_cpus"] = list(n.worker_cpus)
    if n.worker_balance_interval:
        node["worker_balance_interval"] = n.worker_balance_interval
    if n.data_dir is not None:
        node["data_dir"] = str(n.data_dir)
    doc: dict[str, Any] = {"node": node}
    if cfg.devices:
        doc["devices"] = [_device(d) for d in cfg.devices]
    if cfg.pools:
        doc["pools"] = [_pool(p) for p in cfg.pools]
    if cfg.volumes:
        doc["volumes"] = [_volume(v) for v in cfg.volumes]
    if cfg.targets:
        doc["iscsi"] = {"targets": [_target(t) for t in cfg.targets]}
    if cfg.nvme is not None:
        nvme: dict[str, Any] = {"subsystems": [_subsystem(s) for s in cfg.nvme.subsystems]}
        if cfg.nvme.portals:
            nvme["portals"] = _portals(cfg.nvme.portals)
        doc["nvme"] = nvme
    if cfg.nbd_exports or cfg.nbd_tls is not None:
        nbd: dict[str, Any] = {"exports": [_nbd_export(e) for e in cfg.nbd_exports]}
        if cfg.nbd_tls is not None:
            t = cfg.nbd_tls
            nbd["tls"] = {"cert": str(t.cert), "key": str(t.key), "verify_client": t.verify_client,
                          **({"ca": str(t.ca)} if t.ca is not None else {})}
        doc["nbd"] = nbd
    if cfg.api is not None:
        a = cfg.api
        doc["api"] = {"listen": str(a.listen), "enabled": a.enabled,
                      **({"tls": {"cert": str(a.tls.cert), "key": str(a.tls.key)}} if a.tls is not None else {})}
    if cfg.cluster is not None:
        c = cfg.cluster
        doc["cluster"] = {"id": c.id, "etcd": list(c.etcd), "replication": str(c.replication),
                          "lease_ttl": c.lease_ttl, "suspend_seconds": c.suspend_seconds,
                          **({"management": c.management} if c.management is not None else {})}
    return doc
