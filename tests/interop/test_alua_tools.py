"""Implicit ALUA as initiators see it, over a real iSCSI login to a real `vsan serve`: TPGS in INQUIRY
(libiscsi's iscsi-inq and sg3-utils' sg_inq), the VPD 83h relative target port and target port group of
the port each command came in on (decoded by sg_inq), and REPORT TARGET PORT GROUPS (SPC-4 6.36), which
must list that group and port, the check Linux's scsi_dh_alua makes before it trusts a path.

No kernel initiator here, so sg_rtpg (which needs a /dev/sg device) cannot run: our initiator
(openvsan.initiator) sends REPORT TARGET PORT GROUPS and INQUIRY, and sg_inq --inhex decodes the INQUIRY
data. The volume is exported by two targets, portal group tags 1 and 7: one LU seen through two target
ports, in the default model's one active/optimized group."""

from __future__ import annotations

import asyncio
import re
import struct
from collections.abc import Callable
from pathlib import Path

from vsan_harness import TEST_INITIATOR, VsanServer, require_tools, run

from openvsan.initiator import scsi as X
from openvsan.initiator.iscsi import IscsiInitiator

IQN_B = "iqn.2026-11.org.openvsan:disk0-b"


def rtpg(extended: bool, alloc: int = 1024) -> bytes:
    return struct.pack(">BBxxxxIxx", 0xA3, (0x20 if extended else 0) | 0x0A, alloc)


def two_ports(vsan: Callable[..., VsanServer]) -> VsanServer:
    server = vsan(start=False)
    text = server.config.read_text()
    text = text.replace("luns = [", "portal_group_tag = 1\nluns = [", 1)
    text += f'\n[[iscsi.targets]]\niqn = "{IQN_B}"\nportal_group_tag = 7\nluns = [{{ lun = 0, volume = "disk0" }}]\n'
    server.config.write_text(text)
    server.start()
    return server


def sg_inq(data: bytes, tmp: Path, *args: str) -> str:
    f = tmp / f"inq-{len(list(tmp.iterdir()))}.hex"
    f.write_text(data.hex(" "))
    return run(["sg_inq", f"--inhex={f}", *args]).stdout


def test_inquiry_says_implicit_alua(server: VsanServer, tmp_path: Path) -> None:
    require_tools("iscsi-inq", "sg_inq")
    out = run(["iscsi-inq", "-i", TEST_INITIATOR, server.url()]).stdout
    assert re.search(r"^TPGS:1$", out, re.MULTILINE), out

    async def std() -> bytes:
        dev = await IscsiInitiator.open_url(server.url())
        try:
            return bytes(await dev.command(X.inquiry(None, 96), read_len=96))
        finally:
            await dev.close()

    decoded = sg_inq(asyncio.run(std()), tmp_path)
    assert re.search(r"\bTPGS=1\b", decoded), decoded


def test_each_port_names_itself_and_rtpg_lists_it(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    require_tools("iscsi-inq", "sg_inq")
    server = two_ports(vsan)
    url_a, url_b = server.url(), server.url().replace(server.iqn, IQN_B)
    for url in (url_a, url_b):   # libiscsi sees both target port designators on either target
        ids = run(["iscsi-inq", "-i", TEST_INITIATOR, "-e", "1", "-c", "131", url]).stdout
        assert "Designator Type:(4) RELATIVE_TARGET_PORT" in ids, ids
        assert "Designator Type:(5) TARGET_PORT_GROUP" in ids, ids

    async def ask() -> dict[str, bytes]:
        a = await IscsiInitiator.open_url(url_a)
        b = await IscsiInitiator.open_url(url_b)
        try:
            got = {"vpd_a": bytes(await a.command(X.inquiry(0x83, 255), read_len=255)),
                   "vpd_b": bytes(await b.command(X.inquiry(0x83, 255), read_len=255))}
            for name, dev in (("a", a), ("b", b)):
                got[f"rtpg_{name}"] = bytes(await dev.command(rtpg(False), read_len=1024))
                got[f"ext_{name}"] = bytes(await dev.command(rtpg(True), read_len=1024))
            got["short"] = bytes(await a.command(rtpg(False, 4), read_len=4))
            got["rsoc"] = bytes(await a.command(struct.pack(">BBBBHIxx", 0xA3, 0x0C, 0x02, 0xA3, 0x0A, 64),
                                                read_len=64))
            return got
        finally:
            await a.close()
            await b.close()

    got = asyncio.run(ask())
    ports = {}
    for name, want_port in (("vpd_a", 1), ("vpd_b", 7)):
        decoded = sg_inq(got[name], tmp_path, "--page=0x83")
        rel = re.search(r"Relative target port: 0x([0-9a-f]+)", decoded)
        grp = re.search(r"Target port group: 0x([0-9a-f]+)", decoded)
        assert rel and grp, decoded
        assert int(rel.group(1), 16) == want_port, decoded
        ports[want_port] = int(grp.group(1), 16)
    assert ports == {1: 1, 7: 1}   # one group holds both ports

    for which in ("a", "b"):
        plain, ext = got[f"rtpg_{which}"], got[f"ext_{which}"]
        # one descriptor: active/optimized, T/U/S/AN/AO supported, group 1, two ports: 1 and 7
        body = bytes.fromhex("008f0001" "00000002" "00000001" "00000007")
        assert plain == struct.pack(">I", len(body)) + body, plain.hex()
        assert ext == struct.pack(">IBBxx", len(body) + 4, 0x10, 0) + body, ext.hex()
    assert got["short"] == struct.pack(">I", 16)          # the allocation length cuts, the header says all
    assert got["rsoc"][1] & 0x07 == 3 and got["rsoc"][4:6] == b"\xa3\xea"   # supported, as the usage says
