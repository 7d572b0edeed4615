"""Persistent reservations (SPC-4 5.13, PERSISTENT RESERVE IN 6.15, PERSISTENT RESERVE OUT 6.16).

Registrations are per I_T nexus (ALL_TG_PT and SPEC_I_PT are not supported, and REPORT CAPABILITIES says
so). The state is kept across restarts only while the last REGISTER asked for it (APTPL), written whole to
a temporary file, fsynced and renamed over the old one, so a crash leaves the old state or the new one.
"""

from __future__ import annotations

import json
import pathlib
import struct
from dataclasses import dataclass, field
from typing import Any

from openvsan.durable import replace_file
from openvsan.protocol.scsi.nexus import Nexus
from openvsan.protocol.scsi.opcodes import Access
from openvsan.protocol.scsi.sense import (
    ASC_INVALID_RELEASE_OF_PR,
    ASC_REGISTRATIONS_PREEMPTED,
    ASC_RESERVATIONS_PREEMPTED,
    ASC_RESERVATIONS_RELEASED,
    ILLEGAL_REQUEST,
    ScsiError,
    invalid_field,
    invalid_param,
    param_list_length_error,
    reservation_conflict,
)

# SPC-4 6.16.3 table 173: persistent reservation types
WRITE_EXCLUSIVE = 1
EXCLUSIVE_ACCESS = 3
WRITE_EXCLUSIVE_REGISTRANTS_ONLY = 5
EXCLUSIVE_ACCESS_REGISTRANTS_ONLY = 6
WRITE_EXCLUSIVE_ALL_REGISTRANTS = 7
EXCLUSIVE_ACCESS_ALL_REGISTRANTS = 8
TYPES = frozenset((1, 3, 5, 6, 7, 8))
_ALL_REGISTRANTS = frozenset((7, 8))
_REGISTRANTS_ONLY_OR_ALL = frozenset((5, 6, 7, 8))
_EXCLUSIVE_ACCESS = frozenset((3, 6, 8))

# PERSISTENT RESERVE OUT service actions (SPC-4 6.16.2)
REGISTER, RESERVE, RELEASE, CLEAR, PREEMPT, PREEMPT_AND_ABORT, REGISTER_AND_IGNORE, REGISTER_AND_MOVE = range(8)

UnitAttentions = list[tuple[Nexus, int]]


@dataclass
class PersistentReservations:
    path: pathlib.Path | None = None
    keys: dict[Nexus, int] = field(default_factory=dict)   # registrations, in the order they were made
    holder: Nexus | None = None    # None with a type set: an all-registrants reservation
    type: int = 0                  # 0: not reserved
    generation: int = 0
    aptpl: bool = False

    # ---- the reservation as other commands see it (SPC-4 5.13.1 table 62)

    def is_holder(self, nexus: Nexus) -> bool:
        if self.type in _ALL_REGISTRANTS:
            return nexus in self.keys
        return self.type != 0 and self.holder == nexus

    def conflicts(self, nexus: Nexus, access: Access) -> bool:
        """True when `nexus` may not run a command of this access class under the current reservation."""
        if not self.type or access is Access.ALWAYS or self.is_holder(nexus):
            return False
        if self.type in _REGISTRANTS_ONLY_OR_ALL and nexus in self.keys:
            return False
        if access is Access.WRITE:
            return True
        return access is Access.READ and self.type in _EXCLUSIVE_ACCESS

    # ---- PERSISTENT RESERVE IN (SPC-4 6.15)

    def read_keys(self) -> bytes:
        keys = b"".join(struct.pack(">Q", k) for k in self.keys.values())
        return struct.pack(">II", self.generation, len(keys)) + keys

    def read_reservation(self) -> bytes:
        if not self.type:
            return struct.pack(">II", self.generation, 0)
        key = 0 if self.type in _ALL_REGISTRANTS else self.keys.get(self.holder, 0)  # type: ignore[arg-type]
        return struct.pack(">IIQIBBH", self.generation, 16, key, 0, 0, self.type, 0)

    @staticmethod
    def report_capabilities() -> bytes:
        # CRH 0, SIP_C 0, ATP_C 0, PTPL_C 1; TMV 1 with ALLOW COMMANDS 0, PTPL_A set later; all six types
        return bytes((0, 8, 0x01, 0x80, 0x80 | 0x40 | 0x20 | 0x08 | 0x02, 0x01, 0, 0))

    def read_full_status(self) -> bytes:
        out = bytearray()
        for nexus, key in self.keys.items():
            tid = transport_id(nexus)
            holder = 0x01 if self.is_holder(nexus) else 0
            scope_type = self.type if holder else 0
            out += struct.pack(">QIBBIHI", key, 0, holder, scope_type, 0, nexus.tpgt, len(tid)) + tid
        return struct.pack(">II", self.generation, len(out)) + out

    def persistent_reserve_in(self, sa: int) -> bytes:
        if sa == 0:
            return self.read_keys()
        if sa == 1:
            return self.read_reservation()
        if sa == 2:
            caps = bytearray(self.report_capabilities())
            caps[3] |= 0x01 if self.aptpl else 0   # PTPL_A
            return bytes(caps)
        if sa == 3:
            return self.read_full_status()
        raise invalid_field(1, 4)

    # ---- PERSISTENT RESERVE OUT (SPC-4 6.16, 5.13.5-5.13.11)

    def persistent_reserve_out(self, nexus: Nexus, cdb: bytes, params: bytes) -> UnitAttentions:
        """Apply one PR OUT; returns the unit attentions to establish. The caller saves the state."""
        sa = cdb[1] & 0x1F
        scope, rtype = cdb[2] >> 4, cdb[2] & 0x0F
        plen = struct.unpack_from(">I", cdb, 5)[0]
        if sa == REGISTER_AND_MOVE:
            return self._register_and_move(nexus, scope, rtype, plen, params)
        if sa > REGISTER_AND_MOVE:
            raise invalid_field(1, 4)
        if plen != 24:
            raise param_list_length_error()
        if len(params) < 24:
            raise param_list_length_error()
        rk, sark = struct.unpack_from(">QQ", params, 0)
        flags = params[20]
        if flags & 0x08:  # SPEC_I_PT
            raise invalid_param(20, 3)
        if flags & 0x04:  # ALL_TG_PT
            raise invalid_param(20, 2)
        if sa in (REGISTER, REGISTER_AND_IGNORE):
            return self._register(nexus, rk, sark, bool(flags & 0x01), ignore=sa == REGISTER_AND_IGNORE)
        if flags & 0x01:  # APTPL only means something to REGISTER
            raise invalid_param(20, 0)
        if nexus not in self.keys or self.keys[nexus] != rk:
            raise reservation_conflict()
        if sa in (RESERVE, RELEASE, PREEMPT, PREEMPT_AND_ABORT):
            if scope != 0:
                raise invalid_field(2, 7)
            if rtype not in TYPES:
                raise invalid_field(2, 3)
        if sa == RESERVE:
            return self._reserve(nexus, rtype)
        if sa == RELEASE:
            return self._release(nexus, rtype)
        if sa == CLEAR:
            return self._clear(nexus)
        return self._preempt(nexus, sark, rtype)

    def _register(self, nexus: Nexus, rk: int, sark: int, aptpl: bool, *, ignore: bool) -> UnitAttentions:
        current = self.keys.get(nexus)
        if current is None:
            if rk and not ignore:
                raise reservation_conflict()
            if not sark:
                return []
            self.keys[nexus] = sark
        else:
            if current != rk and not ignore:
                raise reservation_conflict()
            if not sark:
                return self._unregister(nexus)
            self.keys[nexus] = sark
        self.aptpl = aptpl
        self.generation += 1
        return []

    def _unregister(self, nexus: Nexus) -> UnitAttentions:
        uas: UnitAttentions = []
        was_holder = self.is_holder(nexus)
        del self.keys[nexus]
        self.generation += 1
        if was_holder and (self.type not in _ALL_REGISTRANTS or not self.keys):
            # SPC-4 5.13.11.2.3: the holder going away releases the reservation
            if self.type in (WRITE_EXCLUSIVE_REGISTRANTS_ONLY, EXCLUSIVE_ACCESS_REGISTRANTS_ONLY):
                uas = [(n, ASC_RESERVATIONS_RELEASED) for n in self.keys]
            self.holder, self.type = None, 0
        return uas

    def _reserve(self, nexus: Nexus, rtype: int) -> UnitAttentions:
        if self.type:
            if self.is_holder(nexus) and self.type == rtype:
                return []
            raise reservation_conflict()
        self.type = rtype
        self.holder = None if rtype in _ALL_REGISTRANTS else nexus
        return []

    def _release(self, nexus: Nexus, rtype: int) -> UnitAttentions:
        if not self.type or not self.is_holder(nexus):
            return []
        if rtype != self.type:
            raise ScsiError(ILLEGAL_REQUEST, ASC_INVALID_RELEASE_OF_PR)
        released = self.type
        self.holder, self.type = None, 0
        if released in _REGISTRANTS_ONLY_OR_ALL:
            return [(n, ASC_RESERVATIONS_RELEASED) for n in self.keys if n != nexus]
        return []

    def _clear(self, nexus: Nexus) -> UnitAttentions:
        uas = [(n, ASC_RESERVATIONS_PREEMPTED) for n in self.keys if n != nexus]
        self.keys.clear()
        self.holder, self.type = None, 0
        self.generation += 1
        return uas

    def _remove_key(self, nexus: Nexus, sark: int) -> UnitAttentions:
        victims = [n for n, k in self.keys.items() if k == sark and n != nexus]
        for n in victims:
            del self.keys[n]
        return [(n, ASC_REGISTRATIONS_PREEMPTED) for n in victims]

    def _preempt(self, nexus: Nexus, sark: int, rtype: int) -> UnitAttentions:
        # SPC-4 5.13.11.4
        if not self.type:
            if not sark:
                raise invalid_param(8)
            if not any(k == sark for n, k in self.keys.items() if n != nexus):
                raise reservation_conflict()
            uas = self._remove_key(nexus, sark)
        elif self.type in _ALL_REGISTRANTS:
            if sark:
                if not any(k == sark for n, k in self.keys.items() if n != nexus):
                    raise reservation_conflict()
                uas = self._remove_key(nexus, sark)
            else:
                uas = [(n, ASC_REGISTRATIONS_PREEMPTED) for n in self.keys if n != nexus]
                self.keys = {nexus: self.keys[nexus]}
                self.type, self.holder = rtype, None if rtype in _ALL_REGISTRANTS else nexus
        else:
            if not sark:
                raise invalid_param(8)
            holder_key = self.keys.get(self.holder) if self.holder else None
            if holder_key == sark:
                changed = rtype != self.type
                uas = self._remove_key(nexus, sark)
                self.type, self.holder = rtype, None if rtype in _ALL_REGISTRANTS else nexus
                if changed:
                    removed = {n for n, _ in uas}
                    uas += [(n, ASC_RESERVATIONS_RELEASED) for n in self.keys if n != nexus and n not in removed]
            else:
                if not any(k == sark for n, k in self.keys.items() if n != nexus):
                    raise reservation_conflict()
                uas = self._remove_key(nexus, sark)
        self.generation += 1
        return uas

    def _register_and_move(self, nexus: Nexus, scope: int, rtype: int, plen: int,
                           params: bytes) -> UnitAttentions:
        # SPC-4 5.13.8
        if plen < 24 or len(params) < 24:
            raise param_list_length_error()
        rk, sark, flags, rel_port, tid_len = struct.unpack_from(">QQxBHI", params, 0)
        if nexus not in self.keys:
            raise reservation_conflict()
        if self.keys[nexus] != rk:
            raise reservation_conflict()
        if not self.type or self.type in _ALL_REGISTRANTS or self.holder != nexus:
            raise reservation_conflict()
        if scope != 0:
            raise invalid_field(2, 7)
        if rtype not in TYPES:
            raise invalid_field(2, 3)
        if not sark:
            raise invalid_param(8)
        if len(params) < 24 + tid_len or plen < 24 + tid_len:
            raise param_list_length_error()
        dest = parse_transport_id(bytes(params[24:24 + tid_len]), nexus.target_name, rel_port)
        if dest == nexus:
            raise invalid_param(24)
        self.keys[dest] = sark
        self.holder, self.type = dest, rtype
        if flags & 0x02:  # UNREG
            del self.keys[nexus]
        self.aptpl = bool(flags & 0x01)
        self.generation += 1
        return []

    # ---- losing state

    def reset(self) -> None:
        """A power loss without APTPL forgets everything (SPC-4 5.13.4)."""
        self.keys.clear()
        self.holder, self.type, self.generation = None, 0, 0

    # ---- persistence (APTPL)

    def snapshot(self) -> bytes | None:
        """The state to write, or None when the file should be removed (APTPL clear)."""
        if not self.aptpl:
            return None
        regs = [{"initiator": n.initiator_name, "isid": n.isid, "target": n.target_name, "tpgt": n.tpgt,
                 "key": k, "holder": n == self.holder} for n, k in self.keys.items()]
        return json.dumps({"version": 1, "generation": self.generation, "type": self.type,
                           "registrations": regs}, indent=1).encode()

    # ---- the whole state as data, whatever APTPL says (a replicated volume's nodes share it: PrSync)

    def state(self) -> dict[str, Any]:
        return {"generation": self.generation, "type": self.type, "aptpl": self.aptpl,
                "registrations": [{"initiator": n.initiator_name, "isid": n.isid, "target": n.target_name,
                                   "tpgt": n.tpgt, "key": k, "holder": n == self.holder}
                                  for n, k in self.keys.items()],
                "all_holder": self.type != 0 and self.holder is None}

    def apply_state(self, state: dict[str, Any]) -> None:
        self.generation = int(state["generation"])
        self.type = int(state["type"])
        self.aptpl = bool(state.get("aptpl", False))
        self.keys, self.holder = {}, None
        for r in state["registrations"]:
            n = Nexus(r["initiator"], int(r["isid"]), r["target"], int(r["tpgt"]))
            self.keys[n] = int(r["key"])
            if r.get("holder"):
                self.holder = n

    def save(self, data: bytes | None) -> None:
        """Write a snapshot() crash-safely (blocking: call it off the event loop)."""
        if self.path is None:
            return
        if data is None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, data)

    def load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        state = json.loads(self.path.read_text())
        self.generation = int(state["generation"])
        self.type = int(state["type"])
        self.aptpl = True
        self.keys = {}
        self.holder = None
        for r in state["registrations"]:
            n = Nexus(r["initiator"], int(r["isid"]), r["target"], int(r["tpgt"]))
            self.keys[n] = int(r["key"])
            if r.get("holder"):
                self.holder = n
        if self.type and self.type not in _ALL_REGISTRANTS and self.holder is None:
            self.type = 0


def transport_id(nexus: Nexus) -> bytes:
    """iSCSI TransportID, format 01b: initiator port name (SPC-4 7.6.4.6)."""
    name = nexus.initiator_port.encode() + b"\0"
    name += b"\0" * (-len(name) % 4)
    return bytes((0x40 | 0x05, 0)) + struct.pack(">H", len(name)) + name


def parse_transport_id(tid: bytes, target_name: str, rel_port: int) -> Nexus:
    if len(tid) < 4 or tid[0] & 0x0F != 0x05 or tid[0] >> 6 != 1:
        raise invalid_param(24)
    length = struct.unpack_from(">H", tid, 2)[0]
    text = tid[4:4 + length].split(b"\0", 1)[0].decode(errors="replace")
    name, sep, isid = text.partition(",i,0x")
    if not sep:
        raise invalid_param(28)
    try:
        return Nexus(name, int(isid, 16), target_name, rel_port or 1)
    except ValueError:
        raise invalid_param(28) from None
