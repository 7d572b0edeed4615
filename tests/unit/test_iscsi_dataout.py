"""Data-Out sequences that break RFC 7143's rules, sent to the target's real Connection (a RAM volume behind it):
the command ends with the RFC's sense (§11.4.7.2: unexpected unsolicited data, incorrect amount of data; SPC's
DATA OFFSET ERROR for a sequence out of order), and nothing the initiator did not send is written over what the
volume holds. Before, a sequence cut short (its F bit early) was taken as whole: the bytes never sent were
written as zeros and the command answered GOOD; and a data error in the first of several R2Ts left the command
unanswered (no more R2Ts were sent, and the transfer waited for them)."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from test_iscsi_codec import data_out_pdu as data_out
from test_iscsi_fastpath import cmd, connect, rw

from openvsan.block.ram import RamDevice

BS = 512
BLOCKS = 256
OLD = b"o" * (16 * BS)
NO_TTT = 0xFFFFFFFF


def write10(itt: int, cmdsn: int, blocks: int, data: bytes = b"", final: bool = True) -> bytes:
    """WRITE(10) at LBA 0 for `blocks` blocks, EDTL to match, `data` as immediate data."""
    return cmd(itt, cmdsn, rw(0x2A, 0, blocks), write=True, edtl=blocks * BS, data=data, final=final)


def pdus(wire: bytes) -> list[tuple[bytes, bytes]]:
    """(BHS, data segment) of each PDU the target sent (no digests)."""
    out, at = [], 0
    while at < len(wire):
        bhs = wire[at:at + 48]
        dsl = int.from_bytes(bhs[5:8], "big")
        start = at + 48 + bhs[4] * 4
        out.append((bhs, wire[start:start + dsl]))
        at = start + dsl + (-dsl % 4)
    return out


class Exchange:
    """One connection to a target whose LUN 0 is a RAM volume holding OLD in its first 16 blocks."""

    def __init__(self, **params: Any) -> None:
        self.ram = RamDevice(BLOCKS, BS)
        self.ram.write_now(0, OLD)

        def setup(unit: Any, c: Any) -> None:
            for k, v in params.items():
                setattr(c.session.params, k, v)

        self.conn, self.wire = connect(self.ram, setup=setup)
        self.seen = 0

    async def send(self, *chunks: bytes) -> list[tuple[bytes, bytes]]:
        """Feed the target; the PDUs it sent since the last call."""
        for chunk in chunks:
            self.conn.data_received(chunk)
            for _ in range(4):
                await asyncio.sleep(0)
        new = bytes(self.wire.out[self.seen:])
        self.seen = len(self.wire.out)
        return pdus(new)


def r2ts(got: list[tuple[bytes, bytes]]) -> list[tuple[int, int, int]]:
    """(TTT, offset, length) of each R2T."""
    return [struct.unpack_from(">I", h, 20) + struct.unpack_from(">II", h, 40) for h, _ in got if h[0] & 0x3F == 0x31]


def response(got: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
    """The one SCSI Response among `got`."""
    (h, d), = [(h, d) for h, d in got if h[0] & 0x3F == 0x21]
    return h, d


def check_condition(got: list[tuple[bytes, bytes]]) -> tuple[int, int, int]:
    """The one SCSI Response: CHECK CONDITION, and (sense key, ASC, ASCQ) of its sense data."""
    h, d = response(got)
    assert h[3] == 0x02, f"status {h[3]:#x}, not CHECK CONDITION"
    sense = d[2:]
    return sense[2] & 0x0F, sense[12], sense[13]


ABORTED = 0x0B


def test_an_r2t_answered_short_fails_the_command_and_writes_nothing() -> None:
    async def go() -> None:
        x = Exchange()
        ((ttt, off, n),) = r2ts(await x.send(write10(1, 1, 16)))
        assert (off, n) == (0, 16 * BS)
        got = await x.send(data_out(1, ttt, 0, 0, b"N" * 4096, final=True))      # F after half of it
        assert check_condition(got) == (ABORTED, 0x0C, 0x0D)                     # incorrect amount of data
        assert bytes(x.ram.read_now(0, 16) or b"") == OLD
    asyncio.run(go())


def test_unsolicited_data_ending_short_of_first_burst_fails_the_command() -> None:
    async def go() -> None:
        x = Exchange(initial_r2t=False, first_burst_length=16 * BS)
        got = await x.send(write10(1, 1, 32, b"I" * 2048, final=False),          # more unsolicited data to come
                           data_out(1, NO_TTT, 0, 2048, b"U" * 2048, final=True))   # ... but it ends at 4 KiB of 8
        assert r2ts(got) == [(1, 16 * BS, 16 * BS)]                              # the solicited part still asked for
        got += await x.send(data_out(1, 1, 0, 16 * BS, b"S" * 16 * BS, final=True))
        assert check_condition(got) == (ABORTED, 0x0C, 0x0D)
        assert bytes(x.ram.read_now(0, 16) or b"") == OLD
    asyncio.run(go())


def test_unexpected_unsolicited_data_is_the_rfcs_write_error() -> None:
    async def go() -> None:
        x = Exchange()                                                           # InitialR2T=Yes: none allowed
        ((ttt, _, n),) = r2ts(await x.send(write10(1, 1, 16)))
        got = await x.send(data_out(1, NO_TTT, 0, 0, b"U" * 512, final=True),
                           data_out(1, ttt, 0, 0, b"S" * n, final=True))
        assert check_condition(got) == (ABORTED, 0x0C, 0x0C)
        assert bytes(x.ram.read_now(0, 16) or b"") == OLD
    asyncio.run(go())


def test_a_sequence_out_of_order_is_a_data_offset_error() -> None:
    async def go() -> None:
        x = Exchange()                                                           # DataPDUInOrder=Yes
        ((ttt, _, _),) = r2ts(await x.send(write10(1, 1, 16)))
        got = await x.send(data_out(1, ttt, 0, 0, b"a" * 4096, final=False),
                           data_out(1, ttt, 1, 2048, b"b" * 4096, final=False),   # overlays the first
                           data_out(1, ttt, 2, 6144, b"c" * 2048, final=True))
        assert check_condition(got) == (ABORTED, 0x4B, 0x05)
        assert bytes(x.ram.read_now(0, 16) or b"") == OLD
    asyncio.run(go())


def test_an_error_in_the_first_of_several_r2ts_still_answers_the_command() -> None:
    async def go() -> None:
        x = Exchange(max_burst_length=4096, max_outstanding_r2t=1)               # 16 blocks: four R2Ts, one at a time
        ((ttt, off, n),) = r2ts(await x.send(write10(1, 1, 16)))
        assert (off, n) == (0, 4096)
        got = await x.send(data_out(1, ttt, 1, 0, b"d" * 4096, final=True))      # DataSN 1 where 0 was due
        assert r2ts(got) == []                                                   # no more asked for
        assert check_condition(got) == (ABORTED, 0x4B, 0x00)                     # answered, not left waiting
        assert bytes(x.ram.read_now(0, 16) or b"") == OLD
        # and the connection goes on: the next write, sent whole, lands
        ((ttt, _, n),) = r2ts(await x.send(write10(2, 2, 8)))
        got = await x.send(data_out(2, ttt, 0, 0, b"w" * 4096, final=True))
        h, _ = response(got)
        assert h[3] == 0 and bytes(x.ram.read_now(0, 8) or b"") == b"w" * 4096
    asyncio.run(go())
