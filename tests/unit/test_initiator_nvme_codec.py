"""Host-side NVMe/TCP PDUs and NVMe commands, with byte strings: what we build the controller's reader
parses, and what the controller's builders make our reader parses."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

import pytest

from openvsan.initiator.nvme_conn import NvmeQueue, Result, _Cmd
from openvsan.initiator.nvme_tcp import Slots, retryable, status_error
from openvsan.protocol.nvme import host_commands as C
from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.command import Sqe
from openvsan.protocol.nvme_tcp import framing as F
from openvsan.protocol.nvme_tcp import host_pdus as H
from openvsan.protocol.nvme_tcp.framing import Pdu
from openvsan.protocol.nvme_tcp.pdu import F_LAST_PDU, F_SUCCESS, PduType, ic_resp, r2t_header


def controller_reader(hd: bool = False, dd: bool = False) -> F.PduReader:
    r = F.PduReader(max_capsule_data=8192, max_h2c_data=131072)
    r.hdgst, r.ddgst = hd, dd
    return r


def test_icreq_is_what_the_controller_expects() -> None:
    raw = H.icreq(hdgst=True, ddgst=False)
    assert len(raw) == 128
    (pdu,) = controller_reader().receive_data(raw)
    assert pdu.type == PduType.IC_REQ
    assert struct.unpack_from("<HBBI", pdu.header, 8) == (0, 0, 1, 0)


@pytest.mark.parametrize(("hd", "dd"), [(False, False), (True, False), (True, True)])
def test_capsule_with_in_capsule_data_round_trips(hd: bool, dd: bool) -> None:
    data = bytes(range(256)) * 4
    sqe = C.write(9, 1, 0x1_0000_0002, 2, 1024, fua=True, in_capsule=True)
    (pdu,) = controller_reader(hd, dd).receive_data(b"".join(H.capsule_cmd(sqe, data, hdgst=hd, ddgst=dd)))
    assert pdu.type == PduType.CAPSULE_CMD and bytes(pdu.data) == data and pdu.data_ok
    s = Sqe(pdu.header[8:72])
    assert (s.opcode, s.cid, s.nsid, s.sgl_len, s.sgl_id) == (C.IO_WRITE, 9, 1, 1024, 0x01)
    assert s.cdw10 | s.cdw11 << 32 == 0x1_0000_0002 and s.cdw12 == 1 | C.FUA


def test_h2c_data_round_trips() -> None:
    payload = b"x" * 5000
    raw = b"".join(H.h2c_data(3, 7, 4096, payload, last=True, hdgst=True, ddgst=True))
    (pdu,) = controller_reader(True, True).receive_data(raw)
    assert pdu.type == PduType.H2C_DATA and pdu.flags & F_LAST_PDU and bytes(pdu.data) == payload
    assert struct.unpack_from("<HHII", pdu.header, 8) == (3, 7, 4096, 5000)


def test_host_reader_parses_controller_pdus() -> None:
    r = H.HostPduReader()
    (ic,) = r.receive_data(ic_resp(0, True, True, 131072))
    resp = H.IcResp.parse(ic)
    assert (resp.pfv, resp.hdgst, resp.ddgst, resp.maxh2cdata) == (0, True, True, 131072)
    r.hdgst = r.ddgst = True
    out: list[bytes | memoryview] = []
    F.c2h_data(out, 5, 512, b"d" * 512, last=True, success=True, hdgst=True, ddgst=True, hpda=0)
    wire = b"".join(bytes(x) for x in out) + F.capsule_resp(S.cqe(5, S.LBA_OUT_OF_RANGE, dw0=1), True)
    r2t = r2t_header(6, 2, 0, 8192, True)
    wire += r2t + F.digest_bytes(r2t)  # the header digest follows the header the target built
    pdus = []
    for i in range(0, len(wire), 13):  # byte-at-a-time-ish arrival
        pdus += r.receive_data(wire[i:i + 13])
    assert [p.type for p in pdus] == [PduType.C2H_DATA, PduType.CAPSULE_RESP, PduType.R2T]
    d = H.DataHeader.parse(pdus[0])
    assert (d.cccid, d.offset, d.length) == (5, 512, 512) and pdus[0].flags & F_SUCCESS
    assert bytes(pdus[0].data) == b"d" * 512 and pdus[0].data_ok
    cqe = H.Cqe.parse(pdus[1].header[8:24])   # §3.6.2.6: the CQE follows the common header
    assert (cqe.cid, cqe.status, cqe.dw0) == (5, S.LBA_OUT_OF_RANGE, 1)
    t = H.DataHeader.parse(pdus[2])
    assert (t.cccid, t.ttag, t.offset, t.length) == (6, 2, 0, 8192)


def test_host_reader_rejects_host_pdus_and_bad_digests() -> None:
    with pytest.raises(H.HostFatalError):
        H.HostPduReader().receive_data(H.icreq(hdgst=False, ddgst=False))
    r = H.HostPduReader()
    r.hdgst = True
    bad = bytearray(F.capsule_resp(S.cqe(1, 0), True))
    bad[-1] ^= 0xFF
    with pytest.raises(H.HostFatalError, match="digest"):
        r.receive_data(bytes(bad))


def test_fabrics_and_admin_commands() -> None:
    s = Sqe(C.connect(1, 2, 64, 5000))
    assert s.opcode == 0x7F and s.fctype == C.FCTYPE_CONNECT
    assert (s.cdw10 >> 16, s.cdw11 & 0xFFFF, s.cdw12, s.sgl_len) == (2, 63, 0, 1024)
    assert Sqe(C.connect(1, 0, 32, 5000)).cdw12 == 5000
    data = C.connect_data(b"\x11" * 16, 0xFFFF, "nqn.a:b", "nqn.h:1")
    assert data[16:18] == b"\xff\xff" and data[256:263] == b"nqn.a:b" and data[512:519] == b"nqn.h:1"
    g = Sqe(C.property_get(3, C.PROP_CAP, eight=True))
    assert (g.fctype, g.cdw10, g.cdw11) == (C.FCTYPE_PROPERTY_GET, 1, 0)
    p = Sqe(C.property_set(4, C.PROP_CC, 0x460001))
    assert (p.fctype, p.cdw11, p.cdw12) == (C.FCTYPE_PROPERTY_SET, C.PROP_CC, 0x460001)
    q = Sqe(C.number_of_queues(5, 4))
    assert (q.opcode, q.cdw10, q.cdw11) == (C.ADMIN_SET_FEATURES, 7, 3 | 3 << 16)
    lp = Sqe(C.get_log_page(6, C.LID_DISCOVERY, 4096))
    assert lp.cdw10 == C.LID_DISCOVERY | (1023 << 16)
    cdb, ranges = C.dsm_deallocate(7, 1, [(100, 8), (200, 1)], in_capsule=True)
    d = Sqe(cdb)
    assert (d.cdw10, d.cdw11, d.sgl_len) == (1, C.DSM_AD, 32)
    assert struct.unpack_from("<IIQ", ranges, 16) == (0, 1, 200)
    assert Sqe(C.write_zeroes(8, 1, 5, 3)).cdw12 == 2


def test_identify_and_discovery_parsing() -> None:
    b = bytearray(4096)
    b[4:12] = b"SERIAL01"
    b[24:32] = b"openvsan"
    b[77] = 8
    struct.pack_into("<HI", b, 78, 3, 0x20000)
    struct.pack_into("<HI", b, 514, 128, 16)
    struct.pack_into("<H", b, 520, 0x0C)
    struct.pack_into("<IIH", b, 1792, (64 + 8192) // 16, 1, 0)
    c = C.IdentifyController.parse(bytes(b))
    assert (c.serial, c.model, c.mdts, c.cntlid, c.ioccsz) == ("SERIAL01", "openvsan", 8, 3, 64 + 8192)
    assert c.write_zeroes and c.dsm
    ns = bytearray(4096)
    struct.pack_into("<QQQ", ns, 0, 1000, 1000, 0)
    ns[26] = 1
    ns[128 + 4 + 2] = 12
    n = C.IdentifyNamespace.parse(bytes(ns))
    assert (n.nsze, n.block_size) == (1000, 4096)
    log = bytearray(2048)
    struct.pack_into("<QQ", log, 0, 9, 1)
    log[1024 + 32:1024 + 36] = b"4420"
    log[1024 + 256:1024 + 263] = b"nqn.a:b"
    log[1024 + 512:1024 + 521] = b"127.0.0.1"
    gen, num, entries = C.parse_discovery_log(bytes(log))
    assert (gen, num) == (9, 1) and (entries[0].subnqn, entries[0].traddr, entries[0].trsvcid) == (
        "nqn.a:b", "127.0.0.1", "4420")


def test_status_to_typed_errors() -> None:
    from openvsan.block import errors as E
    assert isinstance(status_error(S.LBA_OUT_OF_RANGE, ""), E.OutOfRange)
    assert isinstance(status_error(S.NS_WRITE_PROTECTED, ""), E.ReadOnly)
    assert isinstance(status_error(S.CAPACITY_EXCEEDED, ""), E.NoSpace)
    assert isinstance(status_error(S.UNRECOVERED_READ_ERROR, ""), E.MediumError)
    assert isinstance(status_error(S.INTERNAL_ERROR, ""), E.DeviceFailed)
    assert isinstance(status_error(S.ANA_TRANSITION, ""), E.Busy)
    assert retryable(S.NS_NOT_READY) and retryable(S.ANA_TRANSITION)
    assert not retryable(S.LBA_OUT_OF_RANGE) and not retryable(S.INVALID_FIELD)


def test_a_bare_capsule_is_what_the_general_encoder_makes() -> None:
    """capsule_cmd's shortcut for a capsule with nothing but its SQE (no data, no header digest) makes the bytes
    the general encoder made: the common header field by field, then the SQE; the controller's reader takes it."""
    sqe = C.read(0x1234, 1, 0x2_0000_0001, 8, 4096)
    (raw,) = H.capsule_cmd(sqe, b"", hdgst=False, ddgst=True)   # no data: nothing for a data digest to cover
    assert raw == struct.pack("<BBBBI", PduType.CAPSULE_CMD, 0, 72, 0, 72) + sqe
    (pdu,) = controller_reader(False, True).receive_data(raw)
    assert pdu.type == PduType.CAPSULE_CMD and Sqe(pdu.header[8:72]).cid == 0x1234 and not len(pdu.data)


def test_a_write_sqe_is_what_the_general_encoder_makes() -> None:
    """C.write packs its SQE itself: the same bytes as sqe() with the Write's fields (SLBA in CDW10-11, NLB 0's
    based and FUA in CDW12, the SGL for in-capsule or transport data)."""
    cases = ((0, 1, False, True), (0x1_2345_6789, 8, True, True), ((1 << 64) - 9, 256, False, False))
    for lba, blocks, fua, inc in cases:
        assert C.write(0xBEEF, 3, lba, blocks, blocks * 512, fua=fua, in_capsule=inc) == C.sqe(
            C.IO_WRITE, 0xBEEF, 3, cdw10=lba, cdw11=lba >> 32, cdw12=(blocks - 1) | (C.FUA if fua else 0),
            data_len=blocks * 512, in_capsule=inc)


def test_a_read_sqe_is_what_the_general_encoder_makes() -> None:
    """C.read packs its SQE itself: the same bytes as sqe() with the Read's fields (SLBA in CDW10-11, NLB 0's
    based in CDW12, data by C2HData)."""
    for lba, blocks in ((0, 1), (0x1_2345_6789, 8), ((1 << 64) - 9, 256)):
        assert C.read(0xBEEF, 3, lba, blocks, blocks * 512) == C.sqe(
            C.IO_READ, 0xBEEF, 3, cdw10=lba, cdw11=lba >> 32, cdw12=blocks - 1, data_len=blocks * 512)


def test_a_capsule_with_plain_data_is_what_the_general_encoder_makes() -> None:
    """capsule_cmd's shortcut for in-capsule data with no digest and no CPDA padding (a replicated write's
    capsule) makes the common header field by field (PDO 72, PLEN 72 + data), the SQE, then the data itself;
    the controller's reader takes it; with CPDA padding it takes the general encoder, whose PDO moves."""
    data = bytes(range(256)) * 16
    sqe = C.write(0x55, 1, 0x1_0000_0002, 8, 4096, fua=True, in_capsule=True)
    hdr, body = H.capsule_cmd(sqe, data, hdgst=False, ddgst=False)
    assert hdr == struct.pack("<BBBBI", PduType.CAPSULE_CMD, 0, 72, 72, 72 + 4096) + sqe and body == data
    (pdu,) = controller_reader(False, False).receive_data(hdr + bytes(body))
    assert Sqe(pdu.header[8:72]).cid == 0x55 and bytes(pdu.data) == data
    padded = H.capsule_cmd(sqe, data, hdgst=False, ddgst=False, cpda=3)   # 16-byte alignment
    assert padded[0][3] == 80 and padded[1] == bytes(8) and padded[2] == data


def test_a_write_capsule_in_one_pack_is_what_the_general_encoders_make() -> None:
    """H.write_capsule (the common header and a Write's SQE in one pack) makes the header capsule_cmd makes of
    C.write's SQE with the data in the capsule, for LBAs over 32 bits, FUA and the largest block count."""
    for lba, blocks, fua in ((0, 1, False), (0x1_2345_6789, 8, True), ((1 << 64) - 9, 256, False)):
        n = blocks * 512
        hdr, _ = H.capsule_cmd(C.write(0xBEEF, 3, lba, blocks, n, fua=fua, in_capsule=True), b"\0" * n,
                               hdgst=False, ddgst=False)
        assert H.write_capsule(0xBEEF, 3, lba, blocks, n, fua) == hdr


def test_a_read_capsule_in_one_pack_is_what_the_general_encoders_make() -> None:
    """H.read_capsule (the common header and a Read's SQE in one pack) makes what capsule_cmd makes of C.read's
    SQE with no digest, data digest and CPDA padding included (a capsule with no data has neither), for LBAs over
    32 bits and the largest block count."""
    for lba, blocks in ((0, 1), (0x1_2345_6789, 8), ((1 << 64) - 65536, 65536)):
        n = blocks * 512
        for dd, cpda in ((False, 0), (True, 0), (False, 3)):
            (raw,) = H.capsule_cmd(C.read(0xBEEF, 3, lba, blocks, n), hdgst=False, ddgst=dd, cpda=cpda)
            assert H.read_capsule(0xBEEF, 3, lba, blocks, n) == raw


def _sent(hd: bool, dd: bool, cpda: int, send: Callable[[NvmeQueue], None]) -> bytes:
    """What `send(queue)` puts on the wire of a queue with these digests and CPDA, one command left outstanding."""
    async def run() -> bytes:
        q, _ = _queue_with_reads({})
        q.hdgst, q.ddgst, q.cpda = hd, dd, cpda
        wire: list[bytes] = []

        class Wire:
            def write(self, b: bytes) -> None:
                wire.append(bytes(b))

            def writelines(self, parts: list[bytes]) -> None:
                wire.extend(bytes(x) for x in parts)

            def is_closing(self) -> bool:
                return False

        q._batch.transport = Wire()  # type: ignore[assignment]
        send(q)
        assert len(q.cmds) == 1
        q._batch.flush()
        return b"".join(wire)
    return asyncio.run(run())


@pytest.mark.parametrize("hd,dd,cpda", [(False, False, 0), (True, False, 0), (False, True, 0), (False, False, 3)])
def test_read_then_sends_what_submit_sends(hd: bool, dd: bool, cpda: int) -> None:
    """NvmeQueue.read_then (read_soon's send) puts on the wire the bytes submit() puts there for the same Read,
    with and without digests and CPDA padding, and the command waits for `n` bytes; the controller's reader
    takes them."""

    def fast(q: NvmeQueue) -> None:
        q.read_then(5, 0x1_0000_0010, 8, 4096, lambda r, e: None)
        (c,) = q.cmds.values()
        assert c.read_len == 4096 and c.data is None

    def normal(q: NvmeQueue) -> None:
        q.submit(lambda cid: C.read(cid, 5, 0x1_0000_0010, 8, 4096), read_len=4096)

    raw = _sent(hd, dd, cpda, fast)
    assert raw == _sent(hd, dd, cpda, normal)
    (pdu,) = controller_reader(hd, dd).receive_data(raw)
    sqe = Sqe(pdu.header[8:72])
    assert sqe.opcode == C.IO_READ and sqe.nsid == 5 and sqe.cdw10 == 0x10 and sqe.cdw11 == 1 and sqe.cdw12 == 7


@pytest.mark.parametrize("hd,dd,cpda", [(False, False, 0), (True, False, 0), (False, True, 0), (False, False, 3)])
def test_write_then_sends_what_submit_then_sends(hd: bool, dd: bool, cpda: int) -> None:
    """NvmeQueue.write_then (a replicated write's send) puts on the wire the bytes submit_then puts there for the
    same Write, with and without digests and CPDA padding; the controller's reader takes them."""
    data = memoryview(bytes(range(256)) * 16)
    raw = _sent(hd, dd, cpda, lambda q: q.write_then(5, 0x1_0000_0010, 8, data, True, lambda r, e: None))
    assert raw == _sent(hd, dd, cpda, lambda q: q.submit_then(
        lambda cid: C.write(cid, 5, 0x1_0000_0010, 8, 4096, fua=True, in_capsule=True), data, True,
        lambda r, e: None))
    (pdu,) = controller_reader(hd, dd).receive_data(raw)
    sqe = Sqe(pdu.header[8:72])
    assert sqe.nsid == 5 and sqe.cdw10 == 0x10 and sqe.cdw11 == 1 and sqe.cdw12 == 7 | C.FUA
    assert bytes(pdu.data) == bytes(range(256)) * 16


def _queue_with_reads(reads: dict[int, int]) -> tuple[NvmeQueue, dict[int, asyncio.Future[Result]]]:
    """An NvmeQueue with reads of the given lengths outstanding by CID, and their futures."""
    q = NvmeQueue("test", 1)
    q.alive = True
    futs: dict[int, asyncio.Future[Result]] = {}
    for cid, n in reads.items():
        f: asyncio.Future[Result] = q.loop.create_future()
        q.cmds[cid] = _Cmd(cid, n, None, f, None, 0.0)
        futs[cid] = f
    return q, futs


def _feed(q: NvmeQueue, raw: bytes, chunk: int) -> int:
    """`raw` into the queue as receives of `chunk` bytes; returns how many bytes the lane took (the PDU reader
    had the rest)."""
    to_reader = 0
    receive = q.reader.receive_data

    def counted(data: bytes | memoryview) -> list[Pdu]:
        nonlocal to_reader
        to_reader += len(data)
        return receive(data)
    q.reader.receive_data = counted   # type: ignore[method-assign]
    for i in range(0, len(raw), chunk):
        q.data_received(raw[i:i + chunk])
    return len(raw) - to_reader


def test_the_host_read_lane_completes_what_the_pdu_reader_would() -> None:
    """NvmeQueue's read lane (a whole read in one C2HData with SUCCESS at the front of a receive) is a shortcut of
    its PDU reader: the same stream, arriving whole (lane) or a few bytes at a time (reader), completes the same
    commands with the same data and status; what the lane does not take (a read in two PDUs, a CapsuleResp, an
    error status) is left to the reader, in order."""

    async def run(chunk: int) -> tuple[dict[int, tuple[int, bytes]], int]:
        q, futs = _queue_with_reads({1: 4096, 2: 4096, 3: 8192, 4: 512, 5: 4096})
        wire: list[bytes | memoryview] = []
        F.c2h_data(wire, 1, 0, b"\x01" * 4096, last=True, success=True, hdgst=False, ddgst=False, hpda=0)
        F.c2h_data(wire, 2, 0, b"\x02" * 4096, last=True, success=True, hdgst=False, ddgst=False, hpda=0)
        F.c2h_data(wire, 3, 0, b"\x03" * 4096, last=False, success=False, hdgst=False, ddgst=False, hpda=0)
        F.c2h_data(wire, 3, 4096, b"\x33" * 4096, last=True, success=True, hdgst=False, ddgst=False, hpda=0)
        F.c2h_data(wire, 4, 0, b"\x04" * 512, last=True, success=True, hdgst=False, ddgst=False, hpda=0)
        raw = b"".join(bytes(x) for x in wire) + F.capsule_resp(S.cqe(5, S.LBA_OUT_OF_RANGE), False)
        by_lane = _feed(q, raw, chunk)
        await asyncio.sleep(0)
        return {cid: (f.result().status, bytes(f.result().data)) for cid, f in futs.items()}, by_lane

    (whole, by_lane), (trickled, _) = asyncio.run(run(1 << 20)), asyncio.run(run(7))
    assert whole == trickled
    assert by_lane == 2 * (24 + 4096)   # the first two PDUs; the reader had the rest
    assert whole[1] == (0, b"\x01" * 4096) and whole[3] == (0, b"\x03" * 4096 + b"\x33" * 4096)
    assert whole[5] == (S.LBA_OUT_OF_RANGE, b"")


def test_the_host_lane_completes_capsule_resps_as_the_pdu_reader_would() -> None:
    """CapsuleResps at the front of a receive go through the lane too (a replicated write's answers from its
    peer): success, an error, a result in DW0/DW1, one for no waiting command, and a command answered by
    callback (submit_then) get what the reader gives them, whole or a few bytes at a time."""

    async def run(chunk: int) -> tuple[dict[int, tuple[int, int, int]], list[tuple[int, int]], int]:
        q, futs = _queue_with_reads({1: 0, 2: 0, 3: 0})
        answers: list[tuple[int, int]] = []
        q.cmds[4] = _Cmd(4, 0, None, None, lambda r, e: answers.append((r.status, r.cqe.dw0)), 0.0)  # type: ignore[union-attr]
        raw = b"".join(F.capsule_resp(c, False) for c in (
            S.cqe(1, 0, sqhd=7), S.cqe(9, 0), S.cqe(2, S.WRITE_FAULT), S.cqe(3, 0, dw0=0x1234, dw1=5),
            S.cqe(4, 0, dw0=77)))
        by_lane = _feed(q, raw, chunk)
        await asyncio.sleep(0)
        got = {cid: (f.result().status, f.result().cqe.dw0, f.result().cqe.dw1) for cid, f in futs.items()}
        return got, answers, by_lane

    (whole, answered, by_lane), (trickled, answered_trickled, _) = asyncio.run(run(1 << 20)), asyncio.run(run(5))
    assert whole == trickled and answered == answered_trickled == [(0, 77)]
    assert by_lane == 5 * 24            # all five through the lane
    assert whole == {1: (0, 0, 0), 2: (S.WRITE_FAULT, 0, 0), 3: (0, 0x1234, 5)}


def test_the_host_read_lane_leaves_a_stray_c2hdata_to_the_reader() -> None:
    """A C2HData for no waiting command, or longer than its read, is not taken by the lane: the reader's path
    drops the connection, as before."""

    async def run(cid: int, n: int) -> bool:
        q, futs = _queue_with_reads({1: 4096})
        aborted: list[bool] = []
        q.abort = lambda: aborted.append(True)   # type: ignore[method-assign]
        wire: list[bytes | memoryview] = []
        F.c2h_data(wire, cid, 0, b"\x01" * n, last=True, success=True, hdgst=False, ddgst=False, hpda=0)
        q.data_received(b"".join(bytes(x) for x in wire))
        return bool(aborted) and not futs[1].done()

    assert asyncio.run(run(9, 4096)) and asyncio.run(run(1, 8192))


def test_a_command_answered_by_callback_fails_once_its_connection_is_lost() -> None:
    """submit_then's callback gets the connection's loss once, in a later turn (as a future's waiter would),
    not from inside connection_lost, so the association is known dead when the caller sends it again."""

    async def run() -> list[str]:
        q, _ = _queue_with_reads({})
        got: list[str] = []
        q.submit_then(lambda cid: C.write(cid, 1, 0, 1, 512, fua=False, in_capsule=True), memoryview(b"x" * 512), True,
                      lambda r, e: got.append(type(e).__name__))
        q.connection_lost(None)
        assert got == [] and not q.cmds
        await asyncio.sleep(0)
        q.connection_lost(None)          # a second loss answers nothing twice
        await asyncio.sleep(0)
        return got

    assert asyncio.run(run()) == ["ConnectionLost"]


def test_slots_taken_at_once_and_put_back_as_a_semaphore_would() -> None:
    """Slots.try_acquire takes a free slot only when nobody waits; put_back frees one as release() does, and
    hands it to a waiter when there is one."""
    async def run() -> None:
        slots = Slots(2)
        assert slots.try_acquire() and slots.try_acquire() and not slots.try_acquire()
        waiter = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        assert not waiter.done()
        slots.put_back()                       # to the waiter, not to try_acquire
        assert not slots.try_acquire()
        await asyncio.sleep(0)
        assert waiter.done() and slots.locked()
        slots.put_back()
        slots.put_back()
        assert slots._value == 2 and slots.try_acquire()
    asyncio.run(run())
