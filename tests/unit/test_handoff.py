"""The hand-off between worker processes (frontend/handoff.py), over in-memory transports: a host whose
connection is accepted by the worker that does not serve what it names, and handed to the one that does,
sees byte for byte what it would see from a node in one process, however its bytes were cut into reads.
And a worker that would answer the replay differently from what the host already has closes instead."""

from __future__ import annotations

import asyncio
import struct
import uuid
from typing import Any

import pytest
from fastpath_fakes import Wire
from nvme_host import capsule, connect_cmd, connect_data, icreq, sqe

from openvsan.block.ram import RamDevice
from openvsan.frontend import nbd, nvme_tcp
from openvsan.frontend.config import NbdExportConfig, NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.handoff import Elsewhere
from openvsan.protocol.nbd.wire import IHAVEOPT, REQUEST_MAGIC, Opt, Rep
from openvsan.volume import Volume

PORTAL = ("127.0.0.1", 10809)
BS, BLOCKS = 512, 256


class HandWire(Wire):
    """A transport with a socket to hand over; abort() is what the worker does after sending it."""

    class Sock:
        def fileno(self) -> int:
            return 99

        def setsockopt(self, *args: Any) -> None:
            pass

    def __init__(self) -> None:
        super().__init__()
        self.aborted = False
        self.closed = False

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.Sock() if key == "socket" else default

    def get_write_buffer_size(self) -> int:
        return 0

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.aborted or self.closed

    def can_write_eof(self) -> bool:
        return False


class Inbox:
    """An Exchange that keeps what is sent instead of sending it."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, bytes, bytes]] = []

    def send(self, worker: int, fd: int, kind: str, portal: tuple[str, int], received: bytes,
             answered: bytes, hops: int = 1) -> None:
        self.sent.append((worker, kind, received, answered))


def volume(i: int) -> Volume:
    dev = RamDevice(BLOCKS, BS)
    dev.write_now(0, bytes([0x30 + i]) * BS)
    return Volume(dev, name=f"v{i}", uuid=uuid.UUID(int=i + 1))


def served(make: Any, chunks: list[bytes], handing: Any | None = None, owner: Any | None = None) -> bytes:
    """What a host that sends `chunks` receives: from `handing` (a worker that hands it over) then `owner`,
    or from `make` alone (one process)."""
    async def go() -> bytes:
        if handing is None:
            c, w = make(), HandWire()
            c.connection_made(w)
            for ch in chunks:
                c.data_received(ch)
                await asyncio.sleep(0)
            return bytes(w.out)
        inbox = Inbox()
        c, w = handing(inbox), HandWire()
        c.route(inbox)          # as PortalServer._accepted does in a worker
        c.connection_made(w)
        rest = list(chunks)
        while rest and not inbox.sent:
            c.data_received(rest.pop(0))
            await asyncio.sleep(0)
        assert inbox.sent and w.aborted, "not handed over"
        worker, _, received, answered = inbox.sent[0]
        assert worker == 1 and bytes(w.out) == answered
        c2, w2 = owner(), HandWire()
        c2.route(Inbox())
        c2.adopted(received, answered)
        c2.connection_made(w2)
        await asyncio.sleep(0)  # the replay runs in the loop's next turn (BatchedConnection.replay)
        for ch in rest:
            c2.data_received(ch)
            await asyncio.sleep(0)
        for _ in range(3):
            await asyncio.sleep(0)
        return bytes(w.out) + bytes(w2.out)

    return asyncio.run(go())


def one_and_two(connection: Any, server: Any, chunks: list[bytes]) -> tuple[bytes, bytes]:
    """What the host receives from one process serving both volumes, and from worker 0 handing it to worker 1."""
    vols = {0: volume(0), 1: volume(1)}
    one = served(lambda: connection(server({0, 1}, vols), PORTAL), chunks)
    two = served(None, chunks, handing=lambda inbox: connection(server({0}, vols, inbox), PORTAL),
                 owner=lambda: connection(server({1}, vols, Inbox()), PORTAL))
    return one, two


def cuts(stream: bytes, sizes: tuple[int, ...]) -> list[bytes]:
    out, pos, i = [], 0, 0
    while pos < len(stream):
        n = sizes[i % len(sizes)]
        out.append(stream[pos:pos + n])
        pos, i = pos + n, i + 1
    return out


# --- NBD: options answered before the export is named, then NBD_OPT_GO hands it over -------------------
def option(opt: int, data: bytes = b"") -> bytes:
    return struct.pack(">QII", IHAVEOPT, opt, len(data)) + data


def nbd_stream(name: bytes = b"b") -> bytes:
    q = b"base:allocation"
    read = struct.pack(">IHHQQI", REQUEST_MAGIC, 0, 0, 7, 0, 2 * BS)       # NBD_CMD_READ, 2 blocks at 0
    return (struct.pack(">I", 3) + option(Opt.LIST) + option(Opt.STRUCTURED_REPLY)
            + option(Opt.INFO, struct.pack(">I", len(name)) + name + struct.pack(">H", 0))
            + option(Opt.SET_META_CONTEXT, struct.pack(">I", len(name)) + name + struct.pack(">II", 1, len(q)) + q)
            + option(Opt.GO, struct.pack(">I", len(name)) + name + struct.pack(">H", 0)) + read)


def nbd_server(mine: set[int], vols: dict[int, Volume], inbox: Inbox | None = None, *,
               sizes_known: bool = True) -> nbd.NbdServer:
    exports = []
    for i, name in enumerate("ab"):
        if i in mine:
            exports.append(NbdExportConfig(name, vols[i], [PORTAL], description=f"vol {name}"))
        else:
            exports.append(NbdExportConfig(name, None, [PORTAL], description=f"vol {name}", elsewhere=i,
                                           geometry=(BLOCKS, BS) if sizes_known else None))
    srv = nbd.NbdServer(exports)
    srv.exchange = inbox  # type: ignore[assignment]
    return srv


@pytest.mark.parametrize("sizes", [(10_000,), (1,), (4, 13, 7), (16, 40)])
def test_an_nbd_client_handed_over_at_go_sees_what_one_process_would_send(sizes: tuple[int, ...]) -> None:
    one, two = one_and_two(nbd.Connection, nbd_server, cuts(nbd_stream(), sizes))
    assert two == one
    assert bytes([0x31]) * BS in one    # volume b's first block was read


def test_nbd_info_about_an_export_whose_size_is_not_known_yet_is_handed_over_too() -> None:
    asyncio.run(_test_nbd_info_about_an_export_whose_size_is_not_known_yet_is_handed_over_too())


async def _test_nbd_info_about_an_export_whose_size_is_not_known_yet_is_handed_over_too() -> None:
    vols = {0: volume(0), 1: volume(1)}

    def unknown(mine: set[int], inbox: Inbox) -> nbd.NbdServer:
        return nbd_server(mine, vols, inbox, sizes_known=False)

    inbox = Inbox()
    c, w = nbd.Connection(unknown({0}, inbox), PORTAL), HandWire()
    c.route(inbox)  # type: ignore[arg-type]
    c.connection_made(w)  # type: ignore[arg-type]
    c.data_received(struct.pack(">I", 3) + option(Opt.INFO, struct.pack(">I", 1) + b"b" + struct.pack(">H", 0)))
    assert inbox.sent and inbox.sent[0][0] == 1 and w.aborted
    # NBD_OPT_LIST still names both, whoever serves them
    inbox2 = Inbox()
    c, w = nbd.Connection(unknown({0}, inbox2), PORTAL), HandWire()
    c.route(inbox2)  # type: ignore[arg-type]
    c.connection_made(w)  # type: ignore[arg-type]
    c.data_received(struct.pack(">I", 3) + option(Opt.LIST))
    assert b"vol a" in w.out and b"vol b" in w.out and not inbox2.sent


def test_a_replay_answered_differently_closes_the_connection() -> None:
    asyncio.run(_test_a_replay_answered_differently_closes_the_connection())


async def _test_a_replay_answered_differently_closes_the_connection() -> None:
    vols = {0: volume(0), 1: volume(1)}
    stream = nbd_stream()
    inbox = Inbox()
    c, w = nbd.Connection(nbd_server({0}, vols, inbox), PORTAL), HandWire()
    c.route(inbox)  # type: ignore[arg-type]
    c.connection_made(w)  # type: ignore[arg-type]
    c.data_received(stream)
    _, _, received, answered = inbox.sent[0]
    forged = answered[:-1] + bytes([answered[-1] ^ 1])
    c2, w2 = nbd.Connection(nbd_server({1}, vols, Inbox()), PORTAL), HandWire()
    c2.adopted(received, forged)
    c2.connection_made(w2)  # type: ignore[arg-type]
    await asyncio.sleep(0)   # the replay: in the loop's next turn
    assert w2.closed and not w2.out


def test_a_connection_is_not_handed_over_twice_for_what_it_asked_before() -> None:
    asyncio.run(_test_a_connection_is_not_handed_over_twice_for_what_it_asked_before())


async def _test_a_connection_is_not_handed_over_twice_for_what_it_asked_before() -> None:
    """INFO a, INFO b, INFO a in one read, sizes known to no worker: worker 1 hands it to 0 (a); 0 answers
    INFO a and hands it to 1 (b); 1, replaying, would have to answer INFO a, which only 0 can: it closes the
    connection rather than send it back (no loop)."""
    vols = {0: volume(0), 1: volume(1)}

    def unknown(mine: set[int], inbox: Inbox) -> nbd.NbdServer:
        return nbd_server(mine, vols, inbox, sizes_known=False)

    info = [option(Opt.INFO, struct.pack(">I", 1) + n + struct.pack(">H", 0)) for n in (b"a", b"b")]
    stream = struct.pack(">I", 3) + info[0] + info[1] + info[0]
    inbox = Inbox()
    c, w = nbd.Connection(unknown({1}, inbox), PORTAL), HandWire()     # worker 1 accepts: INFO a goes to 0
    c.route(inbox)  # type: ignore[arg-type]
    c.connection_made(w)  # type: ignore[arg-type]
    c.data_received(stream)
    assert inbox.sent[0][0] == 0
    inbox0 = Inbox()
    c0, w0 = nbd.Connection(unknown({0}, inbox0), PORTAL), HandWire()   # worker 0: INFO a, then INFO b -> 1
    c0.route(inbox0)  # type: ignore[arg-type]
    c0.adopted(inbox.sent[0][2], inbox.sent[0][3])
    c0.connection_made(w0)  # type: ignore[arg-type]
    await asyncio.sleep(0)   # the replay: in the loop's next turn
    assert inbox0.sent and inbox0.sent[0][0] == 1
    c1, w1 = nbd.Connection(unknown({1}, Inbox()), PORTAL), HandWire()  # worker 1 again: replaying INFO a
    c1.route(Inbox())  # type: ignore[arg-type]
    c1.adopted(inbox0.sent[0][2], inbox0.sent[0][3])
    c1.connection_made(w1)  # type: ignore[arg-type]
    await asyncio.sleep(0)   # the replay: in the loop's next turn
    assert w1.closed


class UvloopWire(HandWire):
    """A transport that starts reading when connection_made returns, whatever the protocol asked in it, as
    uvloop's does (basetransport.pyx _call_connection_made): a pause_reading() there does not hold."""

    def made(self, c: Any) -> None:
        c.connection_made(self)
        self.paused = False


def test_an_nbd_client_handed_over_at_starttls_is_not_read_in_clear_text_before_tls_takes_the_socket(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A TLS client that worker 1 hands to worker 0 at NBD_OPT_STARTTLS: worker 0 replays the option and sends
    the ACK, and the client answers it with its ClientHello at once. Reading must stay paused from the ACK
    until the TLS layer takes the socket, or the ClientHello is read as clear-text NBD and the handshake
    stalls (seen in CI: one of nbdcopy's connections in a run of twenty)."""
    asyncio.run(_starttls_handed_over(monkeypatch))


async def _starttls_handed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    vols = {0: volume(0), 1: volume(1)}
    seen: list[tuple[bool, bytes]] = []

    async def upgrade(self: nbd.Connection, raw: UvloopWire) -> None:   # where start_tls takes the socket
        seen.append((raw.paused, bytes(raw.out)))

    monkeypatch.setattr(nbd.Connection, "_upgrade", upgrade)

    def server(mine: set[int], inbox: Inbox, tls_worker: int | None) -> nbd.NbdServer:
        srv = nbd_server(mine, vols, inbox)
        srv.ssl_context = object()  # type: ignore[assignment]   # offered; the handshake itself is not run here
        for e in srv.exports.values():
            e.tls = "require"
        srv.tls_worker = tls_worker
        return srv

    inbox = Inbox()
    c, w = nbd.Connection(server({1}, inbox, 0), PORTAL), HandWire()   # worker 1: TLS is worker 0's
    c.route(inbox)  # type: ignore[arg-type]
    c.connection_made(w)  # type: ignore[arg-type]
    c.data_received(struct.pack(">I", 3) + option(Opt.STARTTLS))
    await asyncio.sleep(0)
    assert inbox.sent and w.aborted, "not handed over at NBD_OPT_STARTTLS"
    _, _, received, answered = inbox.sent[0]
    c0, w0 = nbd.Connection(server({0, 1}, Inbox(), None), PORTAL), UvloopWire()   # worker 0: serves TLS
    c0.route(Inbox())  # type: ignore[arg-type]
    c0.adopted(received, answered)
    w0.made(c0)
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(seen) == 1, "the TLS handshake was not started"
    paused, out = seen[0]
    assert out == struct.pack(">QII", 0x3E889045565A9, Opt.STARTTLS, Rep.ACK) + struct.pack(">I", 0), out
    assert paused, "reading went on between NBD_OPT_STARTTLS's ACK and the TLS layer"


# --- NVMe/TCP: ICResp answered, then the Connect names a subsystem of the other worker -------------------
def nvme_server(mine: set[int], vols: dict[int, Volume], inbox: Inbox | None = None) -> nvme_tcp.NvmeTcpServer:
    subs = []
    for i in range(2):
        nqn = f"nqn.2026-12.org.openvsan.test:s{i}"
        if i in mine:
            subs.append(NvmeSubsystemConfig(nqn, [NvmeNamespaceConfig(1, vols[i])], [PORTAL]))
        else:
            subs.append(NvmeSubsystemConfig(nqn, [], [PORTAL], elsewhere=i))
    srv = nvme_tcp.NvmeTcpServer(subs)
    srv.exchange = inbox  # type: ignore[assignment]
    return srv


def nvme_stream() -> bytes:
    nqn = "nqn.2026-12.org.openvsan.test:s1"
    # ICReq; Connect (admin queue); Property Set CC.EN; Identify Namespace 1 (data to the host, 4 KiB)
    return (icreq() + capsule(connect_cmd(1, 0, 31), connect_data(nqn))
            + capsule(sqe(0x7F, 2, 0x00, cdw11=0x14, cdw12=1 | (6 << 16) | (4 << 20)))
            + capsule(sqe(0x06, 3, 1, cdw10=0, sgl_len=4096)))


@pytest.mark.parametrize("sizes", [(10_000,), (128,), (7, 300, 64), (1024,)])
def test_an_nvme_queue_handed_over_at_connect_sees_what_one_process_would_send(sizes: tuple[int, ...]) -> None:
    one, two = one_and_two(nvme_tcp.Connection, nvme_server, cuts(nvme_stream(), sizes))
    assert two == one
    assert len(one) > 4096    # the Identify data came back


def test_discovery_names_subsystems_of_other_workers() -> None:
    vols = {0: volume(0), 1: volume(1)}
    srv = nvme_server({0}, vols)
    names = [s.nqn for s, _ in srv.fabric.discovery_entries("nqn.host")]
    assert names == ["nqn.2026-12.org.openvsan.test:s0", "nqn.2026-12.org.openvsan.test:s1"]


def test_elsewhere_names_the_worker() -> None:
    e = Elsewhere(3, "NBD export x")
    assert e.worker == 3 and "worker 3" in str(e)


# --- a name moving to another worker (node/workers.py move): its connections go there at once ---------------
@pytest.mark.parametrize("served_here", [True, False])
def test_an_nbd_client_naming_an_export_that_moves_goes_to_where_it_moves(served_here: bool) -> None:
    """While export b moves to worker 0, NBD_OPT_GO b goes there, whether this worker still serves b or, at
    that instant of the move, knows nothing of it (its volume closed, its shell not yet up)."""
    asyncio.run(_nbd_moving(served_here))


async def _nbd_moving(served_here: bool) -> None:
    vols = {0: volume(0), 1: volume(1)}
    inbox = Inbox()
    srv = nbd_server({1}, vols, inbox)
    if not served_here:
        del srv.exports["b"]
    srv.moving["b"] = 0
    c, w = nbd.Connection(srv, PORTAL), HandWire()
    c.route(inbox)  # type: ignore[arg-type]
    c.connection_made(w)  # type: ignore[arg-type]
    c.data_received(struct.pack(">I", 3) + option(Opt.INFO, struct.pack(">I", 1) + b"a" + struct.pack(">H", 0))
                    + option(Opt.GO, struct.pack(">I", 1) + b"b" + struct.pack(">H", 0)))
    await asyncio.sleep(0)
    assert inbox.sent and inbox.sent[0][0] == 0 and w.aborted
    srv.moving.clear()                   # the move is over: b is what the exports say again
    inbox2 = Inbox()
    srv.exchange = inbox2  # type: ignore[assignment]
    c, w = nbd.Connection(srv, PORTAL), HandWire()
    c.route(inbox2)  # type: ignore[arg-type]
    c.connection_made(w)  # type: ignore[arg-type]
    c.data_received(struct.pack(">I", 3) + option(Opt.GO, struct.pack(">I", 1) + b"b" + struct.pack(">H", 0)))
    await asyncio.sleep(0)
    assert not inbox2.sent and not w.aborted       # served here, or unknown here: answered here either way


def test_an_nvme_connect_naming_a_subsystem_that_moves_goes_to_where_it_moves() -> None:
    asyncio.run(_nvme_moving())


async def _nvme_moving() -> None:
    vols = {0: volume(0), 1: volume(1)}
    inbox = Inbox()
    srv = nvme_server({1}, vols, inbox)
    srv.moving["nqn.2026-12.org.openvsan.test:s1"] = 0
    c, w = nvme_tcp.Connection(srv, PORTAL), HandWire()
    c.route(inbox)  # type: ignore[arg-type]
    c.connection_made(w)  # type: ignore[arg-type]
    c.data_received(nvme_stream())
    await asyncio.sleep(0)
    assert inbox.sent and inbox.sent[0][0] == 0 and w.aborted
    assert srv.fabric.moving is srv.moving
