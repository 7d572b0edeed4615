"""LUKS2, as cryptsetup writes and reads it (its docs/on-disk-format-luks2.pdf): the header of an encrypted
volume's backing store, so that `cryptsetup open` opens a volume openvsan made, and openvsan serves a
container `cryptsetup luksFormat` made. No I/O of its own: `Luks2` works on a `Store` (read and write at an
offset), the encryption layer (volume/crypt.py) gives it the backing device.

Layout (cryptsetup's defaults, which this follows):

    0            primary binary header (4 KiB) + JSON area       } hdr_size (16 KiB)
    hdr_size     secondary copy of both                          }
    32 KiB ...   keyslot areas (each: the volume key split into `stripes` and encrypted with a key the
                 passphrase derives)                              } up to the data offset (16 MiB)
    16 MiB       the data segment: aes-xts-plain64 in sectors of 512 or 4096 bytes

- **Binary header** (big-endian): magic `LUKS\\xba\\xbe` (the copy: `SKUL\\xba\\xbe`), version 2, hdr_size,
  seqid (raised by every update; of two valid copies the higher wins), label, checksum algorithm, salt,
  UUID, subsystem, the copy's own offset, and the checksum: SHA-256 over the copy's whole hdr_size with the
  checksum field zeroed. A copy whose magic, version, size, offset or checksum is wrong is not used; if
  neither is usable the header is refused with one line, and nothing is written.
- **JSON**: `keyslots` (per slot: key_size, AF "luks1" with stripes and hash, area offset/size/encryption,
  KDF argon2id/argon2i/pbkdf2 with its salt), `segments` (offset, size "dynamic", iv_tweak, encryption,
  sector_size), `digests` (PBKDF2 of the volume key: how a passphrase is known to be right), `config`
  (json_size, keyslots_size). Sizes and offsets are decimal strings (u64 in JSON).
- **Keyslot**: the volume key is split by the anti-forensic splitter (AF, LUKS1's: stripes-1 random blocks,
  each folded into a running XOR that is diffused by SHA-256 per hash-size chunk, the last block the key
  XOR that), then encrypted with the keyslot's cipher (aes-xts-plain64, 512-byte sectors, IV from 0) under
  the KDF's output. Unlocking undoes both and checks the digest.
- **Data**: aes-xts-plain64 per sector of sector_size bytes, the tweak the sector's position in 512-byte
  units (dm-crypt's default: no iv_large_sectors) plus iv_tweak, little-endian, 16 bytes.

Crypto is C-backed: AES-XTS through `cryptography` (OpenSSL, AES-NI), Argon2 through `argon2-cffi` (the
reference C implementation), PBKDF2 through hashlib (OpenSSL).
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import hmac
import json
import logging
import os
import secrets
import struct
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

log = logging.getLogger(__name__)

MAGIC, MAGIC_COPY = b"LUKS\xba\xbe", b"SKUL\xba\xbe"
BINARY = 4096
HEADER = struct.Struct(">6sHQQ48s32s64s40s48sQ184s64s")      # 512 bytes, then padding to 4096
CSUM_AT = 448
HDR_SIZES = tuple(1 << i for i in range(14, 23))               # 16 KiB .. 4 MiB (the format's allowed sizes)
DEFAULT_HDR_SIZE = 16384
KEYSLOTS_AT = 2 * DEFAULT_HDR_SIZE                             # 32 KiB: after both header copies
DATA_OFFSET = 16 << 20                                         # 16 MiB: cryptsetup's default
STRIPES = 4000
IV_SECTOR = 512
CIPHERS = ("aes-xts-plain64",)
MAX_KEYSLOTS = 32


class Luks2Error(ValueError):
    """A header that cannot be used, or a request it cannot meet; str() is one line for the user."""


class WrongPassphrase(Luks2Error):
    """No keyslot opens with this passphrase."""


class Store(Protocol):
    def read(self, offset: int, length: int) -> bytes: ...

    def write(self, offset: int, data: bytes) -> None: ...


# ---- the primitives: KDFs, the AF splitter, AES-XTS per sector


@dataclass(frozen=True)
class Kdf:
    """How a passphrase becomes a keyslot's key: argon2id (the default), argon2i or pbkdf2."""

    type: str = "argon2id"
    time: int = 4                 # argon2: passes
    memory: int = 262144          # argon2: KiB (256 MiB: about a second on one core of a server)
    cpus: int = 2                 # argon2: lanes
    hash: str = "sha256"          # pbkdf2
    iterations: int = 600_000     # pbkdf2 (OWASP's figure for PBKDF2-HMAC-SHA256)
    salt: bytes = b""

    def json(self) -> dict[str, Any]:
        salt = base64.b64encode(self.salt).decode()
        if self.type == "pbkdf2":
            return {"type": "pbkdf2", "hash": self.hash, "iterations": self.iterations, "salt": salt}
        return {"type": self.type, "time": self.time, "memory": self.memory, "cpus": self.cpus, "salt": salt}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Kdf:
        salt = base64.b64decode(d["salt"])
        if d["type"] == "pbkdf2":
            return cls("pbkdf2", hash=d["hash"], iterations=int(d["iterations"]), salt=salt)
        if d["type"] in ("argon2i", "argon2id"):
            return cls(d["type"], time=int(d["time"]), memory=int(d["memory"]), cpus=int(d["cpus"]), salt=salt)
        raise Luks2Error(f"keyslot KDF {d['type']!r} is not supported (argon2id, argon2i and pbkdf2 are)")

    def salted(self) -> Kdf:
        return Kdf(self.type, self.time, self.memory, self.cpus, self.hash, self.iterations, secrets.token_bytes(32))

    def derive(self, passphrase: bytes, length: int) -> bytes:
        if self.type == "pbkdf2":
            return hashlib.pbkdf2_hmac(self.hash, passphrase, self.salt, self.iterations, length)
        from argon2.low_level import Type, hash_secret_raw

        return hash_secret_raw(passphrase, self.salt, time_cost=self.time, memory_cost=self.memory,
                               parallelism=self.cpus, hash_len=length,
                               type=Type.ID if self.type == "argon2id" else Type.I, version=0x13)


def _diffuse(block: bytes, hash_name: str) -> bytes:
    size = hashlib.new(hash_name).digest_size
    out = bytearray()
    for i in range(0, len(block), size):
        chunk = block[i:i + size]
        out += hashlib.new(hash_name, struct.pack(">I", i // size) + chunk).digest()[:len(chunk)]
    return bytes(out)


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")


def af_split(key: bytes, stripes: int, hash_name: str) -> bytes:
    """The key spread over `stripes` blocks, all of which are needed to get it back (LUKS1's AF)."""
    out = bytearray()
    d = bytes(len(key))
    for _ in range(stripes - 1):
        s = secrets.token_bytes(len(key))
        out += s
        d = _diffuse(_xor(d, s), hash_name)
    out += _xor(d, key)
    return bytes(out)


def af_merge(material: bytes, key_size: int, stripes: int, hash_name: str) -> bytes:
    d = bytes(key_size)
    for i in range(stripes - 1):
        d = _diffuse(_xor(d, material[i * key_size:(i + 1) * key_size]), hash_name)
    return _xor(d, material[(stripes - 1) * key_size:stripes * key_size])


def xts(key: bytes, data: bytes | bytearray | memoryview, iv: int, sector_size: int, *, encrypt: bool) -> bytes:
    """aes-xts-plain64 over `data` (whole sectors of `sector_size`): the first sector's tweak is `iv`, each
    next one's `sector_size // 512` more (IVs count 512-byte sectors)."""
    if len(data) % sector_size:
        raise Luks2Error(f"{len(data)} bytes is not a whole number of {sector_size}-byte sectors")
    aes = algorithms.AES(key)
    step = sector_size // IV_SECTOR
    out = bytearray(len(data))
    view = memoryview(data)
    for i, at in enumerate(range(0, len(data), sector_size)):
        c = Cipher(aes, modes.XTS(((iv + i * step) & (2**64 - 1)).to_bytes(16, "little")))
        op = c.encryptor() if encrypt else c.decryptor()
        out[at:at + sector_size] = op.update(view[at:at + sector_size])
    return bytes(out)


class Xts:
    """aes-xts-plain64 with one key, for many calls: the same bytes as xts(), without its cost per sector.

    `cryptography` takes a new cipher object per XTS data unit (each sector has its own tweak), about 5 us
    each: 40 us for a 4 KiB command in 512-byte sectors. OpenSSL itself can keep one context with its key
    schedule and set only the tweak per sector (EVP_CipherInit_ex with the key left NULL), so this calls
    libcrypto (the OpenSSL 3 that `cryptography` also runs on) through ctypes. The walk over the sectors is
    `_xts_sectors.c`, one ctypes call per command (a MiB of 4 KiB sectors in 0.18 ms, AES-NI's own time;
    ctypes releases the GIL around it); where that was not built at install (no C compiler), the same walk
    runs in Python, two ctypes calls per sector (0.5 ms a MiB). Where libcrypto cannot be loaded, it falls
    back to xts(). Where libgcrypt loads too (and the C walk was built), the C walk runs over libgcrypt's XTS
    instead, whose AES-NI/VAES code takes a 4 KiB sector in half the time of OpenSSL 3.0's (0.1 ms a MiB);
    each Xts checks on one sector that it gives OpenSSL's bytes before it uses it. A test checks all of them
    give the same bytes."""

    def __init__(self, key: bytes, *, gcrypt: bool = True) -> None:
        self.key = key
        self._lib = _libcrypto()
        self._loop = _sector_loop() if self._lib is not None else None
        self._ctx: dict[bool, Any] = {}
        self._gcry: _GcryXts | None = None
        if self._lib is None:
            return
        lib, cipher = self._lib, (self._lib.EVP_aes_256_xts() if len(key) == 64 else self._lib.EVP_aes_128_xts())
        for encrypt in (True, False):
            ctx = lib.EVP_CIPHER_CTX_new()
            if not ctx or lib.EVP_CipherInit_ex(ctx, cipher, None, key, None, 1 if encrypt else 0) != 1:
                raise Luks2Error("OpenSSL would not take the AES-XTS key")
            self._ctx[encrypt] = ctx
        self._calls = (_address_of(lib.EVP_CipherInit_ex), _address_of(lib.EVP_CipherUpdate))
        self._iv = ctypes.create_string_buffer(16)
        self._iv_at = ctypes.addressof(self._iv)
        self._outl = ctypes.c_int()
        self._outl_at = ctypes.addressof(self._outl)
        if gcrypt and self._loop is not None:
            self._gcry = _GcryXts.open(key)
            probe = bytes(range(256)) * 2
            if self._gcry is not None and \
                    self.crypt(probe, 1, 512, encrypt=True) != self.crypt(probe, 1, 512, encrypt=True, in_python=True):
                log.warning("libgcrypt's AES-XTS gave other bytes than OpenSSL's; not using it")
                self._gcry.close()
                self._gcry = None

    @property
    def path(self) -> str:
        """How the sectors are run, for `vsan volume show`: the C walk, the Python one, or a cipher per sector."""
        if self._gcry is not None:
            return "libgcrypt, sectors walked in C"
        if self._lib is None:
            return "cryptography, one cipher per sector (libcrypto could not be loaded: about a tenth of the speed)"
        if self._loop is None:
            return ("OpenSSL, sectors walked in Python (installed without a C compiler: about a third of the speed "
                    "on large I/O; pip install -e . again with gcc)")
        return "OpenSSL, sectors walked in C"

    def crypt(self, data: bytes | bytearray | memoryview, iv: int, sector_size: int, *, encrypt: bool,
              in_python: bool = False) -> bytes:
        """`data` encrypted or decrypted; `in_python` walks the sectors in Python, through OpenSSL, even where the
        C walk was built (for the test that every way gives the same bytes)."""
        n = len(data)
        if self._lib is None:
            return xts(self.key, data, iv, sector_size, encrypt=encrypt)
        if n % sector_size:
            raise Luks2Error(f"{n} bytes is not a whole number of {sector_size}-byte sectors")
        out: bytes = _new_bytes(None, n)    # a new bytes object's own memory, filled here before anyone else sees it
        ctx, step = self._ctx[encrypt], sector_size // IV_SECTOR
        # the source: bytes as they are; a large view (a RAM volume lends its mapping) read in place by its address
        # (nothing writes it during the call: the loop waits on it); a small one copied
        held = np.frombuffer(data, np.uint8) if n > COPY_MAX and not isinstance(data, bytes) else None
        src = data if isinstance(data, bytes) else bytes(data) if held is None else held.ctypes.data
        if self._gcry is not None and not in_python:
            if self._gcry.walk(out, src, n, sector_size, iv & _U64, step, encrypt) != 0:
                raise Luks2Error("libgcrypt's AES-XTS failed")
            return out
        if self._loop is not None and not in_python:     # C takes bytes or an address alike
            if self._loop(*self._calls, ctx, out, src, n, sector_size, iv & _U64, step) != 0:
                raise Luks2Error("OpenSSL's AES-XTS failed")
            return out
        lib, ivbuf, iv_at, outl = self._lib, self._iv, self._iv_at, self._outl_at
        src_at = src if isinstance(src, int) else _address_of(ctypes.c_char_p(src))
        out_at = _address_of(ctypes.c_char_p(out))
        for at in range(0, n, sector_size):
            struct.pack_into("<QQ", ivbuf, 0, iv & _U64, 0)
            if lib.EVP_CipherInit_ex(ctx, None, None, None, iv_at, -1) != 1 or \
                    lib.EVP_CipherUpdate(ctx, out_at + at, outl, src_at + at, sector_size) != 1:
                raise Luks2Error("OpenSSL's AES-XTS failed")
            iv += step
        return out

    def __del__(self) -> None:
        for ctx in getattr(self, "_ctx", {}).values():
            self._lib.EVP_CIPHER_CTX_free(ctx)
        if getattr(self, "_gcry", None) is not None:
            self._gcry.close()      # type: ignore[union-attr]


class _GcryXts:
    """One libgcrypt AES-XTS handle with its key, for Xts: the C walk over it (ovs_xts_sectors_gcry)."""

    def __init__(self, lib: Any, walk: Any, handle: int) -> None:
        self._lib, self._walk, self._handle = lib, walk, handle
        self._setiv = _address_of(lib.gcry_cipher_setiv)
        self._crypt = {True: _address_of(lib.gcry_cipher_encrypt), False: _address_of(lib.gcry_cipher_decrypt)}

    @classmethod
    def open(cls, key: bytes) -> _GcryXts | None:
        """A handle with `key` set, or None where libgcrypt or the C walk is missing or refuses the key."""
        lib, walk = _libgcrypt(), _sector_loop_gcry()
        if lib is None or walk is None or len(key) not in (32, 64):
            return None
        h = ctypes.c_void_p()
        if lib.gcry_cipher_open(ctypes.byref(h), GCRY_AES256 if len(key) == 64 else GCRY_AES128, GCRY_MODE_XTS, 0):
            return None
        if lib.gcry_cipher_setkey(h, key, len(key)):
            lib.gcry_cipher_close(h)
            return None
        return cls(lib, walk, h.value or 0)

    def walk(self, out: bytes, src: Any, n: int, sector_size: int, sector: int, step: int, encrypt: bool) -> int:
        """Xts.crypt's C walk of n bytes over this handle (0: done)."""
        return int(self._walk(self._setiv, self._crypt[encrypt], self._handle, out, src, n, sector_size, sector,
                              step))

    def close(self) -> None:
        if self._handle:
            self._lib.gcry_cipher_close(self._handle)
            self._handle = 0


_U64 = 2**64 - 1
GCRY_AES128, GCRY_AES256, GCRY_MODE_XTS = 7, 9, 13      # gcrypt.h: GCRY_CIPHER_AES, _AES256, GCRY_CIPHER_MODE_XTS
GCRYCTL_DISABLE_SECMEM, GCRYCTL_INITIALIZATION_FINISHED = 37, 38
_LIBGCRYPT: list[Any] = []
COPY_MAX = 64 << 10     # a view up to this size is copied (cheaper than its address through numpy), above read in place
_LIBCRYPTO: list[Any] = []
_WALKS: dict[str, Any] = {}      # _walk's functions by name (None: not built)

# PyBytes_FromStringAndSize(NULL, n): a bytes object whose n bytes are not yet set, for the cipher to write
# into (the C API's way to build one without a copy); nothing else holds it until crypt() returns it.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_new_bytes.restype = ctypes.py_object


def _address_of(obj: Any) -> int:
    return ctypes.cast(obj, ctypes.c_void_p).value or 0


def _walk(name: str) -> Any:
    """`_xts_sectors.c`'s function `name` (ovs_xts_sectors over OpenSSL, ovs_xts_sectors_gcry over libgcrypt),
    typed, where the file was built at install; else None."""
    if name not in _WALKS:
        import importlib.util

        fn = None
        spec = importlib.util.find_spec("openvsan.volume._xts_sectors")
        if spec is not None and spec.origin:
            try:
                fn = getattr(ctypes.CDLL(spec.origin), name)
                v, size, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
                fn.argtypes = [v, v, v, v, v, size, size, u64, u64]      # buffers: bytes or an address
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _WALKS[name] = fn
    return _WALKS[name]


def _sector_loop() -> Any:
    return _walk("ovs_xts_sectors")


def _sector_loop_gcry() -> Any:
    return _walk("ovs_xts_sectors_gcry") if _sector_loop() is not None else None


def _libgcrypt() -> Any:
    """libgcrypt (1.9 or later: AES-XTS with AES-NI and VAES) initialized without secure memory, its cipher calls
    typed; or None (Xts then runs OpenSSL's). Only handles of XTS keys are made with it."""
    if not _LIBGCRYPT:
        import ctypes.util

        lib = None
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("gcrypt") or "libgcrypt.so.20")
            lib.gcry_check_version.restype = ctypes.c_char_p
            lib.gcry_check_version.argtypes = [ctypes.c_char_p]
            if lib.gcry_check_version(b"1.9.0") is None:      # also the library's required initialization
                lib = None
            else:
                lib.gcry_control(ctypes.c_int(GCRYCTL_DISABLE_SECMEM), ctypes.c_int(0))
                lib.gcry_control(ctypes.c_int(GCRYCTL_INITIALIZATION_FINISHED), ctypes.c_int(0))
                v = ctypes.c_void_p
                lib.gcry_cipher_open.argtypes = [v, ctypes.c_int, ctypes.c_int, ctypes.c_uint]
                lib.gcry_cipher_open.restype = ctypes.c_uint
                lib.gcry_cipher_setkey.argtypes = [v, ctypes.c_char_p, ctypes.c_size_t]
                lib.gcry_cipher_setkey.restype = ctypes.c_uint
                lib.gcry_cipher_close.argtypes = [v]
                lib.gcry_cipher_close.restype = None
        except (OSError, AttributeError):
            lib = None
        _LIBGCRYPT.append(lib)
    return _LIBGCRYPT[0]


def _libcrypto() -> Any:
    """libcrypto with the EVP calls Xts makes typed, or None (then Xts uses `cryptography` per sector)."""
    if not _LIBCRYPTO:
        import ctypes.util

        lib = None
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("crypto") or "libcrypto.so.3")
            v = ctypes.c_void_p
            lib.EVP_CIPHER_CTX_new.restype = v
            lib.EVP_CIPHER_CTX_new.argtypes = []
            lib.EVP_CIPHER_CTX_free.argtypes = [v]
            lib.EVP_aes_256_xts.restype = v
            lib.EVP_aes_128_xts.restype = v
            lib.EVP_CipherInit_ex.argtypes = [v, v, v, ctypes.c_char_p, v, ctypes.c_int]
            lib.EVP_CipherInit_ex.restype = ctypes.c_int
            lib.EVP_CipherUpdate.argtypes = [v, v, v, v, ctypes.c_int]
            lib.EVP_CipherUpdate.restype = ctypes.c_int
        except (OSError, AttributeError):
            lib = None
        _LIBCRYPTO.append(lib)
    return _LIBCRYPTO[0]


# ---- the header


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("ascii", errors="replace")


@dataclass
class Header:
    """One valid header: the JSON metadata and the binary fields around it."""

    meta: dict[str, Any]
    seqid: int
    uuid: str
    label: str = ""
    subsystem: str = ""
    hdr_size: int = DEFAULT_HDR_SIZE
    salts: tuple[bytes, bytes] = field(default_factory=lambda: (secrets.token_bytes(64), secrets.token_bytes(64)))

    def copy_bytes(self, second: bool) -> bytes:
        """The header copy at offset 0 (primary) or hdr_size (secondary), checksum included."""
        text = json.dumps(self.meta, separators=(",", ":")).encode()
        json_size = self.hdr_size - BINARY
        if len(text) >= json_size:
            raise Luks2Error(f"the LUKS2 metadata ({len(text)} bytes) does not fit its {json_size}-byte area")
        binary = HEADER.pack(MAGIC_COPY if second else MAGIC, 2, self.hdr_size, self.seqid,
                             self.label.encode()[:47], b"sha256", self.salts[1 if second else 0],
                             self.uuid.encode()[:39], self.subsystem.encode()[:47],
                             self.hdr_size if second else 0, b"", b"")
        whole = bytearray(binary.ljust(BINARY, b"\0") + text.ljust(json_size, b"\0"))
        whole[CSUM_AT:CSUM_AT + 32] = hashlib.sha256(whole).digest()
        return bytes(whole)


def _parse_copy(store: Store, offset: int, magic: bytes) -> tuple[Header | None, str]:
    raw = store.read(offset, BINARY)
    if len(raw) < BINARY:
        return None, "the device is smaller than a LUKS2 header"
    (m, version, hdr_size, seqid, label, csum_alg, salt, uuid, subsystem, hdr_offset, _,
     csum) = HEADER.unpack(raw[:HEADER.size])
    if m != magic:
        return None, "no LUKS2 signature"
    if version != 2:
        return None, f"LUKS version {version}, not 2"
    if hdr_size not in HDR_SIZES or hdr_offset != offset:
        return None, f"a header size of {hdr_size} or offset of {hdr_offset} that LUKS2 does not allow"
    if _cstr(csum_alg) != "sha256":
        return None, f"header checksum {_cstr(csum_alg)!r} (sha256 is supported)"
    whole = bytearray(raw + store.read(offset + BINARY, hdr_size - BINARY))
    whole[CSUM_AT:CSUM_AT + 64] = bytes(64)
    if not hmac.compare_digest(hashlib.sha256(whole).digest(), csum[:32]):
        return None, "the header checksum does not match (damaged)"
    try:
        meta = json.loads(bytes(whole[BINARY:]).split(b"\0", 1)[0])
    except ValueError as e:
        return None, f"the JSON metadata is not JSON ({e})"
    if not isinstance(meta, dict) or not all(k in meta for k in ("keyslots", "segments", "digests", "config")):
        return None, "the JSON metadata lacks keyslots, segments, digests or config"
    return Header(meta, seqid, _cstr(uuid), _cstr(label), _cstr(subsystem), hdr_size, (salt, salt)), ""


def read_header(store: Store) -> Header:
    """The newer of the two valid copies; Luks2Error saying what is wrong with both when neither is."""
    primary, why1 = _parse_copy(store, 0, MAGIC)
    size = primary.hdr_size if primary is not None else _peek_size(store)
    secondary, why2 = (_parse_copy(store, size, MAGIC_COPY) if size else (None, "no primary to size it by"))
    if primary is None and secondary is None:
        if why1 == "no LUKS2 signature" and not size:
            raise Luks2Error("not a LUKS2 device (no LUKS2 signature at its start)")
        raise Luks2Error(f"no usable LUKS2 header: primary: {why1}; secondary: {why2}")
    best = max((h for h in (primary, secondary) if h is not None), key=lambda h: h.seqid)
    return best


def _peek_size(store: Store) -> int:
    """The secondary's offset when the primary is damaged: the primary's size field, or every size tried."""
    for size in HDR_SIZES:
        if store.read(size, 6) == MAGIC_COPY:
            return size
    return 0


# ---- a container


@dataclass
class Segment:
    offset: int
    sector_size: int
    iv_tweak: int
    cipher: str
    size: int | None          # None: to the end of the device ("dynamic")


class Luks2:
    """A LUKS2 container on `store`: format, unlock, add and remove passphrases. Writes both header copies
    (secondary first, then primary) at every change; the caller flushes."""

    def __init__(self, store: Store, header: Header) -> None:
        self.store, self.header = store, header

    # -- making one

    @classmethod
    def format(cls, store: Store, passphrase: bytes, *, key_size: int = 64, sector_size: int = 512,
               kdf: Kdf | None = None, label: str = "", volume_key: bytes | None = None,
               uuid: str | None = None) -> tuple[Luks2, bytes]:
        """A new container (header, one keyslot for `passphrase`); its volume key. The data segment starts
        at DATA_OFFSET; what was there is not touched (it reads as noise once encrypted)."""
        if key_size not in (32, 64):
            raise Luks2Error(f"key size {key_size * 8} bits: aes-xts-plain64 takes 256 or 512")
        if sector_size not in (512, 1024, 2048, 4096):
            raise Luks2Error(f"sector size {sector_size}: use 512 or 4096 (or 1024, 2048)")
        key = volume_key if volume_key is not None else _xts_key(key_size)
        digest_kdf = Kdf("pbkdf2", iterations=100_000).salted()
        meta: dict[str, Any] = {
            "keyslots": {}, "tokens": {},
            "segments": {"0": {"type": "crypt", "offset": str(DATA_OFFSET), "size": "dynamic", "iv_tweak": "0",
                               "encryption": "aes-xts-plain64", "sector_size": sector_size}},
            "digests": {"0": {"type": "pbkdf2", "keyslots": [], "segments": ["0"], "hash": "sha256",
                              "iterations": digest_kdf.iterations,
                              "salt": base64.b64encode(digest_kdf.salt).decode(),
                              "digest": base64.b64encode(digest_kdf.derive(key, 32)).decode()}},
            "config": {"json_size": str(DEFAULT_HDR_SIZE - BINARY), "keyslots_size": str(DATA_OFFSET - KEYSLOTS_AT)},
        }
        c = cls(store, Header(meta, 0, uuid or str(uuidlib.uuid4()), label))
        c._add(key, passphrase, kdf or Kdf())
        return c, key

    @classmethod
    def open(cls, store: Store) -> Luks2:
        return cls(store, read_header(store))

    # -- what it says

    @property
    def segment(self) -> Segment:
        segs = self.header.meta["segments"]
        if len(segs) != 1:
            raise Luks2Error(f"{len(segs)} data segments (a reencryption under way?): one is supported")
        s = next(iter(segs.values()))
        if s.get("type") != "crypt" or s.get("encryption") not in CIPHERS:
            raise Luks2Error(f"data segment {s.get('type')}/{s.get('encryption')}: aes-xts-plain64 is supported")
        if s.get("integrity"):
            raise Luks2Error("a data segment with integrity protection (dm-integrity) is not supported")
        return Segment(int(s["offset"]), int(s.get("sector_size", 512)), int(s.get("iv_tweak", "0")),
                       s["encryption"], None if s.get("size") == "dynamic" else int(s["size"]))

    def keyslots(self) -> list[int]:
        return sorted(int(k) for k in self.header.meta["keyslots"])

    # -- keys

    def unlock(self, passphrase: bytes) -> bytes:
        """The volume key, if a keyslot opens with `passphrase` (WrongPassphrase otherwise)."""
        return self._opened(passphrase)[1]

    def slot_of(self, passphrase: bytes) -> int:
        """The keyslot `passphrase` opens (WrongPassphrase if none)."""
        return self._opened(passphrase)[0]

    def _opened(self, passphrase: bytes) -> tuple[int, bytes]:
        """The keyslot `passphrase` opens and the volume key (one KDF run per slot tried)."""
        for slot in self.keyslots():
            key = self._try(slot, passphrase)
            if key is not None:
                return slot, key
        raise WrongPassphrase("no keyslot opens with this passphrase" if self.keyslots()
                              else "the header has no keyslot")

    def add_keyslot(self, volume_key: bytes, passphrase: bytes, kdf: Kdf | None = None) -> int:
        if not self._digest_ok(volume_key):
            raise Luks2Error("that is not this container's volume key")
        return self._add(volume_key, passphrase, kdf or Kdf())

    def remove_keyslot(self, slot: int) -> None:
        """Forget keyslot `slot` (its area overwritten); the last one is refused (the data would be lost)."""
        slots = self.header.meta["keyslots"]
        if str(slot) not in slots:
            raise Luks2Error(f"no keyslot {slot} (keyslots: {', '.join(map(str, self.keyslots())) or 'none'})")
        if len(slots) == 1:
            raise Luks2Error("that is the last keyslot: removing it would leave the data unreadable forever")
        area = slots.pop(str(slot))["area"]
        for d in self.header.meta["digests"].values():
            d["keyslots"] = [k for k in d["keyslots"] if k != str(slot)]
        self._write_header()
        self.store.write(int(area["offset"]), secrets.token_bytes(int(area["size"])))

    def change_passphrase(self, old: bytes, new: bytes, kdf: Kdf | None = None) -> int:
        slot, key = self._opened(old)      # the KDF once, not once to unlock and again to find the slot
        added = self.add_keyslot(key, new, kdf)
        self.remove_keyslot(slot)
        return added

    # -- inside

    def _digest_ok(self, key: bytes) -> bool:
        for d in self.header.meta["digests"].values():
            if d["type"] != "pbkdf2":
                raise Luks2Error(f"digest type {d['type']!r} is not supported (pbkdf2 is)")
            want = base64.b64decode(d["digest"])
            got = hashlib.pbkdf2_hmac(d["hash"], key, base64.b64decode(d["salt"]), int(d["iterations"]), len(want))
            if hmac.compare_digest(got, want):
                return True
        return False

    def _try(self, slot: int, passphrase: bytes) -> bytes | None:
        ks = self.header.meta["keyslots"][str(slot)]
        if ks.get("type") != "luks2" or ks["af"].get("type") != "luks1":
            return None
        area = ks["area"]
        if area.get("encryption") not in CIPHERS:
            return None
        key_size, stripes, hash_name = int(ks["key_size"]), int(ks["af"]["stripes"]), ks["af"]["hash"]
        length = _round(key_size * stripes, IV_SECTOR)
        k = Kdf.from_json(ks["kdf"]).derive(passphrase, int(area["key_size"]))
        material = xts(k, self.store.read(int(area["offset"]), length), 0, IV_SECTOR, encrypt=False)
        key = af_merge(material, key_size, stripes, hash_name)
        return key if self._digest_ok(key) else None

    def _add(self, key: bytes, passphrase: bytes, kdf: Kdf) -> int:
        slots = self.header.meta["keyslots"]
        free = next((i for i in range(MAX_KEYSLOTS) if str(i) not in slots), None)
        if free is None:
            raise Luks2Error(f"all {MAX_KEYSLOTS} keyslots are in use")
        size = _round(len(key) * STRIPES, 4096)
        offset = self._free_area(size)
        kdf = kdf.salted()
        area_key = kdf.derive(passphrase, len(key))
        material = af_split(key, STRIPES, "sha256").ljust(_round(len(key) * STRIPES, IV_SECTOR), b"\0")
        self.store.write(offset, xts(area_key, material, 0, IV_SECTOR, encrypt=True).ljust(size, b"\0"))
        slots[str(free)] = {"type": "luks2", "key_size": len(key),
                            "af": {"type": "luks1", "stripes": STRIPES, "hash": "sha256"},
                            "area": {"type": "raw", "offset": str(offset), "size": str(size),
                                     "encryption": "aes-xts-plain64", "key_size": len(key)},
                            "kdf": kdf.json()}
        digest = next(iter(self.header.meta["digests"].values()))
        digest["keyslots"] = sorted({*digest["keyslots"], str(free)}, key=int)
        self._write_header()
        return free

    def _free_area(self, size: int) -> int:
        end = KEYSLOTS_AT + int(self.header.meta["config"]["keyslots_size"])
        used = sorted((int(s["area"]["offset"]), int(s["area"]["size"]))
                      for s in self.header.meta["keyslots"].values())
        at = KEYSLOTS_AT
        for off, n in used:
            if off - at >= size:
                break
            at = max(at, _round(off + n, 4096))
        if at + size > end:
            raise Luks2Error("the keyslot area is full")
        return at

    def _write_header(self) -> None:
        self.header.seqid += 1
        self.store.write(self.header.hdr_size, self.header.copy_bytes(second=True))
        self.store.write(0, self.header.copy_bytes(second=False))


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def _xts_key(size: int) -> bytes:
    """A random XTS key whose halves differ (OpenSSL refuses equal halves)."""
    while True:
        k = secrets.token_bytes(size)
        if k[:size // 2] != k[size // 2:]:
            return k


class FileStore:
    """A Store over a file or block device (tests, `vsan volume` tools)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def write(self, offset: int, data: bytes) -> None:
        os.pwrite(self.fd, data, offset)

