"""The I_T nexus: which initiator port talks to which target port (SAM-5 4.7)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Nexus:
    initiator_name: str   # iSCSI initiator name; with the ISID it names the initiator port (RFC 7143 §4.4)
    isid: int             # 48-bit session identifier
    target_name: str
    tpgt: int = 1         # target portal group tag: the target port

    @property
    def initiator_port(self) -> str:
        # RFC 7143 §13.1: "iqn...,i,0x<ISID in 12 hex digits>"
        return f"{self.initiator_name},i,0x{self.isid:012x}"
