"""The commands this logical unit supports, with their CDB usage data (SPC-4 6.35.3, REPORT SUPPORTED
OPERATION CODES), reservation access class (SPC-4 5.13.1 table 62, SBC-4 4.17) and timeouts.

The usage data is also what the dispatcher checks a CDB against: a bit set where the usage data has a zero
is a field we do not implement, and gets INVALID FIELD IN CDB pointing at it. So what REPORT SUPPORTED
OPERATION CODES says is exactly what the dispatcher accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class Access(IntEnum):
    """How a command fares under a reservation held by another I_T nexus."""

    ALWAYS = 0   # allowed under any reservation (INQUIRY, REPORT LUNS, ...)
    READ = 1     # conflicts only with the exclusive-access types
    WRITE = 2    # conflicts with every type held by someone else
    SPECIAL = 3  # decided by the handler (PERSISTENT RESERVE OUT, RESERVE/RELEASE, PREVENT ALLOW)


@dataclass(frozen=True)
class CommandSpec:
    opcode: int
    sa: int | None                 # service action, for commands that have one
    name: str
    usage: bytes                   # CDB usage data; usage[0] is the opcode, len(usage) the CDB length
    access: Access
    spc2_allowed: bool = False     # allowed while another I_T nexus holds a RESERVE(6)/(10) (SPC-2 5.5.1)
    timeout: tuple[int, int] = (0, 30)   # nominal, recommended seconds (SPC-4 6.35.4)
    check_mask: int = field(default=0, compare=False)  # bits that may be set, as an int over the CDB

    def __post_init__(self) -> None:
        mask = bytearray(self.usage)
        if self.sa is not None:
            mask[1] |= 0x1F  # the service action field itself routes the command; it is not a flag
        object.__setattr__(self, "check_mask", int.from_bytes(mask, "big"))


def _u(*b: int) -> bytes:
    return bytes(b)


F = 0xFF
A, R, W, S = Access.ALWAYS, Access.READ, Access.WRITE, Access.SPECIAL

COMMANDS: tuple[CommandSpec, ...] = (
    # SPC-4
    CommandSpec(0x00, None, "TEST UNIT READY", _u(0x00, 0, 0, 0, 0, 0), A),
    CommandSpec(0x03, None, "REQUEST SENSE", _u(0x03, 0x01, 0, 0, F, 0), A, True),
    CommandSpec(0x12, None, "INQUIRY", _u(0x12, 0x01, F, F, F, 0), A, True),
    CommandSpec(0x15, None, "MODE SELECT(6)", _u(0x15, 0x11, 0, 0, F, 0), W),
    CommandSpec(0x16, None, "RESERVE(6)", _u(0x16, 0, 0, 0, 0, 0), S),
    CommandSpec(0x17, None, "RELEASE(6)", _u(0x17, 0, 0, 0, 0, 0), S, True),
    CommandSpec(0x1A, None, "MODE SENSE(6)", _u(0x1A, 0x08, F, F, F, 0), R),
    CommandSpec(0x1B, None, "START STOP UNIT", _u(0x1B, 0x01, 0, 0x0F, 0xF7, 0), W),
    CommandSpec(0x1E, None, "PREVENT ALLOW MEDIUM REMOVAL", _u(0x1E, 0, 0, 0, 0x03, 0), S, True),
    CommandSpec(0x55, None, "MODE SELECT(10)", _u(0x55, 0x11, 0, 0, 0, 0, 0, F, F, 0), W),
    CommandSpec(0x56, None, "RESERVE(10)", _u(0x56, 0, 0, 0, 0, 0, 0, 0, 0, 0), S),
    CommandSpec(0x57, None, "RELEASE(10)", _u(0x57, 0, 0, 0, 0, 0, 0, 0, 0, 0), S, True),
    CommandSpec(0x5A, None, "MODE SENSE(10)", _u(0x5A, 0x18, F, F, 0, 0, 0, F, F, 0), R),
    CommandSpec(0x5E, 0x00, "PERSISTENT RESERVE IN / READ KEYS", _u(0x5E, 0x00, 0, 0, 0, 0, 0, F, F, 0), A),
    CommandSpec(0x5E, 0x01, "PERSISTENT RESERVE IN / READ RESERVATION", _u(0x5E, 0x01, 0, 0, 0, 0, 0, F, F, 0), A),
    CommandSpec(0x5E, 0x02, "PERSISTENT RESERVE IN / REPORT CAPABILITIES",
                _u(0x5E, 0x02, 0, 0, 0, 0, 0, F, F, 0), A),
    CommandSpec(0x5E, 0x03, "PERSISTENT RESERVE IN / READ FULL STATUS", _u(0x5E, 0x03, 0, 0, 0, 0, 0, F, F, 0), A),
    *(CommandSpec(0x5F, sa, f"PERSISTENT RESERVE OUT / {name}", _u(0x5F, sa, F, 0, 0, F, F, F, F, 0), S)
      for sa, name in ((0, "REGISTER"), (1, "RESERVE"), (2, "RELEASE"), (3, "CLEAR"), (4, "PREEMPT"),
                       (5, "PREEMPT AND ABORT"), (6, "REGISTER AND IGNORE EXISTING KEY"),
                       (7, "REGISTER AND MOVE"))),
    CommandSpec(0xA0, None, "REPORT LUNS", _u(0xA0, 0, F, 0, 0, 0, F, F, F, F, 0, 0), A, True),
    CommandSpec(0xA3, 0x0C, "REPORT SUPPORTED OPERATION CODES",
                _u(0xA3, 0x0C, 0x87, F, F, F, F, F, F, F, 0, 0), A, True),
    CommandSpec(0xA3, 0x0D, "REPORT SUPPORTED TASK MANAGEMENT FUNCTIONS",
                _u(0xA3, 0x0D, 0x80, 0, 0, 0, F, F, F, F, 0, 0), A, True),
    # SPC-4 6.36; PARAMETER DATA FORMAT in byte 1 bits 7-5. Allowed under any reservation (SPC-4 5.13.1):
    # a multipath initiator asks it on every path
    CommandSpec(0xA3, 0x0A, "REPORT TARGET PORT GROUPS", _u(0xA3, 0xEA, 0, 0, 0, 0, F, F, F, F, 0, 0), A, True),
    CommandSpec(0x83, 0x00, "EXTENDED COPY(LID1)", _u(0x83, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, F, F, F, F, 0, 0), W),
    CommandSpec(0x84, 0x00, "RECEIVE COPY RESULTS / COPY STATUS",
                _u(0x84, 0x00, F, 0, 0, 0, 0, 0, 0, 0, F, F, F, F, 0, 0), R),
    CommandSpec(0x84, 0x03, "RECEIVE COPY RESULTS / OPERATING PARAMETERS",
                _u(0x84, 0x03, 0, 0, 0, 0, 0, 0, 0, 0, F, F, F, F, 0, 0), R),
    # SBC-4
    CommandSpec(0x08, None, "READ(6)", _u(0x08, 0x1F, F, F, F, 0), R),
    CommandSpec(0x0A, None, "WRITE(6)", _u(0x0A, 0x1F, F, F, F, 0), W),
    CommandSpec(0x25, None, "READ CAPACITY(10)", _u(0x25, 0, F, F, F, F, 0, 0, 0x01, 0), A),
    CommandSpec(0x28, None, "READ(10)", _u(0x28, 0x18, F, F, F, F, 0x1F, F, F, 0), R),
    CommandSpec(0x2A, None, "WRITE(10)", _u(0x2A, 0x18, F, F, F, F, 0x1F, F, F, 0), W),
    CommandSpec(0x2E, None, "WRITE AND VERIFY(10)", _u(0x2E, 0x16, F, F, F, F, 0x1F, F, F, 0), W),
    CommandSpec(0x2F, None, "VERIFY(10)", _u(0x2F, 0x16, F, F, F, F, 0x1F, F, F, 0), R),
    CommandSpec(0x34, None, "PRE-FETCH(10)", _u(0x34, 0x02, F, F, F, F, 0x1F, F, F, 0), R),
    CommandSpec(0x35, None, "SYNCHRONIZE CACHE(10)", _u(0x35, 0x02, F, F, F, F, 0x1F, F, F, 0), W),
    CommandSpec(0x37, None, "READ DEFECT DATA(10)", _u(0x37, 0, 0x1F, 0, 0, 0, 0, F, F, 0), R),
    CommandSpec(0x41, None, "WRITE SAME(10)", _u(0x41, 0x08, F, F, F, F, 0x1F, F, F, 0), W),
    CommandSpec(0x42, None, "UNMAP", _u(0x42, 0, 0, 0, 0, 0, 0x1F, F, F, 0), W),
    CommandSpec(0x48, 0x01, "SANITIZE / OVERWRITE", _u(0x48, 0x81 | 0x20, 0, 0, 0, 0, 0, F, F, 0), W,
                timeout=(60, 3600)),
    CommandSpec(0x48, 0x02, "SANITIZE / BLOCK ERASE", _u(0x48, 0x82 | 0x20, 0, 0, 0, 0, 0, F, F, 0), W,
                timeout=(60, 3600)),
    CommandSpec(0x48, 0x03, "SANITIZE / CRYPTOGRAPHIC ERASE", _u(0x48, 0x83 | 0x20, 0, 0, 0, 0, 0, F, F, 0), W,
                timeout=(60, 3600)),
    CommandSpec(0x48, 0x1F, "SANITIZE / EXIT FAILURE MODE", _u(0x48, 0x9F | 0x20, 0, 0, 0, 0, 0, F, F, 0), W),
    CommandSpec(0x88, None, "READ(16)", _u(0x88, 0x18, F, F, F, F, F, F, F, F, F, F, F, F, 0x1F, 0), R),
    CommandSpec(0x89, None, "COMPARE AND WRITE", _u(0x89, 0x18, F, F, F, F, F, F, F, F, 0, 0, 0, F, 0x1F, 0), W),
    CommandSpec(0x8A, None, "WRITE(16)", _u(0x8A, 0x18, F, F, F, F, F, F, F, F, F, F, F, F, 0x1F, 0), W),
    CommandSpec(0x8B, None, "ORWRITE(16)", _u(0x8B, 0x18, F, F, F, F, F, F, F, F, F, F, F, F, 0x1F, 0), W),
    CommandSpec(0x8E, None, "WRITE AND VERIFY(16)", _u(0x8E, 0x16, F, F, F, F, F, F, F, F, F, F, F, F, 0x1F, 0), W),
    CommandSpec(0x8F, None, "VERIFY(16)", _u(0x8F, 0x16, F, F, F, F, F, F, F, F, F, F, F, F, 0x1F, 0), R),
    CommandSpec(0x90, None, "PRE-FETCH(16)", _u(0x90, 0x02, F, F, F, F, F, F, F, F, F, F, F, F, 0x1F, 0), R),
    CommandSpec(0x91, None, "SYNCHRONIZE CACHE(16)",
                _u(0x91, 0x02, F, F, F, F, F, F, F, F, F, F, F, F, 0x1F, 0), W),
    CommandSpec(0x93, None, "WRITE SAME(16)", _u(0x93, 0x09, F, F, F, F, F, F, F, F, F, F, F, F, 0x1F, 0), W),
    CommandSpec(0x9C, None, "WRITE ATOMIC(16)", _u(0x9C, 0x18, F, F, F, F, F, F, F, F, F, F, F, F, 0x1F, 0), W),
    CommandSpec(0x9E, 0x10, "READ CAPACITY(16)", _u(0x9E, 0x10, F, F, F, F, F, F, F, F, F, F, F, F, 0x01, 0), A),
    CommandSpec(0x9E, 0x12, "GET LBA STATUS", _u(0x9E, 0x12, F, F, F, F, F, F, F, F, F, F, F, F, 0, 0), R),
    CommandSpec(0xA8, None, "READ(12)", _u(0xA8, 0x18, F, F, F, F, F, F, F, F, 0x1F, 0), R),
    CommandSpec(0xAA, None, "WRITE(12)", _u(0xAA, 0x18, F, F, F, F, F, F, F, F, 0x1F, 0), W),
    CommandSpec(0xAE, None, "WRITE AND VERIFY(12)", _u(0xAE, 0x16, F, F, F, F, F, F, F, F, 0x1F, 0), W),
    CommandSpec(0xAF, None, "VERIFY(12)", _u(0xAF, 0x16, F, F, F, F, F, F, F, F, 0x1F, 0), R),
    CommandSpec(0xB7, None, "READ DEFECT DATA(12)", _u(0xB7, 0x1F, 0, 0, 0, 0, F, F, F, F, 0, 0), R),
)

# opcodes whose service action lives in byte 1 bits 4-0
SERVICE_ACTION_OPCODES = frozenset(c.opcode for c in COMMANDS if c.sa is not None)
