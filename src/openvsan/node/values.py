"""Parsers for the scalar values a config holds: sizes, iSCSI and NVMe names, portals, CHAP secrets.

Each returns the parsed value or raises ValueError with a message that says what is wrong and how to mend
it; the config reader adds the key path in front.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

# Single letters and IEC suffixes are binary (as qemu-img and fio read them); KB/MB/GB/TB are SI.
_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
    "p": 1 << 50, "pib": 1 << 50, "pb": 10**15,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """'1GiB', '512MiB', '100G' (binary), '10GB' (decimal), or a plain number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size; write bytes or a string such as \"1GiB\"")  # noqa: TRY004
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(f"{value!r} is not a size; write it like \"512MiB\", \"1GiB\", \"100G\" or a "
                             "number of bytes")
        num = m.group(1)
        whole, _, frac = num.partition(".")
        scale = _UNITS[unit]
        n = int(whole) * scale + (int(frac) * scale) // 10 ** len(frac) if frac else int(whole) * scale
        if frac and (int(frac) * scale) % 10 ** len(frac):
            raise ValueError(f"{value!r} is not a whole number of bytes")
    else:
        raise ValueError(f"{value!r} is not a size; write bytes or a string such as \"1GiB\"")  # noqa: TRY004
    if n <= 0:
        raise ValueError(f"size must be positive, not {value!r}")
    return n


def format_size(n: int) -> str:
    """1073741824 -> '1.0 GiB' (for logs and summaries)."""
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# RFC 3720 §3.2.6.3.1: iqn.<yyyy-mm>.<reversed domain name>[:<anything>]. After stringprep (RFC 3722) a
# name is lower case, so we ask for it written that way rather than have initiators see two spellings.
_LABEL = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?"
_IQN = re.compile(rf"^iqn\.(\d{{4}})-(\d{{2}})\.({_LABEL}(?:\.{_LABEL})*)(?::[a-z0-9.:\-]*)?$")
_EUI = re.compile(r"^eui\.[0-9a-fA-F]{16}$")                       # RFC 3720 §3.2.6.3.2
_NAA = re.compile(r"^naa\.(?:[0-9a-fA-F]{16}|[0-9a-fA-F]{32})$")   # RFC 3980 §1
_MAX_NAME = 223                                                     # RFC 3720 §3.2.6.1, in bytes


def check_iscsi_name(name: object) -> str:
    """An iSCSI name in the iqn., eui. or naa. format (RFC 3720 §3.2.6, RFC 3980)."""
    if not isinstance(name, str) or not name:
        raise ValueError("an iSCSI name is a string such as \"iqn.2026-11.org.example:disk0\"")
    if len(name.encode()) > _MAX_NAME:
        raise ValueError(f"{name!r} is longer than {_MAX_NAME} bytes (RFC 3720 §3.2.6.1); shorten it")
    low = name.lower()
    if low.startswith("iqn."):
        m = _IQN.match(low)
        if not m or not 1 <= int(m.group(2)) <= 12:
            raise ValueError(f"{name!r} is not an iqn name; write iqn.<yyyy-mm>.<reversed domain>[:<id>], e.g. "
                             "\"iqn.2026-11.org.example:disk0\" (RFC 3720 §3.2.6.3.1)")
        if low != name:
            raise ValueError(f"{name!r} has upper case letters; iSCSI names compare in lower case, write {low!r}")
        return name
    if low.startswith("eui."):
        if not _EUI.match(name):
            raise ValueError(f"{name!r} is not an eui name; write \"eui.\" and 16 hex digits (RFC 3720 §3.2.6.3.2)")
        return name
    if low.startswith("naa."):
        if not _NAA.match(name):
            raise ValueError(f"{name!r} is not a naa name; write \"naa.\" and 16 or 32 hex digits (RFC 3980)")
        return name
    raise ValueError(f"{name!r} is not an iSCSI name; it starts with iqn., eui. or naa. (RFC 3720 §3.2.6)")


@dataclass(frozen=True, order=True)
class Portal:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def parse_portal(value: object) -> Portal:
    """'127.0.0.1:3260', '[::1]:3260' or 'host.example:3260'."""
    hint = "write it as \"host:port\", e.g. \"127.0.0.1:3260\" or \"[::1]:3260\""
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a portal; {hint}")  # noqa: TRY004 - a config value, not a bug
    if value.startswith("["):
        host, sep, port_s = value[1:].partition("]:")
        try:
            if not sep or ipaddress.ip_address(host).version != 6:
                raise ValueError
        except ValueError:
            raise ValueError(f"{value!r} is not a portal; {hint}") from None
    else:
        host, sep, port_s = value.rpartition(":")
        if not sep or not host or ":" in host:
            raise ValueError(f"{value!r} is not a portal; {hint}")
        if not _HOSTNAME.match(host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ValueError(f"{value!r}: {host!r} is not an IP address or host name; {hint}") from None
    if not (port_s.isascii() and port_s.isdigit()) or not 1 <= int(port_s) <= 65535:
        raise ValueError(f"{value!r}: the port must be a number from 1 to 65535 (3260 is iSCSI's)")
    return Portal(host, int(port_s))


# RFC 7143 §12.1.3 asks for at least 12 bytes (96 bits); many initiators (Windows, VMware) take at most 16.
CHAP_SECRET_MIN, CHAP_SECRET_MAX = 12, 16


def check_chap_secret(secret: object) -> str:
    if not isinstance(secret, str):
        raise ValueError("the secret is a string of 12 to 16 bytes")  # noqa: TRY004
    n = len(secret.encode())
    if not CHAP_SECRET_MIN <= n <= CHAP_SECRET_MAX:
        raise ValueError(f"the secret is {n} bytes; use {CHAP_SECRET_MIN} to {CHAP_SECRET_MAX} bytes "
                         "(RFC 7143 §12.1.3 wants at least 12; many initiators accept no more than 16)")
    return secret


_OBJECT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_object_name(name: object) -> str:
    """Names of devices and volumes: they become file names (pr/<volume>.json) and log words."""
    if not isinstance(name, str) or not _OBJECT_NAME.match(name):
        raise ValueError(f"{name!r} is not a usable name; use 1 to 64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return name


# NVMe Base 2.0 §4.5 (NVMe Qualified Names): "nqn.<yyyy-mm>.<reversed domain>:<anything>", or the UUID form
# "nqn.2014-08.org.nvmexpress:uuid:<uuid>"; at most 223 bytes of UTF-8.
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
_NQN = re.compile(rf"^nqn\.(\d{{4}})-(\d{{2}})\.({_LABEL}(?:\.{_LABEL})*):\S+$", re.IGNORECASE)
_NQN_UUID = re.compile(r"^nqn\.2014-08\.org\.nvmexpress:uuid:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-"
                       r"[0-9a-f]{12}$", re.IGNORECASE)
_MAX_NQN = 223


def check_nqn(name: object, *, subsystem: bool = True) -> str:
    """An NVMe Qualified Name (NVMe Base 2.0 §4.5) for a subsystem or a host."""
    if not isinstance(name, str) or not name:
        raise ValueError("an NQN is a string such as \"nqn.2026-11.org.example:disk0\"")
    if len(name.encode()) > _MAX_NQN:
        raise ValueError(f"{name!r} is longer than {_MAX_NQN} bytes (NVMe Base 2.0 §4.5); shorten it")
    if subsystem and name == DISCOVERY_NQN:
        raise ValueError(f"{name!r} is the discovery subsystem's NQN, which every NVMe/TCP port serves already; "
                         "name the subsystem after its volumes, e.g. \"nqn.2026-11.org.example:disk0\"")
    if _NQN_UUID.match(name):
        return name
    m = _NQN.match(name)
    if not m or not 1 <= int(m.group(2)) <= 12:
        raise ValueError(f"{name!r} is not an NQN; write nqn.<yyyy-mm>.<reversed domain>:<id>, e.g. "
                         "\"nqn.2026-11.org.example:disk0\" (NVMe Base 2.0 §4.5)")
    return name


# proto.md "Conventions": export names are UTF-8 strings without NUL, SHOULD be at most 256 bytes
_MAX_EXPORT_NAME = 256


def check_nbd_export_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError("an NBD export name is a non-empty string such as \"disk0\"")
    if len(name.encode()) > _MAX_EXPORT_NAME or not name.isprintable():
        raise ValueError(f"{name!r}: use up to {_MAX_EXPORT_NAME} bytes of printable text")
    return name
