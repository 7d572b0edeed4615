"""Descriptor and connection limits of a real `vsan serve` (issue 10): started under `ulimit -n 1024`, it raises
its soft RLIMIT_NOFILE to the hard limit, and a 2,000-connection idle flood from one address on each of its
iSCSI, NVMe/TCP and NBD portals neither stops the sessions logged in before it nor new logins from another
address (libiscsi's iscsi-ls, qemu-img, nbdinfo, the NVMe/TCP test host); the log says so in a few lines,
with counts."""

from __future__ import annotations

import asyncio
import re
import resource
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from nvme_host import Queue, connect_controller
from vsan_harness import IQN, VsanServer, require_root, require_tools, run

from openvsan.initiator.iscsi import IscsiInitiator
from openvsan.initiator.nbd import NbdInitiator

pytestmark = pytest.mark.interop

NQN = "nqn.2026-11.org.openvsan:limits"
FLOOD = 2000            # idle connections per portal, all from FLOOD_FROM
FLOOD_FROM = "127.0.0.2"  # the whole of 127/8 is loopback on Linux: another address, the same portal
PER_SOURCE = 32         # [node] max_unauthenticated_per_source's default
SERVER_SOFT = 1024      # what systemd starts a service with
MIN_HARD = 4 * FLOOD + 1024   # the test holds 3 x FLOOD sockets itself


def write_config(server: VsanServer) -> None:
    server.config.write_text(f"""\
[node]
name = "limits"

[[devices]]
name = "ram0"
type = "ram"
size = "64MiB"

[[volumes]]
name = "disk0"
device = "ram0"

[iscsi]
portals = ["127.0.0.1:{server.port}"]

[[iscsi.targets]]
iqn = "{IQN}"
luns = [{{ lun = 0, volume = "disk0" }}]

[nvme]
portals = ["127.0.0.1:{server.nvme_port}"]

[[nvme.subsystems]]
nqn = "{NQN}"
namespaces = [{{ nsid = 1, volume = "disk0" }}]

[nbd]
portals = ["127.0.0.1:{server.nbd_port}"]

[[nbd.exports]]
name = "disk0"
volume = "disk0"
""")


@contextmanager
def soft_nofile(soft: int) -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE for a while: what a child started meanwhile inherits."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def nofile_of(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"/proc/{pid}/limits has no Max open files line")


def flood(port: int, n: int, held: list[socket.socket]) -> None:
    """n idle TCP connections from FLOOD_FROM, kept open in `held`. A refused one is accepted and reset by the
    server, so connect() itself succeeds either way."""
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.append(s)
        s.settimeout(10)
        s.bind((FLOOD_FROM, 0))
        s.connect(("127.0.0.1", port))


def refused_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "refused" in line and FLOOD_FROM in line]


def refusals_counted(lines: list[str]) -> int:
    """The refused connections the log accounts for: one for each line logged whole, N for each summary."""
    total = 0
    for line in lines:
        m = re.search(r": (\d+) connections? refused in the last \d+ s \((iSCSI|NVMe/TCP|NBD): .*\) from "
                      + re.escape(FLOOD_FROM) + r" x(\d+)$", line)
        if m:
            assert m.group(1) == m.group(3), line  # one address: its tally is the whole count
            total += int(m.group(1))
        else:
            assert re.search(re.escape(FLOOD_FROM) + r":\d+: (iSCSI|NVMe/TCP|NBD) connection refused: ", line), line
            total += 1
    return total


async def still_working(server: VsanServer, iscsi: IscsiInitiator, nbd: NbdInitiator, nvme_io: Queue,
                        round_: int) -> None:
    """The sessions logged in before the flood do I/O, and new logins from 127.0.0.1 work on all three."""
    pattern = bytes([0x40 + round_]) * 4096
    await iscsi.write(8 * round_, pattern)
    assert bytes(await nbd.read(8 * round_, 8)) == pattern
    assert await nvme_io.write(1, 8 * round_ + 1024, pattern) == 0
    assert bytes(await iscsi.read(8 * round_ + 1024, 8)) == pattern
    status, data = await nvme_io.read(1, 8 * round_, 8)
    assert status == 0 and data == pattern

    def tools() -> None:
        assert IQN in run(["iscsi-ls", "-s", f"iscsi://127.0.0.1:{server.port}"], timeout=20).stdout
        assert "virtual size: 64 MiB" in run(["qemu-img", "info", "-f", "raw", server.url()], timeout=20).stdout
        assert "export-size: 67108864" in run(["nbdinfo", server.nbd_url()], timeout=20).stdout

    await asyncio.to_thread(tools)
    admin, (io,) = await connect_controller(server.nvme_port, NQN)
    try:
        status, data = await io.read(1, 8 * round_, 8)
        assert status == 0 and data == pattern
    finally:
        await io.close()
        await admin.close()


def test_flood_from_one_address(vsan: Callable[..., VsanServer]) -> None:
    require_tools("iscsi-ls", "qemu-img", "nbdinfo")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < MIN_HARD:
        require_root(f"the hard RLIMIT_NOFILE ({hard}) must be raised to {MIN_HARD} for the flood")
        hard = MIN_HARD
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        server = vsan(start=False)
        write_config(server)
        with soft_nofile(SERVER_SOFT):
            server.start()
        assert server.proc is not None
        assert nofile_of(server.proc.pid) == (hard, hard)
        assert f"file descriptors: soft limit raised from {SERVER_SOFT} to {hard}" in server.log_text()
        asyncio.run(flood_while_serving(server))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def flood_while_serving(server: VsanServer) -> None:
    iscsi = await IscsiInitiator.open_url(server.url())
    nbd = await NbdInitiator.open_url(server.nbd_url())
    admin, (nvme_io,) = await connect_controller(server.nvme_port, NQN)
    held: list[socket.socket] = []
    try:
        await still_working(server, iscsi, nbd, nvme_io, 0)
        started = time.monotonic()
        for round_, port in enumerate((server.port, server.nvme_port, server.nbd_port), 1):
            await asyncio.to_thread(flood, port, FLOOD, held)
            await still_working(server, iscsi, nbd, nvme_io, round_)
        # every never-logged-in connection is held at once: the flood is over before any login timeout
        assert time.monotonic() - started < 25, "the flood took too long to mean anything"
        for s in held:
            s.close()
        held.clear()
        await still_working(server, iscsi, nbd, nvme_io, 4)
    finally:
        for s in held:
            s.close()
        await iscsi.close()
        await nbd.close()
        await nvme_io.close()
        await admin.close()

    # all but the first PER_SOURCE were refused, and the log accounts for each of them in a few lines,
    # once the summaries of the interval (10 s) are out
    want = 3 * FLOOD - PER_SOURCE
    deadline = time.monotonic() + 25
    while True:
        lines = refused_lines(server.log_text())
        if refusals_counted(lines) >= want or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert refusals_counted(lines) == want, "\n".join(lines)
    assert 3 <= len(lines) <= 12, "\n".join(lines)
    assert any("max_unauthenticated_per_source" in line for line in lines)


def test_flood_from_many_addresses_leaves_room_for_a_new_login(vsan: Callable[..., VsanServer]) -> None:
    """24 addresses x 32 idle connections fill [node] max_unauthenticated (512) on the iSCSI portal: a login
    from another address still gets in, because the limits close the oldest waiting connection of the
    busiest address to make room for it."""
    require_tools("iscsi-ls")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 24 * PER_SOURCE + 1024
    if hard < need:
        require_root(f"the hard RLIMIT_NOFILE ({hard}) must be raised to {need} for the flood")
        hard = need
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server = vsan(start=False)
    write_config(server)
    server.start()
    held: list[socket.socket] = []
    try:
        for i in range(24):
            for _ in range(PER_SOURCE):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.settimeout(10)
                s.bind((f"127.0.1.{10 + i}", 0))
                s.connect(("127.0.0.1", server.port))
        time.sleep(0.5)   # the server has taken them all in
        listed = run(["iscsi-ls", "-s", server.portal_url()], timeout=30)
        assert IQN in listed.stdout, listed.stdout
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    log = server.log_text()
    assert "closed to make room for another address ([node] max_unauthenticated)" in log, log[-3000:]
