"""Bad input against a running `vsan serve` while a good initiator keeps writing and verifying its data.

Each test starts a real `vsan serve` (the `vsan` fixture: its teardown fails the test unless the server
exits 0 on SIGTERM with no Traceback in its log, so a crash anywhere is a failure even if no socket saw it).
A good client (tests/fuzz/client.py) writes random data to its own LBA range and reads it back the whole
time; other sockets send the bad input. Asserted: the RFC 7143 answer where there is one (Reject with its
reason, login status class/detail, a clean close), an answer or a close and never a hang otherwise, and the
good client's I/O and data untouched.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import budget
import pdus
import pytest
from client import Closed, Initiator, ProtocolViolation

BLOCK = 512
GOOD_BLOCKS = 8192              # the good client's range: LBAs [0, 8192)
FUZZ_LBA = 65536                # fuzzers write only at or above this LBA (the device has 131072 blocks)
KNOWN_REJECT_REASONS = {0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0A, 0x0C}
SIXTEEN_MIB = (1 << 24) - 1     # the largest DataSegmentLength the format can carry (§11.2.1.5)


# --- the good client --------------------------------------------------------------------------------

class GoodClient(threading.Thread):
    """Writes random data at random places of its range, reads each write back, and at the end reads the
    whole range and compares it with what it wrote (a shadow copy)."""

    def __init__(self, port: int, iqn: str) -> None:
        super().__init__(daemon=True)
        self.port, self.iqn = port, iqn
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.ios = 0
        self.shadow = bytearray(GOOD_BLOCKS * BLOCK)
        self.rng = random.Random(7)

    def run(self) -> None:
        try:
            c = Initiator("127.0.0.1", self.port, self.iqn, name="iqn.2026-11.org.openvsan.test:good").connect()
            c.login()
            # start from a known state: the device may hold anything a previous start left
            for lba in range(0, GOOD_BLOCKS, 512):
                self._write(c, lba, bytes(512 * BLOCK))
            while not self.stop.is_set():
                blocks = self.rng.choice((1, 8, 64, 256))
                lba = self.rng.randrange(GOOD_BLOCKS - blocks)
                self._write(c, lba, self.rng.randbytes(blocks * BLOCK))
                out = c.read(lba, blocks)
                assert out.status == 0, f"READ status {out.status:#x} sense {out.sense.hex()}"
                assert out.data == self.shadow[lba * BLOCK:(lba + blocks) * BLOCK], f"data differs at LBA {lba}"
                self.ios += 2
            for lba in range(0, GOOD_BLOCKS, 512):
                out = c.read(lba, 512)
                assert out.status == 0 and out.data == self.shadow[lba * BLOCK:(lba + 512) * BLOCK], \
                    f"final check: data differs in LBAs {lba}..{lba + 511}"
            c.nop(b"still here")
            c.logout()
            c.close()
        except BaseException as e:  # noqa: BLE001  (reported by the test thread)
            self.error = e

    def _write(self, c: Initiator, lba: int, data: bytes) -> None:
        out = c.write(lba, data)
        assert out.status == 0, f"WRITE status {out.status:#x} sense {out.sense.hex()}"
        self.shadow[lba * BLOCK:lba * BLOCK + len(data)] = data
        self.ios += 1


@pytest.fixture
def served(vsan: Callable[..., object]) -> Iterator[tuple[object, GoodClient]]:
    server = vsan(device="ram", size="64MiB")
    good = GoodClient(server.port, server.iqn)  # type: ignore[attr-defined]
    good.start()
    deadline = time.monotonic() + 10
    while good.ios < 20 and good.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    yield server, good
    good.stop.set()
    good.join(60)
    assert not good.is_alive(), "the good client hung"
    if good.error is not None:
        raise AssertionError(f"the good client failed beside the fuzzers: {good.error!r}") from good.error
    assert good.ios > 20
    assert server.running, f"vsan serve died:\n{server.log_tail()}"  # type: ignore[attr-defined]


# --- helpers ----------------------------------------------------------------------------------------

_names = iter(range(1, 1 << 30))
_names_lock = threading.Lock()


def fuzz_initiator(server: object, **kw: object) -> Initiator:
    with _names_lock:
        n = next(_names)
    return Initiator("127.0.0.1", server.port, server.iqn,  # type: ignore[attr-defined]
                     name=f"iqn.2026-11.org.openvsan.test:fuzz-{n}",
                     isid=bytes((0x80,)) + n.to_bytes(5, "big"), timeout=10, **kw)  # type: ignore[arg-type]


def logged_in(server: object, **kw: object) -> Initiator:
    c = fuzz_initiator(server, **kw).connect()
    c.login()
    return c


def expect_close(c: Initiator, *, allow: Callable[[pdus.Reply], bool] = lambda r: False, half_close: bool = True,
                 timeout: float = 10) -> list[pdus.Reply]:
    """The target must close the connection (EOF or reset) within timeout; replies before that must pass
    allow. With half_close we shut our sending side first: a target waiting for more bytes then sees EOF."""
    assert c.sock is not None
    if half_close:
        try:
            c.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    c.sock.settimeout(timeout)
    seen = []
    try:
        while True:
            r = c.recv()
            assert allow(r), f"unexpected opcode 0x{r.opcode:02x} before the close ({r.bhs[:4].hex()})"
            seen.append(r)
    except Closed:
        return seen
    except TimeoutError:
        raise AssertionError(f"the target neither answered nor closed the connection in {timeout}s") from None
    finally:
        c.close()


def expect_reject(c: Initiator, reasons: set[int]) -> pdus.Reply:
    r = c.recv()
    assert r.opcode == pdus.REJECT, f"wanted Reject, got opcode 0x{r.opcode:02x}"
    assert r.reject_reason in reasons, f"Reject reason {r.reject_reason:#x}, wanted one of {reasons}"
    assert len(r.data) == 48  # §11.17: the rejected PDU's header
    return r


def still_alive(c: Initiator) -> None:
    """The connection survived: a ping is answered."""
    c.nop(b"ping")


# --- the RFC's answers, one case at a time ----------------------------------------------------------------

def test_targeted_bad_input(served: tuple[object, GoodClient]) -> None:
    server, good = served

    # Before login: something that is not a Login Request → 020B, then close (§11.13.5)
    c = fuzz_initiator(server).connect()
    c.send_raw(pdus.scsi_command(pdus.read10(0, 1), itt=1, cmdsn=1, edtl=512, read=True))
    [r] = expect_close(c, allow=lambda r: r.opcode == pdus.LOGIN_RSP)
    assert r.login_status == (2, 11)

    # Login failures with their status class/detail, then close
    base = {"InitiatorName": "iqn.2026-11.org.openvsan.test:fuzz-login", "TargetName": server.iqn}  # type: ignore[attr-defined]
    cases = [
        ({**base, "TargetName": "iqn.2026-11.org.nowhere:x"}, {}, (2, 3)),
        ({"TargetName": server.iqn}, {}, (2, 7)),  # type: ignore[attr-defined]
        (pdus.text(base) + b"MaxBurstLength=512\0MaxBurstLength=512\0", {}, (2, 0)),
        (base, {"vmin": 1, "vmax": 1}, (2, 5)),
        ({**base, "SessionType": "Bogus"}, {}, (2, 9)),
        ({**base, "MaxBurstLength": "²"}, {}, (0, 0)),  # answered Reject, login goes on (§6.2)
    ]
    for keys, kw, status in cases:
        c = fuzz_initiator(server).connect()
        c.send_raw(pdus.login_request(keys, **kw))  # type: ignore[arg-type]
        r = c.recv()
        assert r.opcode == pdus.LOGIN_RSP and r.login_status == status, (keys, r.login_status)
        if status == (0, 0):
            assert r.keys().get("MaxBurstLength") == "Reject" and r.keys().get("Unknown", "") == ""
            c.logout()
            c.close()
        else:
            expect_close(c)
        budget.count()

    # Unknown keys: NotUnderstood, and the login completes
    c = fuzz_initiator(server).connect()
    r = c.login(**{"X-org.example.unknown": "1", "FooBar": "baz"})
    assert r.keys()["FooBar"] == "NotUnderstood" and r.keys()["X-org.example.unknown"] == "NotUnderstood"
    still_alive(c)
    c.logout()
    c.close()

    # 16 MiB DataSegmentLength announced in a login, half sent, then half-closed: a clean close
    c = fuzz_initiator(server).connect()
    wire = bytearray(pdus.login_request(base))
    wire[5:8] = SIXTEEN_MIB.to_bytes(3, "big")
    c.send_raw(bytes(wire[:48]) + bytes(SIXTEEN_MIB // 2))
    expect_close(c, allow=lambda r: r.opcode == pdus.LOGIN_RSP and r.login_status[0] != 0)

    # ... and sent whole: login text past any limit is an initiator error (0200), then close
    c = fuzz_initiator(server).connect()
    c.send_raw(bytes(wire[:48]) + bytes(SIXTEEN_MIB + 1))
    [r] = expect_close(c, allow=lambda r: r.opcode == pdus.LOGIN_RSP, half_close=False)
    assert r.login_status == (2, 0)

    # Full feature phase --------------------------------------------------------------------------------
    c = logged_in(server)
    c.send_raw(pdus.snack(itt=0x77, expstatsn=c.expstatsn))  # ERL 0: no SNACK support (§7.1.4)
    expect_reject(c, {0x03, 0x04})
    still_alive(c)

    wire = bytearray(pdus.nop_out(itt=0x78, cmdsn=c.cmdsn))
    wire[0] = 0x40 | 0x1C  # an opcode no one defined (§11.2.1.2)
    c.send_raw(bytes(wire))
    expect_reject(c, {0x04, 0x05})
    still_alive(c)

    c.send_raw(pdus.login_request(base, itt=0x79, cmdsn=c.cmdsn))  # login in full feature phase
    expect_reject(c, {0x04})
    still_alive(c)

    c.send_raw(pdus.data_out(bytes(4096), itt=0xDEAD, ttt=0x1234, offset=0))  # Data-Out for a task that is not
    still_alive(c)  # ... dropped (or Rejected); the connection lives either way
    budget.count(5)

    # CmdSN far outside [ExpCmdSN, MaxCmdSN]: silently ignored (§4.2.2.1); the next in-window one runs
    c.send_raw(pdus.scsi_command(pdus.read10(FUZZ_LBA, 1), itt=0x80, cmdsn=(c.cmdsn + 100000) & 0xFFFFFFFF,
                                 edtl=512, read=True))
    c.send_raw(pdus.scsi_command(pdus.read10(FUZZ_LBA, 1), itt=0x81, cmdsn=(c.cmdsn - 5) & 0xFFFFFFFF,
                                 edtl=512, read=True))
    r = c.nop(b"after")  # recv_for fails on a reply for another ITT: nothing came for 0x80 or 0x81
    out = c.read(FUZZ_LBA, 1)
    assert out.status == 0 and len(out.data) == 512

    # Immediate data longer than the EDTL: protocol error (§10.3.4)
    c.send_raw(pdus.scsi_command(pdus.write10(FUZZ_LBA, 1), itt=0x82, cmdsn=c.cmdsn, edtl=512, write=True,
                                 data=bytes(1024)))
    expect_reject(c, {0x04, 0x09})
    still_alive(c)

    # A second command with the ITT of one still waiting for its data: Task in progress (§11.17.1)
    c.send_raw(pdus.scsi_command(pdus.write10(FUZZ_LBA, 8), itt=0x83, cmdsn=c.cmdsn, edtl=4096, write=True))
    c.cmdsn += 1
    r2t = c.recv()
    assert r2t.opcode == pdus.R2T
    c.send_raw(pdus.scsi_command(pdus.read10(FUZZ_LBA, 1), itt=0x83, cmdsn=c.cmdsn, edtl=512, read=True))
    c.cmdsn += 1
    expect_reject(c, {0x07})
    c.send_raw(pdus.data_out(bytes(range(256)) * 16, itt=0x83, ttt=r2t.ttt, offset=0))
    r = c.recv_for(0x83)
    assert r.opcode == pdus.SCSI_RSP and r.scsi_status == 0

    # Malformed text in a Text Request: protocol error
    c.send_raw(pdus.text_request(b"NoEqualsSign\0", itt=0x84, cmdsn=c.cmdsn))
    expect_reject(c, {0x04})
    still_alive(c)

    # ABORT TASK for a task nobody sent: Function complete or Task does not exist (§11.6.1)
    c.send_raw(pdus.task_mgmt(1, itt=0x85, cmdsn=c.cmdsn, rtt=0x4242, refcmdsn=(c.cmdsn + 1000) & 0xFFFFFFFF))
    r = c.recv_for(0x85)
    assert r.opcode == pdus.TMF_RSP and r.bhs[2] in (0, 1)

    # A whole 16 MiB NOP-Out data segment, far past our MaxRecvDataSegmentLength: Reject, or a close
    c.send_raw(pdus.nop_out(itt=0x86, cmdsn=c.cmdsn, data=bytes(SIXTEEN_MIB)))
    try:
        expect_reject(c, {0x04})
        still_alive(c)
        c.logout()
        c.close()
    except Closed:
        pass
    budget.count(10)

    # 16 MiB announced in full feature phase (beyond our MaxRecvDataSegmentLength), half sent, half-closed:
    # refused from its header with a Reject (Protocol Error, §11.17.1), then a clean close
    c = logged_in(server)
    wire = bytearray(pdus.nop_out(itt=0x90, cmdsn=c.cmdsn))
    wire[5:8] = SIXTEEN_MIB.to_bytes(3, "big")
    c.send_raw(bytes(wire) + bytes(1 << 20))
    expect_close(c, allow=lambda r: r.opcode == pdus.REJECT and r.reject_reason == pdus.REJECT_PROTOCOL)

    # Header digest error: the connection is dropped (§7.8, ERL 0)
    c = logged_in(server, header_digest=True, data_digest=True)
    assert c.header_digest and c.data_digest
    still_alive(c)
    wire = bytearray(pdus.nop_out(itt=0x91, cmdsn=c.cmdsn, hd=True))
    wire[20] ^= 0xFF
    c.send_raw(bytes(wire))
    expect_close(c, half_close=False)

    # Data digest error: Reject reason 02 and the connection lives (§7.8)
    c = logged_in(server, header_digest=True, data_digest=True)
    wire = bytearray(pdus.nop_out(itt=0x92, cmdsn=c.cmdsn, data=b"digest me", hd=True, dd=True))
    wire[-1] ^= 0xFF
    c.send_raw(bytes(wire))
    expect_reject(c, {0x02})
    still_alive(c)
    c.logout()
    c.close()

    # Logout, then more PDUs on the same socket: the target closes after its Logout Response
    c = logged_in(server)
    c.send_raw(pdus.logout_request(itt=0x93, cmdsn=c.cmdsn))
    c.send_raw(pdus.nop_out(itt=0x94, cmdsn=c.cmdsn))
    replies = expect_close(c, allow=lambda r: r.opcode in (pdus.LOGOUT_RSP, pdus.NOP_IN, pdus.REJECT))
    assert replies and replies[0].opcode in (pdus.LOGOUT_RSP, pdus.NOP_IN)

    # Connect and leave at once, connect and half-close, connect and send half a header
    for payload in (b"", b"\x43", pdus.login_request(base)[:30]):
        c = fuzz_initiator(server).connect()
        if payload:
            c.send_raw(payload)
        expect_close(c)
    budget.count(10)
    assert good.error is None


# --- random and mutated input ---------------------------------------------------------------------------

SAFE_CDBS = [
    lambda rng: pdus.read10(FUZZ_LBA + rng.randrange(1000), rng.choice((0, 1, 8, 300))),
    lambda rng: pdus.write10(FUZZ_LBA + rng.randrange(1000), rng.choice((0, 1, 8))),
    lambda rng: pdus.TEST_UNIT_READY,
    lambda rng: bytes((0x12, rng.choice((0, 1)), rng.choice((0, 0x80, 0x83, 0xB0, 0x55)), 0, rng.randrange(256), 0)),
    lambda rng: bytes((0x25,)) + bytes(9),                       # READ CAPACITY(10)
    lambda rng: bytes((0x9E, 0x10)) + bytes(8) + (32).to_bytes(4, "big") + bytes(2),  # READ CAPACITY(16)
    lambda rng: bytes((0xA0, 0, 0, 0, 0, 0)) + rng.randrange(1 << 16).to_bytes(4, "big") + bytes(2),  # REPORT LUNS
    lambda rng: bytes((rng.choice((0x02, 0x0E, 0xC0, 0xD7, 0xFF)),)) + rng.randbytes(15),  # unknown opcodes
    lambda rng: bytes((0x88,)) + bytes(1) + (FUZZ_LBA + 7).to_bytes(8, "big") + (4).to_bytes(4, "big") + bytes(2),
]


def sanitize(wire: bytes, rng: random.Random) -> bytes:
    """Keep a mutated PDU from doing legal things that would touch the good client's session or data
    (a write to its LBAs, a LUN/target reset, a reservation): the target would be right to let it."""
    if len(wire) < 48:
        return wire
    b = bytearray(wire)
    op = b[0] & 0x3F
    if op == pdus.SCSI_CMD:
        b[32:48] = rng.choice(SAFE_CDBS)(rng).ljust(16, b"\0")
    elif op == pdus.TMF_REQ:
        b[1] = 0x80 | rng.choice((1, 2, 3, 8, 9, 0x7F))  # own session only: abort task (set), unsupported ones
    return bytes(b)


def templates(c: Initiator, rng: random.Random) -> list[bytes]:
    sn, ex = c.cmdsn, c.expstatsn
    return [
        pdus.scsi_command(pdus.write10(FUZZ_LBA, 8), itt=rng.randrange(1, 1 << 31), cmdsn=sn, expstatsn=ex,
                          edtl=4096, write=True, data=rng.randbytes(rng.choice((0, 512, 4096)))),
        pdus.scsi_command(pdus.read10(FUZZ_LBA, 8), itt=rng.randrange(1, 1 << 31), cmdsn=sn, edtl=4096, read=True),
        pdus.scsi_command(pdus.write10(FUZZ_LBA, 8), itt=7, cmdsn=sn, edtl=4096, write=True, final=False),
        pdus.data_out(rng.randbytes(512), itt=7, offset=rng.choice((0, 512, 4096)), datasn=rng.randrange(3)),
        pdus.nop_out(itt=rng.randrange(1 << 31), cmdsn=sn, data=rng.randbytes(rng.randrange(64))),
        pdus.nop_out(itt=pdus.RESERVED_TAG, ttt=rng.randrange(1 << 32), cmdsn=sn),
        pdus.text_request({"SendTargets": rng.choice(("All", "", c.target, "iqn.x"))}, itt=rng.randrange(1 << 31),
                          cmdsn=sn),
        pdus.text_request(rng.randbytes(rng.randrange(100)), itt=rng.randrange(1 << 31), cmdsn=sn),
        pdus.task_mgmt(1, itt=rng.randrange(1 << 31), cmdsn=sn, rtt=7),
        pdus.snack(itt=7, snack_type=rng.randrange(4)),
        pdus.logout_request(itt=rng.randrange(1 << 31), cmdsn=sn, reason=rng.choice((0, 1, 2, 3))),
        pdus.login_request({"InitiatorName": c.name}, itt=1, cmdsn=sn),
    ]


def one_fuzz_connection(server: object, rng: random.Random) -> int:
    """Log in (mostly), send a few mutated PDUs, then ping: the target must answer with legal PDUs and
    either still answer the ping or close the connection. Returns how many inputs were sent."""
    kind = rng.random()
    c = fuzz_initiator(server).connect()
    sent = 0
    try:
        if kind < 0.1:  # random bytes before login
            c.send_raw(rng.randbytes(rng.randrange(1, 400)))
            expect_close(c, allow=lambda r: r.opcode == pdus.LOGIN_RSP and r.login_status[0] != 0)
            return 1
        if kind < 0.25:  # a mutated login
            keys = {"InitiatorName": c.name, "TargetName": c.target,
                    rng.choice(("MaxBurstLength", "FooBar", "HeaderDigest", "X-a")): rng.choice(("1", "²", "Yes"))}
            c.send_raw(pdus.mutate(pdus.login_request(keys, isid=c.isid), rng))
            expect_close(c, allow=lambda r: r.opcode == pdus.LOGIN_RSP)
            return 1
        c.login()
        for _ in range(rng.randrange(1, 8)):
            t = rng.choice(templates(c, rng))
            wire = rng.randbytes(rng.randrange(1, 200)) if rng.random() < 0.05 else \
                sanitize(pdus.mutate(t, rng, keep_length=rng.random() < 0.85), rng)
            c.send_raw(wire)
            sent += 1
        itt = 0x7FFFFFF0
        c.send_raw(pdus.nop_out(itt=itt, cmdsn=c.cmdsn, data=b"alive?"))
        assert c.sock is not None
        c.sock.settimeout(0.75)  # loopback answers in milliseconds; longer means the stream is out of frame
        try:
            while True:
                r = c.recv()
                if r.opcode == pdus.REJECT:
                    assert r.reject_reason in KNOWN_REJECT_REASONS, f"Reject reason {r.reject_reason:#x}"
                    assert len(r.data) == 48
                if r.opcode == pdus.LOGIN_RSP:
                    raise ProtocolViolation("Login Response in full feature phase")
                if r.opcode == pdus.NOP_IN and r.itt == itt:
                    assert r.data == b"alive?"
                    break
        except TimeoutError:
            # the ping may sit inside a data segment a mutation announced: half-close; the target must close
            expect_close(c, allow=lambda r: True)
            return sent
        except Closed:
            return sent
        c.close()
        return sent
    except Closed:
        return sent
    finally:
        c.close()


def run_random(server: object, seed: int, connections: int, workers: int = 8) -> int:
    def worker(i: int) -> int:
        rng = random.Random(seed * 1_000_003 + i)
        try:
            return one_fuzz_connection(server, rng)
        except Exception as e:
            raise AssertionError(f"seed {seed} connection {i}: {e!r}") from e

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(worker, range(connections)))


@pytest.mark.parametrize("seed", budget.SEEDS[:2])
def test_random_and_mutated_pdus_beside_good_client(served: tuple[object, GoodClient], seed: int) -> None:
    server, good = served
    n = run_random(server, seed, int(os.environ.get("FUZZ_LIVE_CONNECTIONS", "400")))
    budget.count(n)
    assert server.running  # type: ignore[attr-defined]
    assert good.error is None, repr(good.error)


@pytest.mark.soak
def test_soak_live(served: tuple[object, GoodClient]) -> None:
    server, good = served
    n = run_random(server, 99, max(1, budget.soak_inputs() // 5))
    budget.count(n)
    assert good.error is None, repr(good.error)
