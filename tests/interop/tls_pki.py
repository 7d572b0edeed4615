"""X.509 files for TLS tests, made with the openssl CLI: a CA, a server and client certificates, laid out the way
GnuTLS-based clients read a directory (QEMU's tls-creds-x509 dir=, libnbd's tls-certificates=, nbdkit):
ca-cert.pem, server-cert.pem / server-key.pem, client-cert.pem / client-key.pem."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

SERVER_EXT = "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature\n"
CLIENT_EXT = "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature\n"
CLIENT_SUBJECT = "/O=openvsan test/CN=client1"


@dataclass(frozen=True)
class Pki:
    server: Path     # ca-cert.pem (the clients' CA), server-cert.pem, server-key.pem
    client: Path     # ca-cert.pem, client-cert.pem, client-key.pem (signed by the CA)
    nocert: Path     # ca-cert.pem only: trusts the server, has no certificate of its own
    stranger: Path   # ca-cert.pem, and a client certificate signed by another CA

    @property
    def ca(self) -> Path:
        return self.server / "ca-cert.pem"


def _openssl(*args: str | Path) -> None:
    p = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, check=False)
    if p.returncode:
        pytest.fail(f"openssl {' '.join(map(str, args))}: {p.stderr}", pytrace=False)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}-key.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key,
             "-out", cert, "-days", "2", "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def _issue(d: Path, name: str, subject: str, ext: str, ca: tuple[Path, Path]) -> None:
    key, csr, cert, extfile = (d / f"{name}-key.pem", d / f"{name}.csr", d / f"{name}-cert.pem", d / f"{name}.ext")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key,
             "-out", csr, "-subj", subject)
    extfile.write_text(ext)
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial", "-out", cert,
             "-days", "2", "-extfile", extfile)
    csr.unlink()
    extfile.unlink()


def make_pki(root: Path) -> Pki:
    if shutil.which("openssl") is None:
        pytest.fail("missing openssl: apt-get install openssl", pytrace=False)
    authority = root / "authority"
    pki = Pki(root / "server", root / "client", root / "nocert", root / "stranger")
    for d in (authority, pki.server, pki.client, pki.nocert, pki.stranger):
        d.mkdir(parents=True)
    ca = _ca(authority, "ca")
    other = _ca(authority, "other-ca")
    _issue(pki.server, "server", "/CN=localhost", SERVER_EXT, ca)
    _issue(pki.client, "client", CLIENT_SUBJECT, CLIENT_EXT, ca)
    _issue(pki.stranger, "client", "/CN=stranger", CLIENT_EXT, other)
    for d in (pki.server, pki.client, pki.nocert, pki.stranger):
        shutil.copy(ca[0], d / "ca-cert.pem")
        for f in d.glob("*-key.pem"):
            f.chmod(0o600)
    return pki
