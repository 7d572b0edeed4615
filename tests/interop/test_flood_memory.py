"""Bounded memory for peers that never log in (issue 10): a real `vsan serve` (examples/single-node.toml, with a
small RAM disk), 32 raw-socket connections that each declare a 16 MiB segment and then send as much of it as
the server takes, and the server's resident memory sampled from /proc/PID/status the whole time.

Acceptance (the issue's words): "32 never-logged-in connections that each declare a 16 MiB Login segment
raise RSS by < 64 MiB at peak and leave < 16 MiB after they close"; the same bounds for an NVMe/TCP and an
NBD variant, and the server serves afterwards.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import pytest
from vsan_harness import REPO, TEST_INITIATOR, VsanServer, require_tools, run

pytestmark = pytest.mark.interop

EXAMPLE = REPO / "examples" / "single-node.toml"
MIB = 1 << 20
CONNECTIONS = 32
DECLARED = 0xFFFFFC                 # the DataSegmentLength of the report: 16 MiB - 4
TO_SEND = 16 * MIB - 5              # what each connection tries to send behind its header
PEAK_LIMIT = 64 * MIB
LEFT_LIMIT = 16 * MIB
FLOOD_SECONDS = 60.0


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/{pid}/status")


@dataclass
class RssSampler:
    """VmRSS every few milliseconds while the flood runs, and VmHWM around it."""

    pid: int
    samples: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Self:
        self.start = status_kib(self.pid, "VmRSS")
        self.hwm_before = status_kib(self.pid, "VmHWM")
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(status_kib(self.pid, "VmRSS"))
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.hwm_after = status_kib(self.pid, "VmHWM")

    @property
    def peak_rise(self) -> int:
        peak = max(self.samples, default=self.start)
        if self.hwm_after > self.hwm_before:      # a peak between two samples still counts
            peak = max(peak, self.hwm_after)
        return peak - self.start

    def settled_rise(self, timeout: float = 10.0) -> int:
        """RSS above the start once the closed connections are gone (waits for it to come down)."""
        deadline = time.monotonic() + timeout
        while True:
            rise = status_kib(self.pid, "VmRSS") - self.start
            if rise < LEFT_LIMIT or time.monotonic() > deadline:
                return rise
            time.sleep(0.2)


@dataclass
class Flooder:
    """One raw connection: `prologue` (read first, e.g. the NBD greeting), then `header`, then zeros until
    the server closes, TO_SEND bytes have gone, or time runs out. Keeps what the server answered."""

    port: int
    header: bytes
    greeting: int = 0
    sent: int = 0
    answer: bytes = b""
    closed_by_server: bool = False
    error: str = ""

    def run(self, deadline: float) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        except OSError as e:
            self.error = f"connect: {e}"
            return
        with s:
            s.settimeout(2.0)
            try:
                got = b""
                while len(got) < self.greeting:
                    chunk = s.recv(self.greeting - len(got))
                    if not chunk:
                        self.closed_by_server = True
                        return
                    got += chunk
                s.sendall(self.header)
                zeros = bytes(64 * 1024)
                while self.sent < TO_SEND and time.monotonic() < deadline:
                    n = min(len(zeros), TO_SEND - self.sent)
                    try:
                        self.sent += s.send(zeros[:n])
                    except TimeoutError:
                        pass   # the server does not read: see whether it answered and closed
                    if self._drain(s):
                        return
                while time.monotonic() < deadline and not self._drain(s, wait=True):
                    pass
            except (BrokenPipeError, ConnectionResetError):
                self.closed_by_server = True
                self._drain(s)
            except OSError as e:
                self.error = str(e)

    def _drain(self, s: socket.socket, wait: bool = False) -> bool:
        """Read what the server sent; True once it has closed."""
        s.setblocking(wait)
        if wait:
            s.settimeout(0.5)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    self.closed_by_server = True
                    return True
                self.answer += chunk
        except (BlockingIOError, TimeoutError):
            return False
        except (ConnectionResetError, BrokenPipeError):
            self.closed_by_server = True
            return True
        finally:
            s.settimeout(2.0)


def flood(server: VsanServer, port: int, header: bytes, *, greeting: int = 0) -> tuple[list[Flooder], RssSampler]:
    assert server.proc is not None
    floods = [Flooder(port, header, greeting) for _ in range(CONNECTIONS)]
    deadline = time.monotonic() + FLOOD_SECONDS
    with RssSampler(server.proc.pid) as rss:
        threads = [threading.Thread(target=f.run, args=(deadline,), daemon=True) for f in floods]
        for t in threads:
            t.start()
        for t in threads:
            t.join(FLOOD_SECONDS + 15)
    return floods, rss


def check_bounds(what: str, floods: list[Flooder], rss: RssSampler) -> None:
    settled = rss.settled_rise()
    sent = sum(f.sent for f in floods)
    summary = (f"{what}: {CONNECTIONS} connections sent {sent / MIB:.1f} MiB in all; RSS start "
               f"{rss.start / MIB:.1f} MiB, peak rise {rss.peak_rise / MIB:.1f} MiB, after close "
               f"{settled / MIB:.1f} MiB")
    print(summary)
    assert rss.peak_rise < PEAK_LIMIT, summary
    assert settled < LEFT_LIMIT, summary
    assert all(f.closed_by_server for f in floods), [f.error for f in floods if not f.closed_by_server]


@pytest.fixture
def example(vsan: Callable[..., VsanServer]) -> VsanServer:
    """examples/single-node.toml on free ports, with a 64 MiB RAM disk instead of 1 GiB, in one process."""
    text = EXAMPLE.read_text()
    assert 'size = "1GiB"' in text
    server = vsan(start=False)
    # one process: the one whose memory is sampled is the one the connections reach
    assert 'name = "node1"\n' in text
    server.write_example(text.replace('size = "1GiB"', 'size = "64MiB"')
                         .replace('name = "node1"\n', 'name = "node1"\nworkers = 1\n'))
    server.start()
    server.wait_api()    # the REST API loaded (its libraries) before the baseline is taken
    return server


def login_header(dsl: int) -> bytes:
    b = bytearray(48)
    b[0], b[1] = 0x43, 0x81          # RFC 7143 §11.12: Login Request, immediate, T, CSG 0 -> NSG 1
    b[5:8] = dsl.to_bytes(3, "big")
    b[8:14] = b"\x40\0\0\0\0\x01"    # ISID
    struct.pack_into(">I", b, 16, 1)  # ITT
    return bytes(b)


def test_iscsi_login_flood_memory_is_bounded(example: VsanServer) -> None:
    """The acceptance test of issue 10: 32 never-logged-in connections that each declare a 16 MiB Login
    segment raise RSS by < 64 MiB at peak and leave < 16 MiB after they close."""
    require_tools("iscsi-ls", "iscsi-readcapacity16")
    floods, rss = flood(example, example.port, login_header(DECLARED))
    check_bounds("iSCSI", floods, rss)
    # RFC 7143 §11.13.5: each refused with a Login Response, status 0200 (initiator error), from the header
    # alone; the target half-closes and drops what still comes, so the answer is not lost to a reset
    for f in floods:
        assert len(f.answer) == 48, f.answer.hex()
        assert f.answer[0] == 0x23 and f.answer[36:38] == b"\x02\x00", f.answer.hex()
    listed = run(["iscsi-ls", "-i", TEST_INITIATOR, "-s", example.portal_url()]).stdout
    assert "Lun:0" in listed, listed
    cap = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, "-s", example.url()]).stdout
    assert cap.strip() == str(64 * MIB), cap


def nvme_icresp(port: int) -> bytes:
    """A plain ICReq (NVMe/TCP 1.0 §3.6.2.2) on a fresh connection: the ICResp that comes back."""
    icreq = struct.pack("<BBBBIHBBI", 0x00, 0, 128, 0, 128, 0, 0, 0, 0) + bytes(112)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(icreq)
        got = b""
        while len(got) < 128:
            chunk = s.recv(128 - len(got))
            if not chunk:
                break
            got += chunk
    return got


@pytest.mark.parametrize("ptype", [0x00, 0x04], ids=["icreq", "capsule-before-icreq"])
def test_nvme_tcp_flood_memory_is_bounded(example: VsanServer, ptype: int) -> None:
    """NVMe/TCP 1.0 §3.6.1: an ICReq (exactly 128 bytes) or a CapsuleCmd before ICReq declaring a 16 MiB PLEN
    is answered with a C2HTermReq from its 8-byte common header and the connection closes, lingering."""
    hlen = 128 if ptype == 0x00 else 72
    header = struct.pack("<BBBBI", ptype, 0, hlen, 0, 16 * MIB) + bytes(hlen - 8)
    floods, rss = flood(example, example.nvme_port, header)
    check_bounds("NVMe/TCP", floods, rss)
    # every one: the target half-closes and drops what still comes, so no reset destroys the C2HTermReq
    answered = [f.answer for f in floods if len(f.answer) >= 24]
    assert len(answered) == len(floods), f"{len(floods) - len(answered)} of {len(floods)} got no C2HTermReq"
    for a in answered:
        assert a[0] == 0x03, a[:24].hex()                    # C2HTermReq
        fes = int.from_bytes(a[8:10], "little")
        assert fes == (0x01 if ptype == 0x00 else 0x02), a[:24].hex()
    resp = nvme_icresp(example.nvme_port)
    assert len(resp) == 128 and resp[0] == 0x01, resp.hex()  # ICResp: the portal still serves


def test_nbd_option_flood_memory_is_bounded(example: VsanServer) -> None:
    """proto.md option haggling: an option declaring 16 MiB of data is refused from its 16-byte header."""
    require_tools("nbdinfo")
    opt = struct.pack(">IQII", 1, 0x49484156454F5054, 1, 16 * MIB)   # client flags, IHAVEOPT, EXPORT_NAME
    floods, rss = flood(example, example.nbd_port, opt, greeting=18)
    check_bounds("NBD", floods, rss)
    out = run(["nbdinfo", "--size", example.nbd_url()]).stdout
    assert out.strip() == str(64 * MIB), out
