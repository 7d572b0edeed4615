"""NVMe/TCP PDU codec and queue state machine, driven with byte strings (NVMe/TCP 1.0 §3.6)."""

from __future__ import annotations

import struct

import pytest
from nvme_host import HostReader, capsule, dg, h2c_data, icreq, sqe

from openvsan.protocol.nvme.status import cqe
from openvsan.protocol.nvme_tcp.framing import capsule_resp, capsule_resp_of
from openvsan.protocol.nvme_tcp.pdu import Fes
from openvsan.protocol.nvme_tcp.queue import (
    CapsuleCommand,
    DataReceived,
    Established,
    State,
    TcpQueue,
    Terminated,
)


def ready(hd: bool = False, dd: bool = False, hpda: int = 0, **kw: int) -> TcpQueue:
    q = TcpQueue(**kw)
    (ev,) = q.receive_data(icreq(hpda=hpda, hd=hd, dd=dd))
    assert isinstance(ev, Established)
    return q


def term(events: list[object]) -> tuple[int, int]:
    ev = events[-1]
    assert isinstance(ev, Terminated), events
    assert ev.response[0] == 0x03 and ev.response[2] == 24          # C2HTermReq, HLEN 24
    plen = int.from_bytes(ev.response[4:8], "little")
    assert plen == len(ev.response) <= 152
    fes, fei = struct.unpack_from("<HI", ev.response, 8)
    return fes, fei


def test_icreq_icresp() -> None:
    q = TcpQueue(maxh2cdata=65536)
    (ev,) = q.receive_data(icreq(hpda=2, hd=True, dd=True, maxr2t=3))
    assert isinstance(ev, Established)
    r = ev.response
    assert len(r) == 128 and r[0] == 0x01 and r[2] == 128 and int.from_bytes(r[4:8], "little") == 128
    assert struct.unpack_from("<HBBI", r, 8) == (0, 0, 3, 65536)    # PFV 0, CPDA 0, both digests, MAXH2CDATA
    assert q.state is State.READY and q.hdgst and q.ddgst and q.hpda == 2 and q.maxr2t == 4


def test_icreq_in_pieces() -> None:
    q = TcpQueue()
    raw = icreq() + capsule(sqe(0x06, 7, 0, cdw10=1, sgl_len=4096))
    events = []
    for i in range(len(raw)):
        events += q.receive_data(raw[i:i + 1])
    assert [type(e) for e in events] == [Established, CapsuleCommand]
    assert int.from_bytes(events[1].sqe[2:4], "little") == 7      # type: ignore[union-attr]


def test_digests_refused_when_not_offered() -> None:
    q = TcpQueue(hdgst_allowed=False, ddgst_allowed=False)
    (ev,) = q.receive_data(icreq(hd=True, dd=True))
    assert isinstance(ev, Established) and ev.response[11] == 0 and not q.hdgst


@pytest.mark.parametrize(("raw", "fes", "fei"), [
    (icreq(pfv=1), Fes.UNSUPPORTED_PARAMETER, 8),
    (icreq(hpda=32), Fes.UNSUPPORTED_PARAMETER, 10),
    (capsule(sqe(0x06, 1)), Fes.PDU_SEQUENCE_ERROR, 0),                    # a command before ICReq
    (bytes([0x0A, 0, 24, 0, 24, 0, 0, 0]) + bytes(16), Fes.INVALID_PDU_HEADER_FIELD, 0),   # unknown type
    (bytes([0x05, 0, 24, 0, 24, 0, 0, 0]) + bytes(16), Fes.INVALID_PDU_HEADER_FIELD, 0),   # CapsuleResp from host
    (bytes([0x00, 0, 100, 0, 128, 0, 0, 0]) + bytes(120), Fes.INVALID_PDU_HEADER_FIELD, 2),  # ICReq HLEN
    (bytes([0x00, 0, 128, 0, 200, 0, 0, 0]) + bytes(192), Fes.INVALID_PDU_HEADER_FIELD, 4),  # ICReq PLEN
])
def test_bad_first_pdu(raw: bytes, fes: int, fei: int) -> None:
    q = TcpQueue()
    assert term(q.receive_data(raw)) == (fes, fei)
    assert q.state is State.CLOSED and q.receive_data(icreq()) == []


def test_second_icreq_is_a_sequence_error() -> None:
    assert term(ready().receive_data(icreq()))[0] == Fes.PDU_SEQUENCE_ERROR


def test_huge_plen_refused_from_the_common_header_alone() -> None:
    q = ready()
    hdr = struct.pack("<BBBBI", 4, 0, 72, 76, 1 << 31)
    assert term(q.receive_data(hdr))[0] == Fes.DATA_TRANSFER_LIMIT_EXCEEDED


def test_in_capsule_data_over_the_limit() -> None:
    q = ready(in_capsule=4096)
    q.reader.max_capsule_data = 4096
    assert term(q.receive_data(capsule(sqe(0x01, 1, 1, sgl_len=8192, in_capsule=True), bytes(8192))))[0] == \
        Fes.DATA_TRANSFER_LIMIT_EXCEEDED


def test_capsule_with_data_and_digests() -> None:
    q = ready(hd=True, dd=True)
    data = bytes(range(256)) * 4
    (ev,) = q.receive_data(capsule(sqe(0x01, 3, 1, sgl_len=1024, in_capsule=True), data, hd=True, dd=True))
    assert isinstance(ev, CapsuleCommand) and ev.data_ok and bytes(ev.data) == data


def test_data_digest_error_is_not_fatal() -> None:
    q = ready(dd=True)
    raw = bytearray(capsule(sqe(0x01, 3, 1, sgl_len=512, in_capsule=True), bytes(512), dd=True))
    raw[-1] ^= 0xFF
    (ev,) = q.receive_data(bytes(raw))
    assert isinstance(ev, CapsuleCommand) and not ev.data_ok
    assert q.state is State.READY


def test_header_digest_error_is_fatal() -> None:
    q = ready(hd=True)
    raw = bytearray(capsule(sqe(0x06, 3), hd=True))
    raw[20] ^= 1
    assert term(q.receive_data(bytes(raw)))[0] == Fes.HEADER_DIGEST_ERROR


def test_header_digest_flag_must_match() -> None:
    q = ready(hd=True)
    assert term(q.receive_data(capsule(sqe(0x06, 3))))[:2] == (Fes.INVALID_PDU_HEADER_FIELD, 1)


def test_bad_pdo() -> None:
    q = ready()
    raw = bytearray(capsule(sqe(0x01, 1, 1, sgl_len=512, in_capsule=True), bytes(512)))
    raw[3] = 40                                       # PDO inside the SQE
    assert term(q.receive_data(bytes(raw))) == (Fes.INVALID_PDU_HEADER_FIELD, 3)


def test_r2t_and_h2c_data() -> None:
    q = ready(hd=True, dd=True, maxh2cdata=4096)
    r2t = q.request_data(9, 10000)
    (p,) = HostReader(hd=True, dd=True).feed(r2t)
    assert p.type == 0x09 and p.flags & 1
    assert (p.u16(8), p.u32(12), p.u32(16)) == (9, 0, 10000)
    ttag = p.u16(10)
    payload = bytes(i & 0xFF for i in range(10000))
    events = []
    for off in range(0, 10000, 4096):
        chunk = payload[off:off + 4096]
        events += q.receive_data(h2c_data(9, ttag, off, chunk, last=off + 4096 >= 10000, hd=True, dd=True))
    (ev,) = events
    assert isinstance(ev, DataReceived) and ev.cccid == 9 and ev.data_ok and bytes(ev.data) == payload
    assert not q.awaiting_data(9)


@pytest.mark.parametrize(("mutate", "fes", "fei"), [
    (lambda c, t: h2c_data(c, t + 1, 0, bytes(512), last=True), Fes.INVALID_PDU_HEADER_FIELD, 10),
    (lambda c, t: h2c_data(c + 1, t, 0, bytes(512), last=True), Fes.INVALID_PDU_HEADER_FIELD, 8),
    (lambda c, t: h2c_data(c, t, 512, bytes(1024), last=True), Fes.DATA_TRANSFER_OUT_OF_RANGE, 0),
    (lambda c, t: h2c_data(c, t, 4, bytes(508), last=True), Fes.INVALID_PDU_HEADER_FIELD, 12),
    (lambda c, t: h2c_data(c, t, 0, bytes(1024), last=False), Fes.INVALID_PDU_HEADER_FIELD, 16),  # DATAL vs PLEN
    (lambda c, t: h2c_data(c, t, 0, bytes(512), last=False), Fes.PDU_SEQUENCE_ERROR, 0),          # LAST missing
])
def test_bad_h2c_data(mutate, fes: int, fei: int) -> None:  # type: ignore[no-untyped-def]
    q = ready()
    (p,) = HostReader().feed(q.request_data(5, 1024 if fei == 16 else 512))
    raw = mutate(5, p.u16(10))
    if fei == 16:
        raw = raw[:16] + (1000).to_bytes(4, "little") + raw[20:]
    assert term(q.receive_data(raw)) == (fes, fei)


def test_h2c_data_beyond_maxh2cdata() -> None:
    q = ready(maxh2cdata=4096)
    (p,) = HostReader().feed(q.request_data(5, 8192))
    assert term(q.receive_data(h2c_data(5, p.u16(10), 0, bytes(8192), last=True)))[0] == \
        Fes.DATA_TRANSFER_LIMIT_EXCEEDED


def test_h2c_data_without_r2t() -> None:
    assert term(ready().receive_data(h2c_data(1, 0, 0, bytes(512), last=True)))[:2] == \
        (Fes.INVALID_PDU_HEADER_FIELD, 10)


def test_host_termination_closes_quietly() -> None:
    q = ready()
    raw = struct.pack("<BBBBIHI10x", 0x02, 0, 24, 0, 24, 1, 0)
    (ev,) = q.receive_data(raw)
    assert isinstance(ev, Terminated) and ev.by_host and ev.response == b""


@pytest.mark.parametrize("hpda", [0, 1, 3])
def test_c2h_data_alignment_digests_and_success(hpda: int) -> None:
    q = ready(hd=True, dd=True, hpda=hpda)
    data = bytes(range(256)) * 1200                  # 300 KiB: several C2HData PDUs
    out: list[bytes | memoryview] = []
    q.read_data(out, 42, data, success=True)
    pdus = HostReader(hd=True, dd=True).feed(b"".join(bytes(x) for x in out))
    assert len(pdus) > 1 and all(p.type == 0x07 for p in pdus)
    got = b""
    for i, p in enumerate(pdus):
        raw_pdo = p.header[3]
        assert raw_pdo % ((hpda + 1) * 4) == 0 and raw_pdo >= 28
        assert p.u16(8) == 42 and p.u32(12) == len(got) and p.u32(16) == len(p.data)
        last = i == len(pdus) - 1
        assert bool(p.flags & 0x04) == last and bool(p.flags & 0x08) == last
        got += p.data
    assert got == data


def test_capsule_resp_with_header_digest() -> None:
    q = ready(hd=True)
    r = q.respond(0x0D0C, 0x0F0E >> 1, 0x03020100, 0x07060504, 0x0908, 0x0B0A)
    raw = bytes(range(16))
    assert len(r) == 28 and r[0] == 0x05 and r[1] == 0x01 and r[8:24] == raw and r[24:] == dg(r[:24])


from hypothesis import given, settings
from hypothesis import strategies as st


@given(st.integers(0, 0xFFFF), st.integers(0, 0x7FFF), st.integers(0, 2**32 - 1), st.integers(-(2**31), 2**32 - 1),
       st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.booleans())
def test_capsule_resp_of_fields_equals_the_header_and_cqe(cid: int, status: int, dw0: int, dw1: int, sqhd: int,
                                                           sqid: int, hd: bool) -> None:
    """The one-pack CapsuleResp both target paths send is the common header and status.cqe's 16 bytes."""
    want = capsule_resp(cqe(cid, status, dw0, dw1, sqhd, sqid), hd)
    assert capsule_resp_of(cid, status, dw0, dw1, sqhd, sqid, hd) == want

_GOOD = icreq(hd=True, dd=True) + capsule(sqe(0x01, 1, 1, sgl_len=512, in_capsule=True), bytes(512), hd=True,
                                           dd=True) + capsule(sqe(0x06, 2, 0, cdw10=1, sgl_len=4096), hd=True)


@settings(max_examples=500, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, len(_GOOD) - 1), st.integers(0, 255)), max_size=6),
       cut=st.integers(1, len(_GOOD)), chunk=st.integers(1, 200), tail=st.binary(max_size=64))
def test_mutated_streams_end_in_events_or_a_term_req(flips: list[tuple[int, int]], cut: int, chunk: int,
                                                     tail: bytes) -> None:
    raw = bytearray(_GOOD)
    for pos, value in flips:
        raw[pos] = value
    stream = bytes(raw[:cut]) + tail
    q = TcpQueue()
    events = []
    for i in range(0, len(stream), chunk):
        events += q.receive_data(stream[i:i + chunk])
    for ev in events[:-1]:
        assert not isinstance(ev, Terminated)
    if events and isinstance(events[-1], Terminated):
        assert q.state is State.CLOSED
        r = events[-1].response
        assert r == b"" or (r[0] == 0x03 and int.from_bytes(r[4:8], "little") == len(r) <= 152)
