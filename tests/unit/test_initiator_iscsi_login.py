"""The initiator's login machine against the target's (both sans-IO), and the initiator PDU codecs, with bytes."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import pytest

from openvsan.frontend.config import ChapCredential
from openvsan.initiator import scsi as X
from openvsan.initiator.url import UrlError, parse_url
from openvsan.protocol.iscsi import initiator_pdus as Q
from openvsan.protocol.iscsi import pdu as P
from openvsan.protocol.iscsi.framing import PduReader, frame
from openvsan.protocol.iscsi.initiator_login import InitiatorLogin, LoginConfig, LoginError
from openvsan.protocol.iscsi.login import LoginMachine
from openvsan.protocol.scsi import sense as S

IQN = "iqn.2026-11.org.openvsan:disk0"
INIT = "iqn.2026-11.org.openvsan.test:init"
ISID = bytes.fromhex("80abcdef0001")


@dataclass
class FakeTarget:
    iqn: str = IQN
    allowed_initiators: list[str] | None = None
    alias: str | None = None
    portal_group_tag: int = 1
    chap: ChapCredential | None = None
    mutual_chap: ChapCredential | None = None


def one_pdu(parts: list[bytes]) -> P.Pdu:
    (pdu,) = PduReader().receive_data(b"".join(frame(parts[0], parts[1] if len(parts) > 1 else b"")))
    return pdu


def run_login(cfg: LoginConfig, target: FakeTarget) -> InitiatorLogin:
    """Pass PDUs between the two machines until the initiator is done or one side fails."""
    tm = LoginMachine(lambda n: target if n == target.iqn else None, lambda st: 0x1234)
    im = InitiatorLogin(cfg, itt=7, cmdsn=1)
    req = im.start()
    for _ in range(20):
        res = tm.receive(one_pdu(req))
        step = im.receive(one_pdu(res.response))
        if step.done:
            assert res.done
            return im
        assert step.request is not None
        req = step.request
    raise AssertionError("login did not finish")


def cfg(**kw: object) -> LoginConfig:
    return LoginConfig(initiator_name=INIT, target_name=IQN, isid=ISID, **kw)  # type: ignore[arg-type]


def test_login_without_auth_negotiates_our_offers() -> None:
    im = run_login(cfg(), FakeTarget())
    p = im.params
    assert im.tsih == 0x1234
    assert not p.initial_r2t and p.immediate_data
    assert p.send_mrdsl == 262144  # the target's declaration
    assert p.error_recovery_level == 0 and p.default_time2retain == 0
    assert p.target_keys["TargetPortalGroupTag"] == "1"


def test_digests_when_asked() -> None:
    im = run_login(cfg(header_digest=True, data_digest=True), FakeTarget())
    assert im.params.header_digest and im.params.data_digest


def test_discovery_session_has_no_target_name() -> None:
    im = run_login(LoginConfig(initiator_name=INIT, target_name=None, isid=ISID), FakeTarget())
    assert im.stage == 3


def test_chap_and_mutual_chap() -> None:
    t = FakeTarget(chap=ChapCredential("alice", "secret-123456"), mutual_chap=ChapCredential("tgt", "other-1234567"))
    run_login(cfg(chap=("alice", "secret-123456"), mutual_chap=("tgt", "other-1234567")), t)
    t1 = FakeTarget(chap=ChapCredential("alice", "secret-123456"))
    run_login(cfg(chap=("alice", "secret-123456")), t1)


def test_wrong_secret_is_an_auth_failure() -> None:
    t = FakeTarget(chap=ChapCredential("alice", "secret-123456"))
    with pytest.raises(LoginError) as e:
        run_login(cfg(chap=("alice", "wrong-secret-12")), t)
    assert e.value.status == (2, 1) and e.value.auth_failure


def test_mutual_chap_catches_an_impostor_target() -> None:
    t = FakeTarget(chap=ChapCredential("alice", "secret-123456"), mutual_chap=ChapCredential("tgt", "impostor-12345"))
    with pytest.raises(LoginError, match="mutual CHAP"):
        run_login(cfg(chap=("alice", "secret-123456"), mutual_chap=("tgt", "other-1234567")), t)


def test_no_credentials_for_a_chap_target() -> None:
    with pytest.raises(LoginError) as e:
        run_login(cfg(), FakeTarget(chap=ChapCredential("alice", "secret-123456")))
    assert e.value.status == (2, 1)


def test_unknown_target_names_the_status() -> None:
    with pytest.raises(LoginError, match="target not found"):
        run_login(LoginConfig(initiator_name=INIT, target_name="iqn.2026-11.x:nope", isid=ISID), FakeTarget())


def test_target_offer_gets_an_answer() -> None:
    """A key the target offers first (§6.2) is answered in the next request."""
    im = InitiatorLogin(cfg(), itt=1)
    im.start()
    im.stage = 1
    rsp = bytearray(P.login_response(0x04 | 0, 0, 0, ISID, 0, 1, 0, 1, 1, 0, 0, 0))
    text = b"MaxOutstandingR2T=4\0"
    rsp[5:8] = len(text).to_bytes(3, "big")
    step = im.receive(one_pdu([bytes(rsp), text]))
    assert step.request is not None and b"MaxOutstandingR2T=" in step.request[1]


# --- PDU codecs ------------------------------------------------------------------------------------

def test_scsi_command_layout() -> None:
    cdb = X.read_16(0x1122334455, 8)
    b = Q.scsi_command(0xA1, P.encode_lun(3), cdb, 4096, 10, 20, read=True)
    assert len(b) == 48 and b[0] == P.Op.SCSI_CMD and b[1] == 0x80 | 0x40 | 1
    assert b[8:10] == b"\x00\x03"
    assert struct.unpack_from(">IIII", b, 16) == (0xA1, 4096, 10, 20)
    assert b[32:48] == cdb
    w = Q.scsi_command(1, bytes(8), X.write_16(0, 1, fua=True), 512, 1, 1, write=True, final=False,
                       immediate_len=512)
    assert w[1] == 0x20 | 1 and w[5:8] == b"\x00\x02\x00"


def test_data_out_layout() -> None:
    b = Q.data_out(5, 0x77, bytes(8), 9, 2, 8192, 4096, final=True)
    assert b[0] == P.Op.DATA_OUT and b[1] == 0x80
    assert struct.unpack_from(">II", b, 16) == (5, 0x77)
    assert struct.unpack_from(">I", b, 28)[0] == 9
    assert struct.unpack_from(">II", b, 36) == (2, 8192)


def test_login_request_layout() -> None:
    b = Q.login_request(ISID, 0, 3, 1, 5, 0, csg=1, nsg=3, transit=True, dsl=10)
    assert b[0] == 0x43 and b[1] == 0x80 | 0x04 | 3
    assert b[8:14] == ISID and struct.unpack_from(">HIH", b, 14) == (0, 3, 1)


def test_parse_target_pdus_built_by_the_target_code() -> None:
    rsp = one_pdu([P.scsi_response(9, 2, 100, 5, 40, dsl=20, flags=0x02, residual=512),
                   struct.pack(">H", 18) + S.build_sense(S.MEDIUM_ERROR, S.ASC_READ_ERROR, info=77)])
    r = Q.ScsiResponse.parse(rsp)
    assert (r.itt, r.status, r.statsn, r.residual, r.underflow) == (9, 2, 100, 512, True)
    assert Q.exp_max_cmdsn(rsp) == (5, 40)
    err = X.status_error(r.status, r.sense, write=False, what="x")
    assert type(err).__name__ == "MediumError" and err.lba == 77  # type: ignore[attr-defined]
    d = Q.DataIn.parse(one_pdu([P.data_in(4, 3, 1024, 0, final=True, expcmdsn=1, maxcmdsn=2, status=0, statsn=8)]))
    assert d.has_status and d.final and (d.itt, d.datasn, d.offset, d.statsn) == (4, 3, 1024, 8)
    r2 = Q.R2T.parse(one_pdu([P.r2t(4, 0x55, bytes(8), 1, 1, 2, 0, 4096, 8192)]))
    assert (r2.ttt, r2.offset, r2.length) == (0x55, 4096, 8192)
    n = Q.NopIn.parse(one_pdu([P.nop_in(P.RESERVED_TAG, 0x99, 3, 1, 2)]))
    assert n.ttt == 0x99 and n.itt == P.RESERVED_TAG


def test_sense_to_typed_errors() -> None:
    from openvsan.block import errors as E
    cases = [
        (S.ILLEGAL_REQUEST, S.ASC_LBA_OUT_OF_RANGE, E.OutOfRange),
        (S.DATA_PROTECT, S.ASC_WRITE_PROTECTED, E.ReadOnly),
        (S.DATA_PROTECT, S.ASC_SPACE_ALLOCATION_FAILED_WRITE_PROTECT, E.NoSpace),
        (S.HARDWARE_ERROR, S.ASC_INTERNAL_TARGET_FAILURE, E.DeviceFailed),
    ]
    for key, asc, cls in cases:
        assert isinstance(X.status_error(S.CHECK_CONDITION, S.build_sense(key, asc), write=True, what=""), cls)
    assert isinstance(X.status_error(S.TASK_SET_FULL, b"", write=False, what=""), E.Busy)
    desc = bytes([0x72, S.MEDIUM_ERROR, 0x11, 0x00, 0, 0, 0, 12, 0x00, 0x0A, 0x80, 0]) + (1 << 40).to_bytes(8, "big")
    assert X.sense_key_asc(desc) == (S.MEDIUM_ERROR, 0x1100, 1 << 40)
    assert X.retryable(S.CHECK_CONDITION, S.build_sense(S.UNIT_ATTENTION, S.ASC_POWER_ON_RESET))


def test_cdbs() -> None:
    assert X.write_16(1, 2, fua=True)[1] == 0x08
    assert X.read_capacity_16() == bytes.fromhex("9e10") + bytes(8) + bytes.fromhex("00000020") + bytes(2)
    cdb, param = X.unmap([(10, 5), (100, 1)])
    assert cdb[0] == 0x42 and struct.unpack_from(">H", cdb, 7)[0] == len(param) == 8 + 32
    assert struct.unpack_from(">HH", param) == (38, 32)
    assert X.write_same_16(0, 8, unmap=True)[1] == 0x08
    assert X.inquiry(0xB0, 64) == bytes([0x12, 1, 0xB0, 0, 64, 0])


def test_capacity_and_vpd_parsing() -> None:
    cap = struct.pack(">QI", 999, 4096) + bytes([0, 0, 0xC0, 0]) + bytes(16)
    c = X.Capacity.parse(cap)
    assert (c.num_blocks, c.block_size, c.lbpme, c.lbprz) == (1000, 4096, True, True)
    b0 = bytearray(64)
    b0[1] = 0xB0
    struct.pack_into(">I", b0, 8, 2048)
    struct.pack_into(">II", b0, 20, 1 << 20, 64)
    struct.pack_into(">Q", b0, 36, 65535)
    assert X.BlockLimits.parse(bytes(b0)) == X.BlockLimits(2048, 1 << 20, 64, 65535)
    assert X.vpd_pages(bytes([0, 0, 0, 3, 0x00, 0xB0, 0xB2])) == {0, 0xB0, 0xB2}


def test_urls() -> None:
    u = parse_url("iscsi://alice%s3cr%40t@[::1]:3261/iqn.2026-11.org.openvsan:disk0/2?header_digest=crc32c&queues=4")
    assert (u.host, u.port, u.name, u.unit, u.user, u.secret) == ("::1", 3261, IQN, 2, "alice", "s3cr@t")
    assert u.opt_bool("header_digest") and u.opt_int("queues", 1) == 4
    assert "s3cr" not in u.redacted()
    n = parse_url("nvme+tcp://127.0.0.1/nqn.2026-11.org.openvsan:disk0/1")
    assert (n.port, n.name, n.unit) == (4420, "nqn.2026-11.org.openvsan:disk0", 1)
    assert parse_url("iscsi://h").name is None
    for bad in ("http://h/x", "iscsi://h:99999/x", "iscsi:///x", "iscsi://h/iqn.x/lun"):
        with pytest.raises(UrlError):
            parse_url(bad)
