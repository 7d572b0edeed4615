"""NBD over TLS against a real `vsan serve`: libnbd's nbdinfo and nbdcopy on nbds:// URLs, QEMU's NBD driver
with tls-creds-x509, plain clients refused where TLS is required, and client certificates checked.

(Not test_nbd_tls.py: tests/unit has that name, and two test modules of one basename break collection.)"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from tls_pki import CLIENT_SUBJECT, Pki, make_pki
from vsan_harness import VSAN, VsanServer, qemu_io, require_tools, run

pytestmark = pytest.mark.interop

MiB = 1024 * 1024
IHAVEOPT = 0x49484156454F5054
OPT_EXPORT_NAME, OPT_LIST, OPT_STARTTLS, OPT_GO = 1, 3, 5, 7
REP_ACK, REP_SERVER, REP_ERR_TLS_REQD = 1, 2, (1 << 31) + 5


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_server(vsan: Callable[..., VsanServer], pki: Pki, *, verify_client: bool = True, export: str = "") -> VsanServer:
    """disk0 over NBD with [nbd] tls (the export's tls: its default, "require", unless `export` says otherwise)."""
    s = vsan(nbd=True, start=False)
    d = pki.server
    tls = (f'tls = {{ cert = "{d / "server-cert.pem"}", key = "{d / "server-key.pem"}", ca = "{d / "ca-cert.pem"}", '
           f"verify_client = {str(verify_client).lower()} }}")
    text = s.config.read_text()
    portals = f'portals = ["127.0.0.1:{s.nbd_port}"]'
    assert text.count(portals) == 1
    text = text.replace(portals, f"{portals}\n{tls}")
    # the iSCSI LUN of the harness has no CHAP: served open beside an NBD export that checks certificates,
    # on purpose (node/access.py)
    text = text.replace('luns = [{ lun = 0, volume = "disk0" }]',
                        'luns = [{ lun = 0, volume = "disk0" }]\nallow_unauthenticated = true')
    s.config.write_text(text + export)
    s.start()
    return s


def nbds(server: VsanServer, certs: Path, export: str = "disk0") -> str:
    """libnbd's TLS URI: nbds:// with the GnuTLS certificate directory as tls-certificates."""
    return f"nbds://127.0.0.1:{server.nbd_port}/{export}?tls-certificates={certs}"


def qemu_tls(server: VsanServer, certs: Path) -> list[str]:
    return ["--object", f"tls-creds-x509,id=tls0,dir={certs},endpoint=client", "--image-opts",
            f"driver=nbd,host=127.0.0.1,port={server.nbd_port},export=disk0,tls-creds=tls0"]


# --- a raw client, for what the tools do not show -------------------------------------------------------
def raw_connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    greeting = recv_exactly(s, 18)
    assert greeting[:8] == b"NBDMAGIC"
    s.sendall(struct.pack(">I", 3))  # FIXED_NEWSTYLE | NO_ZEROES
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def raw_option(s: socket.socket, opt: int, data: bytes = b"") -> list[tuple[int, bytes]]:
    s.sendall(struct.pack(">QII", IHAVEOPT, opt, len(data)) + data)
    out = []
    while True:
        _, got, rep, n = struct.unpack(">QIII", recv_exactly(s, 20))
        assert got == opt
        out.append((rep, recv_exactly(s, n)))
        if rep != REP_SERVER:
            return out


# --- TLS with client certificates -------------------------------------------------------------------
def test_nbdinfo_over_tls_with_a_client_certificate(vsan: Callable[..., VsanServer], pki: Pki) -> None:
    require_tools("nbdinfo")
    server = tls_server(vsan, pki)
    listed = run(["nbdinfo", "--list", nbds(server, pki.client, "")]).stdout
    assert "with TLS" in listed and 'export="disk0"' in listed, listed
    info = json.loads(run(["nbdinfo", "--json", nbds(server, pki.client)]).stdout)
    assert info["TLS"] is True and info["protocol"] == "newstyle-fixed", info
    (e,) = info["exports"]
    assert e["export-name"] == "disk0" and e["export-size"] == 64 * MiB
    log = server.log_text()
    # the server names the TLS version, cipher and the client certificate's subject
    subject = CLIENT_SUBJECT.strip("/").replace("/", ",")
    assert "NBD TLS TLSv1.3, TLS_" in log and f"client certificate {subject}" in log, server.log_tail()
    assert "NBD export disk0 (67108864 bytes, structured replies, TLS)" in log, server.log_tail()


def test_nbdcopy_writes_and_reads_back_over_tls(vsan: Callable[..., VsanServer], pki: Pki, tmp_path: Path) -> None:
    require_tools("nbdcopy")
    server = tls_server(vsan, pki)
    src, back = tmp_path / "src.raw", tmp_path / "back.raw"
    src.write_bytes(os.urandom(64 * MiB))
    args = ["--connections=4", "--threads=4", "--requests=16"]
    run(["nbdcopy", *args, "--flush", src, nbds(server, pki.client)])
    run(["nbdcopy", *args, nbds(server, pki.client), back])
    assert back.read_bytes() == src.read_bytes()
    assert server.log_text().count("structured replies, TLS)") >= 2, server.log_tail()


def test_qemu_over_tls(vsan: Callable[..., VsanServer], pki: Pki) -> None:
    require_tools("qemu-img", "qemu-io")
    server = tls_server(vsan, pki)
    opts = qemu_tls(server, pki.client)
    info = run(["qemu-img", "info", "--output=json", *opts]).stdout
    assert json.loads(info)["virtual-size"] == 64 * MiB, info
    for cmds in (["write -P 0x5a 0 1M", "write -P 0xa5 63M 512"], ["read -P 0x5a 0 1M", "read -P 0xa5 63M 512"]):
        p = run(["qemu-io", *opts, *(x for c in cmds for x in ("-c", c))])
        assert "Pattern verification failed" not in p.stdout and "failed:" not in p.stdout, p.stdout
    # what QEMU wrote inside TLS is what the iSCSI LUN holds
    qemu_io(server.url(), "read -P 0x5a 0 1M", "read -P 0xa5 63M 512")


# --- plain clients refused --------------------------------------------------------------------------
def test_plain_clients_refused_when_tls_is_required(vsan: Callable[..., VsanServer], pki: Pki) -> None:
    require_tools("nbdinfo", "qemu-img")
    server = tls_server(vsan, pki)
    plain = f"nbd://127.0.0.1:{server.nbd_port}/disk0"
    p = run(["nbdinfo", plain], check=False, env={"LIBNBD_DEBUG": "1"})
    # libnbd turns NBD_REP_ERR_TLS_REQD into "not supported" and logs the server's message when debugging
    assert p.returncode != 0 and "without TLS" in p.stdout, p.stdout
    assert "server error message: this server requires TLS: send NBD_OPT_STARTTLS" in p.stdout, p.stdout
    p = run(["nbdinfo", "--list", f"nbd://127.0.0.1:{server.nbd_port}"], check=False)
    assert p.returncode != 0 and 'export="disk0"' not in p.stdout, p.stdout
    p = run(["qemu-img", "info", plain], check=False)
    assert p.returncode != 0 and "requires TLS" in p.stdout, p.stdout
    # on the wire: FORCEDTLS mode, every option but STARTTLS is NBD_REP_ERR_TLS_REQD, EXPORT_NAME is dropped
    with raw_connect(server.nbd_port) as s:
        assert [r for r, _ in raw_option(s, OPT_LIST)] == [REP_ERR_TLS_REQD]
        go = struct.pack(">I", 5) + b"disk0" + struct.pack(">H", 0)
        assert [r for r, _ in raw_option(s, OPT_GO, go)] == [REP_ERR_TLS_REQD]
        s.sendall(struct.pack(">QII", IHAVEOPT, OPT_EXPORT_NAME, 5) + b"disk0")
        assert s.recv(1) == b""
    with raw_connect(server.nbd_port) as s:
        assert raw_option(s, OPT_STARTTLS) == [(REP_ACK, b"")]   # the way in: STARTTLS is acknowledged
    assert "NBD export disk0 (67108864 bytes" not in server.log_text(), server.log_tail()


# --- client certificates -----------------------------------------------------------------------------
@pytest.mark.parametrize("who", ["nocert", "stranger"])
def test_client_without_a_good_certificate_refused(vsan: Callable[..., VsanServer], pki: Pki, who: str) -> None:
    require_tools("nbdinfo", "qemu-img")
    server = tls_server(vsan, pki)
    certs = getattr(pki, who)
    p = run(["nbdinfo", nbds(server, certs)], check=False)
    assert p.returncode != 0 and "gnutls" in p.stdout.lower(), p.stdout
    p = run(["qemu-img", "info", *qemu_tls(server, certs)], check=False)
    assert p.returncode != 0, p.stdout
    log = server.log_text()
    want = ("TLS handshake failed: no client certificate" if who == "nocert"
            else "TLS handshake failed: client certificate refused: unable to get local issuer certificate")
    lines = [x for x in log.splitlines() if "TLS handshake failed" in x]
    # the first drop is logged whole, naming the peer and why; the second (QEMU's) may be counted in a summary
    assert lines and "127.0.0.1:" in lines[0] and want in lines[0], server.log_tail()
    assert "NBD export disk0 (67108864 bytes" not in log, server.log_tail()


def test_optional_tls_serves_plain_and_tls_clients(vsan: Callable[..., VsanServer], pki: Pki) -> None:
    require_tools("nbdinfo")
    server = tls_server(vsan, pki, verify_client=False, export='tls = "optional"\n')
    plain = json.loads(run(["nbdinfo", "--json", server.nbd_url()]).stdout)
    assert plain["TLS"] is False and plain["exports"][0]["export-name"] == "disk0"
    # no client certificate needed without verify_client: the CA alone, to check the server
    secure = json.loads(run(["nbdinfo", "--json", nbds(server, pki.nocert)]).stdout)
    assert secure["TLS"] is True
    assert "no client certificate" in server.log_text(), server.log_tail()


def test_config_check_names_the_tls_file_that_does_not_load(vsan: Callable[..., VsanServer], pki: Pki) -> None:
    s = vsan(nbd=True, start=False)
    d = pki.server
    text = s.config.read_text().replace(
        f'portals = ["127.0.0.1:{s.nbd_port}"]',
        f'portals = ["127.0.0.1:{s.nbd_port}"]\ntls = {{ cert = "{d / "server-cert.pem"}", '
        f'key = "{pki.client / "client-key.pem"}" }}')
    s.config.write_text(text.replace('luns = [{ lun = 0, volume = "disk0" }]',
                                     'luns = [{ lun = 0, volume = "disk0" }]\nallow_unauthenticated = true'))
    for cmd in (["config", "check", s.config], ["serve", "--config", s.config, "--data-dir", s.data_dir]):
        p = run([VSAN, *cmd], check=False, timeout=30)
        lines = [x for x in p.stdout.splitlines() if x.strip()]
        assert p.returncode != 0 and len(lines) == 1, p.stdout
        assert lines[0].endswith(f"nbd.tls.key: {pki.client / 'client-key.pem'} is not the private key of the "
                                 f"certificate {d / 'server-cert.pem'}"), p.stdout
