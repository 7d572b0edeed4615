"""Implicit ALUA (SPC-4 5.15): target port groups, REPORT TARGET PORT GROUPS (SPC-4 6.36), TPGS in INQUIRY,
the VPD 83h port designators, ASYMMETRIC ACCESS STATE CHANGED, and what each access state refuses, on the
normal path and the iSCSI fast path alike. Driven with CDB bytes through ScsiTarget.execute."""

from __future__ import annotations

import asyncio
import struct
import uuid
from typing import Any

import pytest
from test_iscsi_fastpath import BLOCKS, BS, _pdus, both, cmd, rw

from openvsan.block.ram import RamDevice
from openvsan.frontend.iscsi import Connection
from openvsan.protocol.scsi import CHECK_CONDITION, GOOD, Lun, Nexus, ScsiResult, ScsiTarget, parse_sense
from openvsan.protocol.scsi.alua import AccessState, TargetPortGroup, TargetPortGroups
from openvsan.volume import Volume

IQN = "iqn.2026-11.org.openvsan:alua"
P1 = Nexus("iqn.2026-11.org.openvsan.test:init1", 0x23D000000001, IQN, 1)   # in on relative target port 1
P2 = Nexus("iqn.2026-11.org.openvsan.test:init1", 0x23D000000002, IQN, 2)   # the same initiator, port 2
P2B = Nexus("iqn.2026-11.org.openvsan.test:init2", 0x23D000000003, IQN, 2)  # another initiator on port 2

AO, AN, SB, UA, TR = (AccessState.ACTIVE_OPTIMIZED, AccessState.ACTIVE_NON_OPTIMIZED, AccessState.STANDBY,
                      AccessState.UNAVAILABLE, AccessState.TRANSITIONING)
NOT_READY, STANDBY, UNAVAILABLE, TRANSITION = 2, 0x040B, 0x040C, 0x040A
STATE_CHANGED = 0x2A06


def rtpg(fmt: int = 0, alloc: int = 1024) -> bytes:
    return struct.pack(">BBxxxxIxx", 0xA3, (fmt << 5) | 0x0A, alloc)


def two_groups(**kw: Any) -> TargetPortGroups:
    return TargetPortGroups([TargetPortGroup(1, frozenset({1}), AO, preferred=True),
                             TargetPortGroup(2, frozenset({2}), SB)], **kw)


class Harness:
    def __init__(self, alua: TargetPortGroups | None = None) -> None:
        self.lun = Lun(Volume(RamDevice(BLOCKS, BS), name="d", uuid=uuid.UUID(int=7), serial="S"), alua=alua)
        self.target = ScsiTarget(IQN, {0: self.lun})

    def run(self, cdb: bytes | list[int], nexus: Nexus = P1, data: bytes = b"") -> ScsiResult:
        return asyncio.run(self.target.execute(0, bytes(cdb), memoryview(data), nexus))

    def ok(self, cdb: bytes | list[int], nexus: Nexus = P1, data: bytes = b"") -> bytes:
        r = self.run(cdb, nexus, data)
        assert r.status == GOOD, parse_sense(r.sense) if r.sense else r.status
        return bytes(r.data)

    def sense(self, cdb: bytes | list[int], nexus: Nexus = P1, data: bytes = b"") -> tuple[int, int]:
        r = self.run(cdb, nexus, data)
        assert r.status == CHECK_CONDITION, r.status
        return parse_sense(r.sense)


def port_designators(page: bytes) -> dict[int, int]:
    """{designator type: value} of the target port designators (association 01b) with a 4-byte value."""
    out, pos = {}, 4
    while pos < len(page):
        kind, length = page[pos + 1], page[pos + 3]
        if (kind >> 4) & 3 == 1 and length == 4:
            out[kind & 0x0F] = struct.unpack_from(">xxH", page, pos + 4)[0]
        pos += 4 + length
    return out


# ---- INQUIRY and VPD 83h

def test_standard_inquiry_says_implicit_alua() -> None:
    std = Harness().ok([0x12, 0, 0, 0, 255, 0])
    assert std[5] & 0x30 == 0x10       # TPGS 01b: implicit only
    assert std[5] & 0x08               # 3PC kept


def test_vpd_83_names_the_port_and_its_group() -> None:
    h = Harness(two_groups())
    assert port_designators(h.ok([0x12, 1, 0x83, 0, 255, 0], P1)) == {4: 1, 5: 1}
    assert port_designators(h.ok([0x12, 1, 0x83, 0, 255, 0], P2)) == {4: 2, 5: 2}
    # the default model: one group (1), every port in it
    single = Harness()
    assert port_designators(single.ok([0x12, 1, 0x83, 0, 255, 0], P2)) == {4: 2, 5: 1}
    # a port no group lists, with no default group: no group designator, and the LU is unavailable there
    h3 = Harness(TargetPortGroups([TargetPortGroup(1, frozenset({1}))]))
    p3 = Nexus("iqn.x:y", 1, IQN, 3)
    assert port_designators(h3.ok([0x12, 1, 0x83, 0, 255, 0], p3)) == {4: 3}
    assert h3.sense([0x00] * 6, p3) == (NOT_READY, UNAVAILABLE)


def test_vpd_83_of_a_single_node_export_is_unchanged() -> None:
    """Port 1, group 1: the bytes a single-node export reported before ALUA (designators 4 and 5 = 1)."""
    page = Harness().ok([0x12, 1, 0x83, 0, 255, 0])
    assert bytes.fromhex("5194000400000001") in page and bytes.fromhex("5195000400000001") in page


# ---- REPORT TARGET PORT GROUPS

def test_rtpg_one_group() -> None:
    out = Harness().ok(rtpg())
    # length 12; AO, T/U/S/AN/AO supported, group 1, no status, 1 port: relative port 1 (this nexus's)
    assert out == bytes.fromhex("0000000c" "008f0001" "00000001" "00000001")


def test_rtpg_two_groups_both_formats() -> None:
    h = Harness(two_groups(transition_time=30))
    plain = h.ok(rtpg(0))
    assert plain == bytes.fromhex("00000018" "808f0001" "00000001" "00000001"
                                  "028f0002" "00000001" "00000002")
    ext = h.ok(rtpg(1))
    # RETURN DATA LENGTH counts the rest of the extended header; FORMAT TYPE 001b, 30 s
    assert ext == bytes.fromhex("0000001c" "101e0000") + plain[4:]


def test_rtpg_allocation_length_cuts_the_data() -> None:
    h = Harness(two_groups())
    full = h.ok(rtpg(0))
    for alloc in (0, 2, 4, 13, len(full) - 1):
        assert h.ok(rtpg(0, alloc)) == full[:alloc]
    assert h.ok(rtpg(0, 4)) == b"\x00\x00\x00\x18"    # the header still tells the whole length


def test_rtpg_refuses_a_reserved_format() -> None:
    h = Harness()
    r = h.run(rtpg(2))
    assert r.status == CHECK_CONDITION and parse_sense(r.sense) == (5, 0x2400)
    assert r.sense[15] == 0xC0 | 0x08 | 7 and r.sense[16:18] == b"\x00\x01"   # CDB byte 1, bit 7


def test_rtpg_lists_every_port_the_default_group_was_reached_through() -> None:
    h = Harness()
    h.ok([0x00] * 6, P2)
    out = h.ok(rtpg(), P1)
    assert out[11] == 2 and out[12:20] == bytes.fromhex("0000000100000002")


def test_rtpg_is_in_report_supported_operation_codes() -> None:
    h = Harness()
    out = h.ok([0xA3, 0x0C, 0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0])
    n = struct.unpack_from(">I", out)[0] // 8
    assert (0xA3, 0x0A) in {(out[4 + 8 * i], struct.unpack_from(">H", out, 6 + 8 * i)[0]) for i in range(n)}
    one = h.ok([0xA3, 0x0C, 0x03, 0xA3, 0, 0x0A, 0, 0, 0, 64, 0, 0])
    assert one[1] & 7 == 3 and one[4:16] == bytes((0xA3, 0xEA, 0, 0, 0, 0, 255, 255, 255, 255, 0, 0))


# ---- state changes and the unit attention

def test_a_state_change_raises_one_unit_attention_per_nexus() -> None:
    model = two_groups()
    h = Harness(model)
    for n in (P1, P2, P2B):
        h.run([0x00] * 6, n)
    model.set_states({1: SB, 2: AO})
    for n in (P1, P2, P2B):
        assert h.sense([0x00] * 6, n) == (6, STATE_CHANGED)   # once ...
    h.ok([0x00] * 6, P2)
    h.ok([0x00] * 6, P2B)                                       # ... then the new state: port 2 serves
    assert h.sense([0x00] * 6, P1) == (NOT_READY, STANDBY)      # and port 1 is standby
    out = h.ok(rtpg())
    assert out[4] == 0x80 | SB and out[9] == 0x02               # status: altered by implicit ALUA
    assert out[16] == AO and out[21] == 0x02
    model.set_state(2, AO)                                      # no change: no unit attention
    h.ok([0x00] * 6, P2)


def test_the_unit_attention_comes_before_the_refusal_and_inquiry_does_not_take_it() -> None:
    model = two_groups()
    h = Harness(model)
    h.run([0x00] * 6, P1)
    model.set_state(1, UA)
    h.ok([0x12, 0, 0, 0, 36, 0], P1)                             # INQUIRY: the UA stays (SPC-4 5.14)
    assert h.sense([0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], P1) == (6, STATE_CHANGED)
    assert h.sense([0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], P1) == (NOT_READY, UNAVAILABLE)


def test_set_alua_swaps_the_model_and_tells_the_nexuses() -> None:
    h = Harness()
    h.run([0x00] * 6, P1)
    h.lun.set_alua(TargetPortGroups.single())                  # the same: nothing to tell
    h.ok([0x00] * 6, P1)
    model = two_groups()
    h.lun.set_alua(model)
    assert h.sense([0x00] * 6, P1) == (6, STATE_CHANGED)
    h.ok([0x00] * 6, P1)
    h.lun.unlisten()
    model.set_state(1, SB)                                      # gone: the LU no longer hears of it
    assert h.lun.unit_attentions == {}


def test_the_model_refuses_what_it_cannot_report() -> None:
    with pytest.raises(ValueError, match="groups 1 and 2"):
        TargetPortGroups([TargetPortGroup(1, frozenset({1})), TargetPortGroup(2, frozenset({1}))])
    with pytest.raises(ValueError, match="use 1 to 65535"):
        TargetPortGroups([TargetPortGroup(0)])
    with pytest.raises(ValueError, match="relative target port 70000"):
        TargetPortGroups([TargetPortGroup(1, frozenset({70000}))])
    with pytest.raises(ValueError, match="listed twice"):
        TargetPortGroups([TargetPortGroup(1), TargetPortGroup(1)])
    with pytest.raises(ValueError, match="default target port group 9"):
        TargetPortGroups([TargetPortGroup(1)], default=9)
    with pytest.raises(ValueError, match="0 to 255"):
        TargetPortGroups([TargetPortGroup(1)], transition_time=256)
    model = two_groups()
    with pytest.raises(ValueError, match="no target port group 3"):
        model.set_state(3, AO)
    with pytest.raises(ValueError, match="not an access state"):
        model.set_state(1, 0x0E)   # offline: a secondary state this target does not offer
    assert model.groups[1].state == AO


# ---- what each state lets through (SPC-4 5.15.2.4, 5.15.2.5)

READ10 = [0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0]
WRITE10 = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0]
COMMANDS: dict[str, tuple[list[int] | bytes, bytes]] = {
    "TEST UNIT READY": ([0x00] * 6, b""),
    "READ(10)": (READ10, b""),
    "WRITE(10)": (WRITE10, bytes(BS)),
    "SYNCHRONIZE CACHE(10)": ([0x35] + [0] * 9, b""),
    "READ CAPACITY(10)": ([0x25] + [0] * 9, b""),
    "READ CAPACITY(16)": ([0x9E, 0x10] + [0] * 11 + [32, 0, 0], b""),
    "MODE SENSE(6)": ([0x1A, 0, 0x3F, 0, 255, 0], b""),
    "PERSISTENT RESERVE IN": ([0x5E, 0, 0, 0, 0, 0, 0, 0, 255, 0], b""),
    "REPORT SUPPORTED OPERATION CODES": ([0xA3, 0x0C, 0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0], b""),
    "INQUIRY": ([0x12, 0, 0, 0, 36, 0], b""),
    "REQUEST SENSE": ([0x03, 0, 0, 0, 18, 0], b""),
    "REPORT TARGET PORT GROUPS": (rtpg(), b""),
    "REPORT LUNS": ([0xA0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], b""),
}
ALLOWED = {
    AO: set(COMMANDS),
    AN: set(COMMANDS),
    SB: {"READ CAPACITY(10)", "READ CAPACITY(16)", "MODE SENSE(6)", "PERSISTENT RESERVE IN", "INQUIRY",
         "REQUEST SENSE", "REPORT TARGET PORT GROUPS", "REPORT LUNS"},
    UA: {"INQUIRY", "REQUEST SENSE", "REPORT TARGET PORT GROUPS", "REPORT LUNS"},
    TR: {"INQUIRY", "REQUEST SENSE", "REPORT TARGET PORT GROUPS", "REPORT LUNS"},
}
REFUSAL = {SB: STANDBY, UA: UNAVAILABLE, TR: TRANSITION}


@pytest.mark.parametrize("state", [AO, AN, SB, UA, TR], ids=lambda s: s.name)
def test_each_state_lets_through_what_the_spec_lists(state: AccessState) -> None:
    model = two_groups()
    model.set_state(2, state)
    h = Harness(model)
    for name, (c, data) in COMMANDS.items():
        r = h.run(c, P2, data)
        if name in ALLOWED[state]:
            assert r.status == GOOD, (name, parse_sense(r.sense))
        else:
            assert r.status == CHECK_CONDITION and parse_sense(r.sense) == (NOT_READY, REFUSAL[state]), name
        h.ok(c, P1, data)   # port 1, active/optimized, serves all


def test_an_unsupported_opcode_is_still_an_illegal_request_on_a_standby_port() -> None:
    model = two_groups()
    h = Harness(model)
    assert h.sense([0xC5, 0, 0, 0, 0, 0], P2) == (5, 0x2000)


# ---- the fast path: the same refusal, byte for byte

def _setup(states: dict[int, AccessState]) -> Any:
    def setup(unit: Lun, c: Connection) -> None:
        assert c.session is not None and c.session.nexus is not None
        model = TargetPortGroups([TargetPortGroup(c.session.nexus.tpgt, frozenset({c.session.nexus.tpgt}))])
        model.set_states(states)
        unit.set_alua(model)                  # before the nexus is known: no unit attention
        unit.nexuses.add(c.session.nexus)
    return setup


def test_fast_path_refuses_as_the_normal_path_does() -> None:
    data = bytes(range(256)) * 2
    stream = [cmd(1, 1, rw(0x28, 0, 1), read=True, edtl=BS),
              cmd(2, 2, rw(0x2A, 10, 1), write=True, edtl=BS, data=data),
              cmd(3, 3, rw(0x88, 10, 1), read=True, edtl=BS),
              cmd(4, 4, rw(0x8A, 11, 1, 0x08), write=True, edtl=BS, data=data)]
    wanted = {AO: ([0, 0, 0, 0], 4), AN: ([0, 0, 0, 0], 4),
              SB: ([2] * 4, 0), UA: ([2] * 4, 0), TR: ([2] * 4, 0)}
    for state, (statuses, fast_ones) in wanted.items():
        fast, slow, used = both([b"".join(stream)], _setup({1: state}))
        assert fast == slow, state
        assert [p[1] for p in _pdus(fast)] == statuses, state
        assert used == fast_ones, state


def test_lun_fast_path_declines_on_a_standby_port() -> None:
    model = two_groups()
    h = Harness(model)
    h.run([0x00] * 6, P1)
    h.run([0x00] * 6, P2)
    assert h.lun.read_now(bytes(READ10), P1) is not None
    assert h.lun.read_now(bytes(READ10), P2) is None
    assert h.lun.write_now(bytes(WRITE10), bytes(BS), P2) is False
    assert h.sense(READ10, P2) == (NOT_READY, STANDBY)
    model.set_states({1: AN, 2: AN})
    h.run([0x00] * 6, P2)                                   # the unit attention
    assert h.lun.read_now(bytes(READ10), P2) is not None    # active/non-optimized serves, fast
