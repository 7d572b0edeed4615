"""libiscsi's command-line tools (Debian libiscsi-bin) against a real `vsan serve`: discovery, INQUIRY, capacity."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from vsan_harness import IQN, TEST_INITIATOR, VsanServer, require_tools, run

pytestmark = pytest.mark.interop


def test_iscsi_ls_lists_the_lun(server: VsanServer) -> None:
    require_tools("iscsi-ls")
    out = run(["iscsi-ls", "-i", TEST_INITIATOR, "-s", server.portal_url()]).stdout
    assert f"Target:{IQN} Portal:127.0.0.1:{server.port}" in out, out
    assert re.search(r"^Lun:0\s+Type:DIRECT_ACCESS", out, re.MULTILINE), out


def test_sendtargets_discovery(server: VsanServer) -> None:
    """iscsi-ls without -s is a discovery session with SendTargets=All and nothing else."""
    require_tools("iscsi-ls")
    out = run(["iscsi-ls", "-i", TEST_INITIATOR, server.portal_url()]).stdout
    assert re.search(rf"^Target:{re.escape(IQN)} Portal:127\.0\.0\.1:{server.port},\d+$", out, re.MULTILINE), out
    urls = run(["iscsi-ls", "-i", TEST_INITIATOR, "--url", server.portal_url()]).stdout
    assert f"iscsi://127.0.0.1:{server.port}/{IQN}" in urls, urls


def test_standard_inquiry(server: VsanServer) -> None:
    require_tools("iscsi-inq")
    out = run(["iscsi-inq", "-i", TEST_INITIATOR, server.url()]).stdout
    assert "Peripheral Qualifier:CONNECTED" in out, out
    assert "Peripheral Device Type:DIRECT_ACCESS" in out, out
    assert re.search(r"^Vendor:\S", out, re.MULTILINE) and re.search(r"^Product:\S", out, re.MULTILINE), out
    assert "CmdQue:1" in out, out  # libiscsi and the Linux initiator only queue commands when it is set


def test_vpd_pages(server: VsanServer) -> None:
    """SPC-4 7.8: the pages the issue requires are listed, and 0x80/0x83 carry a serial and NAA + T10 ids."""
    require_tools("iscsi-inq")
    pages = run(["iscsi-inq", "-i", TEST_INITIATOR, "-e", "1", server.url()]).stdout
    for code in ("0x00", "0x80", "0x83", "0xb0", "0xb1", "0xb2"):
        assert f"Page:{code} " in pages, pages
    serial = run(["iscsi-inq", "-i", TEST_INITIATOR, "-e", "1", "-c", "128", server.url()]).stdout
    m = re.search(r"Unit Serial Number:\[(.*)\]", serial)
    assert m and m.group(1).strip(), serial
    ids = run(["iscsi-inq", "-i", TEST_INITIATOR, "-e", "1", "-c", "131", server.url()]).stdout
    assert "Designator Type:(3) NAA" in ids, ids
    assert "Designator Type:(1) T10_VENDORT_ID" in ids, ids  # (sic: libiscsi's spelling)
    limits = run(["iscsi-inq", "-i", TEST_INITIATOR, "-e", "1", "-c", "176", server.url()]).stdout
    assert "maximum unmap lba count" in limits, limits


def test_vpd_ids_stable_across_restart(vsan: Callable[..., VsanServer]) -> None:
    """An initiator (multipath, VMware, Windows) matches a LUN by its 0x80 serial and 0x83 ids: keep them."""
    require_tools("iscsi-inq")
    server = vsan("shm")

    def ids() -> tuple[str, str]:
        return (
            run(["iscsi-inq", "-i", TEST_INITIATOR, "-e", "1", "-c", "128", server.url()]).stdout,
            run(["iscsi-inq", "-i", TEST_INITIATOR, "-e", "1", "-c", "131", server.url()]).stdout,
        )

    before = ids()
    server.restart()
    assert ids() == before


@pytest.mark.parametrize(
    ("device", "size", "block_size", "blocks"),
    [
        ("ram", "64MiB", 512, 131072),
        ("ram", "64MiB", 4096, 16384),
        ("shm", "32MiB", 512, 65536),
        ("file", "1GiB", 512, 2097152),
        ("null", "2GiB", 512, 4194304),
    ],
)
def test_readcapacity16(vsan: Callable[..., VsanServer], device: str, size: str, block_size: int, blocks: int) -> None:
    require_tools("iscsi-readcapacity16")
    server = vsan(device, size, block_size=block_size)
    out = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, server.url()]).stdout
    assert f"RETURNED LOGICAL BLOCK ADDRESS:{blocks - 1}\n" in out, out
    assert f"LOGICAL BLOCK LENGTH IN BYTES:{block_size}\n" in out, out
    assert f"Total size:{blocks * block_size}\n" in out, out
    if device in ("ram", "shm", "file"):
        assert "LBPME:1" in out, out  # SBC-4 5.16.2: these devices unmap, so say so (Linux then sends UNMAP)
    size_only = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, "-s", server.url()]).stdout
    assert size_only.strip() == str(blocks * block_size)


def test_missing_lun_is_refused(server: VsanServer) -> None:
    """A LUN that is not configured: the command fails (CHECK CONDITION), and the target stays up."""
    require_tools("iscsi-readcapacity16")
    bad = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, server.url(lun=5)], check=False)
    assert bad.returncode != 0, bad.stdout
    run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, server.url()])
