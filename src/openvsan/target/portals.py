"""What the iSCSI, NVMe/TCP and NBD servers share: listening on portals, draining on stop, and connections
that send everything made in one event-loop turn in one writelines."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from openvsan.netio import Buffer, WriteBatcher
from openvsan.target.busypoll import BusyPoll

log = logging.getLogger("openvsan.target")
T = TypeVar("T")

DRAIN_TIMEOUT = 30.0  # seconds stop() waits for commands in flight before closing connections anyway


class BatchedConnection(asyncio.Protocol):
    """A target connection: TCP_NODELAY, and replies sent through a WriteBatcher. Subclasses implement
    received(); what it answers at once leaves in one writelines when it returns, in the same loop turn."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self._closed = False
        self._batch = WriteBatcher()
        self.busy_poll: BusyPoll | None = None   # set by the server that accepted it
        self.authenticated = False               # login, Connect or NBD negotiation finished

    def logged_in(self) -> None:
        """The peer finished its login (iSCSI), Connect and authentication (NVMe/TCP) or negotiation (NBD):
        from now on the limits on peers that have not logged in stop counting this connection."""
        self.authenticated = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass it
        self._batch.transport = self.transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"

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
        self.answer_at_once(self.received, data)

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
        self.busy_poll: BusyPoll | None = None   # handed to every connection accepted from now on

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
        loop = asyncio.get_running_loop()
        for host, port in self.portals():
            try:
                srv = await loop.create_server(lambda p=(host, port): self._accepted(p),  # type: ignore[misc]
                                               host, port, reuse_address=True, backlog=128)
            except OSError as e:
                await self.stop()
                raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
            self._servers.append(srv)
            note = self.portal_note((host, port))
            log.info("%s portal listening on %s:%d%s", self.kind, host, port, f" ({note})" if note else "")

    def _accepted(self, portal: tuple[str, int]) -> BatchedConnection:
        c = self.make_connection(portal)
        c.busy_poll = self.busy_poll
        return c

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
