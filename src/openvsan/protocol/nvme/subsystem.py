"""NVM subsystems, their namespaces and ANA groups (NVMe Base 2.0 §2.1 / §8.1 ANA, NVMe-oF 1.1 §4)."""

from __future__ import annotations

import hashlib
import uuid as uuidlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from openvsan.protocol.nvme.reservations import Reservations
from openvsan.volume import Volume

if TYPE_CHECKING:
    from openvsan.protocol.nvme.auth import HostPolicy
    from openvsan.protocol.nvme.controller import Controller

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"

# ANA states (NVMe Base 2.0 §8.1.3 Figure 471 / ANA log page ANAS)
ANA_OPTIMIZED = 0x01
ANA_NON_OPTIMIZED = 0x02
ANA_INACCESSIBLE = 0x03
ANA_PERSISTENT_LOSS = 0x04
ANA_CHANGE = 0x0F
ANA_STATES = (ANA_OPTIMIZED, ANA_NON_OPTIMIZED, ANA_INACCESSIBLE, ANA_PERSISTENT_LOSS, ANA_CHANGE)


@dataclass
class Namespace:
    nsid: int
    volume: Volume
    read_only: bool = False
    ana_group: int = 1
    reservations: Reservations = field(default_factory=Reservations)
    unlisten: Callable[[], None] | None = field(default=None, repr=False)

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
    """An NVM subsystem (or the discovery subsystem): namespaces, allowed hosts, live controllers.

    `dhchap_hosts` (host NQN -> HostPolicy) are the hosts that must authenticate with DH-HMAC-CHAP (Base 2.0
    §8.13); each may connect as if it were in `allowed_hosts`. Once any host has a secret, a host with none
    may connect only if `allowed_hosts` names it: an open subsystem would let any host in by claiming
    another NQN."""

    def __init__(self, nqn: str, namespaces: Iterable[Namespace] = (), *, allowed_hosts: list[str] | None = None,
                 serial: str = "", model: str = "openvsan", discovery: bool = False,
                 dhchap_hosts: dict[str, HostPolicy] | None = None) -> None:
        self.nqn = nqn
        self.namespaces: dict[int, Namespace] = {ns.nsid: ns for ns in namespaces}
        self.allowed_hosts = None if allowed_hosts is None else set(allowed_hosts)
        self.dhchap_hosts: dict[str, HostPolicy] = dict(dhchap_hosts or {})
        self.serial = serial or hashlib.sha256(nqn.encode()).hexdigest()[:20]
        self.model = model
        self.discovery = discovery
        self.controllers: dict[int, Controller] = {}
        self.ana_states: dict[int, int] = {1: ANA_OPTIMIZED}
        self.ana_change_count = 0
        self._next_cntlid = 1
        # counters for the SMART / health log (NVMe Base 2.0 §5.16.1.3)
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_commands = 0
        self.write_commands = 0
        self.media_errors = 0
        for ns in self.namespaces.values():
            self.ana_states.setdefault(ns.ana_group, ANA_OPTIMIZED)
            self._watch(ns)

    def allows(self, hostnqn: str) -> bool:
        if hostnqn in self.dhchap_hosts:
            return True
        if self.allowed_hosts is None:
            return not self.dhchap_hosts
        return hostnqn in self.allowed_hosts

    def allocate_cntlid(self) -> int | None:
        """Dynamic controller model (NVMe-oF 1.1 §4.2): IDs 1..FFEFh, never one in use."""
        for _ in range(0xFFEF):
            c = self._next_cntlid
            self._next_cntlid = c + 1 if c < 0xFFEF else 1
            if c not in self.controllers:
                return c
        return None

    def ana_state(self, group: int) -> int:
        return self.ana_states.get(group, ANA_INACCESSIBLE)

    def set_ana_state(self, group: int, state: int) -> None:
        """Change an ANA group's state (replication uses this on failover); every controller that asked
        for ANA change notices gets an asynchronous event (NVMe Base 2.0 §8.1.4)."""
        if state not in ANA_STATES:
            raise ValueError(f"ANA state {state:#x} is not one of {ANA_STATES}")
        if self.ana_states.get(group) == state:
            return
        self.ana_states[group] = state
        self.ana_change_count += 1
        for c in list(self.controllers.values()):
            c.ana_changed()

    def add_namespace(self, ns: Namespace) -> None:
        if ns.nsid in self.namespaces:
            raise ValueError(f"{self.nqn}: namespace {ns.nsid} exists")
        self.namespaces[ns.nsid] = ns
        self.ana_states.setdefault(ns.ana_group, ANA_OPTIMIZED)
        self._watch(ns)
        self._ns_changed(ns.nsid)

    def remove_namespace(self, nsid: int) -> Namespace | None:
        ns = self.namespaces.pop(nsid, None)
        if ns is not None:
            if ns.unlisten is not None:
                ns.unlisten()
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
