"""Asymmetric logical unit access, implicit only (SPC-4 5.15): the target port groups a logical unit is seen
through, each in one access state, what a command may do through a port in each state, and REPORT TARGET
PORT GROUPS (SPC-4 6.36).

A target port here is an iSCSI target portal group: its tag is the relative target port identifier (RFC 7143
§13.3, SPC-4 7.8.6.4). One model per logical unit, shared by every target that exports it; the node changes
a group's state with set_state() (implicit ALUA: no SET TARGET PORT GROUPS), and every listener (each Lun
using the model) raises ASYMMETRIC ACCESS STATE CHANGED on its I_T nexuses (SPC-4 5.15.2.6)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum

from openvsan.protocol.scsi.sense import (
    ASC_LU_NOT_ACCESSIBLE_STANDBY,
    ASC_LU_NOT_ACCESSIBLE_TRANSITION,
    ASC_LU_NOT_ACCESSIBLE_UNAVAILABLE,
)


class AccessState(IntEnum):
    """ASYMMETRIC ACCESS STATE (SPC-4 6.36 table: the primary states and transitioning)."""

    ACTIVE_OPTIMIZED = 0x0
    ACTIVE_NON_OPTIMIZED = 0x1
    STANDBY = 0x2
    UNAVAILABLE = 0x3
    TRANSITIONING = 0xF


# STATUS CODE of a target port group descriptor (SPC-4 6.36)
STATUS_NONE = 0x00
STATUS_ALTERED_IMPLICITLY = 0x02

# the states every group supports: T_SUP, U_SUP, S_SUP, AN_SUP, AO_SUP (no offline, no LBA dependent)
SUPPORTED_STATES = 0x80 | 0x08 | 0x04 | 0x02 | 0x01

# INQUIRY TPGS field 01b: implicit asymmetric access only (SPC-4 6.6.2)
TPGS_IMPLICIT = 0x10

_ACTIVE = (AccessState.ACTIVE_OPTIMIZED, AccessState.ACTIVE_NON_OPTIMIZED)

# What a port in each non-active state lets through, as (opcode, service action or None). Only commands this
# LU implements matter: anything else is refused before (INVALID COMMAND OPERATION CODE).
# SPC-4 5.15.2.4.4 standby: INQUIRY, LOG SELECT/SENSE, MODE SELECT/SENSE, REPORT LUNS, RECEIVE DIAGNOSTIC
# RESULTS, SEND DIAGNOSTIC, REPORT/SET TARGET PORT GROUPS, REQUEST SENSE, PERSISTENT RESERVE IN/OUT, echo
# buffer READ/WRITE BUFFER. "The device server may support other commands": READ CAPACITY(10)/(16) too, so
# that an initiator can size the disk on a standby path when it scans (Linux sd does; LIO allows it).
_STANDBY_OK = frozenset({
    (0x12, None), (0x4C, None), (0x4D, None), (0x15, None), (0x55, None), (0x1A, None), (0x5A, None),
    (0xA0, None), (0x1C, None), (0x1D, None), (0xA3, 0x0A), (0xA4, 0x0A), (0x03, None),
    *((0x5E, sa) for sa in range(4)), *((0x5F, sa) for sa in range(8)),
    (0x25, None), (0x9E, 0x10),
})
# SPC-4 5.15.2.4.5 unavailable: INQUIRY, REPORT LUNS, REPORT/SET TARGET PORT GROUPS, REQUEST SENSE, echo buffer
_UNAVAILABLE_OK = frozenset({(0x12, None), (0xA0, None), (0xA3, 0x0A), (0xA4, 0x0A), (0x03, None)})
# SPC-4 5.15.2.5 transitioning: INQUIRY, REPORT LUNS, REPORT TARGET PORT GROUPS, REQUEST SENSE, echo buffer
_TRANSITIONING_OK = frozenset({(0x12, None), (0xA0, None), (0xA3, 0x0A), (0x03, None)})

# state -> (what it lets through, the ASC/ASCQ of NOT READY for the rest)
_REFUSE: dict[AccessState, tuple[frozenset[tuple[int, int | None]], int]] = {
    AccessState.STANDBY: (_STANDBY_OK, ASC_LU_NOT_ACCESSIBLE_STANDBY),
    AccessState.UNAVAILABLE: (_UNAVAILABLE_OK, ASC_LU_NOT_ACCESSIBLE_UNAVAILABLE),
    AccessState.TRANSITIONING: (_TRANSITIONING_OK, ASC_LU_NOT_ACCESSIBLE_TRANSITION),
}

_HEADER = struct.Struct(">I")
_EXT_HEADER = struct.Struct(">IBBxx")
_DESCRIPTOR = struct.Struct(">BBHxBxB")
_PORT = struct.Struct(">xxH")
MAX_ID = 0xFFFF


@dataclass
class TargetPortGroup:
    """One target port group (SPC-4 5.15.2.1): its id, the relative target port ids in it, its state."""

    id: int
    ports: frozenset[int] = frozenset()
    state: AccessState = AccessState.ACTIVE_OPTIMIZED
    preferred: bool = False          # PREF: the group an initiator should prefer (SPC-4 6.36)
    status: int = STATUS_NONE


class TargetPortGroups:
    """The target port groups of a logical unit. `default` names the group of every port that no group
    lists (a single-node export: one group holding whatever port the LU is reached through); a port in no
    group, with no default, reaches the LU as unavailable: a path nobody configured serves no I/O."""

    def __init__(self, groups: Iterable[TargetPortGroup], *, default: int | None = None,
                 transition_time: int = 0) -> None:
        self.groups: dict[int, TargetPortGroup] = {}
        self._by_port: dict[int, TargetPortGroup] = {}
        for g in groups:
            if not 1 <= g.id <= MAX_ID:
                raise ValueError(f"target port group {g.id}: use 1 to {MAX_ID}")
            if g.id in self.groups:
                raise ValueError(f"target port group {g.id} is listed twice")
            if len(g.ports) > 255:   # TARGET PORT COUNT is one byte
                raise ValueError(f"target port group {g.id}: at most 255 ports")
            g.state = AccessState(g.state)
            for p in g.ports:
                if not 1 <= p <= MAX_ID:
                    raise ValueError(f"relative target port {p}: use 1 to {MAX_ID}")
                if p in self._by_port:
                    raise ValueError(f"relative target port {p} is in groups {self._by_port[p].id} and {g.id}")
                self._by_port[p] = g
            self.groups[g.id] = g
        if not self.groups:
            raise ValueError("a logical unit with ALUA needs at least one target port group")
        if default is not None and default not in self.groups:
            raise ValueError(f"default target port group {default} is not one of the groups")
        if not 0 <= transition_time <= 255:
            raise ValueError("implicit transition time: use 0 to 255 seconds")
        self.default = self.groups[default] if default is not None else None
        self.transition_time = transition_time   # IMPLICIT TRANSITION TIME (SPC-4 6.36), 0: unspecified
        self._listeners: list[Callable[[], None]] = []
        self._update()

    @classmethod
    def single(cls, group: int = 1) -> TargetPortGroups:
        """One group, active/optimized, holding every port: what a single-node export reports."""
        return cls([TargetPortGroup(group)], default=group)

    def _update(self) -> None:
        # the fast path asks once per command: no lookup at all while every group is active
        self.all_active = self.default is not None and all(g.state in _ACTIVE for g in self.groups.values())

    # ---- where a port stands

    def group_of(self, port: int) -> TargetPortGroup | None:
        return self._by_port.get(port, self.default)

    def state_of(self, port: int) -> AccessState:
        g = self._by_port.get(port, self.default)
        return AccessState.UNAVAILABLE if g is None else g.state

    def refusal(self, opcode: int, sa: int | None, port: int) -> int | None:
        """The ASC/ASCQ of NOT READY, LOGICAL UNIT NOT ACCESSIBLE that refuses this command on this port, or
        None: it may run (SPC-4 5.15.2.4: active/optimized and active/non-optimized serve every command)."""
        state = self.state_of(port)
        rule = _REFUSE.get(state)
        if rule is None or (opcode, sa) in rule[0]:
            return None
        return rule[1]

    # ---- changes (implicit: the node decides, SPC-4 5.15.2.6)

    def listen(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call fn after every change of state; returns the function that stops it."""
        self._listeners.append(fn)

        def unlisten() -> None:
            if fn in self._listeners:
                self._listeners.remove(fn)
        return unlisten

    def set_state(self, group: int, state: AccessState | int) -> None:
        self.set_states({group: state})

    def set_states(self, states: Mapping[int, AccessState | int]) -> None:
        """Move several groups at once (a failover: one to standby, another to active/optimized): the LU's
        nexuses get one ASYMMETRIC ACCESS STATE CHANGED for all of them. A group already in its state is
        left alone; nothing changed, no unit attention."""
        wanted: dict[int, AccessState] = {}
        for gid, st in states.items():
            if gid not in self.groups:
                raise ValueError(f"no target port group {gid}")
            try:
                wanted[gid] = AccessState(st)
            except ValueError:
                raise ValueError(f"target port group {gid}: {st!r} is not an access state "
                                 f"(0, 1, 2, 3 or 15)") from None
        changed = False
        for gid, st in wanted.items():
            g = self.groups[gid]
            if g.state != st:
                g.state, g.status = st, STATUS_ALTERED_IMPLICITLY
                changed = True
        if changed:
            self._update()
            for fn in list(self._listeners):
                fn()

    # ---- REPORT TARGET PORT GROUPS parameter data (SPC-4 6.36)

    def report(self, *, extended: bool, seen_ports: Iterable[int] = ()) -> bytes:
        """The parameter data, every group, in id order: the length-only header (format 000b) or the
        extended one (001b) with the implicit transition time. seen_ports: the ports the LU was reached
        through, listed under the default group when no group names them."""
        extra = sorted({p for p in seen_ports if 1 <= p <= MAX_ID and p not in self._by_port})
        body = bytearray()
        for gid in sorted(self.groups):
            g = self.groups[gid]
            ports = sorted(g.ports) + (extra if g is self.default else [])
            ports = ports[:255]
            body += _DESCRIPTOR.pack((0x80 if g.preferred else 0) | g.state, SUPPORTED_STATES, g.id, g.status,
                                     len(ports))
            for p in ports:
                body += _PORT.pack(p)
        if extended:
            # RETURN DATA LENGTH counts what follows it (n - 3), the rest of the extended header too
            return _EXT_HEADER.pack(len(body) + 4, 0x10, self.transition_time) + body
        return _HEADER.pack(len(body)) + body

    def snapshot(self) -> tuple[tuple[int, frozenset[int], int], ...]:
        return tuple((g.id, g.ports, g.state) for g in self.groups.values())
