"""NBD wire values and layouts, declared once beside the text of the NBD project's doc/proto.md.

Section names below are those of proto.md ("Values", "Handshake phase", ...). All numbers on the wire are
big-endian (proto.md "Conventions").
"""

from __future__ import annotations

import struct
from enum import IntEnum, IntFlag

# proto.md "Newstyle negotiation": the server's greeting and the client's option header
NBDMAGIC = 0x4E42444D41474943           # "NBDMAGIC" (INIT_PASSWD)
IHAVEOPT = 0x49484156454F5054           # "IHAVEOPT"
OPTION_REPLY_MAGIC = 0x0003E889045565A9  # "Fixed newstyle negotiation": magic of every option reply
# proto.md "Request message", "Simple reply message", "Structured reply chunk message"
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF
EXTENDED_REQUEST_MAGIC = 0x21E41C71     # "Reserved Magic values": the experimental EXTENDED_HEADERS

GREETING = struct.Struct(">QQH")        # NBDMAGIC, IHAVEOPT, 16-bit handshake flags
CLIENT_FLAGS = struct.Struct(">I")      # 32-bit client flags
OPTION = struct.Struct(">QII")          # IHAVEOPT, option, length of option data
OPTION_REPLY = struct.Struct(">QIII")   # reply magic, option, reply type, length of reply data
EXPORT_NAME_REPLY = struct.Struct(">QH")  # NBD_OPT_EXPORT_NAME: size, transmission flags (+124 zeroes)
REQUEST = struct.Struct(">IHHQQI")      # magic, command flags, type, cookie, offset, length
SIMPLE_REPLY = struct.Struct(">IIQ")    # magic, error, cookie
CHUNK = struct.Struct(">IHHQI")         # magic, flags, type, cookie, length of payload
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
INFO_EXPORT = struct.Struct(">HQH")     # NBD_INFO_EXPORT, size, transmission flags (reply length 12)
INFO_BLOCK_SIZE = struct.Struct(">HIII")  # NBD_INFO_BLOCK_SIZE, minimum, preferred, maximum payload (14)
ERROR_CHUNK = struct.Struct(">IH")      # error, message length (then the message)
EXTENT = struct.Struct(">II")           # length, status flags

EXPORT_NAME_ZEROES = bytes(124)         # "Newstyle negotiation": reserved, unless NO_ZEROES was agreed
MAX_STRING = 4096                       # "Conventions": a string MUST be no longer than 4096 bytes


class HandshakeFlag(IntFlag):
    """proto.md "Handshake flags" (16 bits, from the server)."""

    FIXED_NEWSTYLE = 1 << 0
    NO_ZEROES = 1 << 1


class ClientFlag(IntFlag):
    """proto.md "Client flags" (32 bits); any other bit set: the server MUST drop the connection."""

    FIXED_NEWSTYLE = 1 << 0
    NO_ZEROES = 1 << 1


class TransmissionFlag(IntFlag):
    """proto.md "Transmission flags" (16 bits, per export)."""

    HAS_FLAGS = 1 << 0
    READ_ONLY = 1 << 1
    SEND_FLUSH = 1 << 2
    SEND_FUA = 1 << 3
    ROTATIONAL = 1 << 4
    SEND_TRIM = 1 << 5
    SEND_WRITE_ZEROES = 1 << 6
    SEND_DF = 1 << 7
    CAN_MULTI_CONN = 1 << 8
    SEND_RESIZE = 1 << 9
    SEND_CACHE = 1 << 10
    SEND_FAST_ZERO = 1 << 11


class Opt(IntEnum):
    """proto.md "Option types"."""

    EXPORT_NAME = 1
    ABORT = 2
    LIST = 3
    PEEK_EXPORT = 4
    STARTTLS = 5
    INFO = 6
    GO = 7
    STRUCTURED_REPLY = 8
    LIST_META_CONTEXT = 9
    SET_META_CONTEXT = 10
    EXTENDED_HEADERS = 11


_ERR = 1 << 31


class Rep(IntEnum):
    """proto.md "Option reply types"; errors have bit 31 set."""

    ACK = 1
    SERVER = 2
    INFO = 3
    META_CONTEXT = 4
    ERR_UNSUP = _ERR + 1
    ERR_POLICY = _ERR + 2
    ERR_INVALID = _ERR + 3
    ERR_PLATFORM = _ERR + 4
    ERR_TLS_REQD = _ERR + 5
    ERR_UNKNOWN = _ERR + 6
    ERR_SHUTDOWN = _ERR + 7
    ERR_BLOCK_SIZE_REQD = _ERR + 8
    ERR_TOO_BIG = _ERR + 9


class Info(IntEnum):
    """proto.md "Option reply types" / NBD_REP_INFO: information types."""

    EXPORT = 0
    NAME = 1
    DESCRIPTION = 2
    BLOCK_SIZE = 3


class Cmd(IntEnum):
    """proto.md "Request types"."""

    READ = 0
    WRITE = 1
    DISC = 2
    FLUSH = 3
    TRIM = 4
    CACHE = 5
    WRITE_ZEROES = 6
    BLOCK_STATUS = 7
    RESIZE = 8


class CmdFlag(IntFlag):
    """proto.md "Command flags"."""

    FUA = 1 << 0
    NO_HOLE = 1 << 1
    DF = 1 << 2
    REQ_ONE = 1 << 3
    FAST_ZERO = 1 << 4
    PAYLOAD_LEN = 1 << 5


REPLY_FLAG_DONE = 1 << 0  # proto.md "Structured reply flags"


class ReplyType(IntEnum):
    """proto.md "Structured reply types"; error chunks have bit 15 set."""

    NONE = 0
    OFFSET_DATA = 1
    OFFSET_HOLE = 2
    BLOCK_STATUS = 5
    ERROR = (1 << 15) + 1
    ERROR_OFFSET = (1 << 15) + 2


class Errno(IntEnum):
    """proto.md "Error values" (the common errno numbers, fixed by the protocol)."""

    EPERM = 1
    EIO = 5
    ENOMEM = 12
    EINVAL = 22
    ENOSPC = 28
    EOVERFLOW = 75
    ENOTSUP = 95
    ESHUTDOWN = 108


# proto.md "base:allocation metadata context"
BASE_ALLOCATION = "base:allocation"
STATE_HOLE = 1 << 0
STATE_ZERO = 1 << 1
