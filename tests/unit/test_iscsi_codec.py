"""PDU framing, digests, key negotiation and transfer bookkeeping, driven with byte strings."""

import struct

import pytest

from openvsan.protocol.iscsi import pdu as P
from openvsan.protocol.iscsi.framing import FramingError, PduReader, digest, frame
from openvsan.protocol.iscsi.keys import Params, TextError, encode_text, negotiate_key, parse_text
from openvsan.protocol.iscsi.sequencing import WriteTransfer, data_in_segments, sn_in_window, sn_lt


def bhs(opcode: int, flags: int = 0x80, dsl: int = 0, itt: int = 1, immediate: bool = False,
        rest: bytes = b"") -> bytes:
    b = bytearray(48)
    b[0] = opcode | (0x40 if immediate else 0)
    b[1] = flags
    b[5:8] = dsl.to_bytes(3, "big")
    struct.pack_into(">I", b, 16, itt)
    b[20:20 + len(rest)] = rest
    return bytes(b)


def test_crc32c_matches_rfc_example():
    # RFC 7143 Appendix B.4: 32 bytes of zeros
    assert digest(bytes(32)) == bytes.fromhex("aa36918a")
    assert digest(b"\xff" * 32) == bytes.fromhex("43aba862")


def test_reader_splits_and_joins_pdus_across_chunks():
    data = b"hello"
    wire = b"".join(frame(bhs(P.Op.NOP_OUT, dsl=len(data)), data)) * 3
    r = PduReader()
    got = []
    for i in range(0, len(wire), 7):
        got += r.receive_data(wire[i:i + 7])
    assert [bytes(p.data) for p in got] == [data] * 3
    assert all(p.opcode == P.Op.NOP_OUT for p in got)


def test_reader_digests_detect_corruption():
    r = PduReader()
    r.header_digest = r.data_digest = True
    wire = bytearray(b"".join(frame(bhs(P.Op.NOP_OUT, dsl=6), b"abcdef", header_digest=True, data_digest=True)))
    (pdu,) = r.receive_data(bytes(wire))
    assert pdu.digest_ok and bytes(pdu.data) == b"abcdef"
    wire[52] ^= 1  # a data byte: the PDU comes through flagged, the stream stays in sync
    (pdu,) = r.receive_data(bytes(wire))
    assert not pdu.digest_ok
    wire[52] ^= 1
    wire[3] ^= 1  # a header byte: fatal at ErrorRecoveryLevel 0
    with pytest.raises(FramingError):
        r.receive_data(bytes(wire))


def test_frame_pads_to_four_bytes():
    parts = frame(bhs(P.Op.NOP_IN, dsl=5), b"12345")
    assert len(b"".join(parts)) == 48 + 8


def test_lun_encoding_round_trip():
    for lun in (0, 1, 255, 256, 16383):
        assert P.decode_lun(P.encode_lun(lun)) == lun


def test_text_parse_and_encode():
    pairs = [("HeaderDigest", "CRC32C,None"), ("X-com.example", "1")]
    assert parse_text(encode_text(pairs)) == pairs
    with pytest.raises(TextError):
        parse_text(b"novalue\0")


@pytest.mark.parametrize("key,offer,answer", [
    ("HeaderDigest", "CRC32C,None", "CRC32C"),
    ("DataDigest", "None", "None"),
    ("HeaderDigest", "MD5", "Reject"),
    ("InitialR2T", "No", "No"),
    ("InitialR2T", "Yes", "Yes"),
    ("ImmediateData", "Yes", "Yes"),
    ("MaxBurstLength", "262144", "262144"),
    ("MaxBurstLength", "100", "Reject"),
    ("MaxConnections", "8", "1"),
    ("ErrorRecoveryLevel", "2", "0"),
    ("DefaultTime2Wait", "0", "2"),
    ("MaxOutstandingR2T", "1", "1"),
    ("X-com.example.Foo", "bar", "NotUnderstood"),
    ("Bogus", "1", "NotUnderstood"),
    ("OFMarker", "Yes", "No"),
])
def test_negotiation_rules(key, offer, answer):
    assert negotiate_key(key, offer, discovery=False, params=Params()) == answer


def test_negotiation_applies_results_and_irrelevance():
    p = Params()
    negotiate_key("HeaderDigest", "CRC32C", discovery=False, params=p)
    negotiate_key("MaxRecvDataSegmentLength", "65536", discovery=False, params=p)
    assert p.header_digest and p.initiator_mrdsl == 65536
    assert negotiate_key("MaxBurstLength", "65536", discovery=True, params=p) == "Irrelevant"


def test_serial_number_arithmetic_wraps():
    assert sn_lt(0xFFFFFFFF, 0)
    assert not sn_lt(0, 0xFFFFFFFF)
    assert sn_in_window(1, 0xFFFFFFF0, 5)
    assert not sn_in_window(6, 0xFFFFFFF0, 5)


def test_data_in_segments_respect_mrdsl_and_burst():
    p = Params(initiator_mrdsl=8192, max_burst_length=16384)
    segs = data_in_segments(40000, p)
    assert sum(n for _, n, _ in segs) == 40000
    assert all(n <= 8192 for _, n, _ in segs)
    finals = [off + n for off, n, f in segs if f]
    assert finals == [16384, 32768, 40000]


def test_write_transfer_immediate_unsolicited_and_r2t():
    p = Params(initial_r2t=False, first_burst_length=8192, max_burst_length=16384, max_outstanding_r2t=1)
    t = WriteTransfer.start(40000, 40000, memoryview(b"a" * 4096), final=False, params=p)
    ttts = iter(range(100, 200))
    (r1,) = t.r2ts(ttts)
    assert (r1.offset, r1.length) == (8192, 16384)
    t.data_out(0xFFFFFFFF, 0, 4096, memoryview(b"b" * 4096), True)  # rest of the first burst
    t.data_out(r1.ttt, 0, 8192, memoryview(b"c" * 16384), True)
    (r2,) = t.r2ts(ttts)
    assert (r2.offset, r2.length) == (24576, 15424)
    t.data_out(r2.ttt, 0, 24576, memoryview(b"d" * 15424), True)
    assert t.complete and t.error is None
    assert bytes(t.buffer[4090:4100]) == b"aaaaaabbbb"


def test_write_transfer_flags_bad_datasn():
    p = Params(max_burst_length=8192)
    t = WriteTransfer.start(8192, 8192, memoryview(b""), final=True, params=p)
    (r,) = t.r2ts(iter(range(5)))
    t.data_out(r.ttt, 1, 0, memoryview(bytes(4096)), False)  # DataSN should be 0
    t.data_out(r.ttt, 1, 4096, memoryview(bytes(4096)), True)
    assert t.complete and t.error is not None and t.error.asc == 0x4B00


def data_out_pdu(itt: int, ttt: int, datasn: int, offset: int, data: bytes, final: bool = True) -> bytes:
    rest = struct.pack(">II", ttt, 0) + bytes(8) + struct.pack(">II", datasn, offset)   # bytes 20..43
    return b"".join(frame(bhs(P.Op.DATA_OUT, flags=0x80 if final else 0, dsl=len(data), itt=itt, rest=rest), data))


def read_in(reader: PduReader, wire: bytes, cuts: list[int]) -> list[P.Pdu]:
    got: list[P.Pdu] = []
    at = 0
    for cut in [*cuts, len(wire)]:
        got += reader.receive_data(wire[at:cut])
        at = cut
    return got


def test_reader_places_a_straddling_data_out_where_place_says_and_its_bytes_equal_the_join():
    """The shortcut's PDUs equal the joining reader's, byte for byte; a straddling Data-Out's payload lands in
    the memory `place` gave (its data is that memory); PDUs inside one receive and other opcodes are not
    offered to `place`."""
    pay1, pay2 = bytes(range(256)) * 40, b"\x5a" * 9000
    wire = (data_out_pdu(7, 100, 0, 0, pay1) + b"".join(frame(bhs(P.Op.NOP_OUT, dsl=5), b"hello"))
            + data_out_pdu(7, 100, 1, len(pay1), pay2))
    cuts = [1000, 20000, 20100]   # the first Data-Out straddles; the NOP and the second one lie in one receive
    target = bytearray(len(pay1) + len(pay2))
    asked: list[tuple[int, int]] = []

    def place(head: memoryview, dsl: int) -> memoryview | None:
        offset = struct.unpack_from(">I", head, 40)[0]
        asked.append((offset, dsl))
        return memoryview(target)[offset:offset + dsl]

    plain = read_in(PduReader(), wire, cuts)
    r = PduReader()
    r.place = place
    placed = read_in(r, wire, cuts)
    assert [(bytes(p.bhs), bytes(p.ahs), bytes(p.data)) for p in placed] == \
        [(bytes(p.bhs), bytes(p.ahs), bytes(p.data)) for p in plain]
    assert asked == [(0, len(pay1))]                    # the second Data-Out lay inside one receive
    assert placed[0].data.obj is target and bytes(target[:len(pay1)]) == pay1
    assert placed[2].data.obj is not target

    # the second one alone, split: placed too; a None from place is the join as before
    r2 = PduReader()
    r2.place = place
    (p2,) = read_in(r2, data_out_pdu(7, 100, 1, len(pay1), pay2), [3000])
    assert p2.data.obj is target and bytes(target[len(pay1):]) == pay2
    r3 = PduReader()
    r3.place = lambda head, dsl: None
    (p3,) = read_in(r3, data_out_pdu(7, 100, 1, 0, pay2), [3000])
    assert bytes(p3.data) == pay2


def test_reader_does_not_place_with_data_digests():
    r = PduReader()
    r.data_digest = True
    r.place = lambda head, dsl: pytest.fail("placed with a data digest")  # type: ignore[no-any-return]
    rest = struct.pack(">II", 100, 0) + bytes(8) + struct.pack(">II", 0, 0)
    wire = b"".join(frame(bhs(P.Op.DATA_OUT, dsl=6000, rest=rest), b"q" * 6000, data_digest=True))
    (pdu,) = read_in(r, wire, [2000])
    assert bytes(pdu.data) == b"q" * 6000 and pdu.digest_ok


def test_write_transfer_takes_placed_data_without_copying_and_still_judges_it():
    p = Params(max_burst_length=16384)
    t = WriteTransfer.start(16384, 16384, memoryview(b""), final=True, params=p)
    (r,) = t.r2ts(iter(range(5)))
    spot = t.placed(0, 8192)
    assert spot is not None and t.placed(12288, 8192) is None     # beyond the buffer
    spot[:] = b"p" * 8192
    t.data_out(r.ttt, 0, 0, spot, False)
    t.data_out(r.ttt, 1, 8192, memoryview(b"n" * 8192), True)
    assert t.complete and t.error is None and bytes(t.buffer) == b"p" * 8192 + b"n" * 8192
    # placed data for an unknown TTT fails the transfer like any other, and nothing more is placed after it
    t2 = WriteTransfer.start(8192, 8192, memoryview(b""), final=True, params=p)
    t2.r2ts(iter(range(5)))
    spot2 = t2.placed(0, 8192)
    assert spot2 is not None
    t2.data_out(0x1234, 0, 0, spot2, True)
    assert t2.error is not None and t2.error.asc == 0x4B01 and t2.placed(0, 4096) is None
