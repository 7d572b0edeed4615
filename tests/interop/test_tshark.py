"""Wireshark's iSCSI and SCSI dissectors read everything the target sends, and find nothing malformed.

A capture on lo (dumpcap, from tshark's wireshark-common) of discovery, logins with CHAP, INQUIRY and VPD
pages, READ CAPACITY, large writes (R2T + Data-Out), reads, WRITE SAME, UNMAP, SYNCHRONIZE CACHE and
logouts, then `tshark` with the iSCSI dissector on the test's port: no `[Malformed Packet]`, no error-level
expert info. One known false alarm is allowed: a VPD page cut short at the initiator's ALLOCATION LENGTH
(SPC-4 6.6.1 says to do exactly that, and libiscsi asks with 64 bytes first), which the SCSI dissector
cannot parse to its end. TCP retransmissions (the kernel's, on lo under load) are not judged: their bytes are
dissected in their first copy.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from vsan_harness import TEST_INITIATOR, VsanServer, qemu_io, require_root, require_tools, run

pytestmark = pytest.mark.interop

USER, SECRET = "alice", "horse-battery1"


def capture(port: int, out: Path, log: Path) -> subprocess.Popen[bytes]:
    require_tools("tshark")
    with open(log, "wb") as err:
        # -B: a 64 MiB kernel buffer, so 4 MiB writes over loopback are not dropped
        proc = subprocess.Popen(
            ["dumpcap", "-q", "-i", "lo", "-f", f"tcp port {port}", "-B", "64", "-s", "0", "-w", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    deadline = time.monotonic() + 15
    while "Capturing on" not in log.read_text(errors="replace") or not out.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"dumpcap did not start:\n{log.read_text(errors='replace')}", pytrace=False)
        time.sleep(0.05)
    # "Capturing on" comes a moment before the filter sees packets: connect (and hang up) until one is written
    base = out.stat().st_size
    while out.stat().st_size == base:
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("dumpcap captured nothing of a TCP connection to the target", pytrace=False)
        with socket.socket() as s:
            s.connect(("127.0.0.1", port))
        time.sleep(0.1)
    return proc


def tshark_fields(cap: Path, port: int, display_filter: str, *fields: str) -> list[list[str]]:
    argv = ["tshark", "-r", cap, "-d", f"tcp.port=={port},iscsi", "-Y", display_filter, "-T", "fields"]
    for f in fields:
        argv += ["-e", f]
    out = run(argv, timeout=120).stdout
    return [line.split("\t") for line in out.splitlines() if line and not line.startswith("Running as user")]


def test_dissectors_find_nothing_malformed(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    require_root("capturing on lo")
    require_tools("tshark", "iscsi-ls", "iscsi-inq", "iscsi-readcapacity16", "qemu-io")
    server = vsan(chap=(USER, SECRET))
    cap, cap_log = tmp_path / "iscsi.pcapng", tmp_path / "dumpcap.log"
    dumpcap = capture(server.port, cap, cap_log)
    try:
        url = server.url()
        run(["iscsi-ls", "-i", TEST_INITIATOR, server.portal_url()])  # discovery needs no CHAP here
        run(["iscsi-inq", "-i", TEST_INITIATOR, url])
        for page in ("0", "128", "131", "176", "177", "178"):
            run(["iscsi-inq", "-i", TEST_INITIATOR, "-e", "1", "-c", page, url])
        run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, url])
        qemu_io(
            url,
            "write -P 1 0 4M",
            "read -P 1 0 4M",
            "write -f -P 2 4M 64k",
            "write -z 1M 1M",
            "discard 2M 64k",
            "flush",
            "read -P 0 1M 1M",
        )
        time.sleep(0.5)  # let the last FIN/ACKs reach the capture
    finally:
        dumpcap.send_signal(signal.SIGTERM)
        dumpcap.wait(timeout=30)
    stats = cap_log.read_text(errors="replace")
    m = re.search(r"Packets received/dropped on interface '[^']*': (\d+)/(\d+)", stats)
    assert m, stats
    assert int(m.group(2)) == 0, f"dumpcap dropped packets, the analysis would be incomplete:\n{stats}"

    opcodes = {op for row in tshark_fields(cap, server.port, "iscsi", "iscsi.opcode") for op in row[0].split(",")}
    # login, text (SendTargets), SCSI command, Data-Out, logout; and their answers, R2T, Data-In
    for op in ("0x03", "0x04", "0x01", "0x05", "0x06", "0x23", "0x24", "0x21", "0x31", "0x25", "0x26"):
        assert op in opcodes, f"no iSCSI opcode {op} in the capture (dissector not applied?): {sorted(opcodes)}"

    # A TCP retransmission on lo (the kernel dropped a segment under load and sent it again) carries bytes the
    # capture already holds: Wireshark's TCP reassembly flags the overlap as an error of its own, not of any PDU
    # (seen once in CI: "Reassembly error, protocol TCP: New fragment overlaps old data (retransmission?)").
    # The first copy of those bytes was dissected with the rest.
    bad = tshark_fields(
        cap,
        server.port,
        '(_ws.malformed || _ws.expert.severity >= "Error") && !tcp.analysis.retransmission'
        " && !tcp.analysis.fast_retransmission && !tcp.analysis.spurious_retransmission",
        "frame.number",
        "iscsi.datasegmentlength",
        "iscsi.request_frame",
        "_ws.col.Info",
    )
    problems = []
    for frame, dsl, request, info in bad:
        if "(Inquiry Response Data)" in info and request:
            alloc = tshark_fields(cap, server.port, f"frame.number == {request}", "scsi.cdb.alloclen16")
            if alloc and alloc[0][0] and dsl and int(dsl.split(",")[0]) == int(alloc[0][0]):
                continue  # cut at the ALLOCATION LENGTH, as SPC-4 asks
        problems.append(f"frame {frame}: {info}")
    if problems:
        detail = run(
            [
                "tshark",
                "-r",
                cap,
                "-d",
                f"tcp.port=={server.port},iscsi",
                "-V",
                "-Y",
                f"frame.number == {problems[0].split()[1].rstrip(':')}",
            ]
        ).stdout
        pytest.fail(
            f"{len(problems)} malformed or error frames in {cap}:\n"
            + "\n".join(problems[:20])
            + f"\n\nfirst one in full:\n{detail[-6000:]}",
            pytrace=False,
        )
