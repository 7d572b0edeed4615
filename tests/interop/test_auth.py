"""CHAP, mutual CHAP and initiator-name ACLs, seen from libiscsi and QEMU (RFC 7143 §12.1.3, RFC 1994)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from vsan_harness import IQN, PROBE_INITIATOR, TEST_INITIATOR, VsanServer, qemu_io, qemu_iscsi_opts, require_tools, run

pytestmark = pytest.mark.interop

USER, SECRET = "alice", "horse-battery1"  # 12 to 16 bytes, as the config requires
TARGET_USER, TARGET_SECRET = "target0", "staple-door-22"
OTHER_INITIATOR = "iqn.2026-11.org.openvsan.test:intruder"


def readcap(url: str, initiator: str = TEST_INITIATOR) -> int:
    return run(["iscsi-readcapacity16", "-i", initiator, "-s", url], check=False, timeout=30).returncode


def test_chap(vsan: Callable[..., VsanServer]) -> None:
    require_tools("iscsi-readcapacity16")
    server = vsan(chap=(USER, SECRET))
    assert readcap(server.url(user=USER, secret=SECRET)) == 0
    assert readcap(server.url(user=USER, secret=SECRET + "x")) != 0, "wrong secret accepted"
    assert readcap(server.url(user="mallory", secret=SECRET)) != 0, "wrong user accepted"
    assert readcap(f"iscsi://127.0.0.1:{server.port}/{IQN}/0") != 0, "login without CHAP accepted"
    # a refused login leaves the target serving the others
    assert readcap(server.url(user=USER, secret=SECRET)) == 0


def test_chap_with_qemu(vsan: Callable[..., VsanServer]) -> None:
    server = vsan(chap=(USER, SECRET))
    opts = qemu_iscsi_opts(server)  # carries user= and password=
    qemu_io(opts, "write -P 0x33 0 64k", "read -P 0x33 0 64k", image_opts=True)
    bad = qemu_io(qemu_iscsi_opts(server, password="wrong-secret-123"), "read 0 512", image_opts=True, check=False)
    assert bad.returncode != 0, bad.stdout


def test_mutual_chap(vsan: Callable[..., VsanServer]) -> None:
    """The initiator checks the target's answer too: a target that does not know TARGET_SECRET is refused."""
    require_tools("iscsi-readcapacity16")
    server = vsan(chap=(USER, SECRET), mutual_chap=(TARGET_USER, TARGET_SECRET))
    assert readcap(server.url()) == 0  # url() adds target_user/target_password
    wrong = server.url(target_user=TARGET_USER, target_password=TARGET_SECRET + "x")
    assert readcap(wrong) != 0, "initiator accepted a target that answered with another secret"


def test_initiator_acl(vsan: Callable[..., VsanServer]) -> None:
    require_tools("iscsi-readcapacity16", "iscsi-ls")
    server = vsan(allowed_initiators=[TEST_INITIATOR, PROBE_INITIATOR])
    assert readcap(server.url(), TEST_INITIATOR) == 0
    assert readcap(server.url(), OTHER_INITIATOR) != 0, "initiator outside the ACL logged in"
    listed = run(["iscsi-ls", "-s", "-i", TEST_INITIATOR, server.portal_url()]).stdout
    assert IQN in listed and "Lun:0" in listed, listed
    # SendTargets only reports targets this initiator may log in to (RFC 7143 §11.13 leaves it to the target;
    # reporting a target whose login then fails only confuses the initiator's admin)
    other = run(["iscsi-ls", "-s", "-i", OTHER_INITIATOR, server.portal_url()], check=False).stdout
    assert "Lun:0" not in other, other
    assert readcap(server.url(), TEST_INITIATOR) == 0


# libiscsi offers AuthMethod=CHAP,None whenever it has credentials; when the target answers None (a discovery
# session, or a target without CHAP) it sends InitiatorName again in its next Login Request. Our login accepts
# that identical redeclaration, as tgt does, so `iscsi-ls -s` with the target's CHAP credentials (the way to list
# a CHAP target's LUNs) works.
def test_iscsi_ls_lists_luns_of_a_chap_target(vsan: Callable[..., VsanServer]) -> None:
    require_tools("iscsi-ls")
    server = vsan(chap=(USER, SECRET))
    listed = run(["iscsi-ls", "-s", "-i", TEST_INITIATOR, server.portal_url(user=USER, secret=SECRET)]).stdout
    assert IQN in listed and "Lun:0" in listed, listed


def test_credentials_offered_to_a_target_without_chap(server: VsanServer) -> None:
    require_tools("iscsi-readcapacity16")
    assert readcap(server.url(user=USER, secret=SECRET)) == 0
