"""The asyncio NBD server: portals, connections, and block I/O for checked requests.

A Connection is an asyncio BufferedProtocol that feeds received bytes to the sans-IO NbdServerConnection
(protocol/nbd) and runs the requests it yields on the export's BlockDevice, each in its own task, so
replies go out in completion order (proto.md "Transmission": replies need not be in request order). The
payload of a large write is received straight into its own buffer (get_buffer: NbdServerConnection's
payload_window); everything else lands in one receive buffer and is copied out at once.

TLS (proto.md "TLS support"): with an ssl context the server offers NBD_OPT_STARTTLS on every portal that
serves an export with tls = "optional" or "require"; the protocol layer answers the option, and the
Connection upgrades its socket with loop.start_tls and goes on with the decrypted stream. Exports with
tls = "off" are served with or without TLS; "require" ones only inside it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from openvsan.block.errors import (
    BlockError,
    MediumError,
    NoSpace,
    OutOfRange,
    ReadOnly,
)
from openvsan.frontend.config import NbdExportConfig
from openvsan.frontend.handoff import Elsewhere
from openvsan.frontend.portals import BatchedConnection, PortalServer
from openvsan.netio import start_eagerly
from openvsan.protocol.nbd import (
    Close,
    Cmd,
    Disconnect,
    Errno,
    ExportInfo,
    NbdServerConnection,
    Negotiated,
    Request,
    Send,
    StartTls,
)
from openvsan.protocol.nbd.events import DEFAULT_MAX_PAYLOAD, Buffer, Event
from openvsan.protocol.nbd.transmission import allocation_extents

log = logging.getLogger("openvsan.nbd")

SUSPEND_TIMEOUT = 30.0                   # a connection moving with its volume: its requests must finish by then
HANDSHAKE_TIMEOUT = 30.0                 # a connection must reach the transmission phase within this time
MAX_INFLIGHT = 256                       # requests one connection may have running before we stop reading
MAX_INFLIGHT_BYTES = 128 * 1024 * 1024   # data (write payloads, read results) one connection may hold
ZERO_CHUNK = 1024 * 1024                 # NBD_CMD_FLAG_NO_HOLE writes real zeroes this much at a time
_ZEROES = bytes(ZERO_CHUNK)
# decrypted bytes a client may send in the one loop turn between its TLS handshake and our taking the new
# transport: a client is waiting for its first option reply then, so a few KiB is already generous
MAX_EARLY_TLS_DATA = 256 * 1024


def export_info(e: NbdExportConfig) -> ExportInfo:
    if e.volume is None:
        # another worker of this node serves it: listed and described here, handed over for NBD_OPT_GO (and
        # for NBD_OPT_INFO while its size is not known here: size -1)
        blocks, bs = e.geometry if e.geometry is not None else (-1, 512)
    else:
        blocks, bs = e.volume.num_blocks, e.volume.block_size
    # proto.md "Size constraints": the device's block is the smallest unit we can write without a
    # read-modify-write, so it is the minimum block size we ask clients to keep to
    return ExportInfo(e.name, blocks * bs if blocks >= 0 else -1, min_block=bs, preferred_block=max(4096, bs),
                      max_payload=DEFAULT_MAX_PAYLOAD, read_only=e.read_only, description=e.description,
                      elsewhere=e.elsewhere)


class TlsCredentialError(ValueError):
    """The server's TLS files do not load; `which` is the one at fault: "cert", "key" or "ca"."""

    def __init__(self, which: str, message: str) -> None:
        super().__init__(message)
        self.which = which


def _encrypted_key() -> bytes:
    # called by OpenSSL for a key with a passphrase: a server must not stop and prompt on its terminal
    raise TlsCredentialError("key", "is encrypted")


def _read_pem(which: str, path: Path, marker: str, what: str) -> None:
    try:
        text = path.read_bytes()
    except OSError as e:
        raise TlsCredentialError(which, f"cannot read {path}: {e.strerror}") from None
    if marker.encode() not in text:
        raise TlsCredentialError(which, f"{path} holds no PEM {what}")


def tls_context(cert: Path, key: Path, ca: Path | None = None, verify_client: bool = False) -> ssl.SSLContext:
    """The server side of NBD over TLS; TlsCredentialError names the file that does not load.

    proto.md "TLS versions": TLS 1.2 MUST be supported and older versions SHOULD NOT be by default. With a CA,
    a client certificate is checked when offered (verify_client: required)."""
    if verify_client and ca is None:
        raise TlsCredentialError("ca", "missing; verify_client = true needs the CA that signs client certificates")
    _read_pem("cert", cert, "-----BEGIN CERTIFICATE-----", "certificate")
    _read_pem("key", key, "PRIVATE KEY-----", "private key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key, password=_encrypted_key)
    except TlsCredentialError:
        raise TlsCredentialError("key", f"{key} is encrypted; give the server a key without a passphrase") from None
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise TlsCredentialError("key", f"{key} is not the private key of the certificate {cert}") from None
        raise TlsCredentialError("cert", f"{cert} (with the key {key}) does not load: {e.reason or e}") from None
    if ca is not None:
        _read_pem("ca", ca, "-----BEGIN CERTIFICATE-----", "CA certificate")
        try:
            ctx.load_verify_locations(cafile=ca)
        except ssl.SSLError as e:
            raise TlsCredentialError("ca", f"{ca} does not load: {e.reason or e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED if verify_client else ssl.CERT_OPTIONAL
    return ctx


def _subject(cert: dict[str, object]) -> str:
    # ssl's getpeercert(): subject is a tuple of RDNs, each a tuple of (name, value) pairs
    names = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C"}
    rdns = cert.get("subject", ())
    assert isinstance(rdns, tuple)
    return ",".join(f"{names.get(k, k)}={v}" for rdn in rdns for k, v in rdn)


def _tls_failure(e: BaseException) -> tuple[str, str]:
    """Why a TLS handshake failed: the kind (one phrase per cause, as rate-limited drops are counted) and detail."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return "TLS handshake failed: client certificate refused", e.verify_message
    if isinstance(e, ssl.SSLError):
        if e.reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return "TLS handshake failed: no client certificate", "verify_client requires one signed by the CA"
        return "TLS handshake failed", e.reason or str(e)
    if isinstance(e, TimeoutError):
        return "TLS handshake failed", "not finished in time"
    if isinstance(e, ConnectionError):
        return "TLS handshake failed", "the client closed the connection"
    return "TLS handshake failed", str(e) or type(e).__name__


class NbdServer(PortalServer):
    kind = "NBD"

    def __init__(self, exports: Sequence[NbdExportConfig], *, handshake_timeout: float = HANDSHAKE_TIMEOUT,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__()
        names = [e.name for e in exports]
        if len(set(names)) != len(names):
            raise ValueError(f"NBD export names must be unique: {names}")
        for e in exports:
            if e.tls not in ("off", "optional", "require"):
                raise ValueError(f"NBD export {e.name}: tls is {e.tls!r}; use off, optional or require")
            if e.tls != "off" and ssl_context is None:
                raise ValueError(f"NBD export {e.name}: tls = {e.tls!r} needs the server's TLS credentials")
        self.exports = {e.name: e for e in exports}
        self.handshake_timeout = handshake_timeout
        self.lane = True   # connections take the request lane once negotiated (False: tests compare the two)
        self.ssl_context = ssl_context
        self.tasks: set[asyncio.Task[None]] = set()
        # a worker of several that does not run TLS sessions: the one that does (it serves every NBD export)
        self.tls_worker: int | None = None

    def portals(self) -> list[tuple[str, int]]:
        seen: dict[tuple[str, int], None] = {}
        for e in self.exports.values():
            for host, port in e.portals:
                seen[(host, int(port))] = None
        return list(seen)

    def make_connection(self, portal: tuple[str, int]) -> Connection:
        return Connection(self, portal)

    def _here(self, portal: tuple[str, int]) -> list[NbdExportConfig]:
        return [e for e in self.exports.values() if portal in [(h, int(p)) for h, p in e.portals]]

    def portal_note(self, portal: tuple[str, int]) -> str:
        return ", ".join(e.name + {"off": "", "optional": ": TLS optional", "require": ": TLS required"}[e.tls]
                         for e in self._here(portal))

    # --- changes while serving (the node's data plane calls these) ------------------------------------
    async def add_export(self, e: NbdExportConfig) -> None:
        """Serve one more export; a new client sees it at once (NBD_OPT_LIST, GO), on a new portal too."""
        if e.name in self.exports:
            raise ValueError(f"NBD export {e.name} is already served")
        if e.tls != "off" and self.ssl_context is None:
            raise ValueError(f"NBD export {e.name}: tls = {e.tls!r} needs the server's TLS credentials")
        self.exports[e.name] = e
        try:
            await self.sync_portals()
        except OSError:
            del self.exports[e.name]
            raise

    async def remove_export(self, name: str) -> NbdExportConfig:
        """Stop serving an export: clients using it are disconnected (NBD has no way to tell them first)."""
        e = self.exports.pop(name)
        for c in list(self.connections):
            if isinstance(c, Connection) and c.export is e:
                c.close()
        await self.sync_portals()
        return e

    def before_drain(self) -> None:
        # requests still arriving get NBD_ESHUTDOWN while those in flight finish
        for c in list(self.connections):
            assert isinstance(c, Connection)
            c.conn.start_shutdown()

    def in_flight(self) -> list[asyncio.Future[None]]:
        return [*self.tasks, *(c.soon_idle() for c in self.connections if c.soon)]

    def exports_on(self, portal: tuple[str, int]) -> list[ExportInfo]:
        # made when a client connects, so a resized volume shows its new size to every new client
        return [export_info(e) for e in self._here(portal)]

    def tls_on(self, portal: tuple[str, int]) -> tuple[bool, frozenset[str]]:
        """Whether the portal offers NBD_OPT_STARTTLS, and its TLS-only exports."""
        here = self._here(portal)
        offered = self.ssl_context is not None and any(e.tls != "off" for e in here)
        return offered, frozenset(e.name for e in here if e.tls == "require")


# received bytes land here first (one buffer for every NBD connection of the process: buffer_updated copies
# them out at once), except the payload of a large write, received straight into its own buffer
RECEIVE_SIZE = 256 * 1024
_RECEIVE_VIEW = memoryview(bytearray(RECEIVE_SIZE))
DIRECT_PAYLOAD = 64 * 1024   # payload still to come from which a write's buffer is received into directly


class Connection(BatchedConnection, asyncio.BufferedProtocol):
    """One TCP connection: the handshake, then the transmission phase on one export."""

    def __init__(self, server: NbdServer, portal: tuple[str, int]) -> None:
        super().__init__()
        self.server = server
        self.portal = portal
        offered, tls_only = server.tls_on(portal)
        self.conn = NbdServerConnection(server.exports_on(portal), tls_offered=offered, tls_only=tls_only,
                                        tls_elsewhere=server.tls_worker, moving=server.moving)
        self.export: NbdExportConfig | None = None
        self.inflight = 0
        self.inflight_bytes = 0
        self._disconnecting = False
        self._write_paused = False
        self._reading_paused = False
        self._timer: asyncio.TimerHandle | None = None
        # requests parsed but not started: one received chunk can hold thousands of 28-byte requests, each
        # asking for up to 32 MiB, so the budget is kept per request, not per chunk
        self._waiting: deque[Request] = deque()
        self._starting = False
        self._upgrading: asyncio.Task[None] | None = None   # the TLS handshake after NBD_OPT_STARTTLS
        self._early: list[bytes] | None = None              # decrypted data that came before start_tls returned
        self._lane = False                                  # negotiated: received() takes the request lane
        self._into_payload = False                          # get_buffer gave the transport a payload's buffer
        # write windows open on the export's volume (_open_window): one for the payload being received, and
        # for a moment two (a receive that ends one payload can start the next before the first is answered)
        self._windows = 0
        self._expired = False
        self._lost = False
        self._suspended = False   # moving to another worker with its volume (suspend()): reading stays paused

    # --- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # TCP_NODELAY: proto.md "Protocol phases" asks both ends for it
        if self._closed:
            return  # refused: over a connection limit (frontend/limits.py)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.server.connections.add(self)
        if self.server.closing:
            self.conn.start_shutdown()
        if self._resume is not None:
            state, self._resume = self._resume, None
            self._resume_from(state)
            self.replay()
            return
        self._timer = asyncio.get_running_loop().call_later(self.server.handshake_timeout, self._handshake_expired)
        self.send([self.conn.greeting()])
        self.replay()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return  # after a failed TLS handshake, _upgrade reports it and the SSL layer may report it again
        self._lost = True
        super().connection_lost(exc)  # closed, and its place in the connection limits given back
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        while self._windows:
            # a write's payload was being received into the device: part of it is there, unacknowledged
            self._windows -= 1
            assert self.export is not None
            vol = self.export.volume
            assert vol is not None   # a window is only open on a volume this worker has
            vol.close_window()
        # requests still running finish on the device (a write may be half done); their replies are dropped

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    def received(self, data: bytes) -> None:
        if self._early is not None:
            self._early_data(data)
            return
        rest: Buffer = data
        if self._lane:
            # reads and whole writes at the front skip the protocol's event loop (protocol/nbd lane())
            reqs, rest = self.conn.lane(data)
            for req in reqs:
                if self._closed:
                    return
                self._start(req)
            if not len(rest) or self._closed:
                return
        self._events(self.conn.receive_data(rest))

    # --- receiving a large write's payload straight into its buffer (asyncio.BufferedProtocol) -------------
    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the transport receives next: the rest of a large write's payload when one is being read (no
        copy of it here), else the receive buffer every NBD connection of this process shares (received
        bytes are copied out of it in buffer_updated, before any other connection can receive)."""
        if self._lane and not self.conn.tls and not self._replay:
            window = self.conn.payload_window(DIRECT_PAYLOAD)
            if window is not None:
                self._into_payload = True
                return window
        self._into_payload = False
        return _RECEIVE_VIEW

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_payload:
            self._into_payload = False
            self.answer_at_once(self._payload_arrived, nbytes)
        else:
            self.data_received(bytes(_RECEIVE_VIEW[:nbytes]))   # bytes: requests keep views of what came

    def _payload_arrived(self, nbytes: int) -> None:
        self._events(self.conn.payload_filled(nbytes))

    def _events(self, events: list[Event]) -> None:
        for event in events:
            if self._closed:
                return
            if isinstance(event, Request):   # first: what comes most
                self._start(event)
            elif isinstance(event, StartTls):
                self._start_tls()
            elif isinstance(event, Send):
                self.send(event.data)
            elif isinstance(event, Negotiated):
                self._negotiated(event)
            elif isinstance(event, Disconnect):
                self._disconnecting = True
                self._update_reading()
                self._maybe_finish()
            elif isinstance(event, Close):
                self.dropped("protocol error", event.reason)
                self.close()
            elif isinstance(event, Elsewhere):
                # the last event: the answers to the options before it have been sent (they are in the record)
                if self.record is not None:
                    self.hand_off(event)
                else:
                    self.dropped("asked for an export another worker serves, too late to hand it over", str(event))
                    self.close()

    # --- sending ----------------------------------------------------------------------------------
    def send(self, data: list[Buffer]) -> None:
        self.send_buffers(data)

    def _update_reading(self) -> None:
        if self._closed or self.transport is None:
            return
        pause = (self._write_paused or self._disconnecting or bool(self._waiting) or self._over_budget()
                 or self._suspended)
        if pause and not self._reading_paused:
            self.transport.pause_reading()
        elif not pause and self._reading_paused:
            self.transport.resume_reading()
        self._reading_paused = pause

    def _over_budget(self) -> bool:
        return self.inflight >= MAX_INFLIGHT or self.inflight_bytes >= MAX_INFLIGHT_BYTES

    def _maybe_finish(self) -> None:
        if self._disconnecting and not self.inflight and not self._waiting:
            self.close()

    # --- moving to another worker with the volume (node/workers.py move) -------------------------------
    async def suspend(self) -> tuple[dict[str, Any], bytes] | None:
        """Stop reading, let the requests received finish and their replies leave, then cut the input where
        it stands (NbdServerConnection.suspend): the transmission phase's state is the negotiated session,
        which the other worker takes up as it is. A connection in TLS, still negotiating or ending cannot move."""
        s = self.conn.session
        if (s is None or s.tls or self._closed or self._disconnecting or self._suspended or self.transport is None
                or self.export is None):
            return None
        self._suspended = True
        self._update_reading()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SUSPEND_TIMEOUT
        while self.inflight or self._waiting:
            if self._closed or loop.time() > deadline:
                self._resume_reading()
                return None
            await asyncio.sleep(0.001)
        if self._closed:
            return None
        received = self.conn.suspend()
        while self._windows:       # the payload being received into the device: copied into `received`
            self._windows -= 1
            vol = self.export.volume
            assert vol is not None   # a window is only open on a volume this worker has
            vol.close_window()
        if not await self.drained(SUSPEND_TIMEOUT):
            self.resume_here(self._state(s), received)
            return None
        return self._state(s), received

    def detach_for_move(self) -> None:
        self.server.connections.discard(self)

    def reattach(self) -> None:
        self.server.connections.add(self)

    @staticmethod
    def _state(s: Negotiated) -> dict[str, Any]:
        return {"export": s.export.name, "structured": s.structured, "flags": s.flags, "meta": s.meta_context_id}

    def resume_here(self, state: dict[str, Any], received: bytes) -> None:
        self._resume_from(state)
        if not self._closed and received:
            self.data_received(received)

    def _resume_reading(self) -> None:
        self._suspended = False
        self._update_reading()

    def _resume_from(self, state: dict[str, Any]) -> None:
        """Go on in the transmission phase of the session suspend() described."""
        name = str(state.get("export"))
        e = self.server.exports.get(name)
        if e is None or e.volume is None:
            self.moved_on(e.elsewhere if e is not None else None, self.server.exchange, state,
                          "moved here for an export this worker does not serve", name)
            return
        info = export_info(e)
        session = Negotiated(info, bool(state.get("structured")), int(state.get("flags") or 0),
                             state.get("meta"), False)
        self.conn = NbdServerConnection.resumed(session)
        self._suspended = False
        self._negotiated(session, moved=True)
        self._update_reading()

    # --- TLS ---------------------------------------------------------------------------------------
    def _start_tls(self) -> None:
        assert self.transport is not None and self.server.ssl_context is not None
        self.settle()                    # a TLS session cannot be handed to another worker
        self._batch.flush()              # the ACK leaves in clear text, before the first TLS record
        self.transport.pause_reading()   # the client's ClientHello waits in the kernel for the TLS layer
        self._early = []
        self._upgrading = asyncio.get_running_loop().create_task(self._upgrade(self.transport))

    def _early_data(self, data: bytes) -> None:
        # asyncio's SSLProtocol can hand over decrypted data before start_tls() returns the new transport
        assert self._early is not None
        self._early.append(data)
        if sum(map(len, self._early)) > MAX_EARLY_TLS_DATA:
            self.dropped("too much data before the TLS session was set up", f"more than {MAX_EARLY_TLS_DATA} bytes")
            self.close()

    async def _upgrade(self, raw: asyncio.Transport) -> None:
        ctx = self.server.ssl_context
        assert ctx is not None
        try:
            tls = await asyncio.get_running_loop().start_tls(raw, self, ctx, server_side=True,
                                                             ssl_handshake_timeout=self.server.handshake_timeout)
        except (OSError, RuntimeError) as e:  # ssl.SSLError, timeouts, resets; RuntimeError: a transport closing
            if not self._expired and not self.server.closing:   # not when we closed it ourselves
                self.dropped(*_tls_failure(e))
            self._closed = True
            raw.close()
            # the SSL layer tells the protocol of a connection lost mid-handshake only when the handshake itself
            # failed, not when the peer (or our timer) closed it first: say it here, so its place in the limits
            # is given back
            self.connection_lost(e)
            return
        finally:
            self._upgrading = None
        if tls is None or self._closed:
            # closed during the handshake: asyncio returns no transport, uvloop a closed one, and neither tells
            # the protocol
            if tls is not None:
                tls.close()
            self.connection_lost(None)
            return
        self.transport = tls
        self._batch.transport = self.transport
        sslobj = tls.get_extra_info("ssl_object")
        peercert = tls.get_extra_info("peercert")
        cipher = sslobj.cipher() if sslobj is not None else None
        log.info("%s: NBD TLS %s, %s%s", self.peer, sslobj.version() if sslobj is not None else "?",
                 cipher[0] if cipher else "?",
                 f", client certificate {_subject(peercert)}" if peercert else ", no client certificate")
        self.conn.tls_started()
        early, self._early = self._early or [], None
        for data in early:
            if self._closed:
                break
            self.answer_at_once(self.received, data)

    # --- handshake --------------------------------------------------------------------------------
    def _handshake_expired(self) -> None:
        if self.conn.session is None and not self._closed:
            self._expired = True
            self.dropped(f"handshake not finished in {self.server.handshake_timeout:.0f} s")
            self.close()

    def _negotiated(self, ev: Negotiated, moved: bool = False) -> None:
        live = self.server.exports.get(ev.export.name)
        if live is None or live.volume is None:
            # the export moved to another worker (or went) since this connection listed the exports it
            # negotiates with (exports_on, made when it connected): on to where it is now, if it still can go
            if live is not None and live.elsewhere is not None and self.record is not None:
                self.hand_off(Elsewhere(live.elsewhere, f"NBD export {ev.export.name}"))
            else:
                self.dropped("NBD export is no longer served here", ev.export.name)
                self.close()
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.export = live
        self.logged_in()
        self.settle()
        self._lane = self.server.lane
        if self._lane and not ev.tls:
            # a large write's payload is received straight into the device where it lends its memory (RAM)
            self.conn.window = self._open_window
        log.info("%s: NBD export %s (%d bytes%s%s%s)%s", self.peer, ev.export.name, ev.export.size,
                 ", read-only" if ev.export.read_only else "", ", structured replies" if ev.structured else "",
                 ", TLS" if ev.tls else "", ": moved here with its volume" if moved else "")

    # --- requests ---------------------------------------------------------------------------------
    def _open_window(self, offset: int, length: int) -> memoryview | None:
        """NbdServerConnection.window: the volume's memory for an admitted write's payload (Volume.open_window),
        or None. Open until the write's Request arrives (_start) or the connection is lost."""
        assert self.export is not None
        if self._waiting:
            return None      # requests before it wait to start (over the budget): none may see its data early
        vol = self.export.volume
        assert vol is not None   # a connection in transmission serves a volume this worker has
        bs = vol.block_size
        view = vol.open_window(offset // bs, length // bs)
        if view is not None:
            self._windows += 1
        return view

    def _start(self, req: Request) -> None:
        if req.in_place:
            # its payload was received into the device (_open_window): the write is done and durable as a
            # SyncWrite's (block/device.py WriteWindow), so it is answered now, whatever waits before it (NBD
            # requests in flight together have no order)
            assert self._windows and self.export is not None
            self._windows -= 1
            vol = self.export.volume
            assert vol is not None   # a window is only open on a volume this worker has
            vol.close_window()
            self.send(self.conn.reply(req))
            return
        if self._waiting or self._over_budget():
            self._waiting.append(req)
            self._update_reading()
            return
        self._run_now(req)

    def _start_waiting(self) -> None:
        if self._starting:
            return  # a request that completed at once, inside the loop below: the loop goes on
        self._starting = True
        try:
            while self._waiting and not self._over_budget() and not self._closed:
                self._run_now(self._waiting.popleft())
        finally:
            self._starting = False

    def _run_now(self, req: Request) -> None:
        if self.server.closing:
            # proto.md "Terminating the transmission phase": requests after shutdown began: NBD_ESHUTDOWN
            self.send(self.conn.reply_error(req, Errno.ESHUTDOWN, "the server is shutting down"))
            return
        if self._done_now(req):
            return
        size = req.length if req.cmd in (Cmd.READ, Cmd.WRITE) else 0
        self.inflight += 1
        self.inflight_bytes += size
        if self._soon(req, size):
            self._update_reading()
            return
        # a device that answers at once (RAM) completes the request here, with no Task (netio.start_eagerly)
        task = start_eagerly(self._execute(req, size))
        if task is not None:
            self.server.tasks.add(task)
            task.add_done_callback(self.server.tasks.discard)
        self._update_reading()

    def _done_now(self, req: Request) -> bool:
        """A read or write done at once by a device that can (Volume.read_now / write_now) and answered
        here; False: nothing was done, the request runs the normal way. Every request here was admitted
        by the protocol layer (protocol/nbd/transmission.py admit: within the export, aligned to its
        minimum block, the volume's block: export_info), as those _run gets were. A SyncWrite write is
        durable on return, so FUA needs nothing more."""
        assert self.export is not None
        vol = self.export.volume
        assert vol is not None   # a connection in transmission serves a volume this worker has
        bs = vol.block_size
        if not req.length:
            return False
        if req.cmd == Cmd.READ:
            data = vol.read_now(req.offset // bs, req.length // bs)
            if data is None:
                return False
            self.send(self.conn.reply(req, data))
            if not isinstance(data, bytes):
                self._batch.flush()  # a lent view leaves before a later request of this read can write there
            return True
        if req.cmd == Cmd.WRITE and req.payload is not None:
            if not vol.write_now(req.offset // bs, req.payload):
                return False
            self.send(self.conn.reply(req))
            return True
        return False

    def _soon(self, req: Request, size: int) -> bool:
        """A write started on a device whose write waits on others (Volume.write_soon: a replicated volume),
        with no Task; _written_soon answers it as _execute would. False: nothing was done."""
        if req.cmd != Cmd.WRITE or not req.length or req.payload is None:
            return False
        assert self.export is not None
        vol = self.export.volume
        assert vol is not None
        self.soon_started(0)
        if vol.write_soon(req.offset // vol.block_size, req.payload, req.fua,
                          functools.partial(self._written_soon, req, size)):
            return True
        self.soon_ended(0)
        return False

    def _written_soon(self, req: Request, size: int, e: BaseException | None) -> None:
        self._finished(size, self.conn.reply(req) if e is None else self._failure(req, e))
        self.soon_ended(0)

    async def _execute(self, req: Request, size: int) -> None:
        try:
            out = await self._run(req)
        except Exception as e:  # noqa: BLE001 - one failing request must not take the connection down
            out = self._failure(req, e)
        except BaseException:
            self.inflight -= 1
            self.inflight_bytes -= size
            raise
        self._finished(size, out)

    def _failure(self, req: Request, e: BaseException) -> list[Buffer]:
        """The error reply for a request that failed with `e`."""
        if isinstance(e, BlockError):
            errno, offset = _errno(req, e, self.export)
            return self.conn.reply_error(req, errno, f"{_cmd_name(req.cmd)}: {e}", offset)
        log.error("%s: %s at offset %d failed", self.peer, _cmd_name(req.cmd), req.offset, exc_info=e)
        return self.conn.reply_error(req, Errno.EIO, f"{_cmd_name(req.cmd)}: internal error: {e}")

    def _finished(self, size: int, out: list[Buffer]) -> None:
        self.inflight -= 1
        self.inflight_bytes -= size
        self.send(out)
        self._start_waiting()
        self._update_reading()
        self._maybe_finish()

    async def _run(self, req: Request) -> list[Buffer]:
        assert self.export is not None
        dev = self.export.volume
        assert dev is not None   # a connection serves an export this worker has the volume of
        bs = dev.block_size
        lba, blocks = req.offset // bs, req.length // bs
        cmd = req.cmd
        if cmd == Cmd.READ:
            data = await dev.read(lba, blocks) if blocks else b""
            return self.conn.reply(req, data)
        if cmd == Cmd.WRITE:
            assert req.payload is not None
            if blocks:
                await dev.write(lba, req.payload, fua=req.fua)
            elif req.fua:
                await dev.flush()
        elif cmd == Cmd.FLUSH:
            await dev.flush()
        elif cmd == Cmd.TRIM:
            if blocks:
                await dev.unmap(lba, blocks)
            if req.fua:
                await dev.flush()
        elif cmd == Cmd.WRITE_ZEROES:
            if req.no_hole:
                # proto.md NBD_CMD_FLAG_NO_HOLE: the range must end up provisioned, so write real zeroes
                # (write_zeroes may punch a hole)
                step = ZERO_CHUNK // bs
                for at in range(lba, lba + blocks, step):
                    n = min(step, lba + blocks - at)
                    await dev.write(at, memoryview(_ZEROES)[:n * bs])
            elif blocks:
                await dev.write_zeroes(lba, blocks)
            if req.fua:
                await dev.flush()
        elif cmd == Cmd.BLOCK_STATUS:
            # base:allocation. A stack that knows its map (capabilities.extents: a logical volume) answers
            # from it, so holes show (nbdinfo --map, qemu-img map); any other reports every block allocated
            # with unknown contents (status 0), which proto.md allows ("a server MAY always safely report a
            # status of 0 for any block"). admit refused a length of 0 at the end of the export the client
            # was given, and any range beyond it
            assert self.conn.session is not None
            n = req.length or min(self.conn.session.export.size - req.offset, 4096)
            if not dev.capabilities.extents:
                return self.conn.reply_block_status(req, [(n, 0)])
            first = req.offset // bs
            runs = cast("list[tuple[int, int, int]]", await dev.lba_status(first, -(-(req.offset + n) // bs) - first))
            return self.conn.reply_block_status(req, allocation_extents(
                req.offset, n, bs, runs, reads_zero=dev.capabilities.unmap_reads_zero, req_one=req.req_one))
        # NBD_CMD_CACHE: a hint; every read already goes to the device, so there is nothing to warm
        return self.conn.reply(req)


def _cmd_name(cmd: int) -> str:
    try:
        return f"NBD_CMD_{Cmd(cmd).name}"
    except ValueError:
        return f"command {cmd}"


def _errno(req: Request, e: BlockError, export: NbdExportConfig | None) -> tuple[Errno, int | None]:
    """Block errors to proto.md "Error values" (one place, as the SCSI layer does for sense data)."""
    if isinstance(e, ReadOnly):
        return Errno.EPERM, None
    if isinstance(e, NoSpace):
        return Errno.ENOSPC, None
    if isinstance(e, OutOfRange):
        return (Errno.ENOSPC if req.cmd in (Cmd.WRITE, Cmd.WRITE_ZEROES) else Errno.EINVAL), None
    if isinstance(e, MediumError) and e.lba is not None and export is not None and export.volume is not None:
        # NBD_REPLY_TYPE_ERROR_OFFSET: the offset MUST lie within the request
        offset = e.lba * export.volume.block_size
        if req.offset <= offset < req.offset + req.length:
            return Errno.EIO, offset
    # MediumError, DeviceFailed, Busy (NBD has no "try again") and anything newer
    return Errno.EIO, None
