"""The server side of one NBD connection, sans-IO: bytes in, events out (the h11 model).

    conn = NbdServerConnection(exports)
    send(conn.greeting())
    for event in conn.receive_data(data):   # Send | Negotiated | StartTls | Request | Disconnect | Close
        ...                                  # run a Request, then send(conn.reply(...))

After StartTls the driver runs the TLS handshake on its socket, calls `tls_started()` and from then on feeds
the decrypted stream to receive_data.

Handshake (proto.md "Fixed newstyle negotiation") and transmission (proto.md "Transmission") framing
live here; option answers in handshake.py, request checks and reply layouts in transmission.py.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from enum import Enum, auto

from openvsan.protocol.nbd.events import (
    Buffer,
    Close,
    Disconnect,
    Event,
    ExportInfo,
    Negotiated,
    Request,
    Send,
    StartTls,
)
from openvsan.protocol.nbd.handshake import Handshake
from openvsan.protocol.nbd.transmission import (
    admit,
    block_status_reply,
    done_reply,
    error_reply,
    read_reply,
)
from openvsan.protocol.nbd.wire import (
    CLIENT_FLAGS,
    EXTENDED_REQUEST_MAGIC,
    IHAVEOPT,
    OPTION,
    REQUEST,
    REQUEST_MAGIC,
    Cmd,
    Errno,
)
from openvsan.protocol.routing import Elsewhere

# Option data we read before deciding the client means harm (proto.md "Termination of the session during
# option haggling": a server MAY hard-disconnect a client whose behaviour is a denial of service). The
# largest legitimate option is NBD_OPT_GO/INFO/SET_META_CONTEXT: a 4 KiB name and a few requests.
MAX_OPTION_DATA = 64 * 1024


_HEADER = REQUEST.size           # 28 bytes: magic, flags, type, cookie, offset, length
# a write from this size is received in place when the driver lends a window (smaller ones mostly arrive whole
# in one receive and take the lane, whose copy into the device is as cheap)
WINDOW_AT = 64 * 1024
_WRITE = int(Cmd.WRITE)


def _pending(events: list[Event]) -> bool:
    """Whether `events` holds a request the driver has yet to run (one received in place is done already)."""
    return any(isinstance(e, Request) and not e.in_place for e in events)


class Phase(Enum):
    CLIENT_FLAGS = auto()
    OPTION_HEADER = auto()
    OPTION_DATA = auto()
    REQUEST = auto()
    PAYLOAD = auto()
    TLS = auto()      # NBD_OPT_STARTTLS acknowledged: the driver is running the TLS handshake
    DONE = auto()     # after NBD_CMD_DISC, NBD_OPT_ABORT or a hard disconnect: input is ignored


class NbdServerConnection:
    def __init__(self, exports: Sequence[ExportInfo], *, default: str | None = None, tls_offered: bool = False,
                 tls_only: Collection[str] = (), tls_elsewhere: int | None = None,
                 moving: Mapping[str, int] | None = None) -> None:
        self.handshake = Handshake(exports, default, tls_offered=tls_offered, tls_only=tls_only,
                                   tls_elsewhere=tls_elsewhere, moving=moving)
        self.phase = Phase.CLIENT_FLAGS
        self.session: Negotiated | None = None
        self._acc = bytearray()        # a header (or option data) being gathered
        self._want = CLIENT_FLAGS.size
        self._option = 0
        # a WRITE whose payload is arriving: its header, the buffer (None: discard) and the error to answer
        self._write: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._payload: bytearray | memoryview | None = None
        self._in_place = False         # _payload is memory window() lent
        self._fill = 0
        self._payload_error: tuple[Errno, str] | None = None
        # set by the driver: where an admitted write's payload of `length` bytes at `offset` may be received
        # in place (the device's own memory), or None for a buffer of its own; used from WINDOW_AT bytes
        self.window: Callable[[int, int], memoryview | None] | None = None

    @classmethod
    def resumed(cls, session: Negotiated) -> NbdServerConnection:
        """A connection in the transmission phase of `session`, negotiated elsewhere: by another worker of
        this node, from which it moved with its volume (suspend() there, node/workers.py move)."""
        conn = cls([session.export])
        conn.session = session
        conn._expect(Phase.REQUEST, REQUEST.size)
        return conn

    def suspend(self) -> bytes:
        """Stop here, in the transmission phase, and return the bytes of the request left half received (a
        header in part, or a write and the part of its payload that came), as the client sent them: fed to
        the resumed() connection first, they go on as if never cut. A payload being received into a window
        is copied out of it; the driver closes the window. Nothing is read here afterwards."""
        if self.phase is Phase.REQUEST:
            out = bytes(self._acc)
        elif self.phase is Phase.PAYLOAD:
            cmd, flags, cookie, offset = self._write
            head = REQUEST.pack(REQUEST_MAGIC, flags, cmd, cookie, offset, self._want)
            got = bytes(memoryview(self._payload)[:self._fill]) if self._payload is not None else bytes(self._fill)
            out = head + got
            self._payload = None
            self._in_place = False
        else:
            raise RuntimeError(f"suspend() in phase {self.phase.name}: only a negotiated connection moves")
        self._acc.clear()
        self.phase = Phase.DONE
        return out

    @property
    def shutting_down(self) -> bool:
        return self.handshake.shutting_down

    def start_shutdown(self) -> None:
        """Options from now on get NBD_REP_ERR_SHUTDOWN (proto.md "Termination ... option haggling")."""
        self.handshake.shutting_down = True

    @property
    def tls(self) -> bool:
        return self.handshake.tls

    def greeting(self) -> bytes:
        return self.handshake.greeting()

    def tls_started(self) -> None:
        """The driver finished the TLS handshake: option haggling starts again, inside TLS."""
        if self.phase is not Phase.TLS:
            raise RuntimeError(f"tls_started() in phase {self.phase.name}, not after StartTls")
        self.handshake.tls_started()
        self._expect(Phase.OPTION_HEADER, OPTION.size)

    # --- input -----------------------------------------------------------------------------------
    def receive_data(self, data: Buffer) -> list[Event]:
        events: list[Event] = []
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        pos, end = 0, len(view)
        while pos < end and self.phase is not Phase.DONE:
            if self.phase is Phase.TLS:
                # proto.md NBD_OPT_STARTTLS: the client upgrades on receiving the ACK, so nothing may follow
                # the option in clear text; taking such bytes as the start of the TLS session would let them
                # pass for protected data (the STARTTLS command injection of SMTP and IMAP)
                self._unsay_starttls(events)
                self._close(f"{end - pos} bytes in clear text after NBD_OPT_STARTTLS", events)
                break
            if self.phase is Phase.PAYLOAD:
                pos = self._payload_bytes(view, pos, events)
                continue
            take = min(self._want - len(self._acc), end - pos)
            if not self._acc and take == self._want:
                chunk = view[pos:pos + take]     # a whole header in hand: no copy
            else:
                self._acc += view[pos:pos + take]
                if len(self._acc) < self._want:
                    return events
                chunk = memoryview(bytes(self._acc))
                self._acc.clear()
            pos += take
            try:
                self._dispatch(chunk, events)
            except Elsewhere as e:
                # another worker serves what this option names: the answers before it still go out, then
                # the frontend hands the connection over (this connection reads nothing more)
                self.phase = Phase.DONE
                events.append(e)
                break
        return events

    def lane(self, data: Buffer) -> tuple[list[Request], Buffer]:
        """The shortcut for what clients send most once negotiated: NBD_CMD_READ and NBD_CMD_WRITE requests
        at the front of `data`, each whole (a write with its payload, which stays a view of `data`) and
        admitted by admit(), as receive_data would make them. Returns those requests and what is left for
        receive_data: from the first request that is anything else, is refused, or is cut by the end of
        `data`; all of it when a request was left half read before (nothing is taken then)."""
        out: list[Request] = []
        if self.phase is not Phase.REQUEST or self._acc:
            return out, data
        s = self.session
        assert s is not None
        n = len(data)
        pos = 0
        unpack = REQUEST.unpack_from
        view: memoryview | None = None
        while n - pos >= _HEADER:
            magic, flags, cmd, cookie, offset, length = unpack(data, pos)
            if magic != REQUEST_MAGIC or cmd > _WRITE:          # READ is 0, WRITE 1
                break
            end = pos + _HEADER + (length if cmd else 0)
            if end > n or admit(s, cmd, flags, offset, length) is not None:
                break
            if cmd:
                if view is None:
                    view = memoryview(data).cast("B")
                out.append(Request(cmd, flags, cookie, offset, length, view[pos + _HEADER:end]))
            else:
                out.append(Request(cmd, flags, cookie, offset, length, None))
            pos = end
        if not pos:
            return out, data
        return out, (view if view is not None else memoryview(data).cast("B"))[pos:]

    @staticmethod
    def _unsay_starttls(events: list[Event]) -> None:
        # the ACK has not left yet: take it back with the StartTls, so the client is not told to upgrade
        for i, e in enumerate(events):
            if isinstance(e, StartTls):
                start = i - 1 if i and isinstance(events[i - 1], Send) else i
                del events[start:i + 1]
                return

    def _dispatch(self, chunk: memoryview, events: list[Event]) -> None:
        if self.phase is Phase.CLIENT_FLAGS:
            (flags,) = CLIENT_FLAGS.unpack_from(chunk)
            why = self.handshake.client_flags(flags)
            if why:
                self._close(why, events)
            else:
                self._expect(Phase.OPTION_HEADER, OPTION.size)
        elif self.phase is Phase.OPTION_HEADER:
            magic, opt, length = OPTION.unpack_from(chunk)
            if magic != IHAVEOPT:
                self._close(f"bad option magic 0x{magic:016x}", events)
            elif length > MAX_OPTION_DATA:
                self._close(f"option {opt} carries {length} bytes of data (limit {MAX_OPTION_DATA})", events)
            else:
                self._option = opt
                if length:
                    self._expect(Phase.OPTION_DATA, length)
                else:
                    self._run_option(memoryview(b""), events)
        elif self.phase is Phase.OPTION_DATA:
            self._run_option(chunk, events)
        elif self.phase is Phase.REQUEST:
            self._request(chunk, events)

    def _expect(self, phase: Phase, n: int) -> None:
        self.phase, self._want = phase, n

    def _close(self, why: str, events: list[Event]) -> None:
        self.phase = Phase.DONE
        events.append(Close(why))

    def _run_option(self, data: memoryview, events: list[Event]) -> None:
        r = self.handshake.option(self._option, data)
        if r.out:
            events.append(Send(list(r.out)))
        if r.close:
            self._close(r.close, events)
        elif r.abort:
            self.phase = Phase.DONE
            events.append(Disconnect())
        elif r.start_tls:
            self.phase = Phase.TLS
            events.append(StartTls())
        elif r.negotiated:
            self.session = r.negotiated
            events.append(r.negotiated)
            self._expect(Phase.REQUEST, REQUEST.size)
        else:
            self._expect(Phase.OPTION_HEADER, OPTION.size)

    # --- transmission ----------------------------------------------------------------------------
    def _request(self, chunk: memoryview, events: list[Event]) -> None:
        s = self.session
        assert s is not None
        magic, flags, cmd, cookie, offset, length = REQUEST.unpack_from(chunk)
        if magic != REQUEST_MAGIC:
            # proto.md "Request message": with a bad magic the stream cannot be framed any more
            what = "extended headers were not negotiated" if magic == EXTENDED_REQUEST_MAGIC else "bad magic"
            self._close(f"request with magic 0x{magic:08x}: {what}", events)
            return
        if cmd == Cmd.DISC:
            # proto.md NBD_CMD_DISC: no reply; finish what is outstanding, then close
            self.phase = Phase.DONE
            events.append(Disconnect())
            return
        problem = admit(s, cmd, flags, offset, length)
        if cmd == Cmd.WRITE and length:
            # the payload follows the header whatever we think of the request; it is read (or skipped)
            # before the answer so the stream stays framed and the connection survives
            self._write = (cmd, flags, cookie, offset)
            self._payload_error = problem
            # in place only once every request before it has been handed out: the payload lands in the device
            # as it comes, so a request still in `events` (not yet run) would see it, or write over it
            lent = (self.window(offset, length) if problem is None and self.window is not None
                    and length >= WINDOW_AT and not _pending(events) else None)
            self._in_place = lent is not None
            self._payload = lent if lent is not None else bytearray(length) if problem is None else None
            self._fill = 0
            self._expect(Phase.PAYLOAD, length)
            return
        if problem is not None:
            events.append(Send([error_reply(s, cmd, cookie, problem[0], problem[1])]))
            return
        events.append(Request(cmd, flags, cookie, offset, length, memoryview(b"") if cmd == Cmd.WRITE else None))

    def payload_window(self, least: int) -> memoryview | None:
        """Where the rest of a write's payload goes, when at least `least` bytes of it are still to come: the
        driver may receive into it directly (then payload_filled), sparing a copy of what it read. None when
        no payload is being read, it is being discarded (a refused write), or little of it is left."""
        if self.phase is not Phase.PAYLOAD or self._payload is None or self._want - self._fill < least:
            return None
        return memoryview(self._payload)[self._fill:self._want]

    def payload_filled(self, n: int) -> list[Event]:
        """`n` more bytes of the payload were received into payload_window()'s buffer."""
        events: list[Event] = []
        if self.phase is not Phase.PAYLOAD or not 0 < n <= self._want - self._fill:
            raise RuntimeError(f"payload_filled({n}) with {self._want - self._fill} bytes of payload to come")
        self._fill += n
        self._payload_done(events)
        return events

    def _payload_bytes(self, view: memoryview, pos: int, events: list[Event]) -> int:
        take = min(self._want - self._fill, len(view) - pos)
        if self._payload is not None:
            self._payload[self._fill:self._fill + take] = view[pos:pos + take]
        self._fill += take
        pos += take
        self._payload_done(events)
        return pos

    def _payload_done(self, events: list[Event]) -> None:
        if self._fill == self._want:
            cmd, flags, cookie, offset = self._write
            payload, self._payload = self._payload, None
            if payload is None:
                assert self._payload_error is not None
                errno, msg = self._payload_error
                events.append(Send([error_reply(self.session, cmd, cookie, errno, msg)]))
            else:
                events.append(Request(cmd, flags, cookie, offset, self._want, memoryview(payload), self._in_place))
                self._in_place = False
            self._expect(Phase.REQUEST, REQUEST.size)

    # --- output ----------------------------------------------------------------------------------
    def reply(self, req: Request, data: Buffer | None = None) -> list[Buffer]:
        """The success reply to `req`; `data` is what a read returned."""
        s = self.session
        assert s is not None
        if req.cmd == Cmd.READ:
            return read_reply(s, req.cookie, req.offset, data if data is not None else b"")
        if req.cmd == Cmd.BLOCK_STATUS:
            raise ValueError("use reply_block_status for NBD_CMD_BLOCK_STATUS")
        return [done_reply(s, req.cookie)]

    def reply_error(self, req: Request, error: Errno, message: str = "", offset: int | None = None) -> list[Buffer]:
        """An error reply to `req` (with a message and the failing offset where structured replies allow)."""
        return [error_reply(self.session, req.cmd, req.cookie, error, message, offset)]

    def reply_block_status(self, req: Request, extents: list[tuple[int, int]]) -> list[Buffer]:
        assert self.session is not None
        return [block_status_reply(self.session, req.cookie, extents)]
