"""Status codes, fixed-format sense data and the one mapping of block errors to sense (SPC-4 4.5)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from openvsan.block.errors import (
    BlockError,
    Busy,
    DeviceFailed,
    Locked,
    MediumError,
    NoSpace,
    OutOfRange,
    ReadOnly,
)

# SAM-5 5.3.1 status codes
GOOD = 0x00
CHECK_CONDITION = 0x02
CONDITION_MET = 0x04
BUSY = 0x08
RESERVATION_CONFLICT = 0x18
TASK_SET_FULL = 0x28
TASK_ABORTED = 0x40

# SPC-4 4.5.6 sense keys
NO_SENSE = 0x0
RECOVERED_ERROR = 0x1
NOT_READY = 0x2
MEDIUM_ERROR = 0x3
HARDWARE_ERROR = 0x4
ILLEGAL_REQUEST = 0x5
UNIT_ATTENTION = 0x6
DATA_PROTECT = 0x7
BLANK_CHECK = 0x8
COPY_ABORTED = 0xA
ABORTED_COMMAND = 0xB
MISCOMPARE = 0xE

# SPC-4 4.5.6 ASC/ASCQ pairs used here, as (asc << 8) | ascq
ASC_NO_ADDITIONAL = 0x0000
ASC_NOT_READY_CAUSE_NOT_REPORTABLE = 0x0400
ASC_NOT_READY_MANUAL_INTERVENTION = 0x0403   # LOGICAL UNIT NOT READY, MANUAL INTERVENTION REQUIRED
ASC_LU_NOT_ACCESSIBLE_TRANSITION = 0x040A    # LOGICAL UNIT NOT ACCESSIBLE, ASYMMETRIC ACCESS STATE TRANSITION
ASC_LU_NOT_ACCESSIBLE_STANDBY = 0x040B       # ... TARGET PORT IN STANDBY STATE
ASC_LU_NOT_ACCESSIBLE_UNAVAILABLE = 0x040C   # ... TARGET PORT IN UNAVAILABLE STATE
ASC_SANITIZE_IN_PROGRESS = 0x041B
ASC_LU_COMMUNICATION_FAILURE = 0x0800        # LOGICAL UNIT COMMUNICATION FAILURE
ASC_WRITE_ERROR = 0x0C00
ASC_READ_ERROR = 0x1100
ASC_PARAMETER_LIST_LENGTH_ERROR = 0x1A00
ASC_MISCOMPARE_DURING_VERIFY = 0x1D00
ASC_INVALID_OPCODE = 0x2000
ASC_LBA_OUT_OF_RANGE = 0x2100
ASC_INVALID_FIELD_IN_CDB = 0x2400
ASC_LUN_NOT_SUPPORTED = 0x2500
ASC_INVALID_FIELD_IN_PARAMETER_LIST = 0x2600
ASC_PARAMETER_NOT_SUPPORTED = 0x2601
ASC_INVALID_RELEASE_OF_PR = 0x2604
ASC_TOO_MANY_TARGET_DESCRIPTORS = 0x2606
ASC_UNSUPPORTED_TARGET_DESCRIPTOR_TYPE = 0x2607
ASC_TOO_MANY_SEGMENT_DESCRIPTORS = 0x2608
ASC_UNSUPPORTED_SEGMENT_DESCRIPTOR_TYPE = 0x2609
ASC_WRITE_PROTECTED = 0x2700
ASC_SPACE_ALLOCATION_FAILED_WRITE_PROTECT = 0x2707
ASC_POWER_ON_RESET = 0x2900
ASC_POWER_ON_OCCURRED = 0x2901
ASC_BUS_RESET = 0x2902
ASC_BUS_DEVICE_RESET = 0x2903
ASC_DEVICE_INTERNAL_RESET = 0x2904
ASC_I_T_NEXUS_LOSS = 0x2907
ASC_PARAMETERS_CHANGED = 0x2A00
ASC_MODE_PARAMETERS_CHANGED = 0x2A01
ASC_RESERVATIONS_PREEMPTED = 0x2A03
ASC_RESERVATIONS_RELEASED = 0x2A04
ASC_REGISTRATIONS_PREEMPTED = 0x2A05
ASC_ASYMMETRIC_ACCESS_STATE_CHANGED = 0x2A06
ASC_CAPACITY_DATA_HAS_CHANGED = 0x2A09
ASC_COMMANDS_CLEARED_BY_ANOTHER_INITIATOR = 0x2F00
ASC_THIN_PROVISIONING_SOFT_THRESHOLD_REACHED = 0x3807   # SBC-4 4.7.3.7
ASC_SAVING_PARAMETERS_NOT_SUPPORTED = 0x3900
ASC_MEDIUM_NOT_PRESENT = 0x3A00
ASC_REPORTED_LUNS_DATA_CHANGED = 0x3F0E
ASC_INTERNAL_TARGET_FAILURE = 0x4400
ASC_MEDIUM_REMOVAL_PREVENTED = 0x5302
ASC_SANITIZE_COMMAND_FAILED = 0x3103
ASC_COPY_TARGET_DEVICE_NOT_REACHABLE = 0x0D02


@dataclass(frozen=True, slots=True)
class ScsiResult:
    """What one SCSI command comes to: a status, data-in (truncated to ALLOCATION LENGTH) and sense."""

    status: int
    data: bytes | bytearray | memoryview = b""
    sense: bytes = b""


def build_sense(key: int, asc: int, *, info: int | None = None, field: int | None = None, bit: int | None = None,
                in_cdb: bool = True, deferred: bool = False) -> bytes:
    """Fixed-format sense data, 18 bytes (SPC-4 4.5.3).

    asc is (ASC << 8) | ASCQ. info fills INFORMATION (VALID set). field/bit fill the sense-key specific
    field pointer (SPC-4 4.5.2.4.2): byte `field` of the CDB (in_cdb) or of the parameter list.
    """
    sense = bytearray(18)
    sense[0] = 0x71 if deferred else 0x70
    sense[2] = key & 0x0F
    sense[7] = 10  # ADDITIONAL SENSE LENGTH
    sense[12] = asc >> 8
    sense[13] = asc & 0xFF
    if info is not None and 0 <= info <= 0xFFFFFFFF:  # a wider value needs descriptor format: VALID stays 0
        sense[0] |= 0x80
        struct.pack_into(">I", sense, 3, info)
    if field is not None:
        b15 = 0x80 | (0x40 if in_cdb else 0)
        if bit is not None:
            b15 |= 0x08 | (bit & 7)
        sense[15] = b15
        struct.pack_into(">H", sense, 16, field)
    return bytes(sense)


class ScsiError(Exception):
    """Raised by a command handler to end the command with CHECK CONDITION (or another status)."""

    def __init__(self, key: int, asc: int, *, info: int | None = None, field: int | None = None,
                 bit: int | None = None, in_cdb: bool = True, status: int = CHECK_CONDITION) -> None:
        super().__init__(f"sense {key:x}/{asc >> 8:02x}/{asc & 0xFF:02x}")
        self.status = status
        self.key, self.asc, self.info, self.field, self.bit, self.in_cdb = key, asc, info, field, bit, in_cdb

    def result(self) -> ScsiResult:
        if self.status != CHECK_CONDITION:
            return ScsiResult(self.status)
        return ScsiResult(CHECK_CONDITION, b"", build_sense(self.key, self.asc, info=self.info, field=self.field,
                                                            bit=self.bit, in_cdb=self.in_cdb))


def invalid_field(byte: int, bit: int | None = None) -> ScsiError:
    """ILLEGAL REQUEST, INVALID FIELD IN CDB, pointing at CDB byte (and bit)."""
    return ScsiError(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_CDB, field=byte, bit=bit)


def invalid_param(byte: int, bit: int | None = None) -> ScsiError:
    """ILLEGAL REQUEST, INVALID FIELD IN PARAMETER LIST, pointing into the parameter list."""
    return ScsiError(ILLEGAL_REQUEST, ASC_INVALID_FIELD_IN_PARAMETER_LIST, field=byte, bit=bit, in_cdb=False)


def param_list_length_error() -> ScsiError:
    return ScsiError(ILLEGAL_REQUEST, ASC_PARAMETER_LIST_LENGTH_ERROR)


def lba_out_of_range() -> ScsiError:
    return ScsiError(ILLEGAL_REQUEST, ASC_LBA_OUT_OF_RANGE)


def write_protected() -> ScsiError:
    return ScsiError(DATA_PROTECT, ASC_WRITE_PROTECTED)


def reservation_conflict() -> ScsiError:
    return ScsiError(0, 0, status=RESERVATION_CONFLICT)


def check_condition(key: int, asc: int, **kw: int) -> ScsiResult:
    return ScsiResult(CHECK_CONDITION, b"", build_sense(key, asc, **kw))  # type: ignore[arg-type]


def block_error_result(exc: BlockError, *, write: bool) -> ScsiResult:
    """The one place block-layer errors become SCSI status and sense (DESIGN.md: typed errors)."""
    if isinstance(exc, Busy):
        return ScsiResult(BUSY)
    if isinstance(exc, Locked):     # an encrypted volume waiting for `vsan volume unlock`
        return check_condition(NOT_READY, ASC_NOT_READY_MANUAL_INTERVENTION)
    if isinstance(exc, OutOfRange):
        return check_condition(ILLEGAL_REQUEST, ASC_LBA_OUT_OF_RANGE)
    if isinstance(exc, MediumError):
        asc = ASC_WRITE_ERROR if (exc.write or write) else ASC_READ_ERROR
        if exc.lba is not None:
            return check_condition(MEDIUM_ERROR, asc, info=exc.lba)
        return check_condition(MEDIUM_ERROR, asc)
    if isinstance(exc, NoSpace):
        return check_condition(DATA_PROTECT, ASC_SPACE_ALLOCATION_FAILED_WRITE_PROTECT)
    if isinstance(exc, ReadOnly):
        return check_condition(DATA_PROTECT, ASC_WRITE_PROTECTED)
    if isinstance(exc, DeviceFailed):
        return check_condition(HARDWARE_ERROR, ASC_INTERNAL_TARGET_FAILURE)
    return check_condition(HARDWARE_ERROR, ASC_INTERNAL_TARGET_FAILURE)


def parse_sense(sense: bytes) -> tuple[int, int]:
    """(sense key, ASC<<8|ASCQ) of fixed-format sense; for tests and logs."""
    return sense[2] & 0x0F, (sense[12] << 8) | sense[13]
