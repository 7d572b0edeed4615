"""What the iSCSI, NVMe/TCP and NBD servers share: listening on portals, draining on stop, and connections
that send everything made in one event-loop turn in one writelines."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from openvsan.frontend.busypoll import BusyPoll
from openvsan.frontend.handoff import MAX_HOPS, Arrival, Elsewhere, Exchange, Record
from openvsan.frontend.limits import ConnectionLimits, Ticket, source_address
from openvsan.frontend.ratelog import connection_log
from openvsan.netio import Buffer, WriteBatcher

log = logging.getLogger("openvsan.frontend")
T = TypeVar("T")

RUNNING_WRITE_BUDGET = 64 * 1024 * 1024   # write data of commands at the device: beyond it, reading pauses
REFUSED_LINGER = 2.0   # seconds a connection closed after an error answer still reads and drops what comes
DRAIN_TIMEOUT = 30.0  # seconds stop() waits for commands in flight before closing connections anyway
# connections the kernel holds for accept(): under a flood a full queue drops SYNs, and every client, the
# honest ones too, waits a second for its retransmit (the kernel caps it at net.core.somaxconn)
BACKLOG = 1024
_ACCEPT_FAILED = "socket.accept() out of system resource"   # asyncio's selector loop, on EMFILE/ENFILE/ENOBUFS


def watch_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio's loop reports an accept() that failed for lack of descriptors or memory to the exception
    handler, with a traceback each time, and listens again a second later: count and rate-limit those
    instead. (uvloop: libuv closes a spare descriptor, accepts and drops what waits, and says nothing; the
    descriptor cap in ConnectionLimits refuses connections before either happens.)"""
    previous = loop.get_exception_handler()
    if getattr(previous, "watches_accept", False):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_FAILED:
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        exc = context.get("exception")
        sock = context.get("socket")
        try:
            name = sock.getsockname() if sock is not None else None
        except OSError:
            name = None
        where = f"portal {name[0]}:{name[1]}" if isinstance(name, tuple) else "a portal"
        code = errno.errorcode.get(getattr(exc, "errno", 0) or 0, "?")
        connection_log.event(f"accept() on a portal: {code}", where,
                             f"{where}: accept() failed: {exc}; listening again in 1 s",
                             noun="accept", verb="failed", detail=str(exc))

    handler.watches_accept = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)


def _discard(data: bytes) -> None:
    """What a lingering connection does with what it still receives."""


class BatchedConnection(asyncio.BaseProtocol):
    """A target connection: TCP_NODELAY, and replies sent through a WriteBatcher. Subclasses implement
    received(); what it answers at once leaves in one writelines when it returns, in the same loop turn.

    In a worker of a node with several (frontend/handoff.py), a connection records what it receives and
    answers until it settles, and hand_off() sends it to the worker that serves what it named; one that
    arrives that way replays the records (adopted(), then replay() at the end of connection_made)."""

    portal: tuple[str, int]

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self._closed = False
        self._batch = WriteBatcher()
        self.busy_poll: BusyPoll | None = None   # set by the server that accepted it
        self.authenticated = False               # login, Connect or NBD negotiation finished
        self.kind = "portal"                     # the protocol's name in log lines, set by the server
        self.source = "?"                        # the peer's address, as the per-address limits count it
        self.limits: ConnectionLimits | None = None   # set by the server that accepted it
        self._ticket: Ticket | None = None
        self._running_bytes = 0          # write data held by commands handed to the device, not yet done
        self.soon = 0                    # writes started with a device's write_soon, not answered yet
        self._soon_idle: asyncio.Future[None] | None = None
        self._budget_paused = False      # reading paused for _running_bytes (not for a full send buffer)
        self._send_paused = False        # reading paused because the send buffer is full
        self.record: Record | None = None   # what came and went before it settled (a worker's connection)
        self._expect = b""                  # answers the peer already had from the worker that handed it over
        self._replay = b""                  # what that worker received, to run through this one's protocol
        # a settled connection that moved here with its volume: the state its old worker suspended it in
        # (suspend(), node/workers.py move); connection_made resumes it there instead of greeting
        self._resume: dict[str, Any] | None = None
        self._hops = 0

    # --- workers: hand-off (frontend/handoff.py) ---------------------------------------------------------
    def route(self, exchange: Exchange) -> None:
        """Record until settled: this connection may still be handed to another worker."""
        self.record = Record(exchange, bytearray(), bytearray())
        self.received = self._recorded  # type: ignore[method-assign]   # instance attributes: the class's
        self.send_buffers = self._watched  # type: ignore[method-assign]  # methods again once settled

    def adopted(self, received: bytes, answered: bytes, hops: int = 1) -> None:
        """This connection comes from another worker: it received `received`, the peer has `answered`; it
        was handed over `hops` times."""
        self._replay = received
        self._expect = answered
        if self.record is not None:
            self.record.hops = hops
        self.send_buffers = self._watched  # type: ignore[method-assign]

    def resumed(self, state: dict[str, Any], received: bytes, hops: int = 1) -> None:
        """This connection moved here with its volume: `state` is what suspend() gave on its old worker and
        `received` what it had received there and not acted on (run after the resume, by replay())."""
        self._resume = state
        self._replay = received
        self._hops = hops
        self.settle()

    async def suspend(self) -> tuple[dict[str, Any], bytes] | None:
        """Stop this settled connection where it can move to another worker with its volume: stop reading,
        let what it started finish and its answers leave, and return its protocol state and the bytes it
        received but did not act on (for resumed() there). None: it cannot move (the caller closes it).
        Reading stays paused; hand_over() sends it, or resume_here() takes it up again here."""
        return None

    def detach_for_move(self) -> None:
        """A suspended connection leaves its server's books before the volumes it uses go, so it is not closed
        with them (reattach() puts it back when the move fails)."""
        raise NotImplementedError

    def reattach(self) -> None:
        raise NotImplementedError

    def resume_here(self, state: dict[str, Any], received: bytes) -> None:
        """Undo suspend() on this worker (the move failed): go on from `state` as a moved connection would."""
        raise NotImplementedError

    async def drained(self, timeout: float) -> bool:
        """Wait until everything queued for the peer has left (the kernel has it): False after `timeout` s."""
        self._batch.flush()
        t = self.transport
        deadline = asyncio.get_running_loop().time() + timeout
        while t is not None and not self._closed and t.get_write_buffer_size():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.001)
        return not self._closed

    def hand_over(self, exchange: Exchange, worker: int, state: dict[str, Any], received: bytes) -> bool:
        """Send this suspended connection to `worker` with its state, and let go of it here. False (and the
        connection closed) when it cannot go."""
        t = self.transport
        sock = t.get_extra_info("socket") if t is not None else None
        if self._hops >= MAX_HOPS:
            self.dropped("moved between workers too many times in a row", f"{state}")
            self.close()
            return False
        try:
            if t is None or sock is None or self._closed or t.get_write_buffer_size():
                raise OSError("answers are still queued here")
            exchange.send(worker, sock.fileno(), self.kind, self.portal, received, b"", self._hops + 1, resume=state)
        except OSError as err:
            self.dropped("could not be moved to the worker that serves its volume now", str(err))
            self.close()
            return False
        self._closed = True
        t.abort()  # type: ignore[attr-defined]   # our descriptor only: the socket lives on in the other worker
        return True

    def moved_on(self, worker: int | None, exchange: Exchange | None, state: dict[str, Any], why: str,
                 name: str) -> None:
        """A connection that moved here names what this worker does not serve: on to `worker`, which serves it
        now (it moved on again), or closed with `why` when none does."""
        if worker is not None and exchange is not None:
            self.hand_over(exchange, worker, state, self._replay)
            self._replay = b""
        else:
            self.dropped(why, name)
            self.close()

    def replay(self) -> None:
        """Subclasses call this last in connection_made: what the other worker received runs in the loop's next
        turn, once connection_made has returned. uvloop starts reading when connection_made returns, whatever
        it asked, so a pause_reading() there does not hold, and the replay may pause (NBD_OPT_STARTTLS stops
        reading until the TLS layer takes the socket: the client's ClientHello read in clear text before that
        stalled the handshake). Bytes that come before the replay has run wait for it (data_received)."""
        if self._replay and not self._closed:
            asyncio.get_running_loop().call_soon(self._replayed)

    def _replayed(self) -> None:
        data, self._replay = self._replay, b""
        if data and not self._closed:
            self.answer_at_once(self.received, data)

    def settle(self) -> None:
        """It named what this worker serves (or recorded too much to be handed off): stop recording."""
        if self.record is None:
            return
        self.record = None
        if self.__dict__.get("received") == self._recorded:
            del self.received
        if not self._expect and "send_buffers" in self.__dict__:
            del self.send_buffers

    def elsewhere(self, worker: int, what: str) -> None:
        """`what` is served by another worker: raise Elsewhere for the protocol to hand_off(), if this
        connection can still go; otherwise return, and the caller answers as for a name it does not know."""
        if self.record is not None:
            raise Elsewhere(worker, what)

    def hand_off(self, e: Elsewhere) -> None:
        """Send this connection to worker e.worker with its records, and let go of it here."""
        r, t = self.record, self.transport
        assert r is not None and t is not None
        if self._expect or r.hops >= MAX_HOPS:
            # still replaying what the worker that handed it over answered: that worker could not answer
            # it either (an NBD_OPT_INFO on an export whose size neither knows yet), and back would be a
            # loop; or handed over MAX_HOPS times already
            self.dropped("handed over again for what it asked before", f"{e.what}")
            self.close()
            return
        self._batch.flush()   # answers made before the name came go first: they are in the record
        sock = t.get_extra_info("socket")
        try:
            if sock is None or t.get_write_buffer_size():
                raise OSError("answers are still queued here")
            r.exchange.send(e.worker, sock.fileno(), self.kind, self.portal, bytes(r.rx), bytes(r.tx), r.hops + 1)
        except OSError as err:
            self.dropped("could not be handed to the worker that serves it", f"{e.what}: {err}")
            self.close()
            return
        log.debug("%s: %s: handed to worker %d", self.peer, e, e.worker)
        self.record = None
        self._closed = True
        t.abort()  # type: ignore[attr-defined]   # our descriptor only: the socket lives on in the other worker

    def _recorded(self, data: bytes) -> None:
        r = self.record
        if r is not None:
            r.rx += data
            if r.full():
                self.settle()
        type(self).received(self, data)

    def _watched(self, parts: Sequence[Buffer]) -> None:
        if self._closed:
            return
        r = self.record
        if r is not None:
            for p in parts:
                r.tx += p
        if self._expect:
            parts = self._unanswered(parts)
            if self._closed:
                return
        if parts:
            self._batch.send(parts)

    def _unanswered(self, parts: Sequence[Buffer]) -> list[Buffer]:
        """Drop from `parts` what the peer already has from the worker that handed this connection over,
        checking it is the same: the replay must lead to the state the peer saw."""
        out: list[Buffer] = []
        exp = self._expect
        for i, p in enumerate(parts):
            if not exp:
                out.extend(parts[i:])
                break
            k = min(len(p), len(exp))
            if bytes(memoryview(p)[:k]) != exp[:k]:
                log.error("%s: handed over from another worker, but this one answers differently; closing",
                          self.peer)
                self._expect = b""
                self.close()
                return []
            exp = exp[k:]
            if k < len(p):
                out.append(memoryview(p)[k:])
        self._expect = exp
        if not exp and self.record is None and "send_buffers" in self.__dict__:
            del self.send_buffers
        return out

    def logged_in(self) -> None:
        """The peer finished its login (iSCSI), Connect and authentication (NVMe/TCP) or negotiation (NBD):
        from now on the limits on peers that have not logged in stop counting this connection."""
        self.authenticated = True
        if self._ticket is not None:
            self._ticket.logged_in()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Subclasses call this first and do nothing more when it leaves the connection closed (over a cap)."""
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass it
        self._batch.transport = self.transport
        sock = transport.get_extra_info("socket")
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.source = source_address(peer)
        if self.limits is not None:
            ticket = self.limits.admit(self.source, sock.fileno() if sock is not None else None)
            if isinstance(ticket, str):
                # before any protocol work: no greeting, no timer; abort frees the descriptor at once (RST)
                self._closed = True
                transport.abort()  # type: ignore[attr-defined]
                connection_log.event(f"{self.kind}: {ticket}", self.source,
                                     f"{self.peer}: {self.kind} connection refused: {ticket}", verb="refused")
                return
            self._ticket = ticket
            ticket.evict = self._evicted
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        """Subclasses call this first."""
        self._closed = True
        if self._ticket is not None:
            self._ticket.release()
            self._ticket = None

    # --- flow control: what stops reading, and what lets it go on ---------------------------------------
    def pause_writing(self) -> None:
        """The send buffer is full: stop reading (the peer's TCP window closes) until it drains."""
        self._send_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._send_paused = False
        if self.transport is not None and not self._closed and not self._budget_paused:
            self.transport.resume_reading()

    def hold_running(self, running: asyncio.Future[None], n: int) -> None:
        """The receive budget after login: `n` bytes of write data stay held until `running` (the command at
        the device) is done. Beyond RUNNING_WRITE_BUDGET reading pauses until half has drained."""
        running.add_done_callback(lambda _: self._release_running(n))
        self.hold_bytes(n)

    def soon_started(self, n: int) -> None:
        """A write of `n` bytes handed to a device's write_soon (no Task): held as hold_running holds a Task's
        data, and counted for soon_idle, until soon_ended(n)."""
        self.soon += 1
        self.hold_bytes(n)

    def soon_ended(self, n: int) -> None:
        self._release_running(n)
        self.soon -= 1
        if not self.soon and self._soon_idle is not None:
            self._soon_idle.set_result(None)
            self._soon_idle = None

    def soon_idle(self) -> asyncio.Future[None]:
        """Done once every write started with write_soon is answered (a server's stop waits for it, as for
        the Tasks of commands in flight)."""
        fut = self._soon_idle
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            if self.soon:
                self._soon_idle = fut
            else:
                fut.set_result(None)
        return fut

    def hold_bytes(self, n: int) -> None:
        """`n` bytes of write data held until `_release_running(n)` (hold_running's and soon_started's count)."""
        self._running_bytes += n
        if self._running_bytes > RUNNING_WRITE_BUDGET and not self._budget_paused:
            self._budget_paused = True
            if self.transport is not None:
                self.transport.pause_reading()

    def _release_running(self, n: int) -> None:
        self._running_bytes -= n
        if self._budget_paused and self._running_bytes <= RUNNING_WRITE_BUDGET // 2:
            self._budget_paused = False
            if self.transport is not None and not self._closed and not self._send_paused:
                self.transport.resume_reading()

    def _evicted(self) -> None:
        """The limits closed this connection, which had not logged in, to let a newer one from a less busy
        address in ([node] max_unauthenticated reached)."""
        self.dropped("not logged in, closed to make room for another address ([node] max_unauthenticated)")
        self._closed = True
        if self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]

    def dropped(self, kind: str, detail: str = "") -> None:
        """Log that this connection is being closed for `kind` (a phrase the same for every connection
        dropped for it), at most one line per interval and kind with the counts (frontend/ratelog.py)."""
        what = f"{kind}: {detail}" if detail else kind
        connection_log.event(f"{self.kind}: {kind}", self.source, f"{self.peer}: {what}; closing the connection",
                             detail=detail)

    def close_lingering(self) -> None:
        """Close after an error answer to a peer that may still be sending: closing a socket with unread
        input resets the connection, and the reset can destroy our answer before the peer reads it. So: send,
        half-close (FIN), then read and drop whatever still comes (holding none of it) until the peer closes
        or REFUSED_LINGER has passed."""
        t = self.transport
        if t is None or self._closed:
            return
        self._batch.flush()
        self._closed = True
        self.received = _discard  # type: ignore[method-assign]   # no cost on the path of connections that live
        if t.can_write_eof():
            t.write_eof()
        asyncio.get_running_loop().call_later(REFUSED_LINGER, t.close)

    def answer_at_once(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) with sends held: what it answers leaves in one send when it returns, in this turn."""
        batch = self._batch
        batch.holding = True
        try:
            return fn(*args)
        finally:
            batch.holding = False
            batch.flush()
            if self.busy_poll is not None:
                self.busy_poll.arrived()

    def data_received(self, data: bytes) -> None:
        if self._replay:
            self._replayed()     # what came before, from the worker that handed this connection over (replay())
        self.answer_at_once(self.received, data)

    def eof_received(self) -> bool | None:
        """The peer half-closed: the transport closes (as asyncio.Protocol's default). A BaseProtocol, not an
        asyncio.Protocol: uvloop gives a protocol that is one data_received() even where it is also a
        BufferedProtocol, as the NBD connection is (frontend/nbd.py get_buffer)."""
        return None

    def received(self, data: bytes) -> None:
        raise NotImplementedError

    def send_buffers(self, parts: Sequence[Buffer]) -> None:
        if not self._closed:
            self._batch.send(parts)

    def close(self) -> None:
        """Send what is queued, then close."""
        if not self._closed and self.transport is not None:
            self._batch.flush()
            self._closed = True
            self.transport.close()


class PortalServer:
    """The listening sockets of one protocol server and their life cycle."""

    kind = "portal"  # the protocol's name in log lines

    def __init__(self) -> None:
        self.closing = False
        self.connections: set[BatchedConnection] = set()
        self._servers: list[asyncio.base_events.Server] = []
        self._listening: dict[tuple[str, int], asyncio.base_events.Server] = {}
        self.busy_poll: BusyPoll | None = None   # handed to every connection accepted from now on
        self.limits: ConnectionLimits | None = None   # the node's, shared by its servers; None: no caps
        # a worker of a node with several: portals are shared (SO_REUSEPORT) and connections that name what
        # another worker serves go there (frontend/handoff.py)
        self.exchange: Exchange | None = None
        # what moves to another worker with its volumes right now (node/workers.py move): target IQN, subsystem
        # NQN or export name -> the worker that serves it next. A connection that names one goes there at once
        # (parked until that worker serves it), so there is no instant where the name is unknown to the node
        self.moving: dict[str, int] = {}
        self._adopting: set[asyncio.Task[None]] = set()

    def portals(self) -> list[tuple[str, int]]:
        raise NotImplementedError

    def make_connection(self, portal: tuple[str, int]) -> BatchedConnection:
        raise NotImplementedError

    def portal_note(self, portal: tuple[str, int]) -> str:
        """Anything worth saying about a portal once it listens."""
        return ""

    def in_flight(self) -> list[asyncio.Future[None]]:
        """Commands running now: stop() lets them finish."""
        return []

    def before_drain(self) -> None:
        """Called once listening has stopped and before stop() waits for commands in flight."""

    async def start(self) -> None:
        watch_accept_errors(asyncio.get_running_loop())
        try:
            await self.sync_portals()
        except OSError:
            await self.stop()
            raise

    async def sync_portals(self) -> None:
        """Listen on every portal portals() names and on no other: at start, and after the node added or
        removed what a portal serves. A portal that cannot be bound raises OSError naming it, and the
        portals bound by this call are let go again (those listening before stay)."""
        loop = asyncio.get_running_loop()
        want = self.portals()
        added: list[tuple[str, int]] = []
        for host, port in want:
            if (host, port) in self._listening:
                continue
            try:
                srv = await loop.create_server(lambda p=(host, port): self._accepted(p),  # type: ignore[misc]
                                               host, port, reuse_address=True, backlog=BACKLOG,
                                               reuse_port=self.exchange is not None)
            except OSError as e:
                for p in added:
                    await self._unlisten(p)
                raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
            self._servers.append(srv)
            self._listening[(host, port)] = srv
            added.append((host, port))
            note = self.portal_note((host, port))
            log.info("%s portal listening on %s:%d%s", self.kind, host, port, f" ({note})" if note else "")
        for p in [p for p in self._listening if p not in want]:
            await self._unlisten(p)
            log.info("%s portal %s:%d no longer listening (nothing is served there)", self.kind, *p)

    async def _unlisten(self, portal: tuple[str, int]) -> None:
        srv = self._listening.pop(portal)
        self._servers.remove(srv)
        srv.close()
        await srv.wait_closed()

    def _accepted(self, portal: tuple[str, int]) -> BatchedConnection:
        c = self.make_connection(portal)
        c.busy_poll = self.busy_poll
        c.limits = self.limits
        c.kind = self.kind
        if self.exchange is not None:
            c.route(self.exchange)
        return c

    def adopt(self, a: Arrival) -> None:
        """A connection another worker of this node accepted and handed over (frontend/handoff.py)."""
        if self.closing:
            a.sock.close()
            return
        c = self._accepted(a.portal)
        if a.resume is not None:
            c.resumed(a.resume, a.received, a.hops)
        else:
            c.adopted(a.received, a.answered, a.hops)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._take(c, a))
        self._adopting.add(task)
        task.add_done_callback(self._adopting.discard)

    async def _take(self, c: BatchedConnection, a: Arrival) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: c, a.sock)
        except OSError as e:
            a.sock.close()
            log.info("%s connection handed over from another worker was lost before it started: %s", self.kind, e)

    async def serve_forever(self) -> None:
        await asyncio.gather(*(s.serve_forever() for s in self._servers))

    async def stop(self) -> None:
        """Stop accepting, let commands in flight finish, then close every connection."""
        self.closing = True
        for s in self._servers:
            s.close()
        self.before_drain()
        running = self.in_flight()
        if running:
            await asyncio.wait(running, timeout=DRAIN_TIMEOUT)
        for c in list(self.connections):
            c.close()
        for s in self._servers:
            await s.wait_closed()
        self._servers.clear()
        self._listening.clear()
