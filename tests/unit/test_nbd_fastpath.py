"""The NBD server's fast path (a read or write on a device with SyncRead/SyncWrite, answered without a Task) must
say exactly what the normal path says: the same bytes to the client for the same request stream, whichever
path each request takes, and every refusal (read-only export, beyond the end, misaligned, bad flags) the
same, because both paths get only the requests protocol/nbd's admit() let through."""

from __future__ import annotations

import asyncio
import random
import struct
import uuid
from typing import Any

from fastpath_fakes import AsyncOnly, Counting, SlowRam, SoonRam, Wire
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openvsan.block.ram import RamDevice
from openvsan.frontend.config import NbdExportConfig
from openvsan.frontend.nbd import Connection, NbdServer
from openvsan.protocol.nbd import Cmd, CmdFlag, Errno
from openvsan.protocol.nbd.wire import IHAVEOPT, NBDMAGIC, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC, Opt

BS = 512
BLOCKS = 2048
SIZE = BS * BLOCKS
PORTAL = ("127.0.0.1", 10809)
NAMES = ("rw", "ro")


# --- a client, from proto.md ---------------------------------------------------------------------
def option(opt: int, data: bytes = b"") -> bytes:
    return struct.pack(">QII", IHAVEOPT, opt, len(data)) + data


def handshake(name: str, structured: bool) -> bytes:
    """Client flags (FIXED_NEWSTYLE | NO_ZEROES), then structured replies and base:allocation if asked,
    then NBD_OPT_GO."""
    n = name.encode()
    out = struct.pack(">I", 3)
    if structured:
        out += option(Opt.STRUCTURED_REPLY)
        q = b"base:allocation"
        out += option(Opt.SET_META_CONTEXT, struct.pack(">I", len(n)) + n + struct.pack(">II", 1, len(q)) + q)
    return out + option(Opt.GO, struct.pack(">I", len(n)) + n + struct.pack(">H", 0))


def request(cmd: int, offset: int, length: int, flags: int, cookie: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, cookie, offset, length) + payload


# one request: (connection: 0 the read-write export, 1 the read-only one; command; offset; length; flags)
Req = tuple[int, int, int, int, int]


def encode(stream: list[Req], seed: int) -> list[tuple[int, bytes]]:
    rnd = random.Random(seed)
    out = []
    for cookie, (which, cmd, offset, length, flags) in enumerate(stream, 1):
        payload = rnd.randbytes(length) if cmd == Cmd.WRITE else b""
        out.append((which, request(cmd, offset, length, flags, cookie, payload)))
    return out


async def run(devices: list[Any], stream: list[tuple[int, bytes]], structured: bool, *,
              lane: bool = True, receive: list[int] | None = None) -> list[bytes]:
    """Each connection's output for `stream`; with `receive` (read sizes, cycled), the bytes go in as a
    transport with a BufferedProtocol gives them: into get_buffer()'s buffer, then buffer_updated()."""
    from openvsan.volume import Volume

    exports = [NbdExportConfig(name, Volume(dev, name=name, uuid=uuid.UUID(int=i + 1)), [PORTAL], read_only=i == 1)
               for i, (name, dev) in enumerate(zip(NAMES, devices, strict=True))]
    srv = NbdServer(exports)
    srv.lane = lane
    conns, wires = [], []
    for name in NAMES:
        c = Connection(srv, PORTAL)
        w = Wire()
        c.connection_made(w)  # type: ignore[arg-type]
        c.data_received(handshake(name, structured))
        assert c.export is not None and c.export.name == name
        conns.append(c)
        wires.append(w)
    step = 0
    for which, chunk in stream:
        if receive is None:
            conns[which].data_received(chunk)
        else:
            pos = 0
            while pos < len(chunk):
                buf = conns[which].get_buffer(-1)
                n = min(len(buf), len(chunk) - pos, receive[step % len(receive)])
                step += 1
                buf[:n] = chunk[pos:pos + n]
                conns[which].buffer_updated(n)
                pos += n
        for _ in range(4):
            await asyncio.sleep(0)
    for c in conns:
        c.close()
    return [bytes(w.out) for w in wires]


def both(stream: list[Req], structured: bool, seed: int = 5) -> tuple[list[bytes], list[bytes], int]:
    async def go() -> tuple[list[bytes], list[bytes], int]:
        fast_devs = [Counting(BLOCKS, BS) for _ in NAMES]
        slow_devs = [RamDevice(BLOCKS, BS) for _ in NAMES]
        for d in fast_devs + slow_devs:
            d.write_now(0, random.Random(7).randbytes(SIZE))
        for d in fast_devs:
            d.fast = 0
        wire = encode(stream, seed)
        fast = await run(fast_devs, wire, structured)
        used = sum(d.fast for d in fast_devs)
        slow = await run([AsyncOnly(d) for d in slow_devs], wire, structured)
        for f, s in zip(fast_devs, slow_devs, strict=True):
            assert f.read_now(0, BLOCKS) == s.read_now(0, BLOCKS)
        return fast, slow, used

    return asyncio.run(go())


def simple_replies(wire: bytes, stream: list[Req]) -> list[tuple[int, int]]:
    """(cookie, error) of each simple reply on a connection without structured replies; a successful
    read's data is skipped."""
    pos = wire.index(struct.pack(">Q", NBDMAGIC)) + 18                  # greeting: magic, IHAVEOPT, flags
    while True:                                                         # option replies, to NBD_OPT_GO's ACK
        _, opt, rep, n = struct.unpack_from(">QIII", wire, pos)
        pos += 20 + n
        if opt == Opt.GO and rep == 1:
            break
    out = []
    while pos < len(wire):
        magic, error, cookie = struct.unpack_from(">IIQ", wire, pos)
        assert magic == SIMPLE_REPLY_MAGIC
        pos += 16
        _, cmd, _, length, _ = stream[cookie - 1]
        if cmd == Cmd.READ and not error:
            pos += length
        out.append((cookie, error))
    return out


# --- the streams ---------------------------------------------------------------------------------
_CMDS = (Cmd.READ, Cmd.READ, Cmd.READ, Cmd.WRITE, Cmd.WRITE, Cmd.WRITE, Cmd.FLUSH, Cmd.TRIM, Cmd.WRITE_ZEROES,
         Cmd.CACHE, Cmd.BLOCK_STATUS, 99)
_FLAGS = (0, 0, 0, CmdFlag.FUA, CmdFlag.DF, CmdFlag.NO_HOLE, CmdFlag.REQ_ONE, 0x80)


def random_stream(rnd: random.Random, n: int) -> list[Req]:
    out: list[Req] = []
    for _ in range(n):
        cmd = rnd.choice(_CMDS)
        length = rnd.choice((BS, 8 * BS, 64 * BS, BS, 8 * BS, 64 * BS, 0, 300, BS + 1))   # some misaligned
        offset = rnd.randrange(BLOCKS - 64) * BS
        odd = rnd.random()
        if odd < 0.1:
            offset = SIZE - length + rnd.choice((BS, 1))     # past the end
        elif odd < 0.15:
            offset += 7                                      # misaligned
        elif odd < 0.2:
            offset = SIZE
        flags = rnd.choice(_FLAGS) if rnd.random() < 0.3 else 0
        out.append((rnd.choice((0, 0, 0, 1)), cmd, max(offset, 0), length, flags))
    return out


def test_ram_offers_sync_io_and_the_wrapper_does_not() -> None:
    caps = AsyncOnly(RamDevice(8, BS)).capabilities
    assert RamDevice(8, BS).capabilities.sync_read and not caps.sync_read and not caps.sync_write


def test_a_random_request_stream_gets_the_same_bytes_on_either_path() -> None:
    stream = random_stream(random.Random(3), 600)
    for structured in (False, True):
        fast, slow, used = both(stream, structured)
        assert used > 100, "the fast path was hardly taken"
        assert fast == slow
    # the refusals were exercised: read-only, beyond the end (reads and writes), misaligned, bad flags
    fast, slow, used = both(stream, False)
    errors = {which: [e for _, e in simple_replies(fast[which], stream)] for which in (0, 1)}
    seen = set(errors[0]) | set(errors[1])
    assert {0, Errno.EPERM, Errno.EINVAL, Errno.ENOSPC} <= seen
    assert Errno.EPERM in errors[1] and Errno.EPERM not in errors[0]


def test_reads_see_the_writes_before_them_on_either_path() -> None:
    stream: list[Req] = [(0, Cmd.WRITE, 64 * BS, 8 * BS, 0), (0, Cmd.READ, 64 * BS, 8 * BS, 0),
                         (0, Cmd.WRITE, 68 * BS, BS, CmdFlag.FUA), (0, Cmd.READ, 60 * BS, 16 * BS, 0),
                         (1, Cmd.WRITE, 0, BS, 0), (1, Cmd.READ, 0, BS, 0),
                         (0, Cmd.READ, SIZE - BS, 2 * BS, 0), (0, Cmd.WRITE, SIZE, BS, 0),
                         (0, Cmd.READ, 3, BS, 0), (0, Cmd.BLOCK_STATUS, SIZE, 0, 0)]
    fast, slow, used = both(stream, False)
    assert fast == slow and used == 5   # 2 writes, 3 reads; the read-only write and the refusals are not tried
    got = simple_replies(fast[0], stream)
    assert [e for _, e in got] == [0, 0, 0, 0, Errno.EINVAL, Errno.ENOSPC, Errno.EINVAL, Errno.EINVAL]
    fast, slow, used = both(stream, True)
    assert fast == slow


_REQ = st.tuples(st.sampled_from((0, 0, 1)), st.sampled_from(_CMDS),
                 st.one_of(st.integers(0, BLOCKS - 1).map(lambda b: b * BS), st.integers(0, SIZE + BS),
                           st.sampled_from((SIZE - BS, SIZE, SIZE + BS))),
                 st.one_of(st.sampled_from((0, BS, 4 * BS, 16 * BS)), st.integers(0, 9000)),
                 st.sampled_from(_FLAGS))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_REQ, max_size=40), st.booleans())
def test_any_request_stream_gets_the_same_bytes_on_either_path(stream: list[Req], structured: bool) -> None:
    fast, slow, _ = both(stream, structured)
    assert fast == slow


# --- the request lane (frontend/nbd.py received -> protocol/nbd lane()) against the protocol's own path ----
def recut(stream: list[tuple[int, bytes]], sizes: list[int]) -> list[tuple[int, bytes]]:
    """Each connection's bytes joined, then cut at other places (several requests in one receive, a header
    or a payload split across receives)."""
    out: list[tuple[int, bytes]] = []
    for which in (0, 1):
        data = b"".join(chunk for w, chunk in stream if w == which)
        pos, i = 0, 0
        while pos < len(data):
            n = sizes[i % len(sizes)]
            out.append((which, data[pos:pos + n]))
            pos, i = pos + n, i + 1
    return out


def lanes(stream: list[Req], structured: bool, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
    async def go() -> tuple[list[bytes], list[bytes]]:
        outs = []
        for lane in (True, False):
            devs = [RamDevice(BLOCKS, BS) for _ in NAMES]
            for d in devs:
                d.write_now(0, random.Random(7).randbytes(SIZE))
            outs.append(await run(devs, recut(encode(stream, 5), sizes), structured, lane=lane))
        return outs[0], outs[1]

    return asyncio.run(go())


def test_the_request_lane_sends_what_the_protocol_path_sends() -> None:
    stream = random_stream(random.Random(11), 400)
    for structured in (False, True):
        for sizes in ([1 << 20], [28], [1, 27, 100, 4096], [28 * 3 + 5, 9000]):
            with_lane, without = lanes(stream, structured, sizes)
            assert with_lane == without, (structured, sizes)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_REQ, max_size=30), st.booleans(), st.lists(st.integers(1, 5000), min_size=1, max_size=4))
def test_any_stream_cut_anywhere_gets_the_same_bytes_with_or_without_the_lane(
        stream: list[Req], structured: bool, sizes: list[int]) -> None:
    with_lane, without = lanes(stream, structured, sizes)
    assert with_lane == without


# --- large writes received straight into their buffer (get_buffer / buffer_updated) --------------------------
def test_large_writes_received_into_their_buffer_send_what_the_copy_path_sends(monkeypatch: Any) -> None:
    from openvsan.protocol.nbd.connection import NbdServerConnection

    direct = []
    filled = NbdServerConnection.payload_filled

    def counting(self: NbdServerConnection, n: int) -> Any:
        direct.append(n)
        return filled(self, n)

    monkeypatch.setattr(NbdServerConnection, "payload_filled", counting)
    rnd = random.Random(21)
    stream: list[Req] = []
    for _ in range(120):
        length = rnd.choice((BS, 8 * BS, 256 * BS, 512 * BS, 1024 * BS))    # up to 512 KiB: past DIRECT_PAYLOAD
        offset = rnd.randrange(0, BLOCKS - length // BS + 1) * BS
        cmd = rnd.choice((Cmd.WRITE, Cmd.WRITE, Cmd.READ))
        stream.append((rnd.choice((0, 0, 1)), cmd, offset, length, rnd.choice((0, CmdFlag.FUA))))
    stream.append((0, Cmd.WRITE, SIZE - BS, 1024 * BS, 0))      # refused (beyond the end): its payload is skipped
    stream.append((0, Cmd.READ, 0, SIZE, 0))

    async def go(receive: list[int] | None, lane: bool, joined: bool = False) -> tuple[list[bytes], list[bytes]]:
        devs = [RamDevice(BLOCKS, BS) for _ in NAMES]
        wire = encode(stream, 9)
        if joined:     # each connection's requests back to back: one receive ends a payload and starts the next
            wire = recut(wire, [3 << 20])
        out = await run(devs, wire, False, lane=lane, receive=receive)
        return out, [bytes(d.read_now(0, BLOCKS)) for d in devs]

    from openvsan.volume import Volume
    windows = []
    opened = Volume.open_window

    def lending(self: Volume, lba: int, blocks: int) -> Any:
        view = opened(self, lba, blocks)
        windows.append(view is not None)
        return view

    monkeypatch.setattr(Volume, "open_window", lending)
    reference = asyncio.run(go(None, False))
    assert not windows                             # without the lane: a buffer of its own, then a copy
    for receive in ([1 << 20], [65536 + 28], [1000, 70000, 200000], [4096]):
        direct.clear()
        windows.clear()
        assert asyncio.run(go(receive, True)) == reference, receive
        assert sum(direct) > 1 << 20, receive      # megabytes of payload went straight into the RAM devices
        assert windows.count(True) > 20, receive   # writes of 64 KiB and more, received in place
        assert asyncio.run(go(receive, True, joined=True)) == reference, receive


def test_a_connection_lost_in_a_write_received_in_place_leaves_no_window_open() -> None:
    from openvsan.volume import Volume

    async def go() -> None:
        dev = RamDevice(BLOCKS, BS)
        vol = Volume(dev, name="rw")
        srv = NbdServer([NbdExportConfig("rw", vol, [PORTAL])])
        c = Connection(srv, PORTAL)
        w = Wire()
        c.connection_made(w)  # type: ignore[arg-type]
        c.data_received(handshake("rw", False))
        payload = random.Random(4).randbytes(512 * BS)
        head = request(Cmd.WRITE, 8 * BS, len(payload), 0, 1)
        c.data_received(head + payload[:1000])          # the header and the start of its payload
        buf = c.get_buffer(-1)
        assert len(buf) == len(payload) - 1000           # the rest goes straight to the device
        buf[:100000] = payload[1000:101000]
        c.buffer_updated(100000)
        assert vol._inflight == 1                        # the open window holds the volume's changes off
        c.connection_lost(ConnectionResetError())
        assert vol._inflight == 0
        # what arrived is there (an unacknowledged write, part done: a torn write); nothing was answered
        assert bytes(dev.read_now(8, 512))[:101000] == payload[:101000]
        assert simple_replies(bytes(w.out), []) == []
        await vol.resize(2 * BLOCKS)                     # nothing is left holding it
    asyncio.run(go())


# --- write_soon: a device whose writes wait on others (a replicated volume) answers by callback --------------
def test_writes_answered_by_write_soon_send_what_the_normal_path_sends() -> None:
    """Writes (some failing with a medium error, some FUA) and reads of what they wrote: the replies are the same
    bytes whether the device answers writes by write_soon's callback or only through write()."""
    rnd = random.Random(9)
    stream: list[Req] = []
    for _ in range(300):
        length = rnd.choice((BS, 8 * BS, 16 * BS))
        block = rnd.choice((rnd.randrange(BLOCKS - 16), rnd.randrange(90, 120)))   # some in SlowRam.BAD
        cmd = Cmd.WRITE if rnd.random() < 0.7 else Cmd.READ
        stream.append((0, cmd, block * BS, length, rnd.choice((0, CmdFlag.FUA)) if cmd == Cmd.WRITE else 0))

    async def go(structured: bool) -> tuple[list[bytes], list[bytes], int]:
        fast_devs, slow_devs = [SoonRam(BLOCKS, BS) for _ in NAMES], [SlowRam(BLOCKS, BS) for _ in NAMES]
        wire = encode(stream, 3)
        fast = await run(fast_devs, wire, structured)
        slow = await run(slow_devs, wire, structured)
        for f, s in zip(fast_devs, slow_devs, strict=True):
            assert f.read_now(0, BLOCKS) == s.read_now(0, BLOCKS)
        return fast, slow, fast_devs[0].soon

    for structured in (False, True):
        fast, slow, used = asyncio.run(go(structured))
        assert used > 150, "write_soon was hardly taken"
        assert fast == slow
    errors = {e for _, e in simple_replies(asyncio.run(go(False))[0][0], stream)}
    assert errors == {0, Errno.EIO}
