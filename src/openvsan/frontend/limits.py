"""Limits on peers, shared by the iSCSI, NVMe/TCP and NBD servers of a node: connections in all, connections
that have not logged in (from all addresses, and from one), and the file descriptors the process may hold.

A connection is counted from accept; it stops counting as "not logged in" when its protocol calls
BatchedConnection.logged_in() (iSCSI login, NVMe/TCP Connect, NBD negotiation done). One over a cap is closed
before any protocol work, so a flood of idle connections from one address can neither use up the descriptors
nor lock out logins from elsewhere, and sessions already logged in keep working."""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable

log = logging.getLogger("openvsan.frontend")

# descriptors kept for what is not a connection: device and member files, the state store, listening and control
# sockets, and the accept of a connection that is then refused
FD_RESERVE = 64


class Ticket:
    """One admitted connection's place in the counts; release() when it closes (more calls do nothing)."""

    __slots__ = ("authenticated", "evict", "limits", "released", "source")

    def __init__(self, limits: ConnectionLimits, source: str) -> None:
        self.limits = limits
        self.source = source
        self.authenticated = False
        self.released = False
        self.evict: Callable[[], None] | None = None   # closes the connection when the limits make room

    def logged_in(self) -> None:
        if not self.authenticated and not self.released:
            self.authenticated = True
            self.limits._unauthenticated_done(self)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limits.total -= 1
            if not self.authenticated:
                self.limits._unauthenticated_done(self)


class ConnectionLimits:
    """The caps of [node] max_connections, max_unauthenticated and max_unauthenticated_per_source, and the
    soft RLIMIT_NOFILE (fd_limit) less FD_RESERVE."""

    def __init__(self, max_connections: int, max_unauthenticated: int, max_unauthenticated_per_source: int, *,
                 fd_limit: int | None = None) -> None:
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.max_unauthenticated_per_source = max_unauthenticated_per_source
        self.fd_limit = fd_limit
        self.total = 0
        self.unauthenticated = 0
        self.per_source: dict[str, int] = {}   # address -> its connections not logged in (no entry at 0)
        self.refused: dict[str, int] = {}      # reason -> connections refused for it
        self.evicted = 0                       # connections not logged in closed to make room for another
        self._waiting: dict[Ticket, None] = {}  # connections not logged in, oldest first

    def admit(self, source: str, fd: int | None = None) -> Ticket | str:
        """A Ticket for a new connection from address `source` (its socket is descriptor `fd`), or why it is
        refused: a phrase that names the cap, the same for every refusal of its kind."""
        why = self._over(source, fd)
        if why is not None and why.endswith("[node] max_unauthenticated") and self._make_room(source):
            why = self._over(source, fd)
        if why is not None:
            self.refused[why] = self.refused.get(why, 0) + 1
            return why
        self.total += 1
        self.unauthenticated += 1
        self.per_source[source] = self.per_source.get(source, 0) + 1
        ticket = Ticket(self, source)
        self._waiting[ticket] = None
        return ticket

    def _make_room(self, source: str) -> bool:
        """At max_unauthenticated, close the oldest connection not logged in of the address that holds the
        most of them, when that address holds more than `source` would with this one (SSH's MaxStartups
        idea, without the randomness): a flood from many addresses then only crowds itself, a host that logs in
        at once still gets in, and no address can push out others with a flood of its own."""
        busiest = max(self.per_source, key=self.per_source.__getitem__, default=None)
        if busiest is None or self.per_source[busiest] <= self.per_source.get(source, 0) + 1:
            return False
        victim = next(t for t in self._waiting if t.source == busiest)
        victim.release()         # its connection_lost then releases nothing more: the ticket is spent
        self.evicted += 1
        if victim.evict is not None:
            victim.evict()
        return True

    def _over(self, source: str, fd: int | None) -> str | None:
        # descriptors are handed out lowest free first: fd N means N below it are in use
        if fd is not None and self.fd_limit is not None and fd >= self.fd_limit - FD_RESERVE:
            return f"file descriptors nearly used up: soft RLIMIT_NOFILE {self.fd_limit}"
        if self.total >= self.max_connections:
            return f"{self.max_connections} connections open, [node] max_connections"
        if self.unauthenticated >= self.max_unauthenticated:
            return f"{self.max_unauthenticated} connections not logged in, [node] max_unauthenticated"
        if self.per_source.get(source, 0) >= self.max_unauthenticated_per_source:
            return (f"{self.max_unauthenticated_per_source} connections not logged in from one address, "
                    "[node] max_unauthenticated_per_source")
        return None

    def _unauthenticated_done(self, ticket: Ticket) -> None:
        self.unauthenticated -= 1
        self._waiting.pop(ticket, None)
        source = ticket.source
        n = self.per_source[source] - 1
        if n:
            self.per_source[source] = n
        else:
            del self.per_source[source]


def source_address(peername: object) -> str:
    """The address part of a peer name, as the per-address cap counts it (an IPv4-mapped IPv6 address is
    its IPv4 address: one host, whichever socket family the portal listens on)."""
    if isinstance(peername, tuple) and peername:
        host = str(peername[0])
        return host[7:] if host.startswith("::ffff:") and "." in host else host
    return "?"


def raise_fd_limit(max_connections: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (systemd and login shells start services at 1024) and
    log it; warn when even the hard limit cannot hold max_connections. Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = soft
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, max_connections + FD_RESERVE)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            new = target
        except (ValueError, OSError) as e:
            log.warning("file descriptors: cannot raise the soft limit from %d to %d: %s", soft, target, e)
    if new != soft:
        log.info("file descriptors: soft limit raised from %d to %d", soft, new)
    else:
        log.info("file descriptors: soft limit is %d", new)
    need = max_connections + FD_RESERVE
    if new < need:
        log.warning("file descriptors: the limit %d is below the %d that [node] max_connections = %d needs; "
                    "connections are refused from %d on; raise the hard limit (LimitNOFILE= in the systemd unit, "
                    "ulimit -Hn) or lower max_connections", new, need, max_connections, new - FD_RESERVE)
    return soft, new


def soft_fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
