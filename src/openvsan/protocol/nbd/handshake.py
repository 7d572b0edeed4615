"""Fixed newstyle option haggling (proto.md "Handshake", "Option types", "Option reply types").

`Handshake.option()` answers one option with the bytes of its replies and, for NBD_OPT_GO and
NBD_OPT_EXPORT_NAME, the export the transmission phase will use. It never sees a socket.

TLS (proto.md "TLS support"): a server that offers TLS acknowledges NBD_OPT_STARTTLS and the driver upgrades
the socket. With every export TLS-only the connection is in FORCEDTLS mode (every option but STARTTLS and
ABORT: NBD_REP_ERR_TLS_REQD); otherwise SELECTIVETLS (TLS-only exports are left out of NBD_OPT_LIST and
refused by NBD_OPT_INFO/GO with NBD_REP_ERR_TLS_REQD until TLS runs). A client without fixed newstyle gets
NOTLS mode, and TLS-only exports stay closed to it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from openvsan.protocol.nbd.events import Buffer, ExportInfo, Negotiated
from openvsan.protocol.nbd.wire import (
    BASE_ALLOCATION,
    EXPORT_NAME_REPLY,
    EXPORT_NAME_ZEROES,
    GREETING,
    IHAVEOPT,
    INFO_BLOCK_SIZE,
    INFO_EXPORT,
    MAX_STRING,
    NBDMAGIC,
    OPTION_REPLY,
    OPTION_REPLY_MAGIC,
    U16,
    U32,
    ClientFlag,
    HandshakeFlag,
    Info,
    Opt,
    Rep,
)
from openvsan.protocol.routing import Elsewhere

SERVER_FLAGS = HandshakeFlag.FIXED_NEWSTYLE | HandshakeFlag.NO_ZEROES
BASE_ALLOCATION_ID = 1  # our id for base:allocation (proto.md: opaque to the client, fixed here)


class BadString(ValueError):
    pass


def decode_string(raw: Buffer) -> str:
    """proto.md "Conventions": UTF-8, no NUL, at most 4096 bytes."""
    if len(raw) > MAX_STRING:
        raise BadString(f"a string of {len(raw)} bytes is longer than {MAX_STRING}")
    try:
        s = bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise BadString("not UTF-8") from None
    if "\0" in s:
        raise BadString("contains NUL")
    return s


def option_reply(opt: int, rep: int, data: bytes = b"") -> bytes:
    # proto.md "Fixed newstyle negotiation": magic, option, reply type, length, data
    return OPTION_REPLY.pack(OPTION_REPLY_MAGIC, opt & 0xFFFFFFFF, rep, len(data)) + data


def error_reply(opt: int, rep: Rep, message: str) -> bytes:
    # proto.md "Option reply types": an error MAY carry a message for the user
    return option_reply(opt, rep, message.encode()[:MAX_STRING])


class TlsMode(Enum):
    """proto.md "Server-side requirements": the mode of one connection, fixed for its lifetime."""

    NOTLS = "NOTLS"
    FORCEDTLS = "FORCEDTLS"
    SELECTIVETLS = "SELECTIVETLS"


@dataclass
class OptionResult:
    out: list[bytes] = field(default_factory=list)
    negotiated: Negotiated | None = None   # NBD_OPT_GO succeeded / NBD_OPT_EXPORT_NAME: transmission begins
    close: str | None = None               # hard disconnect, with why
    abort: bool = False                    # NBD_OPT_ABORT: soft disconnect after the reply
    start_tls: bool = False                # NBD_OPT_STARTTLS acknowledged: the TLS handshake comes next


class Handshake:
    def __init__(self, exports: Sequence[ExportInfo], default: str | None = None, *, tls_offered: bool = False,
                 tls_only: Collection[str] = (), tls_elsewhere: int | None = None,
                 moving: Mapping[str, int] | None = None) -> None:
        self.exports = {e.name: e for e in exports}
        # exports moving to another worker of this node right now (node/workers.py move), by name: the worker
        # that serves them next; a client that asks to use one goes there (the server's dict, kept current)
        self.moving: Mapping[str, int] = moving if moving is not None else {}
        self.tls_offered = tls_offered         # the server can run NBD_OPT_STARTTLS (it has credentials)
        # TLS sessions are run by that worker process of this node (it serves every NBD export then):
        # NBD_OPT_STARTTLS hands the connection over before it is acknowledged
        self.tls_elsewhere = tls_elsewhere
        self.tls_only = frozenset(tls_only)    # exports served only inside TLS
        if self.tls_only - set(self.exports):
            raise ValueError(f"TLS-only exports that are not exports: {sorted(self.tls_only - set(self.exports))}")
        if self.tls_only and not tls_offered:
            raise ValueError("TLS-only exports need a server that offers TLS")
        self.tls = False                       # TLS has been initiated on this connection
        # proto.md NBD_OPT_EXPORT_NAME: the empty name is the "default" export; ours is the first one
        self.default = default if default is not None else (exports[0].name if exports else None)
        self.fixed = False
        self.no_zeroes = False
        self.structured = False
        self.shutting_down = False
        self.meta_export: str | None = None    # the export base:allocation was selected for

    def greeting(self) -> bytes:
        # proto.md "Newstyle negotiation": S: NBDMAGIC, IHAVEOPT, handshake flags
        return GREETING.pack(NBDMAGIC, IHAVEOPT, SERVER_FLAGS)

    def client_flags(self, flags: int) -> str | None:
        """proto.md "Client flags": unknown or unoffered flags: the server MUST drop the connection."""
        if flags & ~int(ClientFlag.FIXED_NEWSTYLE | ClientFlag.NO_ZEROES):
            return f"unknown client flags 0x{flags:08x}"
        self.fixed = bool(flags & ClientFlag.FIXED_NEWSTYLE)
        self.no_zeroes = bool(flags & ClientFlag.NO_ZEROES)
        return None

    @property
    def mode(self) -> TlsMode:
        # proto.md: NOTLS unless both ends agreed fixed newstyle; FORCEDTLS where every export is TLS-only
        if not self.tls_offered or not self.fixed:
            return TlsMode.NOTLS
        if self.exports and self.tls_only >= set(self.exports):
            return TlsMode.FORCEDTLS
        return TlsMode.SELECTIVETLS

    def needs_tls(self, export: ExportInfo) -> bool:
        """The export is TLS-only and TLS has not been initiated."""
        return not self.tls and export.name in self.tls_only

    def tls_started(self) -> None:
        """The TLS handshake succeeded. proto.md NBD_OPT_STARTTLS: the server MUST NOT preserve any
        negotiation state (structured replies, meta contexts) from before it."""
        self.tls = True
        self.structured = False
        self.meta_export = None

    def lookup(self, name: str, *, serve: bool = False) -> ExportInfo | None:
        """The export a name means. Elsewhere (protocol/routing.py) when another worker of this node serves
        it and the client asks to use it (`serve`: NBD_OPT_GO, NBD_OPT_EXPORT_NAME), or asks about it and its
        size is not known here (size < 0): the connection is handed over before anything is answered."""
        key = self.default if name == "" and self.default is not None else name
        if serve and key in self.moving:    # even if it is not listed here at this instant of the move
            raise Elsewhere(self.moving[key], f"NBD export {key}")
        found = self.exports.get(key)
        if found is not None and found.elsewhere is not None and (serve or found.size < 0):
            raise Elsewhere(found.elsewhere, f"NBD export {found.name}")
        return found

    def option(self, opt: int, data: memoryview) -> OptionResult:
        r = OptionResult()
        forced = self.mode is TlsMode.FORCEDTLS and not self.tls
        if opt == Opt.EXPORT_NAME:
            if forced:
                # proto.md "FORCEDTLS mode": NBD_OPT_EXPORT_NAME cannot error, so the server MUST terminate
                r.close = "NBD_OPT_EXPORT_NAME before NBD_OPT_STARTTLS: every export here requires TLS"
            else:
                self._export_name(data, r)
        elif opt == Opt.ABORT:
            # proto.md NBD_OPT_ABORT: the server MUST reply with NBD_REP_ACK (any data is ignored)
            r.out.append(option_reply(opt, Rep.ACK))
            r.abort = True
        elif forced and opt != Opt.STARTTLS:
            # proto.md "FORCEDTLS mode": any other option, NBD_OPT_INFO and unsupported ones included
            r.out.append(error_reply(opt, Rep.ERR_TLS_REQD, "this server requires TLS: send NBD_OPT_STARTTLS"))
        elif self.shutting_down:
            # proto.md "Termination of the session during option haggling"
            r.out.append(error_reply(opt, Rep.ERR_SHUTDOWN, "the server is shutting down"))
        elif opt == Opt.LIST:
            self._list(opt, data, r)
        elif opt in (Opt.INFO, Opt.GO):
            self._info(opt, data, r)
        elif opt == Opt.STRUCTURED_REPLY:
            if len(data):
                # proto.md NBD_OPT_STRUCTURED_REPLY: no data; SHOULD reject it with NBD_REP_ERR_INVALID
                r.out.append(error_reply(opt, Rep.ERR_INVALID, "NBD_OPT_STRUCTURED_REPLY takes no data"))
            else:
                self.structured = True
                r.out.append(option_reply(opt, Rep.ACK))
        elif opt in (Opt.LIST_META_CONTEXT, Opt.SET_META_CONTEXT):
            self._meta_context(opt, data, r)
        elif opt == Opt.STARTTLS:
            self._starttls(opt, data, r)
        else:
            # proto.md "Baseline": options we do not implement get NBD_REP_ERR_UNSUP
            r.out.append(error_reply(opt, Rep.ERR_UNSUP, f"option {opt} is not supported"))
        return r

    # --- options ---------------------------------------------------------------------------------
    def _starttls(self, opt: int, data: memoryview, r: OptionResult) -> None:
        if self.mode is TlsMode.NOTLS:
            # proto.md "NOTLS mode": NBD_REP_ERR_POLICY or NBD_REP_ERR_UNSUP, never NBD_REP_ERR_TLS_REQD
            why = "this server does not offer TLS" if not self.tls_offered else "TLS needs fixed newstyle negotiation"
            r.out.append(error_reply(opt, Rep.ERR_POLICY, why))
        elif self.tls:
            # proto.md "FORCEDTLS mode" / "SELECTIVETLS mode": STARTTLS inside TLS MUST get NBD_REP_ERR_INVALID
            r.out.append(error_reply(opt, Rep.ERR_INVALID, "TLS is already running on this connection"))
        elif len(data):
            # proto.md NBD_OPT_STARTTLS: the client MUST NOT send data with it (e.g. NBD_REP_ERR_INVALID)
            r.out.append(error_reply(opt, Rep.ERR_INVALID, "NBD_OPT_STARTTLS takes no data"))
        else:
            if self.tls_elsewhere is not None:
                raise Elsewhere(self.tls_elsewhere, "NBD over TLS")
            r.out.append(option_reply(opt, Rep.ACK))
            r.start_tls = True

    def _export_name(self, data: memoryview, r: OptionResult) -> None:
        # proto.md NBD_OPT_EXPORT_NAME: no way to report an error, so a bad or unknown name ends the session
        try:
            name = decode_string(data)
        except BadString as e:
            r.close = f"NBD_OPT_EXPORT_NAME: bad export name ({e})"
            return
        export = self.lookup(name, serve=True)
        if export is None or self.shutting_down:
            r.close = f"NBD_OPT_EXPORT_NAME: no export named {name!r}" if export is None else "shutting down"
            return
        if self.needs_tls(export):
            # proto.md "SELECTIVETLS mode": a TLS-only export before TLS: the server MUST terminate the session
            r.close = f"NBD_OPT_EXPORT_NAME: export {export.name!r} requires TLS (NBD_OPT_STARTTLS first)"
            return
        flags = export.transmission_flags(self.structured)
        reply = EXPORT_NAME_REPLY.pack(export.size, flags)
        r.out.append(reply if self.no_zeroes else reply + EXPORT_NAME_ZEROES)
        r.negotiated = Negotiated(export, self.structured, flags, self._meta_id(export), self.tls)

    def _list(self, opt: int, data: memoryview, r: OptionResult) -> None:
        if len(data):
            # proto.md NBD_OPT_LIST: no data; SHOULD reject it with NBD_REP_ERR_INVALID
            r.out.append(error_reply(opt, Rep.ERR_INVALID, "NBD_OPT_LIST takes no data"))
            return
        for e in self.exports.values():
            if self.needs_tls(e):
                continue  # proto.md "SELECTIVETLS mode": MAY omit TLS-only exports from NBD_OPT_LIST
            # proto.md NBD_REP_SERVER: name length, name, then a description for people
            name = e.name.encode()
            r.out.append(option_reply(opt, Rep.SERVER, U32.pack(len(name)) + name + e.description.encode()))
        r.out.append(option_reply(opt, Rep.ACK))

    def _info(self, opt: int, data: memoryview, r: OptionResult) -> None:
        # proto.md NBD_OPT_INFO / NBD_OPT_GO: u32 name length, name, u16 n, n x u16 information requests
        if len(data) < 6:
            r.out.append(error_reply(opt, Rep.ERR_INVALID, "option data shorter than 6 bytes"))
            return
        (nlen,) = U32.unpack_from(data, 0)
        if nlen > len(data) - 6:
            r.out.append(error_reply(opt, Rep.ERR_INVALID, "export name length runs past the option data"))
            return
        (n,) = U16.unpack_from(data, 4 + nlen)
        if len(data) != 6 + nlen + 2 * n:
            r.out.append(error_reply(opt, Rep.ERR_INVALID, "information request count does not match the data"))
            return
        try:
            name = decode_string(data[4:4 + nlen])
        except BadString as e:
            r.out.append(error_reply(opt, Rep.ERR_INVALID, f"bad export name: {e}"))
            return
        wanted = {U16.unpack_from(data, 6 + nlen + 2 * i)[0] for i in range(n)}
        export = self.lookup(name, serve=opt == Opt.GO)
        if export is None:
            r.out.append(error_reply(opt, Rep.ERR_UNKNOWN, f"no export named {name!r}"))
            return
        if self.needs_tls(export):
            r.out.append(self._tls_refusal(opt, export))
            return
        flags = export.transmission_flags(self.structured)
        info = [INFO_EXPORT.pack(Info.EXPORT, export.size, flags),
                # sent whether asked or not: the client learns the alignment it must keep (proto.md "Size
                # constraints": the server MUST send it if asked and its constraints are not the defaults)
                INFO_BLOCK_SIZE.pack(Info.BLOCK_SIZE, export.min_block, export.preferred_block, export.max_payload)]
        if Info.NAME in wanted or name != export.name:
            info.append(U16.pack(Info.NAME) + export.name.encode())
        if Info.DESCRIPTION in wanted and export.description:
            info.append(U16.pack(Info.DESCRIPTION) + export.description.encode()[:MAX_STRING])
        r.out.extend(option_reply(opt, Rep.INFO, i) for i in info)
        r.out.append(option_reply(opt, Rep.ACK))
        if opt == Opt.GO:
            r.negotiated = Negotiated(export, self.structured, flags, self._meta_id(export), self.tls)

    def _tls_refusal(self, opt: int, export: ExportInfo) -> bytes:
        if self.mode is TlsMode.NOTLS:
            # proto.md "NOTLS mode": the server MUST NOT answer NBD_REP_ERR_TLS_REQD (no fixed newstyle here)
            return error_reply(opt, Rep.ERR_POLICY, f"export {export.name!r} requires TLS")
        # proto.md "SELECTIVETLS mode": NBD_OPT_INFO/GO on a TLS-only export MUST get NBD_REP_ERR_TLS_REQD
        return error_reply(opt, Rep.ERR_TLS_REQD, f"export {export.name!r} requires TLS: send NBD_OPT_STARTTLS")

    def _meta_id(self, export: ExportInfo) -> int | None:
        # proto.md NBD_OPT_SET_META_CONTEXT: contexts hold only for the export they were selected on
        return BASE_ALLOCATION_ID if self.meta_export is not None and self.lookup(self.meta_export) is export \
            else None

    def _meta_context(self, opt: int, data: memoryview, r: OptionResult) -> None:
        setting = opt == Opt.SET_META_CONTEXT
        if setting:
            self.meta_export = None  # replaced even when the option fails
        if not self.structured:
            # proto.md: MUST NOT (SET) / SHOULD NOT (LIST) be sent before structured replies
            r.out.append(error_reply(opt, Rep.ERR_INVALID, "negotiate NBD_OPT_STRUCTURED_REPLY first"))
            return
        # data: u32 name length, name, u32 query count, queries (u32 length, string)
        try:
            pos = 0

            def string() -> str:
                nonlocal pos
                if pos + 4 > len(data):
                    raise BadString("truncated")
                (length,) = U32.unpack_from(data, pos)
                if pos + 4 + length > len(data):
                    raise BadString("a length runs past the option data")
                s = decode_string(data[pos + 4:pos + 4 + length])
                pos += 4 + length
                return s

            name = string()
            if pos + 4 > len(data):
                raise BadString("truncated")
            (count,) = U32.unpack_from(data, pos)
            pos += 4
            if count > (len(data) - pos) // 4:
                raise BadString("more queries than the data holds")
            queries = [string() for _ in range(count)]
            if pos != len(data):
                raise BadString("trailing bytes")
        except BadString as e:
            # proto.md: a syntactically invalid request MUST fail with NBD_REP_ERR_INVALID
            r.out.append(error_reply(opt, Rep.ERR_INVALID, f"bad meta context request: {e}"))
            return
        export = self.lookup(name)
        if export is None:
            r.out.append(error_reply(opt, Rep.ERR_UNKNOWN, f"no export named {name!r}"))
            return
        if self.needs_tls(export):
            # proto.md "SELECTIVETLS mode": NBD_REP_ERR_TLS_REQD is only for INFO, GO and EXPORT_NAME
            r.out.append(error_reply(opt, Rep.ERR_POLICY, f"export {export.name!r} requires TLS"))
            return
        if setting:
            # "base:" alone selects nothing on SET; unknown namespaces and leaves are ignored
            chosen = BASE_ALLOCATION in queries
        else:
            chosen = not queries or any(q in ("base:", BASE_ALLOCATION) for q in queries)
        if chosen:
            ctx_id = BASE_ALLOCATION_ID if setting else 0  # LIST: the id is reserved, SHOULD be zero
            r.out.append(option_reply(opt, Rep.META_CONTEXT, U32.pack(ctx_id) + BASE_ALLOCATION.encode()))
            if setting:
                self.meta_export = name
        r.out.append(option_reply(opt, Rep.ACK))
