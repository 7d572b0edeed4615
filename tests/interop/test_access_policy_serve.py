"""CHAP on iSCSI cannot be walked around through another protocol: `vsan config check` and `vsan serve` refuse
a volume that is authenticated on one export and open on another, and name the open one; an export marked
allow_unauthenticated is served open on purpose, and serve says so."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from vsan_harness import VSAN, VsanServer, require_tools, run

pytestmark = pytest.mark.interop

USER, SECRET = "alice", "horse-battery1"


def test_chap_lun_with_open_nbd_export_is_refused(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    server = vsan(chap=(USER, SECRET), nbd=True, start=False)
    check = run([VSAN, "config", "check", server.config], check=False)
    assert check.returncode == 2, check.stdout
    assert check.stdout.count("\n") == 1, check.stdout  # one line
    assert 'nbd.exports[0]: volume "disk0" needs CHAP on iSCSI target' in check.stdout
    assert "NBD export disk0 is open (no TLS)" in check.stdout
    assert "allow_unauthenticated = true" in check.stdout
    data = tmp_path / "never-made"
    serve = run([VSAN, "serve", "--config", server.config, "--data-dir", data], check=False, timeout=30)
    assert serve.returncode == 2, serve.stdout
    assert "nbd.exports[0]" in serve.stdout
    assert not data.exists(), "a refused config touched the data dir"


def test_allow_unauthenticated_serves_it_open_and_logs_it(vsan: Callable[..., VsanServer]) -> None:
    require_tools("nbdinfo", "iscsi-readcapacity16")
    server = vsan(chap=(USER, SECRET), nbd=True, start=False)
    server.config.write_text(server.config.read_text() + "allow_unauthenticated = true\n")
    check = run([VSAN, "config", "check", server.config])
    assert "warning: volume disk0: NBD export disk0 is open (no TLS, allow_unauthenticated = true) while iSCSI " \
           "target" in " ".join(check.stdout.split()), check.stdout
    server.start()
    assert "NBD export disk0 is open (no TLS, allow_unauthenticated = true)" in server.log.read_text()
    # open on NBD by the admin's choice; iSCSI still needs CHAP
    assert run(["nbdinfo", "--size", server.nbd_url()]).stdout.strip() == str(64 << 20)
    bad = run(["iscsi-readcapacity16", "-s", server.url(user=USER, secret="not-the-secret")], check=False)
    assert bad.returncode != 0
