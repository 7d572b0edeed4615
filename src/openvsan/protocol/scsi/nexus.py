"""The I_T nexus: which initiator port talks to which target port (SAM-5 4.7)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Nexus:
    initiator_name: str   # iSCSI initiator name; with the ISID it names the initiator port (RFC 7143 §4.4)
    isid: int             # 48-bit session identifier
    target_name: str
    tpgt: int = 1         # target portal group tag: the target port
    # every command looks its nexus up in a set: the hash is worked out once
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.initiator_name, self.isid, self.target_name, self.tpgt)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def initiator_port(self) -> str:
        # RFC 7143 §13.1: "iqn...,i,0x<ISID in 12 hex digits>"
        return f"{self.initiator_name},i,0x{self.isid:012x}"
