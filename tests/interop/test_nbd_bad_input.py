"""Bad NBD input against a live `vsan serve`: broken handshakes and requests get the protocol's error or a
clean close, never a crash, and a well-behaved client on the same export keeps doing I/O throughout."""

from __future__ import annotations

import random
import socket
import struct
from collections.abc import Callable

import pytest
from vsan_harness import VsanServer, qemu_io

pytestmark = pytest.mark.interop

IHAVEOPT = 0x49484156454F5054
REQUEST_MAGIC = 0x25609513
MiB = 1 << 20
SIZE = 64 * MiB
GOOD_AREA = 8 * MiB  # where the well-behaved client writes; the fuzzed streams write anywhere
# proto.md "Option types", "Request types", "Error values"
OPT_EXPORT_NAME, OPT_ABORT, OPT_LIST, OPT_GO, OPT_STRUCTURED_REPLY = 1, 2, 3, 7, 8
READ, WRITE, DISC, FLUSH, TRIM, WRITE_ZEROES = 0, 1, 2, 3, 4, 6
EPERM, EINVAL, ENOSPC = 1, 22, 28
REP_ACK, REP_ERR_UNSUP, REP_ERR_INVALID, REP_ERR_UNKNOWN = 1, 2**31 + 1, 2**31 + 3, 2**31 + 6


def option(opt: int, data: bytes = b"") -> bytes:
    return struct.pack(">QII", IHAVEOPT, opt, len(data)) + data


def go_data(name: str = "disk0") -> bytes:
    return struct.pack(">I", len(name)) + name.encode() + struct.pack(">H", 0)


def request(cmd: int, offset: int = 0, length: int = 0, flags: int = 0, cookie: int = 1) -> bytes:
    return struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, cookie, offset, length)


class Raw:
    """A socket speaking NBD by hand."""

    def __init__(self, port: int) -> None:
        self.s = socket.create_connection(("127.0.0.1", port), timeout=10)
        greeting = self.recv(18)
        assert greeting[:16] == b"NBDMAGICIHAVEOPT", greeting

    def recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.s.recv(n - len(out))
            if not chunk:
                raise EOFError(f"closed after {len(out)} of {n} bytes")
            out += chunk
        return out

    def option(self, opt: int, data: bytes = b"") -> list[tuple[int, bytes]]:
        self.s.sendall(option(opt, data))
        replies = []
        while True:
            magic, got, rep, n = struct.unpack(">QIII", self.recv(20))
            assert magic == 0x3E889045565A9 and got == opt
            replies.append((rep, self.recv(n)))
            if rep not in (2, 3):  # NBD_REP_SERVER, NBD_REP_INFO come before the final reply
                return replies

    def go(self, structured: bool = True) -> None:
        self.s.sendall(struct.pack(">I", 3))
        if structured:
            assert self.option(OPT_STRUCTURED_REPLY)[-1][0] == REP_ACK
        assert self.option(OPT_GO, go_data())[-1][0] == REP_ACK

    def call(self, cmd: int, offset: int = 0, length: int = 0, data: bytes = b"", flags: int = 0) -> tuple[int, bytes]:
        """(error, data) with structured replies."""
        self.s.sendall(request(cmd, offset, length, flags, cookie=0xC0FFEE) + data)
        out, error = b"", 0
        while True:
            magic = struct.unpack(">I", self.recv(4))[0]
            if magic == 0x67446698:
                error, cookie = struct.unpack(">IQ", self.recv(12))
                assert cookie == 0xC0FFEE
                return error, out
            assert magic == 0x668E33EF, hex(magic)
            flags_, rtype, cookie, n = struct.unpack(">HHQI", self.recv(16))
            payload = self.recv(n)
            assert cookie == 0xC0FFEE
            if rtype == 1:
                out += payload[8:]
            elif rtype & 0x8000:
                error = struct.unpack_from(">I", payload)[0]
            if flags_ & 1:
                return error, out

    def closed_by_server(self, timeout: float = 10) -> bool:
        """True once the server has closed the connection (whatever it sent before)."""
        self.s.settimeout(timeout)
        try:
            while self.s.recv(65536):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        return True

    def close(self) -> None:
        self.s.close()


@pytest.fixture
def server(vsan: Callable[..., VsanServer]) -> VsanServer:
    return vsan(nbd=True)


class GoodClient:
    """Writes a fresh pattern and reads it back: proof that the export still works for everyone else."""

    def __init__(self, port: int) -> None:
        self.c = Raw(port)
        self.c.go()
        self.rng = random.Random(1)

    def check(self) -> None:
        block = self.rng.randrange(GOOD_AREA // 4096)
        data = self.rng.randbytes(4096)
        assert self.c.call(WRITE, block * 4096, 4096, data) == (0, b"")
        assert self.c.call(READ, block * 4096, 4096) == (0, data)


def test_broken_handshakes(server: VsanServer) -> None:
    good = GoodClient(server.nbd_port)
    port = server.nbd_port
    # unknown client flags: the server MUST drop the connection (proto.md "Client flags")
    c = Raw(port)
    c.s.sendall(struct.pack(">I", 0xFFFF0003))
    assert c.closed_by_server()
    # a bad option magic, and an option that claims 4 GiB of data: a hard disconnect
    for junk in (b"\0" * 16, struct.pack(">QII", IHAVEOPT, OPT_GO, 0xFFFFFFFF)):
        c = Raw(port)
        c.s.sendall(struct.pack(">I", 3) + junk)
        assert c.closed_by_server(), junk
        good.check()
    # unknown options and malformed GO data get errors, and the handshake goes on to succeed
    c = Raw(port)
    c.s.sendall(struct.pack(">I", 3))
    for opt in (0, 4, 11, 12, 1000, 0xFFFFFFFF):
        assert c.option(opt, b"junk" * 10)[-1][0] == REP_ERR_UNSUP, opt
    for data in (b"", b"\xff\xff\xff\xff\0\0", go_data()[:-1], go_data() + b"\0\0\0"):
        assert c.option(OPT_GO, data)[-1][0] == REP_ERR_INVALID, data
    assert c.option(OPT_GO, go_data("nope"))[-1][0] == REP_ERR_UNKNOWN
    assert c.option(OPT_LIST, b"x")[-1][0] == REP_ERR_INVALID
    assert c.option(OPT_GO, go_data())[-1][0] == REP_ACK
    assert c.call(READ, 0, 512)[0] == 0
    c.close()
    # NBD_OPT_EXPORT_NAME of an unknown export cannot be answered: the session ends
    c = Raw(port)
    c.s.sendall(struct.pack(">I", 3) + option(OPT_EXPORT_NAME, b"nope"))
    assert c.closed_by_server()
    # NBD_OPT_ABORT: an ACK, then the close
    c = Raw(port)
    c.s.sendall(struct.pack(">I", 3))
    assert c.option(OPT_ABORT)[-1][0] == REP_ACK and c.closed_by_server()
    good.check()


def test_broken_requests(server: VsanServer) -> None:
    good = GoodClient(server.nbd_port)
    c = Raw(server.nbd_port)
    c.go()
    assert c.call(READ, SIZE - 512, 1024)[0] == EINVAL  # beyond the end
    assert c.call(READ, 2**64 - 512, 1024)[0] == EINVAL  # offset + length past 2^64
    assert c.call(READ, 0, 0xFFFFFFFF)[0] == EINVAL
    assert c.call(READ, 3, 512)[0] == EINVAL  # not aligned to the 512-byte minimum block
    assert c.call(WRITE, SIZE, 512, bytes(512))[0] == ENOSPC
    assert c.call(WRITE_ZEROES, SIZE - 512, 4096)[0] == ENOSPC
    assert c.call(TRIM, 0, 512, flags=0x2)[0] == EINVAL  # NO_HOLE is not a trim's flag
    assert c.call(99, 0, 512)[0] == EINVAL  # unknown command
    assert c.call(WRITE, 0, 40 * MiB, bytes(40 * MiB))[0] == EINVAL  # over the maximum payload, read through
    assert c.call(READ, 0, 512)[0] == 0  # and the connection is still framed
    good.check()
    # a request with a bad magic ends the connection; so does a write whose 4 GiB payload never comes
    c.s.sendall(b"\x12\x56\x09\x53" + bytes(24))
    assert c.closed_by_server()
    c = Raw(server.nbd_port)
    c.go(structured=False)
    c.s.sendall(request(WRITE, 0, 0xFFFFFFFF) + bytes(MiB))
    c.s.shutdown(socket.SHUT_WR)
    assert c.closed_by_server()
    good.check()


def valid_stream(rng: random.Random) -> bytes:
    """A whole session: flags, options, a handful of requests, NBD_CMD_DISC."""
    out = struct.pack(">I", 3) + option(OPT_STRUCTURED_REPLY) + option(OPT_LIST) + option(OPT_GO, go_data())
    for cookie in range(rng.randrange(1, 6)):
        off = rng.randrange(GOOD_AREA, SIZE, 4096)
        kind = rng.choice((READ, WRITE, FLUSH, TRIM, WRITE_ZEROES))
        n = 4096 * rng.randrange(1, 9)
        out += request(kind, off, n if kind != FLUSH else 0, cookie=cookie)
        if kind == WRITE:
            out += rng.randbytes(n)
    return out + request(DISC)


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        what = rng.random()
        i = rng.randrange(len(b))
        if what < 0.5:
            b[i] = rng.randrange(256)  # a byte anywhere: magics, lengths, commands, flags, offsets
        elif what < 0.65:
            b[i : i + 4] = rng.choice((b"\xff\xff\xff\xff", b"\0\0\0\0", b"\x80\0\0\0", b"\0\0\x10\x01"))
        elif what < 0.8:
            del b[i : i + rng.randrange(1, 32)]
        elif what < 0.9:
            b[i:i] = rng.randbytes(rng.randrange(1, 32))
        else:
            b = b[:i]
    return bytes(b)


def test_mutated_sessions(server: VsanServer) -> None:
    """Seeded mutations of whole sessions, each sent then half-closed: the server answers what it can and
    closes; it never hangs, never dies, never logs a Traceback, and the good client's I/O goes on."""
    rng = random.Random(20261130)
    good = GoodClient(server.nbd_port)
    for i in range(150):
        stream = mutate(valid_stream(rng), rng)
        c = Raw(server.nbd_port)
        try:
            c.s.sendall(stream)
            c.s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server already hung up on an earlier part of the stream
        assert c.closed_by_server(), f"case {i}: the server kept the connection open after EOF"
        c.close()
        good.check()
    assert server.running
    # a separate, real client still sees the good client's data
    qemu_io(server.nbd_url(), "read 0 1M", "write -P 0x11 0 64k", "read -P 0x11 0 64k")
