"""The sans-IO NBD server connection, driven with byte strings (proto.md section names in the comments)."""

from __future__ import annotations

import struct

import pytest

from openvsan.protocol.nbd import (
    Close,
    Cmd,
    CmdFlag,
    Disconnect,
    Errno,
    ExportInfo,
    NbdServerConnection,
    Negotiated,
    Phase,
    Request,
    Send,
    TransmissionFlag,
)
from openvsan.protocol.nbd.connection import MAX_OPTION_DATA
from openvsan.protocol.nbd.wire import (
    IHAVEOPT,
    NBDMAGIC,
    OPTION_REPLY_MAGIC,
    REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC,
    STRUCTURED_REPLY_MAGIC,
    Info,
    Opt,
    Rep,
    ReplyType,
)

MiB = 1 << 20
DISK = ExportInfo("disk0", 64 * MiB, min_block=512, description="the disk")
RO = ExportInfo("ro", 8 * MiB, min_block=4096, read_only=True)


# --- a tiny client-side encoder ---------------------------------------------------------------------
def option(opt: int, data: bytes = b"") -> bytes:
    return struct.pack(">QII", IHAVEOPT, opt, len(data)) + data


def go_data(name: str, *infos: int) -> bytes:
    n = name.encode()
    return struct.pack(">I", len(n)) + n + struct.pack(">H", len(infos)) + b"".join(struct.pack(">H", i) for i in infos)


def meta_data(name: str, *queries: str) -> bytes:
    n = name.encode()
    out = struct.pack(">I", len(n)) + n + struct.pack(">I", len(queries))
    for q in queries:
        out += struct.pack(">I", len(q)) + q.encode()
    return out


def request(cmd: int, offset: int = 0, length: int = 0, *, flags: int = 0, cookie: int = 7,
            magic: int = REQUEST_MAGIC) -> bytes:
    return struct.pack(">IHHQQI", magic, flags, cmd, cookie, offset, length)


def sent(events: list) -> bytes:
    return b"".join(bytes(b) for e in events if isinstance(e, Send) for b in e.data)


def option_replies(data: bytes) -> list[tuple[int, int, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        magic, opt, rep, n = struct.unpack_from(">QIII", data, pos)
        assert magic == OPTION_REPLY_MAGIC
        out.append((opt, rep, data[pos + 20:pos + 20 + n]))
        pos += 20 + n
    return out


def connect(*exports: ExportInfo, flags: int = 3) -> NbdServerConnection:
    c = NbdServerConnection(list(exports or (DISK, RO)))
    greeting = c.greeting()
    # proto.md "Newstyle negotiation": NBDMAGIC, IHAVEOPT, FIXED_NEWSTYLE | NO_ZEROES
    assert greeting == struct.pack(">QQH", NBDMAGIC, IHAVEOPT, 3)
    assert c.receive_data(struct.pack(">I", flags)) == []
    return c


def go(c: NbdServerConnection, name: str = "disk0", structured: bool = True) -> Negotiated:
    if structured:
        assert option_replies(sent(c.receive_data(option(Opt.STRUCTURED_REPLY)))) == [
            (Opt.STRUCTURED_REPLY, Rep.ACK, b"")]
    events = c.receive_data(option(Opt.GO, go_data(name, Info.BLOCK_SIZE)))
    (neg,) = [e for e in events if isinstance(e, Negotiated)]
    return neg


# --- handshake ----------------------------------------------------------------------------------------
def test_go_replies_export_block_size_then_ack() -> None:
    c = connect()
    events = c.receive_data(option(Opt.GO, go_data("disk0", Info.NAME, Info.DESCRIPTION, Info.BLOCK_SIZE)))
    replies = option_replies(sent(events))
    assert [r[1] for r in replies] == [Rep.INFO] * 4 + [Rep.ACK]
    infos = {struct.unpack_from(">H", d)[0]: d[2:] for _, _, d in replies[:-1]}
    size, flags = struct.unpack(">QH", infos[Info.EXPORT])
    assert size == 64 * MiB
    for f in (TransmissionFlag.HAS_FLAGS, TransmissionFlag.SEND_FLUSH, TransmissionFlag.SEND_FUA,
              TransmissionFlag.SEND_TRIM, TransmissionFlag.SEND_WRITE_ZEROES, TransmissionFlag.CAN_MULTI_CONN):
        assert flags & f
    assert not flags & (TransmissionFlag.READ_ONLY | TransmissionFlag.SEND_DF)  # no structured replies yet
    assert struct.unpack(">III", infos[Info.BLOCK_SIZE]) == (512, 4096, 32 * MiB)
    assert infos[Info.NAME] == b"disk0" and infos[Info.DESCRIPTION] == b"the disk"
    (neg,) = [e for e in events if isinstance(e, Negotiated)]
    assert neg.export is DISK and not neg.structured and c.phase is Phase.REQUEST


def test_info_does_not_enter_transmission_and_unknown_export_is_an_error() -> None:
    c = connect()
    events = c.receive_data(option(Opt.INFO, go_data("ro")))
    assert not any(isinstance(e, Negotiated) for e in events)
    replies = option_replies(sent(events))
    flags = struct.unpack(">QH", replies[0][2][2:])[1]
    assert flags & TransmissionFlag.READ_ONLY and not flags & TransmissionFlag.SEND_TRIM
    replies = option_replies(sent(c.receive_data(option(Opt.GO, go_data("nope")))))
    assert replies[0][1] == Rep.ERR_UNKNOWN and b"nope" in replies[0][2]
    assert c.phase is Phase.OPTION_HEADER  # the client may try again


def test_empty_name_is_the_default_export_and_names_itself() -> None:
    c = connect()
    replies = option_replies(sent(c.receive_data(option(Opt.GO, go_data("")))))
    names = [d[2:] for _, rep, d in replies if rep == Rep.INFO and struct.unpack_from(">H", d)[0] == Info.NAME]
    assert names == [b"disk0"]


def test_list_and_abort() -> None:
    c = connect()
    replies = option_replies(sent(c.receive_data(option(Opt.LIST))))
    assert [r[1] for r in replies] == [Rep.SERVER, Rep.SERVER, Rep.ACK]
    assert replies[0][2] == struct.pack(">I", 5) + b"disk0" + b"the disk"
    assert option_replies(sent(c.receive_data(option(Opt.LIST, b"x"))))[0][1] == Rep.ERR_INVALID
    events = c.receive_data(option(Opt.ABORT))
    assert option_replies(sent(events)) == [(Opt.ABORT, Rep.ACK, b"")]
    assert isinstance(events[-1], Disconnect) and c.phase is Phase.DONE


@pytest.mark.parametrize("opt", [Opt.PEEK_EXPORT, Opt.EXTENDED_HEADERS, 99, 0xFFFFFFFF])
def test_unknown_options_get_unsup_and_parsing_goes_on(opt: int) -> None:
    c = connect()
    replies = option_replies(sent(c.receive_data(option(opt, b"some data"))))
    assert replies[0][:2] == (opt, Rep.ERR_UNSUP)
    assert go(c).export is DISK  # proto.md "Baseline": MUST NOT fail to parse the next message


def test_starttls_is_refused_by_policy() -> None:
    c = connect()
    assert option_replies(sent(c.receive_data(option(Opt.STARTTLS))))[0][1] == Rep.ERR_POLICY


@pytest.mark.parametrize("data", [
    b"", b"\x00\x00\x00", go_data("disk0")[:-1], go_data("disk0") + b"\x00",
    struct.pack(">I", 1000) + b"disk0\x00\x00", go_data("disk0", 3)[:-4] + b"\x00\x05",
    go_data("di\x00sk"), struct.pack(">I", 2) + b"\xff\xfe" + b"\x00\x00",
])
def test_malformed_go_is_invalid(data: bytes) -> None:
    c = connect()
    replies = option_replies(sent(c.receive_data(option(Opt.GO, data))))
    assert replies[-1][1] == Rep.ERR_INVALID, replies
    assert go(c).export is DISK


def test_export_name_old_way() -> None:
    c = connect(flags=1)  # fixed newstyle, but no NO_ZEROES: 124 zero bytes follow
    events = c.receive_data(option(Opt.EXPORT_NAME, b"disk0"))
    out = sent(events)
    assert len(out) == 8 + 2 + 124 and out[10:] == bytes(124)
    size, flags = struct.unpack_from(">QH", out)
    assert size == 64 * MiB and flags & TransmissionFlag.HAS_FLAGS
    assert isinstance(events[-1], Negotiated)
    c = connect(flags=3)
    assert len(sent(c.receive_data(option(Opt.EXPORT_NAME, b"disk0")))) == 10
    c = connect()
    (ev,) = c.receive_data(option(Opt.EXPORT_NAME, b"nope"))
    assert isinstance(ev, Close)  # proto.md: it cannot report an error, so the session ends


def test_bad_client_flags_and_magic_close() -> None:
    c = NbdServerConnection([DISK])
    (ev,) = c.receive_data(struct.pack(">I", 4))
    assert isinstance(ev, Close) and "client flags" in ev.reason
    c = connect()
    (ev,) = c.receive_data(struct.pack(">QII", 0x1234, Opt.GO, 0))
    assert isinstance(ev, Close) and c.receive_data(b"anything") == []


def test_huge_option_length_closes() -> None:
    c = connect()
    (ev,) = c.receive_data(struct.pack(">QII", IHAVEOPT, Opt.GO, MAX_OPTION_DATA + 1))
    assert isinstance(ev, Close)


def test_shutting_down_errors_options_but_abort() -> None:
    c = connect()
    c.start_shutdown()
    assert option_replies(sent(c.receive_data(option(Opt.GO, go_data("disk0")))))[0][1] == Rep.ERR_SHUTDOWN
    assert option_replies(sent(c.receive_data(option(Opt.ABORT))))[0][1] == Rep.ACK


def test_meta_context_base_allocation() -> None:
    c = connect()
    # before structured replies: invalid
    assert option_replies(sent(c.receive_data(option(Opt.SET_META_CONTEXT, meta_data("disk0", "base:allocation")))))[
        0][1] == Rep.ERR_INVALID
    c.receive_data(option(Opt.STRUCTURED_REPLY))
    listed = option_replies(sent(c.receive_data(option(Opt.LIST_META_CONTEXT, meta_data("disk0")))))
    assert listed == [(Opt.LIST_META_CONTEXT, Rep.META_CONTEXT, b"\0\0\0\0base:allocation"),
                      (Opt.LIST_META_CONTEXT, Rep.ACK, b"")]
    got = option_replies(sent(c.receive_data(option(Opt.SET_META_CONTEXT,
                                                    meta_data("disk0", "qemu:dirty-bitmap:x", "base:allocation")))))
    assert got[0][1] == Rep.META_CONTEXT and got[0][2][4:] == b"base:allocation" and got[1][1] == Rep.ACK
    assert option_replies(sent(c.receive_data(option(Opt.SET_META_CONTEXT, b"\0\0\0\x09disk0"))))[0][1] == \
        Rep.ERR_INVALID
    c.receive_data(option(Opt.SET_META_CONTEXT, meta_data("disk0", "base:allocation")))
    neg = go(c, structured=False)
    assert neg.meta_context_id is not None and neg.structured


def test_meta_context_is_for_its_export_only() -> None:
    c = connect()
    c.receive_data(option(Opt.STRUCTURED_REPLY))
    c.receive_data(option(Opt.SET_META_CONTEXT, meta_data("ro", "base:allocation")))
    neg = go(c, "disk0", structured=False)
    assert neg.meta_context_id is None
    events = c.receive_data(request(Cmd.BLOCK_STATUS, 0, 512))
    assert _chunk(sent(events))[1] == ReplyType.ERROR


# --- transmission ---------------------------------------------------------------------------------------
def _chunk(data: bytes) -> tuple[int, int, int, bytes]:
    magic, flags, rtype, cookie, n = struct.unpack_from(">IHHQI", data)
    assert magic == STRUCTURED_REPLY_MAGIC
    return flags, rtype, cookie, data[20:20 + n]


def _simple(data: bytes) -> tuple[int, int]:
    magic, error, cookie = struct.unpack_from(">IIQ", data)
    assert magic == SIMPLE_REPLY_MAGIC
    return error, cookie


def test_requests_split_anywhere_come_out_whole() -> None:
    c = connect()
    go(c)
    wire = (request(Cmd.WRITE, 4096, 1024, flags=CmdFlag.FUA, cookie=1) + b"w" * 1024
            + request(Cmd.READ, 0, 512, cookie=2) + request(Cmd.FLUSH, cookie=3)
            + request(Cmd.WRITE_ZEROES, 0, 8192, flags=CmdFlag.NO_HOLE, cookie=4) + request(Cmd.DISC))
    events = []
    for i in range(0, len(wire), 5):
        events += c.receive_data(wire[i:i + 5])
    reqs = [e for e in events if isinstance(e, Request)]
    assert [(r.cmd, r.cookie, r.offset, r.length) for r in reqs] == [
        (Cmd.WRITE, 1, 4096, 1024), (Cmd.READ, 2, 0, 512), (Cmd.FLUSH, 3, 0, 0), (Cmd.WRITE_ZEROES, 4, 0, 8192)]
    assert reqs[0].fua and bytes(reqs[0].payload) == b"w" * 1024 and reqs[3].no_hole
    assert isinstance(events[-1], Disconnect)
    assert c.receive_data(request(Cmd.READ, 0, 512)) == []  # nothing after DISC


def test_read_replies_simple_and_structured() -> None:
    c = connect()
    go(c, structured=False)
    (req,) = c.receive_data(request(Cmd.READ, 512, 512, cookie=9))
    out = b"".join(bytes(b) for b in c.reply(req, b"d" * 512))
    assert _simple(out) == (0, 9) and out[16:] == b"d" * 512
    c = connect()
    go(c)
    (req,) = c.receive_data(request(Cmd.READ, 512, 512, cookie=9))
    flags, rtype, cookie, payload = _chunk(b"".join(bytes(b) for b in c.reply(req, b"d" * 512)))
    assert (flags, rtype, cookie) == (1, ReplyType.OFFSET_DATA, 9)
    assert struct.unpack_from(">Q", payload)[0] == 512 and payload[8:] == b"d" * 512
    # non-read success: a simple reply is allowed with structured replies
    (req,) = c.receive_data(request(Cmd.FLUSH, cookie=5))
    assert _simple(b"".join(bytes(b) for b in c.reply(req))) == (0, 5)


def test_error_reply_carries_message_and_offset() -> None:
    c = connect()
    go(c)
    (req,) = c.receive_data(request(Cmd.READ, 0, 4096, cookie=3))
    flags, rtype, cookie, payload = _chunk(bytes(c.reply_error(req, Errno.EIO, "bad sector", 1024)[0]))
    assert rtype == ReplyType.ERROR_OFFSET and flags == 1 and cookie == 3
    err, n = struct.unpack_from(">IH", payload)
    assert err == Errno.EIO and payload[6:6 + n] == b"bad sector" and struct.unpack(">Q", payload[6 + n:]) == (1024,)


@pytest.mark.parametrize(("cmd", "offset", "length", "flags", "errno"), [
    (Cmd.READ, 64 * MiB - 512, 1024, 0, Errno.EINVAL),       # beyond the end
    (Cmd.READ, 100, 512, 0, Errno.EINVAL),                    # unaligned
    (Cmd.READ, 0, 33 * MiB, 0, Errno.EOVERFLOW),              # over the maximum payload (structured)
    (Cmd.READ, 0, 512, CmdFlag.NO_HOLE, Errno.EINVAL),        # a flag that is not a read's
    (Cmd.TRIM, 64 * MiB, 512, 0, Errno.EINVAL),
    (Cmd.WRITE_ZEROES, 64 * MiB, 512, 0, Errno.ENOSPC),      # writes beyond the end: ENOSPC
    (Cmd.WRITE_ZEROES, 0, 512, CmdFlag.FAST_ZERO, Errno.EINVAL),  # FAST_ZERO is not advertised
    (Cmd.BLOCK_STATUS, 0, 512, 0, Errno.EINVAL),              # no meta context selected
    (Cmd.RESIZE, 0, 0, 0, Errno.EINVAL),
    (200, 0, 0, 0, Errno.EINVAL),                             # unknown command
    (Cmd.READ, 2**64 - 512, 512, 0, Errno.EINVAL),            # offset + length wraps in C, not here
])
def test_bad_requests_get_the_protocols_error(cmd: int, offset: int, length: int, flags: int, errno: int) -> None:
    c = connect()
    go(c)
    events = c.receive_data(request(cmd, offset, length, flags=flags, cookie=0xABCDEF))
    assert not any(isinstance(e, Request) for e in events)
    _, rtype, cookie, payload = _chunk(sent(events))
    assert rtype == ReplyType.ERROR and cookie == 0xABCDEF
    assert struct.unpack_from(">I", payload)[0] == errno
    assert c.phase is Phase.REQUEST  # the connection goes on


def test_simple_mode_errors_and_read_overflow_is_einval() -> None:
    c = connect()
    go(c, structured=False)
    assert _simple(sent(c.receive_data(request(Cmd.READ, 0, 33 * MiB, cookie=4)))) == (Errno.EINVAL, 4)
    assert _simple(sent(c.receive_data(request(Cmd.READ, 0, 512, flags=CmdFlag.DF, cookie=5)))) == (Errno.EINVAL, 5)


def test_bad_writes_skip_their_payload_and_the_stream_stays_framed() -> None:
    c = connect(RO, DISK)
    go(c, "ro", structured=False)
    wire = (request(Cmd.WRITE, 0, 4096, cookie=1) + b"x" * 4096           # read-only: EPERM
            + request(Cmd.TRIM, 0, 4096, cookie=2)
            + request(Cmd.READ, 0, 4096, cookie=3))
    events = c.receive_data(wire)
    assert [_simple(sent([e])) for e in events if isinstance(e, Send)] == [(Errno.EPERM, 1), (Errno.EPERM, 2)]
    assert [e.cookie for e in events if isinstance(e, Request)] == [3]
    c = connect()
    go(c, structured=False)
    big = 40 * MiB  # over the maximum payload: read through and refused, not buffered
    events = c.receive_data(request(Cmd.WRITE, 0, big, cookie=8))
    assert events == [] and c._payload is None
    for _ in range(big // MiB - 1):
        assert c.receive_data(bytes(MiB)) == []
    # the error comes once the payload is through; the next header straight after it is read as one
    events = c.receive_data(bytes(MiB) + request(Cmd.WRITE, 60 * MiB, 8 * MiB, cookie=9) + bytes(8 * MiB))
    assert _simple(sent(events[:1])) == (Errno.EINVAL, 8)
    assert _simple(sent(events[1:])) == (Errno.ENOSPC, 9)


@pytest.mark.parametrize("magic", [0, 0x12560953, 0x21E41C71, 0x67446698])
def test_bad_request_magic_closes(magic: int) -> None:
    c = connect()
    go(c)
    (ev,) = c.receive_data(request(Cmd.READ, 0, 512, magic=magic))
    assert isinstance(ev, Close) and c.phase is Phase.DONE


def test_block_status_and_read_only_flush() -> None:
    c = connect()
    c.receive_data(option(Opt.STRUCTURED_REPLY))
    c.receive_data(option(Opt.SET_META_CONTEXT, meta_data("disk0", "base:allocation")))
    neg = go(c, structured=False)
    (req,) = c.receive_data(request(Cmd.BLOCK_STATUS, 0, 1 << 20, flags=CmdFlag.REQ_ONE, cookie=2))
    flags, rtype, cookie, payload = _chunk(bytes(c.reply_block_status(req, [(1 << 20, 0)])[0]))
    assert rtype == ReplyType.BLOCK_STATUS and flags == 1 and cookie == 2
    assert struct.unpack(">III", payload) == (neg.meta_context_id, 1 << 20, 0)
    c = connect()
    go(c, "ro")
    (req,) = c.receive_data(request(Cmd.FLUSH, cookie=2))
    assert req.cmd == Cmd.FLUSH
