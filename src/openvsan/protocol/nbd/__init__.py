"""NBD (the NBD project's doc/proto.md), server side, sans-IO: fixed newstyle handshake and transmission."""

from openvsan.protocol.nbd.connection import NbdServerConnection, Phase
from openvsan.protocol.nbd.events import (
    DEFAULT_MAX_PAYLOAD,
    Close,
    Disconnect,
    Event,
    ExportInfo,
    Negotiated,
    Request,
    Send,
    StartTls,
)
from openvsan.protocol.nbd.transmission import admit
from openvsan.protocol.nbd.wire import Cmd, CmdFlag, Errno, TransmissionFlag

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "Close",
    "Cmd",
    "CmdFlag",
    "Disconnect",
    "Errno",
    "Event",
    "ExportInfo",
    "NbdServerConnection",
    "Negotiated",
    "Phase",
    "Request",
    "Send",
    "StartTls",
    "TransmissionFlag",
    "admit",
]
