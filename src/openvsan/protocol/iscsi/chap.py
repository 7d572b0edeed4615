"""CHAP for iSCSI login (RFC 7143 §12.1.3, RFC 1994), one-way and mutual.

Algorithms (CHAP_A): 5 = MD5 (RFC 1994), 6 = SHA-1, 7 = SHA-256, 8 = SHA3-256 (the IANA iSCSI CHAP registry,
as Linux uses them). We offer SHA-256 and MD5 and take the first of the initiator's list we know.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os

from openvsan.protocol.iscsi.keys import is_decimal

ALGORITHMS = {5: "md5", 6: "sha1", 7: "sha256", 8: "sha3_256"}
SUPPORTED = (7, 5, 6, 8)
CHALLENGE_LEN = 32


class ChapError(Exception):
    """Authentication failed (login status 0x0201)."""


def decode_binary(value: str) -> bytes:
    """RFC 7143 §6.1 binary-value: 0x<hex> or 0b<base64>."""
    try:
        if value[:2] in ("0x", "0X"):
            h = value[2:]
            return bytes.fromhex(h if len(h) % 2 == 0 else "0" + h)
        if value[:2] in ("0b", "0B"):
            return base64.b64decode(value[2:], validate=True)
    except (ValueError, binascii.Error) as e:
        raise ChapError(f"bad binary value: {e}") from e
    raise ChapError("binary value must start with 0x or 0b")


def response(algorithm: int, ident: int, secret: bytes, challenge: bytes) -> bytes:
    return hashlib.new(ALGORITHMS[algorithm], bytes((ident,)) + secret + challenge).digest()


class ChapAuthenticator:
    """The target side of one CHAP exchange."""

    def __init__(self, user: str, secret: str, mutual_user: str | None = None,
                 mutual_secret: str | None = None) -> None:
        self.user = user
        self.secret = secret.encode()
        self.mutual_user = mutual_user
        self.mutual_secret = mutual_secret.encode() if mutual_secret else None
        self.algorithm = 0
        self.ident = 0
        self.challenge = b""
        self.claimed_user: str | None = None   # the CHAP_N the initiator sent, for the log (never the secret)

    def choose(self, offered: str) -> list[tuple[str, str]]:
        """Answer CHAP_A=<list> with the algorithm, identifier and challenge."""
        wanted = []
        for v in offered.split(","):
            v = v.strip()
            if is_decimal(v):
                wanted.append(int(v))
        for alg in wanted:
            if alg in SUPPORTED:
                self.algorithm = alg
                break
        else:
            raise ChapError(f"no supported CHAP algorithm in {offered!r}")
        self.ident = os.urandom(1)[0]
        self.challenge = os.urandom(CHALLENGE_LEN)
        return [("CHAP_A", str(self.algorithm)), ("CHAP_I", str(self.ident)),
                ("CHAP_C", "0x" + self.challenge.hex())]

    def verify(self, keys: dict[str, str]) -> list[tuple[str, str]]:
        """Check CHAP_N/CHAP_R; answer a mutual challenge (CHAP_I/CHAP_C) when one is given."""
        if not self.algorithm:
            raise ChapError("CHAP_R before CHAP_A")
        name, resp = keys.get("CHAP_N"), keys.get("CHAP_R")
        self.claimed_user = name
        if name is None or resp is None:
            raise ChapError("CHAP_N and CHAP_R are required")
        expected = response(self.algorithm, self.ident, self.secret, self.challenge)
        # both judged before either is reported: the time taken says nothing about which one was wrong
        matches = hmac.compare_digest(decode_binary(resp), expected)
        if not hmac.compare_digest(name.encode(), self.user.encode()):
            raise ChapError("unknown CHAP user")   # the initiator sees 0x0201 either way; the log tells them apart
        if not matches:
            raise ChapError("CHAP response does not match")
        if "CHAP_C" not in keys and "CHAP_I" not in keys:
            if self.mutual_secret is not None:
                raise ChapError("mutual CHAP is required by this target")
            return []
        if self.mutual_secret is None or self.mutual_user is None:
            raise ChapError("mutual CHAP requested but not configured")
        ident_s = keys.get("CHAP_I", "")
        if not is_decimal(ident_s) or int(ident_s) > 255:
            raise ChapError("bad CHAP_I")
        their = decode_binary(keys.get("CHAP_C", ""))
        if not their or their == self.challenge:
            raise ChapError("mutual challenge missing or reflected")  # RFC 7143 §12.1.3
        mine = response(self.algorithm, int(ident_s), self.mutual_secret, their)
        return [("CHAP_N", self.mutual_user), ("CHAP_R", "0x" + mine.hex())]
