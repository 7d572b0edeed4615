"""The login state machine (RFC 7143 §6.3, §11.12, §11.13) against bad, random and mutated logins.

Scripted cases check the exact status class/detail the RFC asks for; the random loops check, for every
response, that it is a well-formed Login Response, that a failure is a failure (class != 0, connection to
be closed) and that nothing reaches the full feature phase without naming an initiator, a known target
and, where the target asks for it, the right CHAP response.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import budget
import pdus
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openvsan.frontend.config import ChapCredential
from openvsan.protocol.iscsi.chap import ALGORITHMS, response
from openvsan.protocol.iscsi.framing import PduReader
from openvsan.protocol.iscsi.login import LoginMachine, LoginResult, LoginState
from openvsan.protocol.iscsi.pdu import Pdu

TARGET = "iqn.2026-11.org.openvsan:fuzz"
CHAP_TARGET = "iqn.2026-11.org.openvsan:chap"
ACL_TARGET = "iqn.2026-11.org.openvsan:acl"
INITIATOR = "iqn.2026-11.org.openvsan.test:fuzz"
USER, SECRET = "alice", "twelve+chars"

SUCCESS, INITIATOR_ERROR, AUTH_FAILURE, AUTHORIZATION, NOT_FOUND = (0, 0), (2, 0), (2, 1), (2, 2), (2, 3)
UNSUPPORTED_VERSION, MISSING_PARAMETER, SESSION_TYPE, INVALID_DURING_LOGIN = (2, 5), (2, 7), (2, 9), (2, 11)
# What the target may say of its own accord (declarations, CHAP) besides answering our keys.
TARGET_DECLARES = {"TargetPortalGroupTag", "TargetAlias", "MaxRecvDataSegmentLength", "AuthMethod", "CHAP_A",
                   "CHAP_I", "CHAP_C", "CHAP_N", "CHAP_R"}


@dataclass
class Target:
    iqn: str
    allowed_initiators: list[str] | None = None
    alias: str | None = None
    portal_group_tag: int = 1
    chap: ChapCredential | None = None
    mutual_chap: ChapCredential | None = None


TARGETS = {
    TARGET: Target(TARGET, alias="fuzz"),
    CHAP_TARGET: Target(CHAP_TARGET, chap=ChapCredential(USER, SECRET)),
    ACL_TARGET: Target(ACL_TARGET, allowed_initiators=[INITIATOR]),
}


class Harness:
    """One connection's login: a LoginMachine, a PduReader in front of it, and what admit saw."""

    def __init__(self) -> None:
        self.admitted: list[LoginState] = []
        self.machine = LoginMachine(TARGETS.get, self._admit)
        self.reader = PduReader()
        self.statsn = 0

    def _admit(self, st: LoginState) -> int:
        self.admitted.append(st)
        return 0x1234

    def send(self, wire: bytes) -> list[tuple[LoginResult, pdus.Reply, Pdu]]:
        out = []
        for pdu in self.reader.receive_data(wire):
            result = self.machine.receive(pdu)
            reply = check_response(result, pdu, self.statsn)
            self.statsn += 1
            out.append((result, reply, pdu))
            if result.failed or result.done:
                break
        return out

    def one(self, wire: bytes) -> tuple[LoginResult, pdus.Reply]:
        [(result, reply, _)] = self.send(wire)
        return result, reply


def check_response(result: LoginResult, req: Pdu, statsn: int) -> pdus.Reply:
    """§11.13: every answer is one well-formed Login Response for this request."""
    bhs, *rest = result.response
    data = rest[0] if rest else b""
    assert len(bhs) == 48
    reply = pdus.Reply(bytes(bhs), bytes(data))
    assert reply.opcode == pdus.LOGIN_RSP
    assert int.from_bytes(bhs[5:8], "big") == len(data)
    assert reply.itt == req.itt
    assert reply.statsn == statsn
    assert bhs[2] == 0 and bhs[3] == 0  # version-max, version-active (§11.13.1)
    cls, detail = reply.login_status
    assert cls in (0, 2, 3), (cls, detail)
    assert result.failed == (cls != 0), (result, cls, detail)
    if result.failed:
        assert not result.done and not data
    if result.done:
        assert (cls, detail) == SUCCESS and bhs[1] & 0x80 and bhs[1] & 3 == 3
    if data:
        assert data.endswith(b"\0")
        reply.keys()  # parses as key=value text
    return reply


def login_keys(**extra: str) -> dict[str, str]:
    keys = {"InitiatorName": INITIATOR, "TargetName": TARGET, "SessionType": "Normal"}
    keys.update(extra)
    return {k: v for k, v in keys.items() if v != "-"}


# --- the RFC's answers --------------------------------------------------------------------------------

def test_plain_login_succeeds() -> None:
    h = Harness()
    result, reply = h.one(pdus.login_request(login_keys(MaxBurstLength="65536", HeaderDigest="CRC32C,None")))
    assert result.done and reply.login_status == SUCCESS
    keys = reply.keys()
    assert keys["MaxBurstLength"] == "65536" and keys["HeaderDigest"] == "CRC32C"
    assert keys["TargetPortalGroupTag"] == "1" and "MaxRecvDataSegmentLength" in keys
    assert int.from_bytes(reply.bhs[14:16], "big") == 0x1234  # the TSIH admit chose
    assert h.admitted[0].initiator_name == INITIATOR and h.admitted[0].target is TARGETS[TARGET]


def test_unknown_keys_are_not_understood_and_login_continues() -> None:
    """§6.2: an unknown key is answered NotUnderstood; the negotiation goes on."""
    h = Harness()
    result, reply = h.one(pdus.login_request(login_keys(**{"FooBar": "1", "X-com.example.key": "v",
                                                           "X#private": "3"})))
    assert result.done and reply.login_status == SUCCESS
    keys = reply.keys()
    assert keys["FooBar"] == keys["X-com.example.key"] == keys["X#private"] == "NotUnderstood"


def test_duplicate_key_in_one_request() -> None:
    """§6.2: negotiating a key twice is an initiator error (0200)."""
    h = Harness()
    keys = pdus.text(login_keys()) + b"MaxBurstLength=512\0MaxBurstLength=1024\0"
    result, reply = h.one(pdus.login_request(keys))
    assert result.failed and reply.login_status == INITIATOR_ERROR
    assert not h.admitted


def test_duplicate_key_across_requests() -> None:
    h = Harness()
    result, reply = h.one(pdus.login_request(login_keys(AuthMethod="None", MaxBurstLength="512"), csg=0, nsg=1))
    assert reply.login_status == SUCCESS and not result.done
    result, reply = h.one(pdus.login_request({"MaxBurstLength": "1024"}, csg=1, nsg=3))
    assert result.failed and reply.login_status == INITIATOR_ERROR


def test_duplicate_initiator_name() -> None:
    h = Harness()
    result, reply = h.one(pdus.login_request(pdus.text(login_keys()) + b"InitiatorName=iqn.other\0"))
    assert result.failed and reply.login_status == INITIATOR_ERROR


@pytest.mark.parametrize("keys,status", [
    (login_keys(InitiatorName="-"), MISSING_PARAMETER),          # §13.6
    (login_keys(InitiatorName=""), MISSING_PARAMETER),
    (login_keys(TargetName="-"), MISSING_PARAMETER),             # §13.4: required in a normal session
    (login_keys(TargetName="iqn.2026-11.org.nowhere:x"), NOT_FOUND),
    (login_keys(SessionType="Bogus"), SESSION_TYPE),
    (login_keys(TargetName=ACL_TARGET, InitiatorName="iqn.2026-11.org.stranger:x"), AUTHORIZATION),
    (login_keys(TargetAddress="1.2.3.4:3260,1"), INITIATOR_ERROR),  # §13.8: a target-only key
])
def test_leading_login_failures(keys: dict[str, str], status: tuple[int, int]) -> None:
    h = Harness()
    result, reply = h.one(pdus.login_request(keys))
    assert result.failed and reply.login_status == status, result.reason
    assert not h.admitted


@pytest.mark.parametrize("vmax,vmin", [(1, 1), (5, 2), (0xFF, 0xFF), (0xFF, 1)])
def test_unsupported_version(vmax: int, vmin: int) -> None:
    """§11.12.4: no version in Version-min..Version-max that we speak → 0205."""
    h = Harness()
    result, reply = h.one(pdus.login_request(login_keys(), vmax=vmax, vmin=vmin))
    assert result.failed and reply.login_status == UNSUPPORTED_VERSION


def test_version_range_including_zero_is_fine() -> None:
    h = Harness()
    result, reply = h.one(pdus.login_request(login_keys(), vmax=3, vmin=0))
    assert result.done and reply.login_status == SUCCESS


@pytest.mark.parametrize("opcode", [pdus.SCSI_CMD, pdus.NOP_OUT, pdus.TEXT_REQ, pdus.LOGOUT_REQ, pdus.DATA_OUT,
                                    pdus.SNACK, 0x1F])
def test_other_pdus_during_login(opcode: int) -> None:
    """§11.13.5: anything but a Login Request during login → 020B."""
    h = Harness()
    wire = bytearray(pdus.login_request(login_keys()))
    wire[0] = 0x40 | opcode
    result, reply = h.one(bytes(wire))
    assert result.failed and reply.login_status == INVALID_DURING_LOGIN


@pytest.mark.parametrize("flags", [0xC7, 0xC4, 0x80 | (1 << 2) | 1, 0x80 | (1 << 2) | 2, 0x80 | (2 << 2) | 3,
                                   0x80 | (3 << 2) | 3])
def test_bad_stage_flags(flags: int) -> None:
    """§11.12.2/§6.3: T and C together, a transition backwards or to stage 2, CSG 2 or 3 → 0200."""
    h = Harness()
    wire = bytearray(pdus.login_request(login_keys()))
    wire[1] = flags
    result, reply = h.one(bytes(wire))
    assert result.failed and reply.login_status == INITIATOR_ERROR


def test_isid_change_within_login() -> None:
    h = Harness()
    h.one(pdus.login_request(login_keys(AuthMethod="None"), csg=0, nsg=1))
    result, reply = h.one(pdus.login_request({}, csg=1, nsg=3, isid=bytes(6)))
    assert result.failed and reply.login_status == INITIATOR_ERROR


def test_malformed_text() -> None:
    for bad in (b"NoEquals\0", b"=value\0", b"K" * 64 + b"=v\0", b"Key=\xff\xfe\0"):
        h = Harness()
        result, reply = h.one(pdus.login_request(pdus.text(login_keys()) + bad))
        assert result.failed and reply.login_status == INITIATOR_ERROR, bad


def test_login_text_split_with_continue_bit() -> None:
    """§6.3 / §11.12.2: the first request's text may span PDUs (C bit); the leading keys still count.
    A TargetName that does not exist must fail the login (0203) however the text was split."""
    h = Harness()
    text = pdus.text({"InitiatorName": INITIATOR, "TargetName": "iqn.2026-11.org.nowhere:x"})
    result, reply = h.one(pdus.login_request(text[:10], transit=False, cont=True))
    assert reply.login_status == SUCCESS and not result.done and not reply.data  # §6.3: empty acknowledgement
    result, reply = h.one(pdus.login_request(text[10:]))
    assert result.failed and reply.login_status == NOT_FOUND, (result, h.admitted)


def test_login_text_split_with_continue_bit_succeeds() -> None:
    h = Harness()
    text = pdus.text(login_keys(MaxBurstLength="4096"))
    h.one(pdus.login_request(text[:7], transit=False, cont=True))
    h.one(pdus.login_request(text[7:20], transit=False, cont=True))
    result, reply = h.one(pdus.login_request(text[20:]))
    assert result.done and reply.keys()["MaxBurstLength"] == "4096"
    assert h.admitted[0].initiator_name == INITIATOR and h.admitted[0].target is TARGETS[TARGET]


# --- CHAP (§12.1.3) -----------------------------------------------------------------------------------

def chap_login(h: Harness, *, secret: str = SECRET, user: str = USER, algorithm: str = "5") -> tuple[LoginResult,
                                                                                                       pdus.Reply]:
    result, reply = h.one(pdus.login_request(login_keys(TargetName=CHAP_TARGET, AuthMethod="CHAP,None"),
                                             csg=0, nsg=1, transit=False))
    assert reply.login_status == SUCCESS and reply.keys()["AuthMethod"] == "CHAP"
    result, reply = h.one(pdus.login_request({"CHAP_A": algorithm}, csg=0, nsg=1, transit=False))
    if result.failed:
        return result, reply
    k = reply.keys()
    alg, ident, challenge = int(k["CHAP_A"]), int(k["CHAP_I"]), bytes.fromhex(k["CHAP_C"][2:])
    assert alg in ALGORITHMS
    r = response(alg, ident, secret.encode(), challenge)
    result, reply = h.one(pdus.login_request({"CHAP_N": user, "CHAP_R": "0x" + r.hex()}, csg=0, nsg=1))
    if result.failed:
        return result, reply
    return h.one(pdus.login_request({}, csg=1, nsg=3))


def test_chap_right_secret() -> None:
    h = Harness()
    result, reply = chap_login(h)
    assert result.done and reply.login_status == SUCCESS


@pytest.mark.parametrize("kw", [{"secret": "wrong-secret"}, {"user": "mallory"}, {"secret": ""}])
def test_chap_wrong_response(kw: dict[str, str]) -> None:
    """A CHAP_R that does not match → 0201, and no session."""
    h = Harness()
    result, reply = chap_login(h, **kw)
    assert result.failed and reply.login_status == AUTH_FAILURE
    assert not h.admitted


@pytest.mark.parametrize("alg", ["99", "", "x", "²"])
def test_chap_unsupported_algorithm(alg: str) -> None:
    h = Harness()
    result, reply = chap_login(h, algorithm=alg)
    assert result.failed and reply.login_status == AUTH_FAILURE


@pytest.mark.parametrize("wire", [
    pdus.login_request(login_keys(TargetName=CHAP_TARGET, AuthMethod="None"), csg=0, nsg=1),
    pdus.login_request(login_keys(TargetName=CHAP_TARGET), csg=0, nsg=1),
    pdus.login_request(login_keys(TargetName=CHAP_TARGET), csg=1, nsg=3),  # skips the security stage
])
def test_chap_required(wire: bytes) -> None:
    h = Harness()
    result, reply = h.one(wire)
    assert result.failed and reply.login_status == AUTH_FAILURE
    assert not h.admitted


def test_chap_response_garbage() -> None:
    for r in ("", "0x", "0xZZ", "0b!!", "nothex", "0x" + "00" * 5000):
        h = Harness()
        h.one(pdus.login_request(login_keys(TargetName=CHAP_TARGET, AuthMethod="CHAP"), csg=0, nsg=1,
                                 transit=False))
        h.one(pdus.login_request({"CHAP_A": "5"}, csg=0, nsg=1, transit=False))
        result, reply = h.one(pdus.login_request({"CHAP_N": USER, "CHAP_R": r}, csg=0, nsg=1))
        # a value past the §6.1 length limit is malformed text (0200) before it is a wrong answer (0201)
        assert result.failed and reply.login_status in ((AUTH_FAILURE,) if len(r) < 8192 else
                                                        (AUTH_FAILURE, INITIATOR_ERROR)), r[:20]


# --- random logins ------------------------------------------------------------------------------------

KEY_POOL = ["InitiatorName", "TargetName", "SessionType", "InitiatorAlias", "AuthMethod", "CHAP_A", "CHAP_N",
            "CHAP_R", "CHAP_I", "CHAP_C", "HeaderDigest", "DataDigest", "MaxConnections", "InitialR2T",
            "ImmediateData", "MaxRecvDataSegmentLength", "MaxBurstLength", "FirstBurstLength", "DefaultTime2Wait",
            "DefaultTime2Retain", "MaxOutstandingR2T", "DataPDUInOrder", "DataSequenceInOrder",
            "ErrorRecoveryLevel", "IFMarker", "OFMarker", "TargetAlias", "TargetAddress", "SendTargets",
            "X-org.example", "FooBar", "iSCSIProtocolLevel", "TaskReporting"]
VALUE_POOL = [INITIATOR, TARGET, CHAP_TARGET, ACL_TARGET, "iqn.nowhere", "Normal", "Discovery", "None", "CHAP",
              "CHAP,None", "5", "7", "5,7", USER, "0x00", "CRC32C", "None,CRC32C", "Yes", "No", "1", "0", "2", "512",
              "8192", "262144", "16777215", "16777216", "", "²", "NotUnderstood", "Irrelevant", "Reject", "x" * 300]


def random_login_pdu(rng: random.Random, first: bool, isid: bytes, itt: int) -> bytes:
    keys: list[tuple[str, str]] = []
    if first and rng.random() < 0.8:
        keys.append(("InitiatorName", INITIATOR))
        if rng.random() < 0.9:
            keys.append(("TargetName", rng.choice(list(TARGETS))))
    for _ in range(rng.randrange(6)):
        keys.append((rng.choice(KEY_POOL), rng.choice(VALUE_POOL)))
    rng.shuffle(keys)
    csg = rng.choice((0, 0, 1, 1, 1, 2, 3))
    nsg = rng.choice((1, 3, 3, 0, 2))
    transit = rng.random() < 0.7
    cont = not transit and rng.random() < 0.3 or rng.random() < 0.02
    wire = pdus.login_request(keys, csg=csg, nsg=nsg, transit=transit, cont=cont, isid=isid, itt=itt,
                              vmax=rng.choice((0, 0, 0, 0, 1, 0xFF)), vmin=rng.choice((0, 0, 0, 0, 1)))
    if rng.random() < 0.25:
        wire = pdus.mutate(wire, rng, keep_length=rng.random() < 0.8)
    return wire


def check_admitted(h: Harness) -> None:
    """What reached the full feature phase has the leading keys and passed the target's checks."""
    for st_ in h.admitted:
        assert st_.initiator_name, f"admitted a login that never named its initiator: {st_}"
        if st_.session_type == "Normal":
            assert st_.target is not None and st_.target_name in TARGETS, st_
            t = TARGETS[st_.target_name]
            assert t.chap is None, "a CHAP target admitted a login without the right CHAP response"
            assert t.allowed_initiators is None or st_.initiator_name in t.allowed_initiators
        else:
            assert st_.session_type == "Discovery"


def run_random_login(rng: random.Random) -> None:
    h = Harness()
    isid, itt = pdus.ISID, rng.randrange(1 << 32)
    sent = ""
    for step in range(rng.randrange(1, 6)):
        wire = random_login_pdu(rng, step == 0, isid, itt)
        sent += wire.decode("latin-1")
        stop = False
        for result, reply, _ in h.send(wire):
            for k in reply.keys():  # noqa: SIM118  (Reply.keys() parses the text)
                assert k in TARGET_DECLARES or k in sent, f"answered {k!r}, which nobody offered"
            stop = result.failed or result.done
        if stop:
            break
    assert len(h.admitted) <= 1
    check_admitted(h)


@pytest.mark.parametrize("seed", budget.SEEDS)
def test_random_logins(seed: int) -> None:
    rng = random.Random(seed)
    for i in range(3000):
        try:
            run_random_login(rng)
        except Exception as e:
            raise AssertionError(f"seed {seed} login {i}: {str(e)[:2000]}") from e
        budget.count()


@pytest.mark.parametrize("seed", budget.SEEDS)
def test_random_bytes_as_login(seed: int) -> None:
    """Random BHS bytes with the login opcode, random data: an answer, never an exception."""
    rng = random.Random(seed)
    for i in range(2000):
        h = Harness()
        bhs = bytearray(rng.randbytes(48))
        bhs[0] = rng.choice((0x43, 0x03, bhs[0]))
        bhs[4] = 0 if rng.random() < 0.8 else bhs[4]
        data = rng.randbytes(rng.randrange(300)) if rng.random() < 0.5 else pdus.text(login_keys())
        try:
            h.send(pdus.assemble(bytes(bhs[:48]), data, ahs=bytes(4 * bhs[4])))
            check_admitted(h)
        except Exception as e:
            raise AssertionError(f"seed {seed} input {i}: {str(e)[:2000]}") from e
        budget.count()


@settings(max_examples=budget.hypothesis_examples(300), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KEY_POOL), st.sampled_from(VALUE_POOL) | st.text(max_size=30)),
                max_size=12),
       st.integers(0, 3), st.integers(0, 3), st.booleans(), st.booleans())
def test_hypothesis_login(keys: list[tuple[str, str]], csg: int, nsg: int, transit: bool, cont: bool) -> None:
    h = Harness()
    if any("\0" in k + v or "=" in k for k, v in keys):
        return
    h.send(pdus.login_request(keys, csg=csg, nsg=nsg, transit=transit, cont=cont))
    check_admitted(h)
    budget.count()


@pytest.mark.soak
def test_soak_random_logins() -> None:
    rng = random.Random(budget.soak_inputs())
    for i in range(budget.soak_inputs()):
        try:
            run_random_login(rng)
        except Exception as e:
            raise AssertionError(f"login {i}: {e!r}") from e
        budget.count()
