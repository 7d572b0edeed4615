"""Reservations of one namespace (NVMe Base 2.0 §8.19; commands in NVM Command Set 1.0 §6 / Base §7.5-7.8).

Registrants are hosts, known by their 128-bit Host Identifier: every controller of one host shares its
registration (§8.19.1). Not persistent through power loss (RESCAP bit 0 clear, PTPLS 0).
"""

from __future__ import annotations

import struct
from typing import Any

from openvsan.protocol.nvme import status as S

# Reservation types (§8.19.4 Figure 517)
WRITE_EXCLUSIVE = 1
EXCLUSIVE_ACCESS = 2
WE_REGISTRANTS_ONLY = 3
EA_REGISTRANTS_ONLY = 4
WE_ALL_REGISTRANTS = 5
EA_ALL_REGISTRANTS = 6
# RESCAP (NVM Identify Namespace byte 31): types 1-6 and IEKEY as in 1.3 and later; no power-loss persistence
RESCAP = 0xFE

_HDR = struct.Struct("<IBH2xB14x")             # §7.8 Figure 397: GEN, RTYPE, REGCTL, PTPLS
_ENTRY_EXT = struct.Struct("<HB5xQ16s32x")     # Figure 399: CNTLID, RCSTS, RKEY, HOSTID (128-bit)


class Reservations:
    def __init__(self) -> None:
        self.registrants: dict[bytes, int] = {}   # host identifier -> reservation key
        self.holder: bytes | None = None
        self.rtype = 0
        self.generation = 0

    @property
    def active(self) -> bool:
        return bool(self.registrants)

    @property
    def gated(self) -> bool:
        """Whether I/O must ask allows(): with no registrant every host may do anything (§8.19)."""
        return bool(self.registrants)

    def _holds(self, host: bytes) -> bool:
        if not self.rtype:
            return False
        if self.rtype in (WE_ALL_REGISTRANTS, EA_ALL_REGISTRANTS):
            return host in self.registrants
        return self.holder == host

    def allows(self, host: bytes, write: bool) -> bool:
        """§8.19 Figure 518: may this host read (write=False) or write under the current reservation?"""
        t = self.rtype
        if not t or self._holds(host):
            return True
        if not write and t in (WRITE_EXCLUSIVE, WE_REGISTRANTS_ONLY, WE_ALL_REGISTRANTS):
            return True
        if t in (WRITE_EXCLUSIVE, EXCLUSIVE_ACCESS):
            return False
        return host in self.registrants

    def _drop(self, host: bytes) -> None:
        self.registrants.pop(host, None)
        if self.rtype in (WE_ALL_REGISTRANTS, EA_ALL_REGISTRANTS):
            if not self.registrants:
                self.holder, self.rtype = None, 0
        elif self.holder == host:
            self.holder, self.rtype = None, 0

    def register(self, host: bytes, rrega: int, iekey: bool, cptpl: int, crkey: int, nrkey: int) -> int:
        # Reservation Register (§7.6 Figure 392)
        if cptpl == 2:
            return S.INVALID_FIELD          # persist through power loss: not offered (RESCAP bit 0)
        key = self.registrants.get(host)
        if rrega == 0:
            if key is not None:
                return S.SUCCESS if key == nrkey else S.RESERVATION_CONFLICT
            self.registrants[host] = nrkey
        elif rrega == 1:
            if key is None or (not iekey and key != crkey):
                return S.RESERVATION_CONFLICT
            self._drop(host)
        elif rrega == 2:
            if key is None and not iekey and crkey != 0:
                return S.RESERVATION_CONFLICT
            if key is not None and not iekey and key != crkey:
                return S.RESERVATION_CONFLICT
            self.registrants[host] = nrkey
        else:
            return S.INVALID_FIELD
        self.generation += 1
        return S.SUCCESS

    def acquire(self, host: bytes, racqa: int, rtype: int, iekey: bool, crkey: int, prkey: int) -> int:
        # Reservation Acquire (§7.5 Figure 388)
        if rtype not in range(1, 7) or racqa > 2:
            return S.INVALID_FIELD
        key = self.registrants.get(host)
        if key is None or (not iekey and key != crkey):
            return S.RESERVATION_CONFLICT
        if racqa == 0:
            if self.rtype and not self._holds(host):
                return S.RESERVATION_CONFLICT
            if self.rtype and self.rtype != rtype:
                return S.RESERVATION_CONFLICT
            self.holder, self.rtype = host, rtype
            return S.SUCCESS
        # preempt (1) / preempt and abort (2): commands here finish quickly, nothing to abort (§8.19.7)
        all_regs = self.rtype in (WE_ALL_REGISTRANTS, EA_ALL_REGISTRANTS)
        if all_regs and prkey == 0:
            for h in [h for h in self.registrants if h != host]:
                del self.registrants[h]
            self.holder, self.rtype = host, rtype
        else:
            victims = [h for h, k in self.registrants.items() if k == prkey and h != host]
            holder_key = self.registrants.get(self.holder) if self.holder is not None else None
            if not victims and not (self.rtype and holder_key == prkey):
                return S.RESERVATION_CONFLICT
            took = self.rtype and not all_regs and holder_key == prkey
            for h in victims:
                del self.registrants[h]
            if took or (self.holder is not None and self.holder not in self.registrants):
                self.holder, self.rtype = host, rtype
            elif not self.rtype:
                pass
        self.generation += 1
        return S.SUCCESS

    def release(self, host: bytes, rrela: int, rtype: int, iekey: bool, crkey: int) -> int:
        # Reservation Release (§7.7 Figure 394)
        key = self.registrants.get(host)
        if key is None or (not iekey and key != crkey):
            return S.RESERVATION_CONFLICT
        if rrela == 0:
            if self.rtype and self._holds(host):
                if rtype != self.rtype:
                    return S.INVALID_FIELD
                self.holder, self.rtype = None, 0
            return S.SUCCESS
        if rrela == 1:
            self.registrants.clear()
            self.holder, self.rtype = None, 0
            self.generation += 1
            return S.SUCCESS
        return S.INVALID_FIELD

    # ---- the whole state as data (a replicated volume's nodes share it: node/replicas.py)

    def state(self) -> dict[str, Any]:
        return {"generation": self.generation, "rtype": self.rtype,
                "holder": self.holder.hex() if self.holder is not None else None,
                "registrants": {h.hex(): k for h, k in self.registrants.items()}}

    def apply_state(self, state: dict[str, Any]) -> None:
        self.generation = int(state["generation"])
        self.rtype = int(state["rtype"])
        self.holder = bytes.fromhex(state["holder"]) if state.get("holder") else None
        self.registrants = {bytes.fromhex(h): int(k) for h, k in state["registrants"].items()}

    def report(self, eds: bool, size: int) -> tuple[int, bytes]:
        """Reservation Report (§7.8): (status, data of at most `size` bytes). Over fabrics Host Identifiers
        are 128-bit, which only the extended data structure can carry."""
        if not eds:
            return S.HOST_ID_INCONSISTENT, b""
        out = bytearray(_HDR.pack(self.generation, self.rtype, len(self.registrants), 0))
        out += bytes(64 - len(out))       # Figure 398: extended header is 64 bytes
        for host, key in self.registrants.items():
            holds = 1 if self._holds(host) else 0
            out += _ENTRY_EXT.pack(0xFFFF, holds, key, host)  # CNTLID FFFFh: dynamic controllers (§7.8)
        return S.SUCCESS, bytes(out[:size])
