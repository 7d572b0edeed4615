"""A SCSI target device: its logical units, REPORT LUNS, absent LUNs, resets and I_T nexus loss
(SAM-5 4.6, 6.3; SPC-4 6.33). The iSCSI transport calls this; it never touches a socket."""

from __future__ import annotations

import struct

from openvsan.protocol.scsi.inquiry import PERIPHERAL_ABSENT, standard_inquiry
from openvsan.protocol.scsi.lun import Lun
from openvsan.protocol.scsi.nexus import Nexus
from openvsan.protocol.scsi.sense import (
    ASC_BUS_DEVICE_RESET,
    ASC_INVALID_FIELD_IN_CDB,
    ASC_LUN_NOT_SUPPORTED,
    ASC_NO_ADDITIONAL,
    ASC_POWER_ON_OCCURRED,
    ASC_POWER_ON_RESET,
    ASC_REPORTED_LUNS_DATA_CHANGED,
    CHECK_CONDITION,
    GOOD,
    ILLEGAL_REQUEST,
    NO_SENSE,
    ScsiResult,
    build_sense,
)

REPORT_LUNS = 0xA0
INQUIRY = 0x12
REQUEST_SENSE = 0x03


def encode_lun(lun: int) -> bytes:
    """SAM-5 4.6.7: peripheral device addressing below 256, flat space addressing up to 16383."""
    if lun < 256:
        return struct.pack(">H6x", lun)
    return struct.pack(">H6x", 0x4000 | (lun & 0x3FFF))


class ScsiTarget:
    def __init__(self, name: str, luns: dict[int, Lun]) -> None:
        self.name = name
        self.luns = luns
        for unit in luns.values():
            unit.peers = luns.values

    # ---- LUNs added and removed while serving (SPC-4 6.33: REPORTED LUNS DATA HAS CHANGED)

    def _nexuses(self) -> set[Nexus]:
        return {n for unit in self.luns.values() for n in unit.nexuses}

    def add_lun(self, number: int, unit: Lun) -> None:
        if number in self.luns:
            raise ValueError(f"{self.name}: LUN {number} exists")
        known = self._nexuses()
        self.luns[number] = unit
        unit.peers = self.luns.values
        for unit_ in self.luns.values():
            for n in known:
                unit_.add_ua(n, ASC_REPORTED_LUNS_DATA_CHANGED)
        for n in known:   # the new LU knows of these nexuses: they may address it at once
            unit.nexuses.add(n)

    def remove_lun(self, number: int) -> Lun:
        unit = self.luns.pop(number)
        known = unit.nexuses | self._nexuses()
        for other in self.luns.values():
            for n in known:
                other.add_ua(n, ASC_REPORTED_LUNS_DATA_CHANGED)
        return unit

    def data_out_length(self, lun: int, cdb: bytes) -> int:
        """Bytes of Data-Out the CDB asks the initiator for (0: none, unknown opcode or absent LUN)."""
        unit = self.luns.get(lun)
        if unit is None or not cdb:
            return 0
        return unit.data_out_length(cdb)

    async def execute(self, lun: int, cdb: bytes, data_out: memoryview, nexus: Nexus, *,
                      expected_length: int | None = None) -> ScsiResult:
        """Run one command. expected_length, where the transport knows it (iSCSI EDTL of a write), lets
        the commands whose Data-Out must match the CDB exactly refuse a mismatch."""
        unit = self.luns.get(lun)
        if cdb[0] == REPORT_LUNS:
            if unit is not None:
                unit.nexuses.add(nexus)
                _clear_ua(unit, nexus, ASC_REPORTED_LUNS_DATA_CHANGED)
            return self._report_luns(cdb)
        if unit is None:
            return self._absent(cdb)
        return await unit.execute(cdb, data_out, nexus, expected_length=expected_length)

    def _report_luns(self, cdb: bytes) -> ScsiResult:
        """REPORT LUNS (SPC-4 6.33): SELECT REPORT 0, 1 (none: no well-known LUs) and 2."""
        if len(cdb) < 12 or cdb[1] or any(cdb[3:6]) or cdb[10] or cdb[11]:
            return _invalid_field(1 if len(cdb) >= 12 and cdb[1] else 3)
        select, alloc = cdb[2], struct.unpack_from(">I", cdb, 6)[0]
        if select > 2:
            return _invalid_field(2)
        if alloc < 16:
            return _invalid_field(6)
        luns = b"" if select == 1 else b"".join(encode_lun(n) for n in sorted(self.luns))
        out = struct.pack(">I4x", len(luns)) + luns
        return ScsiResult(GOOD, out[:alloc])

    def _absent(self, cdb: bytes) -> ScsiResult:
        """A LUN with no logical unit behind it (SPC-4 6.6.2, 6.39, SAM-5 5.9.5)."""
        op = cdb[0]
        if op == INQUIRY:
            if cdb[1] & 0x01:
                return _check(ILLEGAL_REQUEST, ASC_LUN_NOT_SUPPORTED)
            alloc = struct.unpack_from(">H", cdb, 3)[0] if len(cdb) >= 5 else 0
            data = standard_inquiry(PERIPHERAL_ABSENT, removable=False, third_party_copy=False)
            return ScsiResult(GOOD, data[:alloc])
        if op == REQUEST_SENSE:
            alloc = cdb[4] if len(cdb) >= 5 else 0
            return ScsiResult(GOOD, build_sense(ILLEGAL_REQUEST, ASC_LUN_NOT_SUPPORTED)[:alloc])
        return _check(ILLEGAL_REQUEST, ASC_LUN_NOT_SUPPORTED)

    # ---- task management and nexus events (SAM-5 7.x; the transport decides when they happen)

    def logical_unit_reset(self, lun: int, nexus: Nexus) -> None:
        unit = self.luns.get(lun)
        if unit is not None:
            unit.reset(ASC_BUS_DEVICE_RESET)

    def target_reset(self, nexus: Nexus, cold: bool) -> None:
        for unit in self.luns.values():
            if cold:
                # a cold reset is a power cycle: registrations without APTPL are gone (SPC-4 5.13.4)
                if not unit.pr.aptpl:
                    unit.pr.reset()
                unit.reset(ASC_POWER_ON_OCCURRED)
            else:
                unit.reset(ASC_POWER_ON_RESET)

    def nexus_lost(self, nexus: Nexus) -> None:
        for unit in self.luns.values():
            unit.nexus_lost(nexus)

    async def flush_all(self) -> None:
        for unit in self.luns.values():
            await unit.volume.flush()


def _clear_ua(unit: Lun, nexus: Nexus, asc: int) -> None:
    pending = unit.unit_attentions.get(nexus)
    if pending and asc in pending:
        pending.remove(asc)
        if not pending:
            del unit.unit_attentions[nexus]


def _check(key: int, asc: int) -> ScsiResult:
    return ScsiResult(CHECK_CONDITION, b"", build_sense(key, asc))


def _invalid_field(byte: int) -> ScsiResult:
    return ScsiResult(CHECK_CONDITION, b"", build_sense(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_CDB, field=byte))


__all__ = ["ASC_NO_ADDITIONAL", "NO_SENSE", "ScsiTarget", "encode_lun"]
