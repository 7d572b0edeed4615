"""Initiator URLs.

    iscsi://[user%secret@]HOST[:PORT][/IQN[/LUN]][?key=value&...]    (libiscsi's form)
    nvme+tcp://HOST[:PORT][/NQN[/NSID]][?key=value&...]

iSCSI keys: header_digest=crc32c, data_digest=crc32c, target_user=, target_password= (mutual CHAP),
initiator=IQN, queues=N, queue_depth=N. NVMe/TCP keys: hostnqn=, hdgst=1, ddgst=1, queues=N, queue_depth=N,
kato=SECONDS. The secret may be percent-encoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

ISCSI_PORT = 3260
NVME_TCP_PORT = 4420


class UrlError(ValueError):
    pass


@dataclass(frozen=True)
class TargetUrl:
    scheme: str                    # "iscsi" or "nvme+tcp"
    host: str
    port: int
    name: str | None               # IQN or NQN; None: the portal only (discovery)
    unit: int | None               # LUN or NSID
    user: str | None = None
    secret: str | None = None
    options: dict[str, str] = field(default_factory=dict)

    @property
    def iscsi(self) -> bool:
        return self.scheme == "iscsi"

    def opt_int(self, key: str, default: int, lo: int = 1, hi: int = 1 << 16) -> int:
        v = self.options.get(key)
        if v is None:
            return default
        if not (v.isascii() and v.isdigit()) or not lo <= int(v) <= hi:
            raise UrlError(f"{key}={v}: want a whole number from {lo} to {hi}")
        return int(v)

    def opt_bool(self, key: str) -> bool:
        v = self.options.get(key, "").lower()
        return v in ("1", "yes", "true", "on", "crc32c")

    def redacted(self) -> str:
        cred = f"{self.user}%***@" if self.user is not None else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        path = "" if self.name is None else f"/{self.name}" + ("" if self.unit is None else f"/{self.unit}")
        return f"{self.scheme}://{cred}{host}:{self.port}{path}"


def parse_url(url: str) -> TargetUrl:
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("iscsi", "nvme+tcp", "nvme-tcp"):
        raise UrlError(f"{url!r}: want iscsi://HOST[:PORT]/IQN/LUN or nvme+tcp://HOST[:PORT]/NQN/NSID")
    scheme = "nvme+tcp" if scheme.startswith("nvme") else scheme
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    user = secret = None
    if "@" in netloc:
        cred, _, netloc = netloc.rpartition("@")
        u, pct, s = cred.partition("%")
        if not pct:
            u, _, s = cred.partition(":")
        user, secret = unquote(u), unquote(s)
    if netloc.startswith("["):
        host, br, tail = netloc[1:].partition("]")
        if not br:
            raise UrlError(f"{url!r}: unclosed [ in the address")
        port_s = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port_s = netloc.partition(":")
    if not host:
        raise UrlError(f"{url!r}: no host")
    default_port = ISCSI_PORT if scheme == "iscsi" else NVME_TCP_PORT
    if port_s and not (port_s.isascii() and port_s.isdigit() and 0 < int(port_s) < 65536):
        raise UrlError(f"{url!r}: bad port {port_s!r}")
    port = int(port_s) if port_s else default_port
    parts = [p for p in path.split("/") if p]
    name = unquote(parts[0]) if parts else None
    unit = None
    if len(parts) >= 2:
        if not (parts[1].isascii() and parts[1].isdigit()):
            raise UrlError(f"{url!r}: {'LUN' if scheme == 'iscsi' else 'NSID'} must be a number, not {parts[1]!r}")
        unit = int(parts[1])
    if len(parts) > 2:
        raise UrlError(f"{url!r}: too many path parts")
    options = {k.lower(): v for k, v in parse_qsl(query, keep_blank_values=True)}
    return TargetUrl(scheme, host, port, name, unit, user, secret, options)
