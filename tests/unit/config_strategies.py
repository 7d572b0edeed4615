"""Hypothesis strategies for valid node configs (node/specs.py NodeConfig), valid by construction: every one
parses back from its config document (node/render.py) with every check node/config.py makes.

A config is drawn inside a `Universe`: what two configs of one node share when one may become the other
while serving ([node], the pools and their devices, [nbd] tls, [nvme] portals, and what each device or
volume name stands for: a device's type, file and block size, the device or pool a volume lives on).
Two configs drawn in one universe then differ only in what may change live (node/reconcile.py), except
for sizes: `grow_only(actual, desired)` makes desired's devices at least as large as actual's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from openvsan.node.access import iscsi_auth, nbd_auth, nvme_auth
from openvsan.node.specs import (
    DHCHAP_DHGROUPS,
    DHCHAP_HASHES,
    ChapSpec,
    DeviceSpec,
    HostAuthSpec,
    LunSpec,
    NamespaceSpec,
    NbdExportSpec,
    NbdTlsSpec,
    NodeConfig,
    NodeSettings,
    NvmeSpec,
    PoolSpec,
    SubsystemSpec,
    TargetSpec,
    VolumeSpec,
)
from openvsan.node.values import Portal
from openvsan.protocol.nvme.auth import HASH_BY_ID, Secret, format_secret, parse_secret
from openvsan.volume.qos import QosLimits

KiB, MiB = 1024, 1 << 20
# one port range per protocol: no two protocols ever share a portal (config.py _check_portal_clashes)
PORTS = {"iscsi": (3260, 3263), "nvme": (4420, 4423), "nbd": (10809, 10812)}
HOSTS = ("127.0.0.1", "127.0.0.2", "0.0.0.0", "::1", "localhost", "san.example")
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
TEXT = st.characters(categories=("L", "N", "P", "S"), include_characters=" ")   # printable, not only ASCII
LEVELS = {"raid0": 1, "raid1": 2, "raid10": 4, "raid5": 3, "raid6": 4}


def portals(proto: str, *, min_size: int = 1) -> st.SearchStrategy[tuple[Portal, ...]]:
    lo, hi = PORTS[proto]
    one = st.builds(Portal, st.sampled_from(HOSTS), st.integers(lo, hi))
    return st.lists(one, min_size=min_size, max_size=3, unique=True).map(tuple)


def names(prefix: str) -> st.SearchStrategy[str]:
    return st.from_regex(rf"\A{prefix}[A-Za-z0-9._-]{{0,8}}\Z")


@st.composite
def node_settings(draw: st.DrawFn) -> NodeSettings:
    top = draw(st.integers(1, 1 << 20))
    unauth = draw(st.integers(1, top))
    per_source = draw(st.integers(1, unauth))
    data_dir = draw(st.none() | st.sampled_from([Path("/var/lib/openvsan"), Path("/srv/vsan/data")]))
    return NodeSettings(draw(names("n")), data_dir, draw(st.integers(0, 10_000)), draw(st.integers(0, 10_000)),
                        top, unauth, per_source, draw(st.booleans()), draw(st.floats(0, 60)),
                        draw(st.integers(0, 1_000_000)), draw(st.integers(1, 86_400)))


@st.composite
def qos(draw: st.DrawFn) -> dict[str, float]:
    """Some of QosLimits' knobs, valid (a burst is 0 or at least its limit), as the parser keeps them."""
    knobs: dict[str, float] = {}
    for scope in draw(st.lists(st.sampled_from(["", "read_", "write_"]), unique=True, max_size=2)):
        kind = draw(st.sampled_from(["iops", "bps"]))
        limit = draw(st.integers(1, 10**9) | st.floats(0.5, 1e9))
        knobs[f"{scope}{kind}_limit"] = limit
        if draw(st.booleans()):
            knobs[f"{scope}{kind}_burst"] = limit + draw(st.integers(0, 10**6))
            knobs[f"{scope}{kind}_burst_seconds"] = draw(st.integers(1, 60) | st.floats(0.1, 60))
    return dict(QosLimits.from_dict(knobs).to_dict())


def chap_secrets() -> st.SearchStrategy[str]:
    return st.text(PRINTABLE, min_size=12, max_size=16)


@st.composite
def dhchap_secret(draw: st.DrawFn) -> str:
    """A DHHC-1 secret as `nvme gen-dhchap-key` prints it (NVMe Base 2.0 §8.13.5.7)."""
    length = draw(st.sampled_from([32, 48, 64]))
    transform = draw(st.sampled_from([t for t in (0, 1, 2, 3) if not t or HASH_BY_ID[t].size <= length]))
    return format_secret(Secret(draw(st.binary(min_size=length, max_size=length)), transform))


host_nqns = st.uuids().map(lambda u: f"nqn.2014-08.org.nvmexpress:uuid:{u}") | st.from_regex(
    r"\Anqn\.2026-0[1-9]\.org\.example:host[a-z0-9]{1,6}\Z")
initiator_names = st.from_regex(r"\Aiqn\.2026-1[0-2]\.org\.example:[a-z0-9.-]{1,10}\Z")


def preference(known: tuple[str, ...]) -> st.SearchStrategy[tuple[str, ...]]:
    """A non-empty ordered choice out of `known` (dhchap_hashes, dhchap_dhgroups); often all of them."""
    return st.just(known) | st.permutations(known).flatmap(
        lambda p: st.integers(1, len(p)).map(lambda n: tuple(p[:n])))


@dataclass(frozen=True)
class Universe:
    node: NodeSettings
    devices: tuple[DeviceSpec, ...]         # what each device name is (its size: the smallest it may be)
    volumes: tuple[VolumeSpec, ...]         # what each volume name lives on (qos, read_only: drawn per config)
    pools: tuple[PoolSpec, ...]
    pool_devices: tuple[DeviceSpec, ...]    # the pools' members and spares: in every config, as they are
    nvme_portals: tuple[Portal, ...]        # (): each subsystem names its own
    nbd_tls: NbdTlsSpec | None
    iqns: tuple[str, ...]
    nqns: tuple[str, ...]
    nbd_names: tuple[str, ...]


@st.composite
def device_spec(draw: st.DrawFn, name: str, *, kinds: tuple[str, ...] = ("ram", "file", "null"),
                block_size: int | None = None) -> DeviceSpec:
    kind = draw(st.sampled_from(kinds))
    bs = block_size or draw(st.sampled_from([512, 4096]))
    size: int | None = draw(st.integers(1, 64)) * 64 * KiB
    backing = path = None
    if kind == "ram" and draw(st.booleans()):
        backing = Path(f"/dev/shm/openvsan-test-{name}")
    if kind == "file":
        path = Path(f"/srv/openvsan-test/{name}.img")
        if draw(st.booleans()):
            size = None   # the file's size
    return DeviceSpec(name, kind, size, bs, backing, path, kind == "file" and draw(st.booleans()))


@st.composite
def universes(draw: st.DrawFn) -> Universe:
    n_dev = draw(st.integers(0, 5))
    devices = tuple(draw(device_spec(f"d{i}")) for i in range(n_dev))
    pools: list[PoolSpec] = []
    pool_devices: list[DeviceSpec] = []
    for p in range(draw(st.integers(0, 2))):
        level = draw(st.sampled_from(sorted(LEVELS)))
        n = LEVELS[level] + draw(st.integers(0, 2)) * (2 if level == "raid10" else 1)
        spares = 0 if level == "raid0" else draw(st.integers(0, 1))
        bs = draw(st.sampled_from([512, 4096]))
        members = [draw(device_spec(f"p{p}m{i}", kinds=("ram", "file"), block_size=bs)) for i in range(n + spares)]
        pool_devices += members
        chunk = 1 << draw(st.integers(12, 24))
        rate = draw(st.none() | st.integers(1, 10**9))
        pools.append(PoolSpec(f"pool{p}", level, tuple(m.name for m in members[:n]),
                              tuple(m.name for m in members[n:]), chunk, rate))
    volumes = [VolumeSpec(f"v{d.name}", d.name) for d in devices]
    volumes += [VolumeSpec(f"v{p.name}", None, pool=p.name) for p in pools]
    tls = draw(st.none() | st.builds(NbdTlsSpec, st.just(Path("/etc/vsan/cert.pem")), st.just(Path("/etc/vsan/key.pem")),
                                     st.none() | st.just(Path("/etc/vsan/ca.pem"))))
    if tls is not None and tls.ca is not None and draw(st.booleans()):
        tls = dataclasses.replace(tls, verify_client=True)
    nvme_portals = draw(st.just(()) | portals("nvme"))
    return Universe(draw(node_settings()), devices, tuple(volumes), tuple(pools), tuple(pool_devices),
                    nvme_portals, tls, tuple(f"iqn.2026-11.org.openvsan:t{i}" for i in range(3)),
                    tuple(f"nqn.2026-11.org.openvsan:s{i}" for i in range(3)), ("e0", "disk e1", "ë2"))


def _some(draw: st.DrawFn, items: tuple[Any, ...], *, min_size: int = 0) -> list[Any]:
    if len(items) < min_size:
        return list(items)
    return draw(st.lists(st.sampled_from(items), unique=True, min_size=min_size, max_size=len(items))
                if items else st.just([]))


def _children(draw: st.DrawFn, volumes: list[str], first: int, last: int, make: Any) -> tuple[Any, ...]:
    """LUNs or namespaces: distinct numbers, distinct volumes, in number order (as the parser keeps them)."""
    chosen = draw(st.lists(st.sampled_from(volumes), unique=True, min_size=1, max_size=min(3, len(volumes))))
    numbers = draw(st.lists(st.integers(first, last), unique=True, min_size=len(chosen), max_size=len(chosen)))
    return tuple(make(n, v) for n, v in sorted(zip(numbers, chosen, strict=True)))


@st.composite
def target_spec(draw: st.DrawFn, iqn: str, volumes: list[str]) -> TargetSpec:
    luns = _children(draw, volumes, 0, 16383, LunSpec)
    chap = mutual = None
    if draw(st.booleans()):
        chap = ChapSpec(draw(st.text(TEXT, min_size=1, max_size=12)), draw(chap_secrets()))
        if draw(st.booleans()):
            mutual = ChapSpec(draw(st.text(TEXT, min_size=1, max_size=12)),
                              draw(chap_secrets().filter(lambda s: s != chap.secret)))
    allowed = draw(st.none() | st.lists(initiator_names, unique=True, max_size=3).map(tuple))
    alias = draw(st.none() | st.text(TEXT, max_size=20))
    return TargetSpec(iqn, luns, draw(portals("iscsi")), draw(portals("iscsi", min_size=0)), allowed, chap, mutual,
                      alias, draw(st.integers(1, 65535)), draw(st.booleans()))


@st.composite
def subsystem_spec(draw: st.DrawFn, nqn: str, volumes: list[str], default_portals: tuple[Portal, ...]) -> SubsystemSpec:
    namespaces = _children(draw, volumes, 1, 0xFFFFFFFE, NamespaceSpec)
    own = draw(portals("nvme")) if not default_portals or draw(st.booleans()) else default_portals
    hosts: list[HostAuthSpec] = []
    for h in draw(st.lists(host_nqns, unique=True, max_size=2)):
        secret = draw(dhchap_secret())
        ctrl = draw(st.none() | dhchap_secret().filter(lambda c, s=secret: parse_secret(c).key != parse_secret(s).key))
        hosts.append(HostAuthSpec(h, secret, ctrl))
    allowed = draw(st.none() | st.lists(host_nqns, unique=True, max_size=2).map(
        lambda xs: tuple(dict.fromkeys([*xs, *(h.nqn for h in hosts[:1])]))))
    serial = draw(st.just("") | st.text(PRINTABLE, min_size=1, max_size=20))
    model = draw(st.just("openvsan") | st.text(PRINTABLE, min_size=1, max_size=40))
    return SubsystemSpec(nqn, namespaces, own, draw(portals("nvme", min_size=0)), allowed, serial, model,
                         tuple(hosts), draw(preference(DHCHAP_HASHES)), draw(preference(DHCHAP_DHGROUPS)),
                         draw(st.booleans()))


@st.composite
def nbd_export_spec(draw: st.DrawFn, name: str, volumes: list[str], tls: NbdTlsSpec | None) -> NbdExportSpec:
    mode = draw(st.sampled_from(["off", "optional", "require"])) if tls is not None else "off"
    return NbdExportSpec(name, draw(st.sampled_from(volumes)), draw(portals("nbd")), draw(st.booleans()),
                         draw(st.text(TEXT, max_size=30)), mode, draw(st.booleans()))


def open_on_purpose(cfg: NodeConfig) -> NodeConfig:
    """The config with allow_unauthenticated = true on each open export of a volume that another export
    authenticates (node/access.py would refuse it otherwise): valid by construction."""
    guarded = {lun.volume for t in cfg.targets if iscsi_auth(t)[0] for lun in t.luns}
    guarded |= {ns.volume for s in cfg.subsystems if nvme_auth(s)[0] for ns in s.namespaces}
    guarded |= {e.volume for e in cfg.nbd_exports if nbd_auth(e, cfg)[0]}
    targets = tuple(t if iscsi_auth(t)[0] or not {x.volume for x in t.luns} & guarded
                    else dataclasses.replace(t, allow_unauthenticated=True) for t in cfg.targets)
    subs = tuple(s if nvme_auth(s)[0] or not {x.volume for x in s.namespaces} & guarded
                 else dataclasses.replace(s, allow_unauthenticated=True) for s in cfg.subsystems)
    nbd = tuple(e if nbd_auth(e, cfg)[0] or e.volume not in guarded
                else dataclasses.replace(e, allow_unauthenticated=True) for e in cfg.nbd_exports)
    nvme = dataclasses.replace(cfg.nvme, subsystems=subs) if cfg.nvme is not None else None
    return dataclasses.replace(cfg, targets=targets, nvme=nvme, nbd_exports=nbd)


@st.composite
def configs(draw: st.DrawFn, u: Universe) -> NodeConfig:
    """One valid config of the universe: some of its devices (at their size or grown), the volumes whose
    device or pool is there (with drawn qos and read_only), and exports of those volumes."""
    devices = []
    for d in _some(draw, u.devices):
        grow = draw(st.integers(0, 3)) * 64 * KiB
        devices.append(d if d.size is None or not grow else dataclasses.replace(d, size=d.size + grow))
    order = [d.name for d in u.devices]
    devices.sort(key=lambda d: order.index(d.name))   # the order means nothing to a node; it keeps draws stable
    present = {d.name for d in devices} | {p.name for p in u.pools}
    volumes = [dataclasses.replace(v, read_only=draw(st.booleans()), qos=draw(st.just({}) | qos()))
               for v in _some(draw, u.volumes) if (v.device or v.pool) in present]
    volumes.sort(key=lambda v: [x.name for x in u.volumes].index(v.name))
    vnames = [v.name for v in volumes]
    targets: list[TargetSpec] = []
    subs: list[SubsystemSpec] = []
    nbd: list[NbdExportSpec] = []
    if vnames:
        targets = [draw(target_spec(iqn, vnames)) for iqn in _some(draw, u.iqns)]
        subs = [draw(subsystem_spec(nqn, vnames, u.nvme_portals)) for nqn in _some(draw, u.nqns)]
        nbd = [draw(nbd_export_spec(n, vnames, u.nbd_tls)) for n in _some(draw, u.nbd_names)]
    nvme = None
    if subs or (u.nvme_portals and draw(st.booleans())):
        nvme = NvmeSpec(u.nvme_portals, tuple(subs))
    cfg = NodeConfig(u.node, (*devices, *u.pool_devices), tuple(volumes), tuple(targets), nvme=nvme,
                     nbd_exports=tuple(nbd), pools=u.pools, nbd_tls=u.nbd_tls)
    return open_on_purpose(cfg)


def grow_only(actual: NodeConfig, desired: NodeConfig) -> NodeConfig:
    """`desired` with each device that `actual` has too at least as large as there (a device in service
    does not shrink)."""
    had = {d.name: d for d in actual.devices}
    out = []
    for d in desired.devices:
        old = had.get(d.name)
        if old is not None and old.size is not None and d.size is not None and d.size < old.size:
            d = dataclasses.replace(d, size=old.size)
        out.append(d)
    return dataclasses.replace(desired, devices=tuple(out))


node_configs = universes().flatmap(configs)
