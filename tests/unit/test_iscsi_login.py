"""The login state machine (RFC 7143 §6, §11.12-13, §12.1.3), driven with PDUs built here."""

import hashlib
import struct
from dataclasses import dataclass

import pytest

from openvsan.frontend.config import ChapCredential
from openvsan.protocol.iscsi import pdu as P
from openvsan.protocol.iscsi.framing import PduReader
from openvsan.protocol.iscsi.keys import encode_text, parse_text
from openvsan.protocol.iscsi.login import LoginFailed, LoginMachine, Status

IQN = "iqn.2026-11.org.openvsan:disk0"
INIT = "iqn.2026-11.org.openvsan.test:init"


@dataclass
class FakeTarget:
    iqn: str = IQN
    allowed_initiators: list | None = None
    alias: str | None = None
    portal_group_tag: int = 1
    chap: ChapCredential | None = None
    mutual_chap: ChapCredential | None = None


def login_pdu(csg: int, nsg: int, transit: bool, keys: list[tuple[str, str]], *, tsih: int = 0, vmin: int = 0,
              cont: bool = False) -> P.Pdu:
    data = encode_text(keys)
    b = bytearray(48)
    b[0] = 0x43
    b[1] = (0x80 if transit else 0) | (0x40 if cont else 0) | csg << 2 | nsg
    b[3] = vmin
    b[5:8] = len(data).to_bytes(3, "big")
    b[8:14] = bytes.fromhex("400000010000")
    struct.pack_into(">HI", b, 14, tsih, 7)
    struct.pack_into(">I", b, 24, 1)
    (pdu,) = PduReader().receive_data(bytes(b) + data + bytes(-len(data) & 3))
    return pdu


def machine(target=None, admitted=None):
    t = target or FakeTarget()
    return LoginMachine(lambda n: t if n == t.iqn else None,
                        lambda st: (admitted.append(st) if admitted is not None else None) or 5)


def answer(result) -> dict[str, str]:
    return dict(parse_text(result.response[1])) if len(result.response) > 1 else {}


def status(result) -> tuple[int, int]:
    b = result.response[0]
    return b[36], b[37]


def test_plain_login_to_full_feature():
    admitted = []
    m = machine(admitted=admitted)
    r = m.receive(login_pdu(0, 1, True, [("InitiatorName", INIT), ("TargetName", IQN), ("SessionType", "Normal"),
                                          ("AuthMethod", "None")]))
    assert status(r) == (0, 0) and not r.done
    a = answer(r)
    assert a["AuthMethod"] == "None" and a["TargetPortalGroupTag"] == "1"
    r = m.receive(login_pdu(1, 3, True, [("HeaderDigest", "CRC32C,None"), ("MaxRecvDataSegmentLength", "65536"),
                                          ("ImmediateData", "Yes"), ("InitialR2T", "No"), ("X-foo", "1")]))
    assert r.done and status(r) == (0, 0)
    a = answer(r)
    assert a["HeaderDigest"] == "CRC32C" and a["X-foo"] == "NotUnderstood" and "MaxRecvDataSegmentLength" in a
    assert r.response[0][1] & 0x83 == 0x83  # T bit, NSG full feature
    assert struct.unpack_from(">H", r.response[0], 14)[0] == 5  # TSIH from admit
    assert admitted[0].params.initiator_mrdsl == 65536 and admitted[0].params.header_digest


@pytest.mark.parametrize("keys,expected", [
    ([("TargetName", IQN)], Status.MISSING_PARAMETER),
    ([("InitiatorName", INIT)], Status.MISSING_PARAMETER),
    ([("InitiatorName", INIT), ("TargetName", "iqn.2026-11.org.example:none")], Status.NOT_FOUND),
    ([("InitiatorName", INIT), ("TargetName", IQN), ("SessionType", "Weird")], Status.SESSION_TYPE_NOT_SUPPORTED),
    ([("InitiatorName", INIT), ("TargetName", IQN), ("TargetName", IQN)], Status.INITIATOR_ERROR),
    ([("InitiatorName", INIT), ("TargetName", IQN), ("TargetAddress", "1.2.3.4")], Status.INITIATOR_ERROR),
])
def test_login_failures(keys, expected):
    r = machine().receive(login_pdu(1, 3, True, keys))
    assert r.failed and status(r) == expected


def test_unsupported_version():
    r = machine().receive(login_pdu(1, 3, True, [("InitiatorName", INIT)], vmin=1))
    assert r.failed and status(r) == Status.UNSUPPORTED_VERSION


def test_acl_refuses_other_initiators():
    m = machine(FakeTarget(allowed_initiators=["iqn.2026-11.org.example:other"]))
    r = m.receive(login_pdu(1, 3, True, [("InitiatorName", INIT), ("TargetName", IQN)]))
    assert r.failed and status(r) == Status.AUTHORIZATION_FAILURE


def test_discovery_session_needs_no_target():
    m = machine()
    r = m.receive(login_pdu(1, 3, True, [("InitiatorName", INIT), ("SessionType", "Discovery"),
                                          ("MaxBurstLength", "8192")]))
    assert r.done and answer(r)["MaxBurstLength"] == "Irrelevant"


def _chap_login(secret: str, mutual: bool = False, mutual_ok: bool = True):
    t = FakeTarget(chap=ChapCredential("alice", "secretsecret12"),
                   mutual_chap=ChapCredential("tgt", "targetsecret34") if mutual else None)
    m = machine(t)
    r = m.receive(login_pdu(0, 1, True, [("InitiatorName", INIT), ("TargetName", IQN),
                                          ("AuthMethod", "CHAP,None")]))
    assert answer(r)["AuthMethod"] == "CHAP" and not r.response[0][1] & 0x80
    r = m.receive(login_pdu(0, 1, False, [("CHAP_A", "7,5")]))
    a = answer(r)
    assert a["CHAP_A"] == "7"
    ident, chal = int(a["CHAP_I"]), bytes.fromhex(a["CHAP_C"][2:])
    resp = hashlib.sha256(bytes([ident]) + secret.encode() + chal).hexdigest()
    keys = [("CHAP_N", "alice"), ("CHAP_R", "0x" + resp)]
    my_chal = b"\x01" * 16
    if mutual:
        keys += [("CHAP_I", "9"), ("CHAP_C", "0x" + my_chal.hex())]
    r = m.receive(login_pdu(0, 1, True, keys))
    return r, my_chal


def test_chap_right_secret_passes():
    r, _ = _chap_login("secretsecret12")
    assert status(r) == (0, 0) and r.response[0][1] & 0x80 and not r.failed


def test_chap_wrong_secret_fails():
    r, _ = _chap_login("wrongwrongwrong")
    assert r.failed and status(r) == Status.AUTH_FAILURE


def test_mutual_chap_answers_the_initiator_challenge():
    r, chal = _chap_login("secretsecret12", mutual=True)
    a = answer(r)
    assert a["CHAP_N"] == "tgt"
    assert a["CHAP_R"] == "0x" + hashlib.sha256(bytes([9]) + b"targetsecret34" + chal).hexdigest()


def test_chap_required_but_skipped():
    m = machine(FakeTarget(chap=ChapCredential("alice", "secretsecret12")))
    r = m.receive(login_pdu(1, 3, True, [("InitiatorName", INIT), ("TargetName", IQN)]))
    assert r.failed and status(r) == Status.AUTH_FAILURE


def test_continued_text_is_joined():
    m = machine()
    first = login_pdu(1, 3, False, [("InitiatorName", INIT)], cont=True)
    r = m.receive(first)
    assert not r.failed and len(r.response) == 1
    r = m.receive(login_pdu(1, 3, True, [("TargetName", IQN)]))
    assert r.done


def test_admit_refusal_is_reported():
    t = FakeTarget()

    def refuse(st):
        raise LoginFailed(Status.TOO_MANY_CONNECTIONS, "no")

    m = LoginMachine(lambda n: t, refuse)
    r = m.receive(login_pdu(1, 3, True, [("InitiatorName", INIT), ("TargetName", IQN)]))
    assert r.failed and status(r) == Status.TOO_MANY_CONNECTIONS
