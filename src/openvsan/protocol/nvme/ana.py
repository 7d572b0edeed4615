"""Asymmetric Namespace Access reporting (NVMe Base 2.0 §8.1): ANA groups, the state of each group on each
port, the change counts, and the ANA log page (§5.16.1.12).

Every namespace is in one ANA group (Identify Namespace ANAGRPID); a controller reports one state for all the
namespaces of a group. Each group has one state for the subsystem, which a port may override (Linux nvmet
keeps a table per port the same way): a node that serves a volume on two portals can tell the hosts on each
a different story. A controller reports the state of the portal its admin queue came in on.

The node sets the states (replication: the primary's node optimized, the others non-optimized, a fenced or
resyncing replica inaccessible; change while a failover moves the primary, at most ANATT seconds). Hosts
follow: Linux native multipath reads the log page at connect, on the ANA change notice, and on a
path-related status (Status Code Type 3h), which admit() in io.py answers from ANA_REFUSAL.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from openvsan.protocol.nvme import status as S

Portal = tuple[str, int]
"""A listening address, as the NVMe/TCP frontend listens on it ([nvme] portals)."""

# ANA states (§8.1.3; the ANA log page's ANA State field, §5.16.1.12 Figure 231)
OPTIMIZED = 0x01
NON_OPTIMIZED = 0x02
INACCESSIBLE = 0x03
PERSISTENT_LOSS = 0x04
CHANGE = 0x0F
STATES = (OPTIMIZED, NON_OPTIMIZED, INACCESSIBLE, PERSISTENT_LOSS, CHANGE)
# the names Linux prints (/sys/block/nvmeXcYnZ/ana_state) and nvme-cli's ana-log shows
NAMES = {OPTIMIZED: "optimized", NON_OPTIMIZED: "non-optimized", INACCESSIBLE: "inaccessible",
         PERSISTENT_LOSS: "persistent-loss", CHANGE: "change"}

# What I/O on a namespace in each state gets (§8.1.3.1-5, path related status §4.6.1.2.4): optimized and
# non-optimized serve everything; the others refuse with the path error that sends a multipath host elsewhere
ANA_REFUSAL = {OPTIMIZED: S.SUCCESS, NON_OPTIMIZED: S.SUCCESS, INACCESSIBLE: S.ANA_INACCESSIBLE,
               PERSISTENT_LOSS: S.ANA_PERSISTENT_LOSS, CHANGE: S.ANA_TRANSITION}

# Identify Controller (§5.17.2.1 Figure 275)
ANAGRPMAX = 128               # ANAGRPMAX and NANAGRPID: group IDs 1..128, all of them usable (as Linux nvmet)
ANATT = 10                    # ANATT: seconds a group may stay in the change state
# ANACAP: every state reported (bits 0-4). Bit 6 clear: a namespace's ANAGRPID may change while it is attached
# (Subsystem.set_ana_group; hosts get the ANA change notice and read the new group from the log). Bit 7 clear:
# no Namespace Management command, so no ANAGRPID to take from one.
ANACAP = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 3) | (1 << 4)

LSP_RGO = 0x01                # Get Log Page LSP bit 0 for the ANA log: Return Groups Only
_HEADER = struct.Struct("<QH6x")          # Change Count, Number of ANA Group Descriptors
_DESCRIPTOR = struct.Struct("<IIQB15x")   # ANAGRPID, Number of NSID Values, Change Count, ANA State
_COUNT_MAX = (1 << 64) - 1


def _bump(count: int) -> int:
    # §5.16.1.12: a change count of FFFFFFFF_FFFFFFFFh rolls over to 0h
    return 0 if count >= _COUNT_MAX else count + 1


def check_group(group: int) -> None:
    if not 1 <= group <= ANAGRPMAX:
        raise ValueError(f"ANA group {group} is out of range: use 1..{ANAGRPMAX}")


def check_state(state: int) -> None:
    if state not in STATES:
        raise ValueError(f"ANA state {state:#x} is not one of "
                         + ", ".join(f"{s:#x} ({NAMES[s]})" for s in STATES))


class AnaGroups:
    """The ANA groups of one subsystem: each group's state, per-portal overrides, and the change counts of
    the log page (the header's, and each group descriptor's)."""

    def __init__(self, groups: Iterable[int] = (1,), state: int = OPTIMIZED) -> None:
        self.states: dict[int, int] = {}
        self.portal_states: dict[Portal, dict[int, int]] = {}
        self.change_count = 0
        self.group_change_counts: dict[int, int] = {}
        for g in groups:
            self.add(g, state, counted=False)

    def __contains__(self, group: int) -> bool:
        return group in self.states

    @property
    def groups(self) -> list[int]:
        return sorted(self.states)

    def add(self, group: int, state: int = OPTIMIZED, *, counted: bool = True) -> bool:
        """A new group (a new descriptor in the log, which changes it, unless the log is being built before
        any host saw it: counted False); False if it was there already."""
        check_group(group)
        check_state(state)
        if group in self.states:
            return False
        self.states[group] = state
        self.group_change_counts[group] = 0
        if counted:
            self.changed(group)
        return True

    def discard(self, group: int) -> bool:
        if group not in self.states:
            return False
        del self.states[group]
        del self.group_change_counts[group]
        for per in self.portal_states.values():
            per.pop(group, None)
        self.change_count = _bump(self.change_count)
        return True

    def changed(self, group: int) -> None:
        """The group's descriptor changed (its state, or which namespaces it holds): both counts move."""
        self.change_count = _bump(self.change_count)
        self.group_change_counts[group] = _bump(self.group_change_counts[group])

    def state(self, group: int, portal: Portal | None = None) -> int:
        """The state controllers on `portal` report for `group` (a group that does not exist: inaccessible)."""
        if portal is not None:
            per = self.portal_states.get(portal)
            if per is not None and group in per:
                return per[group]
        return self.states.get(group, INACCESSIBLE)

    def set_state(self, group: int, state: int, portal: Portal | None = None) -> bool:
        """Set a group's state for the whole subsystem (portal None: every portal's override of this group
        goes too, it was decided again) or for one portal. The group is made if it is new. True if what
        some controller reports changed."""
        check_group(group)
        check_state(state)
        if group not in self.states:
            self.add(group, state if portal is None else OPTIMIZED)
            if portal is None:
                return True
        if portal is None:
            before = {p: per.get(group) for p, per in self.portal_states.items()}
            moved = self.states[group] != state or any(s is not None and s != state for s in before.values())
            self.states[group] = state
            for per in self.portal_states.values():
                per.pop(group, None)
        else:
            moved = self.state(group, portal) != state
            self.portal_states.setdefault(portal, {})[group] = state
        if moved:
            self.changed(group)
        return moved

    def refusals(self, portal: Portal | None) -> dict[int, int]:
        """group -> the status that refuses I/O there (0: none), as a controller on `portal` sees it: the
        one lookup admit() makes per command."""
        return {g: ANA_REFUSAL[self.state(g, portal)] for g in self.states}

    def log(self, members: Mapping[int, int], portal: Portal | None, rgo: bool) -> bytes:
        """The ANA log page (§5.16.1.12 Figure 230/231) for a controller on `portal`: `members` maps each
        NSID to its group. One descriptor per group, ascending group IDs, each with its NSIDs ascending (Linux
        walks them in order), none of them when RGO is set."""
        groups = self.groups
        by_group: dict[int, list[int]] = {g: [] for g in groups}
        if not rgo:
            for nsid in sorted(members):
                g = members[nsid]
                if g in by_group:
                    by_group[g].append(nsid)
        out = bytearray(_HEADER.pack(self.change_count, len(groups)))
        for g in groups:
            nsids = by_group[g]
            out += _DESCRIPTOR.pack(g, len(nsids), self.group_change_counts[g], self.state(g, portal))
            out += struct.pack(f"<{len(nsids)}I", *nsids)
        return bytes(out)


def log_size(groups: int, nsids: int) -> int:
    """Bytes of an ANA log with `groups` descriptors and `nsids` NSIDs in all (what a host reserves: Linux
    takes NANAGRPID descriptors and MNAN NSIDs, and gives up on ANA if that is over MDTS)."""
    return _HEADER.size + groups * _DESCRIPTOR.size + 4 * nsids
