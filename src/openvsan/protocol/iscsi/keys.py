"""Text keys and their negotiation (RFC 7143 §6.2, §13; RFC 7144 §2.1 for iSCSIProtocolLevel).

The rules live in one table: each key has a kind (how the result is computed), its legal range, what the
target itself offers, and whether it only matters in a normal session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

MAX_KEY_LEN = 63        # RFC 7143 §6.1
MAX_VALUE_LEN = 255     # simple values; long ones (names, addresses) are capped by the PDU (§6.1)
MAX_TEXT_VALUE_LEN = 8192


class TextError(Exception):
    """Malformed key=value text: a protocol error (initiator error during login)."""


def parse_text(data: bytes | memoryview) -> list[tuple[str, str]]:
    """'k=v\\0k=v\\0' → pairs, in order (RFC 7143 §6.1: UTF-8, NUL-separated, '=' without spaces)."""
    raw = bytes(data)
    if not raw:
        return []
    items = raw.split(b"\0")
    if items[-1] == b"":
        items.pop()
    pairs = []
    for item in items:
        if not item:
            continue  # stray padding NULs are tolerated, as most targets do
        key, sep, value = item.partition(b"=")
        if not sep or not key:
            raise TextError(f"malformed key=value: {item[:80]!r}")
        if len(key) > MAX_KEY_LEN:
            raise TextError("key too long")
        if len(value) > MAX_TEXT_VALUE_LEN:
            raise TextError(f"value of {key[:63]!r} too long")
        try:
            pairs.append((key.decode("utf-8"), value.decode("utf-8")))
        except UnicodeDecodeError as e:
            raise TextError("text is not UTF-8") from e
    return pairs


def encode_text(pairs: list[tuple[str, str]]) -> bytes:
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in pairs)


class Kind(Enum):
    LIST = 1          # first of the offered values that we support
    AND = 2           # boolean, result Yes only if both say Yes
    OR = 3            # boolean, result Yes if either says Yes
    MIN = 4           # numerical, the lower value
    MAX = 5           # numerical, the higher value
    DECLARE = 6       # declarative: the sender states its own value
    ANSWER = 7        # fixed answer (obsolete keys)


@dataclass(frozen=True)
class KeySpec:
    kind: Kind
    ours: str = ""            # what the target offers/supports
    lo: int = 0
    hi: int = 0
    normal_only: bool = False  # irrelevant in a discovery session
    choices: tuple[str, ...] = ()


KEYS: dict[str, KeySpec] = {
    "HeaderDigest": KeySpec(Kind.LIST, choices=("CRC32C", "None")),                    # §13.1
    "DataDigest": KeySpec(Kind.LIST, choices=("CRC32C", "None")),                      # §13.1
    "MaxConnections": KeySpec(Kind.MIN, "1", 1, 65535, normal_only=True),              # §13.2: no MC/S
    "InitialR2T": KeySpec(Kind.OR, "No", normal_only=True),                            # §13.10
    "ImmediateData": KeySpec(Kind.AND, "Yes", normal_only=True),                       # §13.11
    "MaxRecvDataSegmentLength": KeySpec(Kind.DECLARE, "", 512, (1 << 24) - 1),         # §13.12
    "MaxBurstLength": KeySpec(Kind.MIN, str((1 << 24) - 1), 512, (1 << 24) - 1, normal_only=True),  # §13.13
    "FirstBurstLength": KeySpec(Kind.MIN, str((1 << 24) - 1), 512, (1 << 24) - 1, normal_only=True),  # §13.14
    "DefaultTime2Wait": KeySpec(Kind.MAX, "2", 0, 3600),                                # §13.15
    "DefaultTime2Retain": KeySpec(Kind.MIN, "0", 0, 3600),                              # §13.16: ERL 0 keeps nothing
    "MaxOutstandingR2T": KeySpec(Kind.MIN, "16", 1, 65535, normal_only=True),          # §13.17
    "DataPDUInOrder": KeySpec(Kind.OR, "Yes", normal_only=True),                       # §13.18
    "DataSequenceInOrder": KeySpec(Kind.OR, "Yes", normal_only=True),                  # §13.19
    "ErrorRecoveryLevel": KeySpec(Kind.MIN, "0", 0, 2),                                # §13.20
    "iSCSIProtocolLevel": KeySpec(Kind.MIN, "1", 0, 31),                               # RFC 7144 §2.1
    "TaskReporting": KeySpec(Kind.LIST, choices=("RFC3720",)),                         # §13.23
    "IFMarker": KeySpec(Kind.ANSWER, "No"),                                             # §13.25: markers are gone
    "OFMarker": KeySpec(Kind.ANSWER, "No"),
    "IFMarkInt": KeySpec(Kind.ANSWER, "Irrelevant"),
    "OFMarkInt": KeySpec(Kind.ANSWER, "Irrelevant"),
}
# Declarative keys the initiator states and that need no answer (§13.4, §13.5, §13.6, §13.21).
DECLARED_BY_INITIATOR = {"InitiatorName", "InitiatorAlias", "SessionType", "TargetName"}
# Keys only the target may send (§13.7, §13.8, §13.9); an initiator sending them is in error.
TARGET_ONLY = {"TargetAlias", "TargetAddress", "TargetPortalGroupTag"}
SECURITY_KEYS_PREFIX = "CHAP_"


def is_decimal(value: str) -> bool:
    """§6.1 decimal-constant: ASCII digits only (str.isdigit() also takes '²' and '١', which int() refuses
    or reads as numbers no initiator sent)."""
    return value.isascii() and value.isdigit()


def _bool(value: str) -> bool | None:
    return {"Yes": True, "No": False}.get(value)


@dataclass
class Params:
    """Operational parameters in force for a session/connection, with RFC 7143 defaults."""

    header_digest: bool = False
    data_digest: bool = False
    initial_r2t: bool = True
    immediate_data: bool = True
    initiator_mrdsl: int = 8192        # limit for PDUs we send
    target_mrdsl: int = 8192           # limit for PDUs we receive (we declare a larger one)
    max_burst_length: int = 262144
    first_burst_length: int = 65536
    default_time2wait: int = 2
    default_time2retain: int = 20
    max_outstanding_r2t: int = 1
    data_pdu_in_order: bool = True
    data_sequence_in_order: bool = True
    error_recovery_level: int = 0
    negotiated: set[str] = field(default_factory=set)

    def apply(self, key: str, value: str) -> None:
        if key == "HeaderDigest":
            self.header_digest = value == "CRC32C"
        elif key == "DataDigest":
            self.data_digest = value == "CRC32C"
        elif key == "InitialR2T":
            self.initial_r2t = value == "Yes"
        elif key == "ImmediateData":
            self.immediate_data = value == "Yes"
        elif key == "MaxBurstLength":
            self.max_burst_length = int(value)
        elif key == "FirstBurstLength":
            self.first_burst_length = int(value)
        elif key == "DefaultTime2Wait":
            self.default_time2wait = int(value)
        elif key == "DefaultTime2Retain":
            self.default_time2retain = int(value)
        elif key == "MaxOutstandingR2T":
            self.max_outstanding_r2t = int(value)
        elif key == "DataPDUInOrder":
            self.data_pdu_in_order = value == "Yes"
        elif key == "DataSequenceInOrder":
            self.data_sequence_in_order = value == "Yes"
        elif key == "ErrorRecoveryLevel":
            self.error_recovery_level = int(value)


def negotiate_key(key: str, value: str, *, discovery: bool, params: Params) -> str | None:
    """The target's answer to one offered key (RFC 7143 §6.2), applying the result to params.

    Returns None for declarations that take no answer.
    """
    if key.startswith(("X-", "X#")):
        return "NotUnderstood"  # §13.24: private extensions we do not implement
    if value in ("NotUnderstood", "Irrelevant", "Reject"):
        return None  # an answer to something we offered
    if key == "MaxRecvDataSegmentLength":
        if not is_decimal(value) or not 512 <= int(value) <= (1 << 24) - 1:
            return "Reject"
        params.initiator_mrdsl = int(value)
        return None
    spec = KEYS.get(key)
    if spec is None:
        return "NotUnderstood"
    if spec.normal_only and discovery:
        return "Irrelevant"
    if spec.kind is Kind.ANSWER:
        return spec.ours
    if spec.kind is Kind.LIST:
        offered = [v.strip() for v in value.split(",")]
        for v in offered:
            if v in spec.choices:
                params.apply(key, v)
                return v
        return "Reject"
    if spec.kind in (Kind.AND, Kind.OR):
        b = _bool(value)
        if b is None:
            return "Reject"
        ours = spec.ours == "Yes"
        result = (b and ours) if spec.kind is Kind.AND else (b or ours)
        answer = "Yes" if result else "No"
        params.apply(key, answer)
        return answer
    # numerical
    if not is_decimal(value) or len(value) > 10:
        return "Reject"
    n = int(value)
    if not spec.lo <= n <= spec.hi:
        return "Reject"
    ours_n = int(spec.ours)
    result_n = min(n, ours_n) if spec.kind is Kind.MIN else max(n, ours_n)
    params.apply(key, str(result_n))
    return str(result_n)
