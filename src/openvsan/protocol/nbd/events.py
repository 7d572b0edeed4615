"""What the sans-IO NBD server connection hands its driver: exports it may offer, and events."""

from __future__ import annotations

from dataclasses import dataclass, field

from openvsan.protocol.nbd.wire import CmdFlag, TransmissionFlag
from openvsan.protocol.routing import Elsewhere

Buffer = bytes | bytearray | memoryview

DEFAULT_MAX_PAYLOAD = 32 * 1024 * 1024  # proto.md "Size constraints": 2^25, what clients assume by default


@dataclass(frozen=True)
class ExportInfo:
    """One export as the protocol sees it: a name, a size in bytes and its size constraints."""

    name: str
    size: int
    min_block: int = 1                   # proto.md "Size constraints": a power of 2, at most 64 KiB
    preferred_block: int = 4096
    max_payload: int = DEFAULT_MAX_PAYLOAD
    read_only: bool = False
    description: str = ""
    multi_conn: bool = True              # no per-connection cache: FLUSH/FUA are seen by every connection
    elsewhere: int | None = None         # served by that worker process of this node: listed, handed over

    def transmission_flags(self, structured: bool) -> int:
        """proto.md "Transmission flags" for this export, as sent in NBD_INFO_EXPORT."""
        f = (TransmissionFlag.HAS_FLAGS | TransmissionFlag.SEND_FLUSH | TransmissionFlag.SEND_FUA
             | TransmissionFlag.SEND_CACHE)
        if self.read_only:
            f |= TransmissionFlag.READ_ONLY
        else:
            f |= TransmissionFlag.SEND_TRIM | TransmissionFlag.SEND_WRITE_ZEROES
        if structured:
            # every read is answered with one content chunk, so "don't fragment" costs nothing
            f |= TransmissionFlag.SEND_DF
        if self.multi_conn:
            f |= TransmissionFlag.CAN_MULTI_CONN
        return int(f)


@dataclass(frozen=True)
class Send:
    """Bytes to write to the client, in order."""

    data: list[Buffer]


@dataclass(frozen=True)
class Negotiated:
    """The handshake is over: the transmission phase has begun on `export`."""

    export: ExportInfo
    structured: bool                     # NBD_OPT_STRUCTURED_REPLY was agreed
    flags: int                           # the transmission flags the client was given
    meta_context_id: int | None = None   # base:allocation selected for this export (NBD_CMD_BLOCK_STATUS)
    tls: bool = False                    # negotiated inside TLS (NBD_OPT_STARTTLS)


@dataclass(frozen=True)
class StartTls:
    """NBD_OPT_STARTTLS was acknowledged (the ACK is in the Send before this event): the driver starts the TLS
    handshake as server on the same socket, then calls `tls_started()` and feeds the decrypted stream."""


@dataclass(frozen=True)
class Request:
    """A checked transmission-phase request: known command, valid flags, aligned and within the export."""

    cmd: int                             # wire.Cmd
    flags: int                           # wire.CmdFlag
    cookie: int
    offset: int
    length: int
    payload: memoryview | None = field(default=None, repr=False)  # NBD_CMD_WRITE data
    # the payload was received into memory the driver's window() lent (the device's own): it is written already
    in_place: bool = False

    @property
    def fua(self) -> bool:
        return bool(self.flags & CmdFlag.FUA)

    @property
    def no_hole(self) -> bool:
        return bool(self.flags & CmdFlag.NO_HOLE)

    @property
    def req_one(self) -> bool:
        return bool(self.flags & CmdFlag.REQ_ONE)


@dataclass(frozen=True)
class Disconnect:
    """A soft disconnect (NBD_CMD_DISC, NBD_OPT_ABORT): finish what is in flight, then close."""


@dataclass(frozen=True)
class Close:
    """A hard disconnect: the client broke a MUST of the protocol and nothing after it can be trusted."""

    reason: str


Event = Send | Negotiated | StartTls | Request | Disconnect | Close | Elsewhere   # Elsewhere: protocol/routing.py
