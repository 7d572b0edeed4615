"""The NBD client initiator's URLs (initiator/nbd.py); its I/O against our NbdServer is in
tests/integration/test_nbd_client_loopback.py."""

from __future__ import annotations

import pytest

from openvsan.initiator.nbd import parse_nbd_url
from openvsan.initiator.url import UrlError


def test_url_forms() -> None:
    u = parse_nbd_url("nbd://127.0.0.1/disk0?connections=4")
    assert (u.host, u.port, u.export, u.connections) == ("127.0.0.1", 10809, "disk0", 4)
    assert parse_nbd_url("nbd://[::1]:10810/a%20b").export == "a b"
    for bad in ("nbd://", "nbd://h:99999/x", "nbd://h/x?connections=0", "http://h/x"):
        with pytest.raises(UrlError):
            parse_nbd_url(bad)
