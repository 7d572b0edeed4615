"""Transmission phase: checking requests and encoding replies (proto.md "Transmission", "Request types",
"Simple reply message", "Structured reply chunk message", "Error values").

Every precondition of a request (command, flags, read-only export, bounds, alignment, payload size) is
checked here, once, in `admit()`, at the export edge (STYLE.md §2), before the driver sees the request: its
normal path and its fast path (frontend/nbd.py `_run`, `_done_now`) both get only admitted requests.
"""

from __future__ import annotations

from collections.abc import Iterable

from openvsan.protocol.nbd.events import Buffer, Negotiated
from openvsan.protocol.nbd.wire import (
    CHUNK,
    ERROR_CHUNK,
    EXTENT,
    MAX_STRING,
    REPLY_FLAG_DONE,
    SIMPLE_REPLY,
    SIMPLE_REPLY_MAGIC,
    STATE_HOLE,
    STATE_ZERO,
    STRUCTURED_REPLY_MAGIC,
    U32,
    U64,
    Cmd,
    CmdFlag,
    Errno,
    ReplyType,
    TransmissionFlag,
)

# proto.md "Command flags": which flags each command may carry. FUA is valid on every command once
# NBD_FLAG_SEND_FUA is advertised ("the server MUST accept all commands with this bit set").
_ALLOWED_FLAGS = {
    Cmd.READ: CmdFlag.FUA | CmdFlag.DF,
    Cmd.WRITE: CmdFlag.FUA,
    Cmd.FLUSH: CmdFlag.FUA,
    Cmd.TRIM: CmdFlag.FUA,
    Cmd.CACHE: CmdFlag.FUA,
    Cmd.WRITE_ZEROES: CmdFlag.FUA | CmdFlag.NO_HOLE,
    Cmd.BLOCK_STATUS: CmdFlag.FUA | CmdFlag.REQ_ONE,
}
_WRITES = (Cmd.WRITE, Cmd.TRIM, Cmd.WRITE_ZEROES)
_NAMES = {int(c): f"NBD_CMD_{c.name}" for c in Cmd}
# the same as plain ints: admit() runs for every request, and enum arithmetic costs a microsecond a time
_ALLOWED = {int(c): int(f) for c, f in _ALLOWED_FLAGS.items()}
_DF, _SEND_DF = int(CmdFlag.DF), int(TransmissionFlag.SEND_DF)
_RW = (int(Cmd.READ), int(Cmd.WRITE))


def command_name(cmd: int) -> str:
    return _NAMES.get(cmd, f"command {cmd}")


def admit(s: Negotiated, cmd: int, flags: int, offset: int, length: int) -> tuple[Errno, str] | None:
    """None if the request may run; else the error to answer and a message for the user, in proto.md's
    order: the command and its flags ("Error values", "Command flags"), a write to a read-only export, the
    export's bounds, the size constraints. Pure: it depends only on the negotiated session."""
    e = s.export
    allowed = _ALLOWED.get(cmd)
    if allowed is None or (cmd == Cmd.BLOCK_STATUS and s.meta_context_id is None):
        # proto.md "Error values": an unknown command SHOULD get NBD_EINVAL; so does BLOCK_STATUS without
        # a selected metadata context ("Metadata querying")
        return Errno.EINVAL, f"{command_name(cmd)} is not supported on this connection"
    if not s.flags & _SEND_DF:
        allowed &= ~_DF
    if flags & ~allowed:
        # proto.md "Error values": an unknown flag, or one not documented for the command: NBD_EINVAL
        return Errno.EINVAL, f"{command_name(cmd)}: command flags 0x{flags:04x} are not valid here"
    if cmd == Cmd.FLUSH:
        return None  # offset and length are reserved; nothing to check
    if cmd in _WRITES and e.read_only:
        # proto.md "Error values": a write or trim on a read-only export SHOULD get NBD_EPERM
        return Errno.EPERM, f"{command_name(cmd)}: the export {e.name!r} is read-only"
    if offset + length > e.size:
        # proto.md "Error values": writes beyond the end: NBD_ENOSPC; reads, trims and the rest: NBD_EINVAL
        errno = Errno.ENOSPC if cmd in (Cmd.WRITE, Cmd.WRITE_ZEROES) else Errno.EINVAL
        return errno, f"{command_name(cmd)}: offset {offset} + length {length} is beyond the export size {e.size}"
    if cmd == Cmd.BLOCK_STATUS and not length and offset >= e.size:
        # length 0 asks for the status from offset on (as much as the server likes): there is none at the end
        return Errno.EINVAL, f"{command_name(cmd)} at the end of the export"
    if cmd != Cmd.BLOCK_STATUS and (offset % e.min_block or length % e.min_block):
        # proto.md "Size constraints": requests not aligned to the minimum block size SHOULD get NBD_EINVAL
        return Errno.EINVAL, (f"{command_name(cmd)}: offset {offset} and length {length} must be multiples of the "
                              f"minimum block size {e.min_block}")
    if cmd in _RW and length > e.max_payload:
        # proto.md "Size constraints": the client MUST NOT exceed the maximum payload. For a structured
        # read the server may refuse with NBD_EOVERFLOW ("Request types", NBD_CMD_READ)
        errno = Errno.EOVERFLOW if cmd == Cmd.READ and s.structured else Errno.EINVAL
        return errno, f"{command_name(cmd)}: length {length} is over the maximum payload {e.max_payload}"
    return None


# --- replies -------------------------------------------------------------------------------------
def simple_reply(cookie: int, error: int = 0) -> bytes:
    # proto.md "Simple reply message": magic, error, cookie
    return SIMPLE_REPLY.pack(SIMPLE_REPLY_MAGIC, error, cookie)


def chunk(cookie: int, rtype: int, payload_len: int, *, done: bool = True) -> bytes:
    # proto.md "Structured reply chunk message": magic, flags, type, cookie, length
    return CHUNK.pack(STRUCTURED_REPLY_MAGIC, REPLY_FLAG_DONE if done else 0, rtype, cookie, payload_len)


def read_reply(s: Negotiated, cookie: int, offset: int, data: Buffer) -> list[Buffer]:
    """A successful NBD_CMD_READ: the data, whole, in one reply."""
    if not s.structured:
        return [simple_reply(cookie), data]  # proto.md "Simple reply message": header, then the data
    if not len(data):
        return [chunk(cookie, ReplyType.NONE, 0)]
    # proto.md NBD_REPLY_TYPE_OFFSET_DATA: offset, data; final (DONE) because the data is all in hand
    return [chunk(cookie, ReplyType.OFFSET_DATA, 8 + len(data)) + U64.pack(offset), data]


def done_reply(s: Negotiated, cookie: int) -> bytes:
    """Success without data: a simple reply, which proto.md allows for any request but a read."""
    return simple_reply(cookie)


def error_reply(s: Negotiated | None, cmd: int, cookie: int, error: int, message: str = "",
                offset: int | None = None) -> bytes:
    """An error; with structured replies, an error chunk that carries the message (and offset)."""
    if s is None or not s.structured:
        return simple_reply(cookie, error)  # proto.md NBD_CMD_READ: no payload after an error
    msg = message.encode()[:MAX_STRING]
    if offset is None:
        # proto.md NBD_REPLY_TYPE_ERROR: error, message length, message
        return chunk(cookie, ReplyType.ERROR, 6 + len(msg)) + ERROR_CHUNK.pack(error, len(msg)) + msg
    # proto.md NBD_REPLY_TYPE_ERROR_OFFSET: error, message length, message, offset
    return (chunk(cookie, ReplyType.ERROR_OFFSET, 14 + len(msg)) + ERROR_CHUNK.pack(error, len(msg)) + msg
            + U64.pack(offset))


def block_status_reply(s: Negotiated, cookie: int, extents: list[tuple[int, int]]) -> bytes:
    """proto.md NBD_REPLY_TYPE_BLOCK_STATUS: context id, then (length, status flags) extents."""
    assert s.meta_context_id is not None
    body = U32.pack(s.meta_context_id) + b"".join(EXTENT.pack(n, f) for n, f in extents)
    return chunk(cookie, ReplyType.BLOCK_STATUS, len(body)) + body


def allocation_extents(offset: int, length: int, block_size: int, runs: Iterable[tuple[int, int, int]], *,
                       reads_zero: bool, req_one: bool) -> list[tuple[int, int]]:
    """base:allocation descriptors (length, flags) for the bytes [offset, offset+length) of an export, from the
    device's (lba, blocks, status) runs over the blocks that hold them (status 1: deallocated, as SBC-4 GET
    LBA STATUS says; anything else is reported allocated). proto.md NBD_CMD_BLOCK_STATUS and "base:allocation
    metadata context": consecutive from *offset*, the sum never over *length* (runs that stop short make a
    shorter answer, which the server MAY give; an empty one falls back to one allocated descriptor), neighbours
    with different flags, lengths multiples of the block size save where the request itself is unaligned;
    a deallocated run is NBD_STATE_HOLE, and NBD_STATE_ZERO too when deallocated blocks read as zeroes;
    with NBD_CMD_FLAG_REQ_ONE, one descriptor."""
    end = offset + length
    hole = STATE_HOLE | (STATE_ZERO if reads_zero else 0)
    out: list[list[int]] = []
    pos = offset
    for lba, blocks, status in runs:
        start, stop = max(lba * block_size, pos), min((lba + blocks) * block_size, end)
        if start != pos:
            break         # a gap in what the device said: stop at what is known
        if stop <= start:
            continue
        flags = hole if status == 1 else 0
        if out and out[-1][1] == flags:
            out[-1][0] += stop - start
        else:
            out.append([stop - start, flags])
        pos = stop
        if pos >= end or (req_one and len(out) > 1):
            break
    if not out:
        return [(length, 0)]
    if req_one:
        del out[1:]
    return [(n, f) for n, f in out]
