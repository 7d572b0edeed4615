"""The iSCSI initiator's connection pump with a fake transport: target PDUs in as bytes, what it sends out.

NOP-In pings answered, R2T-driven Data-Out, Data-In with phase collapse and residuals, the MaxCmdSN window.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import fake_transport

from openvsan.initiator.iscsi_conn import Completion, IscsiConnection
from openvsan.protocol.iscsi import pdu as P
from openvsan.protocol.iscsi.framing import PduReader, frame
from openvsan.protocol.iscsi.initiator_login import SessionParams


class FakeTransport(fake_transport.FakeTransport):
    def pdus(self) -> list[P.Pdu]:
        out = PduReader().receive_data(bytes(self.sent))
        self.sent.clear()
        return out


async def connected(**params: Any) -> tuple[IscsiConnection, FakeTransport]:
    c = IscsiConnection("test")
    t = FakeTransport()
    c.connection_made(t)
    c.params = SessionParams(send_mrdsl=params.pop("send_mrdsl", 8192), **params)
    c.cmdsn, c.expcmdsn, c.maxcmdsn, c.expstatsn = 10, 10, 10 + 31, 5
    return c, t


def feed(c: IscsiConnection, bhs: bytes, data: bytes = b"") -> None:
    c.data_received(b"".join(bytes(x) for x in frame(bhs, data)))


async def turn() -> None:
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def test_nop_in_ping_is_answered() -> None:
    async def main() -> None:
        c, t = await connected()
        feed(c, P.nop_in(P.RESERVED_TAG, 0x1234, 5, 10, 50, dsl=4), b"ping")
        await turn()
        (out,) = t.pdus()
        assert out.opcode == P.Op.NOP_OUT and out.immediate
        assert out.itt == P.RESERVED_TAG and out.u32(20) == 0x1234 and bytes(out.data) == b"ping"
        assert c.maxcmdsn == 50  # the window moved with the NOP-In

    asyncio.run(main())


def test_write_with_immediate_unsolicited_and_r2t_data() -> None:
    async def main() -> None:
        c, t = await connected(send_mrdsl=4096, immediate_data=True, initial_r2t=False, first_burst_length=8192)
        data = bytes(range(256)) * 64  # 16 KiB
        fut = c.command(b"\x8a" + bytes(15), bytes(8), data=data)
        await turn()
        cmd, unsol = t.pdus()
        assert cmd.opcode == P.Op.SCSI_CMD and not cmd.flags & P.F_FINAL and len(cmd.data) == 4096
        assert unsol.opcode == P.Op.DATA_OUT and unsol.u32(20) == P.RESERVED_TAG and unsol.u32(40) == 4096
        assert unsol.flags & P.F_FINAL and bytes(unsol.data) == data[4096:8192]
        # the target asks for the rest in one R2T; we answer in two Data-Outs within its MRDSL
        feed(c, P.r2t(cmd.itt, 77, bytes(8), 6, 11, 41, 0, 8192, 8192))
        await turn()
        d1, d2 = t.pdus()
        assert (d1.u32(20), d1.u32(36), d1.u32(40)) == (77, 0, 8192) and not d1.flags & P.F_FINAL
        assert (d2.u32(36), d2.u32(40)) == (1, 12288) and d2.flags & P.F_FINAL
        assert bytes(d1.data) + bytes(d2.data) == data[8192:]
        feed(c, P.scsi_response(cmd.itt, 0, 6, 11, 41))
        done = await fut
        assert done.status == 0 and c.expstatsn == 7

    asyncio.run(main())


def test_read_with_phase_collapse_and_underflow() -> None:
    async def main() -> None:
        c, _ = await connected()
        fut = c.command(b"\x12" + bytes(5), bytes(8), read_len=96)
        await turn()
        itt = next(iter(c.tasks))
        feed(c, P.data_in(itt, 0, 0, 36, final=True, expcmdsn=11, maxcmdsn=41, status=0, statsn=5,
                          flags=P.F_UNDERFLOW, residual=60), b"i" * 36)
        done: Completion = await fut
        assert done.status == 0 and bytes(done.data) == b"i" * 36 and not c.tasks

    asyncio.run(main())


def test_window_holds_commands_until_maxcmdsn_moves() -> None:
    async def main() -> None:
        c, _ = await connected()
        c.maxcmdsn = c.cmdsn  # room for exactly one
        c.command(b"\x00" * 6, bytes(8))
        assert not c.window_open()
        waiter = asyncio.ensure_future(c.wait_window())
        await turn()
        assert not waiter.done()
        # a response that opens the window by 8
        feed(c, P.nop_in(P.RESERVED_TAG, P.RESERVED_TAG, 5, c.cmdsn, c.cmdsn + 7))
        await asyncio.wait_for(waiter, 1)
        # a MaxCmdSN below ExpCmdSN - 1 is ignored (RFC 7143 §4.2.2.1)
        before = c.maxcmdsn
        feed(c, P.nop_in(P.RESERVED_TAG, P.RESERVED_TAG, 5, c.cmdsn + 5, c.cmdsn + 2))
        assert c.maxcmdsn == before

    asyncio.run(main())


def test_data_in_past_the_buffer_drops_the_connection() -> None:
    async def main() -> None:
        c, t = await connected()
        c.command(b"\x88" + bytes(15), bytes(8), read_len=512)
        await turn()
        itt = next(iter(c.tasks))
        feed(c, P.data_in(itt, 0, 512, 512, final=True, expcmdsn=11, maxcmdsn=41), b"x" * 512)
        assert t.aborted

    asyncio.run(main())


def test_digest_framing_is_used_after_login() -> None:
    async def main() -> None:
        c, t = await connected(header_digest=True, data_digest=True)
        c.command(b"\x8a" + bytes(15), bytes(8), data=b"z" * 512)
        await turn()
        r = PduReader()
        r.header_digest = r.data_digest = True
        (p,) = r.receive_data(bytes(t.sent))
        assert p.digest_ok and bytes(p.data) == b"z" * 512
        assert struct.unpack_from(">I", p.bhs, 20)[0] == 512  # EDTL

    asyncio.run(main())


def _reads_stream(c: IscsiConnection, itts: list[int], lengths: list[int]) -> list[bytes]:
    """Target PDUs for the reads waiting on `itts`, per command: whole reads in one Data-In with status (the
    lane's), reads in two Data-Ins, reads with an underflow residual followed by a NOP-In."""
    chunks = []
    statsn = 5
    for i, (itt, n) in enumerate(zip(itts, lengths, strict=True)):
        out: list[Any] = []
        payload = bytes([i + 1]) * n
        if i % 5 == 3:      # in two parts (the general path)
            h = n // 2
            out += frame(P.data_in(itt, 0, 0, h, final=False, expcmdsn=11 + i, maxcmdsn=41 + i), payload[:h])
            out += frame(P.data_in(itt, 1, h, n - h, final=True, expcmdsn=11 + i, maxcmdsn=41 + i, status=0,
                                   statsn=statsn), payload[h:])
        elif i % 5 == 4:    # shorter than asked, with an underflow residual (the general path)
            out += frame(P.data_in(itt, 0, 0, n - 8, final=True, expcmdsn=11 + i, maxcmdsn=41 + i, status=0,
                                   statsn=statsn, flags=P.F_UNDERFLOW, residual=8), payload[:n - 8])
            out += frame(P.nop_in(P.RESERVED_TAG, P.RESERVED_TAG, statsn + 1, 11 + i, 41 + i))
        else:               # the lane's
            out += frame(P.data_in(itt, 0, 0, n, final=True, expcmdsn=11 + i, maxcmdsn=41 + i, status=0,
                                   statsn=statsn), payload)
        statsn += 1
        chunks.append(b"".join(bytes(x) for x in out))
    return chunks


def _receive(c: IscsiConnection, chunks: list[bytes], per: int, cut: int | None) -> None:
    """Each command's PDUs (`chunks`) into c: `per` commands' a receive, or (cut) `cut` bytes a receive."""
    if cut is None:
        for i in range(0, len(chunks), per):
            c.data_received(b"".join(chunks[i:i + per]))
        return
    stream = b"".join(chunks)
    for i in range(0, len(stream), cut):
        c.data_received(stream[i:i + cut])


def _seen_by_reader(c: IscsiConnection, op: P.Op, monkeypatch: Any) -> list[P.Pdu]:
    """The PDUs of opcode `op` that c's PDU reader (not its receive lane) takes from now on."""
    seen: list[P.Pdu] = []
    receive = c.reader.receive_data

    def counted(data: Any) -> Any:
        pdus = receive(data)
        seen.extend(p for p in pdus if p.opcode == op)
        return pdus
    monkeypatch.setattr(c.reader, "receive_data", counted)
    return seen


def test_the_read_lane_completes_reads_as_the_pdu_reader_does(monkeypatch: Any) -> None:
    """The same target stream in receives of whole PDUs (whole Data-Ins at the front of a receive take the
    lane) and a few bytes at a time (every PDU goes through the PDU reader): the same results, window and
    StatSN."""
    lengths = [512, 4096, 3, 4096, 100, 512, 4096, 7, 8192, 1000, 512, 4096]

    async def run(cut: int | None) -> tuple[list[tuple[int, bytes]], tuple[int, int, int], int]:
        c, t = await connected()
        read_by_reader = _seen_by_reader(c, P.Op.DATA_IN, monkeypatch)
        futs = [c.command(b"\x88" + bytes(15), bytes(8), read_len=n) for n in lengths]
        await turn()
        chunks = _reads_stream(c, list(c.tasks), lengths)
        # whole: two commands' PDUs a receive (whole ones at the front take the lane, the rest the reader)
        _receive(c, chunks, 2, cut)
        done = [await f for f in futs]
        assert not c.tasks and not t.aborted
        return [(d.status, bytes(d.data)) for d in done], (c.expcmdsn, c.maxcmdsn, c.expstatsn), len(read_by_reader)

    whole, window, by_reader = asyncio.run(run(None))
    trickled, window2, by_reader2 = asyncio.run(run(5))
    assert whole == trickled and window == window2
    assert [len(d) for _, d in whole] == [n if i % 5 != 4 else n - 8 for i, n in enumerate(lengths)]
    assert by_reader2 == len(lengths) + 2            # trickled: every Data-In through the reader
    assert by_reader <= by_reader2 - 6               # whole PDUs: the lane took the plain ones at the front


def test_a_data_in_the_lane_does_not_know_goes_to_the_general_path() -> None:
    async def main() -> None:
        c, t = await connected()
        fut = c.command(b"\x88" + bytes(15), bytes(8), read_len=512)
        await turn()
        itt = next(iter(c.tasks))
        # a whole read with status for a task no one sent: the general path drops it (an unknown ITT)
        feed(c, P.data_in(itt + 7, 0, 0, 512, final=True, expcmdsn=11, maxcmdsn=41, status=0), b"u" * 512)
        assert not fut.done() and not t.aborted
        # longer than the command asked: the general path drops the connection
        feed(c, P.data_in(itt, 0, 0, 1024, final=True, expcmdsn=11, maxcmdsn=41, status=0), b"l" * 1024)
        assert t.aborted

    asyncio.run(main())


def _responses_stream(itts: list[int]) -> list[bytes]:
    """Target PDUs answering the writes waiting on `itts`, one SCSI Response each: GOOD with nothing else (the
    lane's), RESERVATION CONFLICT with no sense (the lane's), CHECK CONDITION with sense data, an underflow
    residual, and a response other than "completed" (the general path's)."""
    chunks = []
    statsn = 5
    for i, itt in enumerate(itts):
        kind = i % 6
        win = {"expcmdsn": 11 + i, "maxcmdsn": 41 + i}
        if kind == 4:
            sense = bytes([0x70, 0, 0x03, 0, 0, 0, 0, 10]) + bytes(10)    # MEDIUM ERROR
            seg = struct.pack(">H", len(sense)) + sense
            out = frame(P.scsi_response(itt, 0x02, statsn, dsl=len(seg), **win), seg)
        elif kind == 5:
            out = frame(P.scsi_response(itt, 0, statsn, flags=P.F_UNDERFLOW, residual=512, **win))
        elif i == 8:
            out = frame(P.scsi_response(itt, 0, statsn, response=1, **win))
        else:
            out = frame(P.scsi_response(itt, 0x18 if kind == 3 else 0, statsn, **win))
        statsn += 1
        chunks.append(b"".join(bytes(x) for x in out))
    return chunks


def test_the_lane_completes_writes_as_the_pdu_reader_does(monkeypatch: Any) -> None:
    """Writes answered by SCSI Responses, in receives of whole PDUs (plain responses at the front of a receive
    take the lane) and a few bytes at a time (every PDU through the PDU reader): the same statuses, sense,
    failures, window and StatSN."""
    async def run(cut: int | None) -> tuple[list[Any], tuple[int, int, int], int]:
        c, t = await connected(immediate_data=True, initial_r2t=False, first_burst_length=65536)
        by_reader = _seen_by_reader(c, P.Op.SCSI_RSP, monkeypatch)
        futs = [c.command(b"\x8a" + bytes(15), bytes(8), data=bytes([i]) * 4096) for i in range(12)]
        await turn()
        chunks = _responses_stream(list(c.tasks))
        _receive(c, chunks, 3, cut)
        done = await asyncio.gather(*futs, return_exceptions=True)
        assert not c.tasks and not t.aborted
        got = [(d.status, bytes(d.data), bytes(d.sense)) if isinstance(d, Completion) else repr(d) for d in done]
        return got, (c.expcmdsn, c.maxcmdsn, c.expstatsn), len(by_reader)

    whole, window, by_reader = asyncio.run(run(None))
    trickled, window2, by_reader2 = asyncio.run(run(7))
    assert whole == trickled and window == window2 == (22, 52, 17)
    assert [g[0] if isinstance(g, tuple) else "failed" for g in whole] == [
        0, 0, 0, 0x18, 0x02, 0, 0, 0, "failed", 0x18, 0x02, 0]
    assert whole[4][2][:3] == bytes([0x70, 0, 0x03])
    assert by_reader2 == 12                 # trickled: every response through the reader
    assert by_reader == 5                   # whole: the plain ones at the front of a receive took the lane
