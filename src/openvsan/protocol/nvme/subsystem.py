"""NVM subsystems, their namespaces and ANA groups (NVMe Base 2.0 §2.1 / §8.1 ANA, NVMe-oF 1.1 §4)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid as uuidlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from openvsan.protocol.nvme import ana
from openvsan.protocol.nvme.ana import AnaGroups, Portal
from openvsan.protocol.nvme.reservations import Reservations
from openvsan.volume import Volume

if TYPE_CHECKING:
    from openvsan.protocol.nvme.auth import HostPolicy
    from openvsan.protocol.nvme.controller import Controller

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"

# ANA states, under the names the rest of protocol/nvme and its tests use (ana.py has the model)
ANA_OPTIMIZED = ana.OPTIMIZED
ANA_NON_OPTIMIZED = ana.NON_OPTIMIZED
ANA_INACCESSIBLE = ana.INACCESSIBLE
ANA_PERSISTENT_LOSS = ana.PERSISTENT_LOSS
ANA_CHANGE = ana.CHANGE
ANA_STATES = ana.STATES
CNTLID_MAX = 0xFFEF           # NVMe-oF 1.1 §4.2: controller IDs 1..FFEFh (FFF0h and up are reserved)


@dataclass
class Namespace:
    nsid: int
    volume: Volume
    read_only: bool = False
    ana_group: int = 1
    reservations: Reservations = field(default_factory=Reservations)
    unlisten: Callable[[], None] | None = field(default=None, repr=False)
    # a replicated volume's nodes share its reservations (node/replicas.py ResvSync: refresh(res), then
    # commit(state) -> False when another node's command came first); None: this namespace's own
    reservation_sync: Any = field(default=None, repr=False)
    reservation_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    # the namespace's identity is its volume's (Identify Namespace NGUID, EUI64, UUID descriptor)
    @property
    def name(self) -> str:
        return self.volume.name

    @property
    def uuid(self) -> uuidlib.UUID:
        return self.volume.uuid

    @property
    def nguid(self) -> bytes:
        return self.volume.nguid

    @property
    def eui64(self) -> bytes:
        return self.volume.eui64


class Subsystem:
    """An NVM subsystem (or the discovery subsystem): namespaces, allowed hosts, live controllers, and the ANA
    groups its controllers report (ana.py; one group, optimized, unless told otherwise).

    `dhchap_hosts` (host NQN -> HostPolicy) are the hosts that must authenticate with DH-HMAC-CHAP (Base 2.0
    §8.13); each may connect as if it were in `allowed_hosts`. Once any host has a secret, a host with none
    may connect only if `allowed_hosts` names it: an open subsystem would let any host in by claiming
    another NQN.

    `cntlids` bounds the controller IDs this subsystem hands out. When several nodes export one subsystem NQN
    (a replicated volume, one path per node), each needs its own range: Linux refuses a second controller
    with a CNTLID it already has in that subsystem ("Duplicate cntlid"), as nvmet's cntlid_min/max avoid."""

    def __init__(self, nqn: str, namespaces: Iterable[Namespace] = (), *, allowed_hosts: list[str] | None = None,
                 serial: str = "", model: str = "openvsan", discovery: bool = False,
                 dhchap_hosts: dict[str, HostPolicy] | None = None, ana_groups: AnaGroups | None = None,
                 cntlids: tuple[int, int] = (1, CNTLID_MAX)) -> None:
        self.nqn = nqn
        self.namespaces: dict[int, Namespace] = {}
        self.allowed_hosts = None if allowed_hosts is None else set(allowed_hosts)
        self.dhchap_hosts: dict[str, HostPolicy] = dict(dhchap_hosts or {})
        self.serial = serial or hashlib.sha256(nqn.encode()).hexdigest()[:20]
        self.model = model
        self.discovery = discovery
        self.elsewhere: int | None = None   # served by that worker process of this node (its discovery entry)
        self.controllers: dict[int, Controller] = {}
        self.ana = ana_groups if ana_groups is not None else AnaGroups()
        self.cntlids = (1, CNTLID_MAX)
        self._next_cntlid = 1
        self.set_cntlid_range(*cntlids)
        # counters for the SMART / health log (NVMe Base 2.0 §5.16.1.3)
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_commands = 0
        self.write_commands = 0
        self.media_errors = 0
        for ns in namespaces:
            ana.check_group(ns.ana_group)
            self.namespaces[ns.nsid] = ns
            self.ana.add(ns.ana_group, counted=False)     # the log as first built: no change counted yet
            self._watch(ns)

    def allows(self, hostnqn: str) -> bool:
        if hostnqn in self.dhchap_hosts:
            return True
        if self.allowed_hosts is None:
            return not self.dhchap_hosts
        return hostnqn in self.allowed_hosts

    def set_cntlid_range(self, lo: int, hi: int) -> None:
        """The controller IDs new controllers get from now on (those connected keep theirs)."""
        if not 1 <= lo <= hi <= CNTLID_MAX:
            raise ValueError(f"{self.nqn}: controller IDs {lo}..{hi} are not within 1..{CNTLID_MAX}: "
                             f"give each node exporting this subsystem its own range")
        self.cntlids = (lo, hi)
        if not lo <= self._next_cntlid <= hi:
            self._next_cntlid = lo

    def allocate_cntlid(self) -> int | None:
        """Dynamic controller model (NVMe-oF 1.1 §4.2): an ID in `cntlids`, never one in use."""
        lo, hi = self.cntlids
        for _ in range(hi - lo + 1):
            c = self._next_cntlid
            self._next_cntlid = c + 1 if c < hi else lo
            if c not in self.controllers:
                return c
        return None

    # --- ANA (Base 2.0 §8.1): the node calls these; every controller concerned gets the notice ------------
    def ana_state(self, group: int, portal: Portal | None = None) -> int:
        return self.ana.state(group, portal)

    def set_ana_state(self, group: int, state: int, *, portal: Portal | None = None) -> None:
        """Set an ANA group's state, for every portal or for one (replication calls this on failover); each
        controller concerned that enabled ANA change notices gets one (Base 2.0 §8.1.4, §5.2)."""
        if self.ana.set_state(group, state, portal):
            self._ana_changed(portal)

    def set_ana_group(self, nsid: int, group: int) -> None:
        """Move a namespace to another ANA group while attached (ANACAP bit 6 is clear: ANAGRPID may
        change); a new group starts optimized. Hosts get the ANA change notice and read its new group."""
        ns = self.namespaces.get(nsid)
        if ns is None:
            raise ValueError(f"{self.nqn}: no namespace {nsid}")
        ana.check_group(group)
        old = ns.ana_group
        if old == group:
            return
        if not self.ana.add(group):          # a new group's descriptor is counted as it is made
            self.ana.changed(group)
        ns.ana_group = group
        if old in self.ana:
            self.ana.changed(old)
        self._ana_changed(None)

    def _ana_changed(self, portal: Portal | None) -> None:
        for c in list(self.controllers.values()):
            if portal is None or c.portal == portal:
                c.ana_changed()
            else:
                c.refresh_ana()

    def _ana_members(self, ns: Namespace) -> None:
        # a namespace came or went: its group's descriptor lists other NSIDs now; a new group is in every
        # controller's view at once (hosts learn of the namespace by the Namespace Attribute notice)
        if self.ana.add(ns.ana_group):
            for c in list(self.controllers.values()):
                c.refresh_ana()
        else:
            self.ana.changed(ns.ana_group)

    # --- namespaces -----------------------------------------------------------------------------------------
    def add_namespace(self, ns: Namespace) -> None:
        if ns.nsid in self.namespaces:
            raise ValueError(f"{self.nqn}: namespace {ns.nsid} exists")
        ana.check_group(ns.ana_group)
        self.namespaces[ns.nsid] = ns
        self._ana_members(ns)
        self._watch(ns)
        self._ns_changed(ns.nsid)

    def remove_namespace(self, nsid: int) -> Namespace | None:
        ns = self.namespaces.pop(nsid, None)
        if ns is not None:
            if ns.unlisten is not None:
                ns.unlisten()
            if ns.ana_group in self.ana:
                self.ana.changed(ns.ana_group)
            self._ns_changed(nsid)
        return ns

    def _watch(self, ns: Namespace) -> None:
        # a resized volume: Namespace Attribute Changed to every controller (Base 2.0 §5.2 AEN, 5.16.1.5)
        nsid = ns.nsid
        ns.unlisten = ns.volume.listen(lambda what: self._ns_changed(nsid) if what == "resized" else None)

    def _ns_changed(self, nsid: int) -> None:
        for c in list(self.controllers.values()):
            c.namespace_changed(nsid)


@dataclass(frozen=True)
class Port:
    """A transport address the subsystems are reachable on (Discovery Log Page PORTID, TRADDR, TRSVCID)."""
    portid: int
    host: str
    port: int


DiscoveryEntries = Callable[[str], list[tuple[Subsystem, Port]]]
