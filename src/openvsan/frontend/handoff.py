"""Handing a connection to the worker process that owns what it asks for (`vsan serve --workers N`).

Every worker listens on every portal of the node (SO_REUSEPORT: the kernel spreads the connections), but
only one worker owns a given iSCSI target, NVMe subsystem or NBD export, with its volumes. Until a new
connection names what it wants (the login's TargetName, the Connect's SUBNQN, the NBD option's export
name) the worker that accepted it records what it received and what it answered. When the name belongs
to another worker, the socket goes to that worker's inbox (SCM_RIGHTS) with both records; the new owner
replays what was received through its own protocol code and drops the answers the peer already has,
checking that they are the same bytes. So the protocol state crosses as the bytes that made it, and
nothing is parsed twice by different code. After the hand-off the data path is the owner's alone.

What is recorded is small: at most MAX_RECORD bytes each way, the login phase only. A connection that
settles (logs in, connects, finishes NBD negotiation) stops recording."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openvsan.protocol.routing import Elsewhere

log = logging.getLogger("openvsan.frontend")

__all__ = ["Arrival", "Elsewhere", "Exchange", "Record", "inbox_pairs"]

MAX_RECORD = 64 * 1024          # bytes recorded each way before a connection settles; beyond: not handed off
MAX_HOPS = 16                   # hand-offs of one connection: a bound, whatever the protocol asks in a row
_LEN = struct.Struct("<I")
MAX_MESSAGE = 4 * MAX_RECORD    # one inbox message: a header, what was received and what was answered
# the first byte of an inbox message that carries descriptors: a connection, or a supervisor's note
_CONNECTION = b"C"
_NOTE_WITH_FDS = b"F"


@dataclass
class Record:
    """What a connection that has not settled received and answered, for its new owner to replay."""

    exchange: Exchange
    rx: bytearray
    tx: bytearray
    hops: int = 0            # times this connection was handed over before it came here

    def full(self) -> bool:
        return len(self.rx) > MAX_RECORD or len(self.tx) > MAX_RECORD


@dataclass
class Arrival:
    """A connection handed to this worker: its socket, the portal it came to, and the records."""

    kind: str               # the server's kind: "iSCSI", "NVMe/TCP", "NBD"
    portal: tuple[str, int]
    received: bytes
    answered: bytes
    sock: socket.socket
    hops: int = 1
    # a settled connection that moved here with its volume (node/workers.py move): the protocol state its
    # old worker suspended it in; `received` is then what it received and had not yet acted on
    resume: dict[str, Any] | None = None


class Exchange:
    """The inboxes of a node's workers: one SOCK_SEQPACKET socket pair each, made by the supervisor, which
    keeps both ends open. Every worker holds every inbox's sending end and its own receiving end, so a
    connection handed to a worker that is restarting waits in its inbox until the new one reads it."""

    def __init__(self, index: int, send_fds: list[int], inbox_fd: int) -> None:
        self.index = index
        self._send = [socket.socket(fileno=fd) for fd in send_fds]
        for s in self._send:
            s.setblocking(False)
        self._inbox = socket.socket(fileno=inbox_fd)
        self._inbox.setblocking(False)

    def send(self, worker: int, fd: int, kind: str, portal: tuple[str, int], received: bytes,
             answered: bytes, hops: int = 1, resume: dict[str, Any] | None = None) -> None:
        """Send the connection on descriptor `fd` to `worker`'s inbox. OSError when the inbox is full (its
        worker is down and many wait) or gone: the caller keeps the connection and refuses it. `resume`: the
        protocol state of a settled connection that moves with its volume (Arrival.resume)."""
        fields: dict[str, Any] = {"kind": kind, "portal": list(portal), "rx": len(received), "tx": len(answered),
                                  "hops": hops}
        if resume is not None:
            fields["resume"] = resume
        head = json.dumps(fields).encode()
        msg = b"".join((_CONNECTION, _LEN.pack(len(head)), head, received, answered))
        socket.send_fds(self._send[worker], [msg], [fd])

    def watch(self, on_arrival: Callable[[Arrival], None], on_message: Callable[[dict[str, Any]], None]) -> None:
        """Call on_arrival for each connection that comes to this worker's inbox, on_message for each note
        from the supervisor (tell()), on the running loop."""
        import asyncio

        self._callbacks = (on_arrival, on_message)
        asyncio.get_running_loop().add_reader(self._inbox.fileno(), self._read, on_arrival, on_message)

    def poll(self) -> None:
        """Take now what waits in the inbox (what the supervisor put there before asking something of this
        worker, such as the memory of a RAM device that moves here), as watch()'s callbacks would."""
        self._read(*self._callbacks)

    def _read(self, on_arrival: Callable[[Arrival], None], on_message: Callable[[dict[str, Any]], None]) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self._inbox, MAX_MESSAGE, 4)
            except (BlockingIOError, InterruptedError):
                return
            if not fds:
                if not msg:
                    return
                try:
                    note = json.loads(msg)
                except ValueError as e:
                    log.error("worker %d: a malformed note from the supervisor was dropped: %s", self.index, e)
                    continue
                on_message(note)
                continue
            if msg[:1] == _NOTE_WITH_FDS:
                try:
                    note = json.loads(msg[1:])
                except ValueError as e:
                    for fd in fds:
                        os.close(fd)
                    log.error("worker %d: a malformed note from the supervisor was dropped: %s", self.index, e)
                    continue
                note["fds"] = fds      # the receiver owns them now
                on_message(note)
                continue
            extra = fds[1:]
            for fd in extra:
                os.close(fd)
            try:
                arrival = _parse(msg, fds[0])
            except (ValueError, KeyError, TypeError) as e:
                os.close(fds[0])
                log.error("worker %d: a malformed hand-off message was dropped: %s", self.index, e)
                continue
            on_arrival(arrival)

    def close(self) -> None:
        import asyncio
        import contextlib

        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().remove_reader(self._inbox.fileno())
        for s in [*self._send, self._inbox]:
            s.close()


def tell(inbox: socket.socket, note: dict[str, Any], fds: list[int] | None = None) -> None:
    """The supervisor's note to a worker, through the sending end of its inbox: a message with no
    descriptor (what the workers' Exchange passes to on_message), or one with `fds` (a RAM device's memory
    for a volume that moves to it: on_message gets them as note["fds"], in order, and owns them)."""
    if fds:
        socket.send_fds(inbox, [_NOTE_WITH_FDS + json.dumps(note).encode()], fds)
    else:
        inbox.send(json.dumps(note).encode())


def _parse(msg: bytes, fd: int) -> Arrival:
    if msg[:1] != _CONNECTION:
        raise ValueError(f"message kind {msg[:1]!r}")
    (n,) = _LEN.unpack_from(msg, 1)
    head = json.loads(msg[5:5 + n])
    rx, tx = int(head["rx"]), int(head["tx"])
    body = msg[5 + n:]
    if len(body) != rx + tx:
        raise ValueError(f"{len(body)} bytes of records where the header says {rx} + {tx}")
    host, port = head["portal"]
    sock = socket.socket(fileno=fd)
    resume = head.get("resume")
    return Arrival(str(head["kind"]), (str(host), int(port)), bytes(body[:rx]), bytes(body[rx:]), sock,
                   int(head.get("hops", 1)), dict(resume) if isinstance(resume, dict) else None)


def inbox_pairs(n: int) -> list[tuple[socket.socket, socket.socket]]:
    """The supervisor's N inboxes: (receiving end, sending end) each, inheritable by the workers."""
    pairs = []
    for _ in range(n):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (a, b):
            s.set_inheritable(True)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024 * 1024)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        pairs.append((a, b))
    return pairs
