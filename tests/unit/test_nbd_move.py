"""An NBD connection that moves to another worker with its volume (node/workers.py move): suspended on one
server at any point of its request stream (frontend/nbd.py Connection.suspend, NbdServerConnection.suspend)
and resumed on another over the same device, it sends the client the same bytes and leaves the device as a
connection that never moved."""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

from fastpath_fakes import Wire
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_nbd_fastpath import BLOCKS, BS, PORTAL, SIZE, Req, encode, handshake, random_stream, request

from openvsan.block.ram import RamDevice
from openvsan.frontend.config import NbdExportConfig
from openvsan.frontend.nbd import Connection, NbdServer
from openvsan.protocol.nbd import Cmd, CmdFlag
from openvsan.protocol.nbd.connection import NbdServerConnection, Phase
from openvsan.protocol.nbd.events import ExportInfo, Negotiated
from openvsan.volume import Volume


def server(dev: RamDevice) -> NbdServer:
    return NbdServer([NbdExportConfig("rw", Volume(dev, name="rw", uuid=uuid.UUID(int=1)), [PORTAL])])


def feed(c: Connection, data: bytes, sizes: list[int]) -> None:
    """As a transport gives a BufferedProtocol its bytes: into get_buffer()'s buffer, then buffer_updated()
    (a large write's payload straight into the device where it lends its memory)."""
    pos, i = 0, 0
    while pos < len(data):
        buf = c.get_buffer(-1)
        n = min(len(buf), len(data) - pos, sizes[i % len(sizes)])
        buf[:n] = data[pos:pos + n]
        c.buffer_updated(n)
        pos, i = pos + n, i + 1


async def settle() -> None:
    for _ in range(8):
        await asyncio.sleep(0)


async def once(stream: bytes, structured: bool, sizes: list[int]) -> tuple[bytes, bytes]:
    dev = RamDevice(BLOCKS, BS)
    dev.write_now(0, random.Random(7).randbytes(SIZE))
    c, w = Connection(server(dev), PORTAL), Wire()
    c.connection_made(w)  # type: ignore[arg-type]
    feed(c, handshake("rw", structured) + stream, sizes)
    await settle()
    return bytes(w.out), bytes(dev.read_now(0, BLOCKS))


async def moved(stream: bytes, structured: bool, sizes: list[int], cut: int) -> tuple[bytes, bytes, bytes]:
    """The first `cut` bytes of the stream to one server, the rest to another on the same device."""
    dev = RamDevice(BLOCKS, BS)
    dev.write_now(0, random.Random(7).randbytes(SIZE))
    a, wa = Connection(server(dev), PORTAL), Wire()
    a.connection_made(wa)  # type: ignore[arg-type]
    feed(a, handshake("rw", structured) + stream[:cut], sizes)
    await settle()
    got = await a.suspend()
    assert got is not None
    state, received = got
    assert wa.paused                                   # nothing more is read there
    assert a.export is not None and a.export.volume._inflight == 0    # no window left open on the old side
    b, wb = Connection(server(dev), PORTAL), Wire()
    b.resumed(state, received)
    b.connection_made(wb)  # type: ignore[arg-type]
    feed(b, stream[cut:], sizes)
    await settle()
    return bytes(wa.out), bytes(wb.out), bytes(dev.read_now(0, BLOCKS))


def writes(rnd: random.Random, n: int) -> list[Req]:
    out: list[Req] = []
    for _ in range(n):
        length = rnd.choice((BS, 8 * BS, 256 * BS, 512 * BS))     # from 128 KiB: received into the device
        offset = rnd.randrange(0, BLOCKS - length // BS + 1) * BS
        out.append((0, rnd.choice((Cmd.WRITE, Cmd.WRITE, Cmd.READ)), offset, length, rnd.choice((0, CmdFlag.FUA))))
    return out


def check(stream: list[Req], structured: bool, sizes: list[int], cuts: list[int]) -> None:
    wire = b"".join(chunk for _, chunk in encode(stream, 3))

    async def go() -> None:
        sent, device = await once(wire, structured, sizes)
        for cut in cuts:
            a, b, dev = await moved(wire, structured, sizes, min(cut, len(wire)))
            assert a + b == sent, cut
            assert dev == device, cut

    asyncio.run(go())


def test_a_connection_moved_at_any_point_sends_what_one_that_stayed_sends() -> None:
    rnd = random.Random(5)
    stream = [r for r in random_stream(rnd, 60) if r[0] == 0] + writes(rnd, 20)
    wire = b"".join(chunk for _, chunk in encode(stream, 3))
    # cuts inside headers, inside small payloads and inside payloads received straight into the device
    cuts = sorted({0, 1, 27, 28, 29, len(wire) // 2, len(wire) - 1, len(wire), *rnd.sample(range(len(wire)), 40)})
    for structured in (False, True):
        for sizes in ([1 << 20], [28], [1000, 70000, 200000]):
            check(stream, structured, sizes, cuts)


_REQ = st.tuples(st.just(0), st.sampled_from((Cmd.READ, Cmd.WRITE, Cmd.FLUSH, Cmd.TRIM, Cmd.WRITE_ZEROES)),
                 st.integers(0, BLOCKS - 256).map(lambda b: b * BS), st.sampled_from((0, BS, 8 * BS, 256 * BS)),
                 st.sampled_from((0, 0, CmdFlag.FUA)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_REQ, max_size=12), st.booleans(), st.lists(st.integers(1, 100000), min_size=1, max_size=3),
       st.lists(st.integers(0, 300000), min_size=1, max_size=3))
def test_any_stream_moved_anywhere_sends_what_one_that_stayed_sends(stream: list[Req], structured: bool,
                                                                   sizes: list[int], cuts: list[int]) -> None:
    check(stream, structured, sizes, cuts)


def test_suspend_gives_back_the_request_left_half_received() -> None:
    info = ExportInfo("rw", SIZE, min_block=BS)
    session = Negotiated(info, False, info.transmission_flags(False))
    payload = random.Random(2).randbytes(8 * BS)
    whole = request(Cmd.WRITE, 16 * BS, len(payload), 0, 9, payload)
    for cut in (0, 5, 28, 29, 28 + 100, len(whole) - 1):
        conn = NbdServerConnection.resumed(session)
        assert conn.receive_data(whole[:cut]) == []
        rest = conn.suspend()
        assert rest == whole[:cut], cut                 # as the client sent it
        assert conn.phase is Phase.DONE and conn.receive_data(b"x" * 40) == []
        again = NbdServerConnection.resumed(session)
        (req,) = again.receive_data(rest + whole[cut:])
        assert (req.cmd, req.offset, req.cookie, bytes(req.payload or b"")) == (Cmd.WRITE, 16 * BS, 9, payload)


def test_a_connection_still_negotiating_does_not_move() -> None:
    async def go() -> Any:
        c, w = Connection(server(RamDevice(BLOCKS, BS)), PORTAL), Wire()
        c.connection_made(w)  # type: ignore[arg-type]
        c.data_received(handshake("rw", False)[:10])
        return await c.suspend()

    assert asyncio.run(go()) is None
