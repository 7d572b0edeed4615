"""The encryption layer: a volume's data encrypted at rest with aes-xts-plain64, in a LUKS2 container on the
device below (volume/luks2.py), so that `cryptsetup open` on the backing file or device reads what
initiators wrote, and a container `cryptsetup luksFormat` made is served as a volume.

    [[volumes]]
    name = "secret"
    device = "d0"
    encryption = { key_file = "/etc/openvsan/secret.key" }     # format = "luks2", cipher = "aes-xts-plain64"

- **Opening** (`open_crypt`, async, before the stack serves): the first 16 MiB of the device below are read;
  a LUKS2 header there is unlocked with the key file's bytes (all of them, as `cryptsetup --key-file`
  takes them; the KDF runs in a thread: Argon2 takes a memory-hard second on purpose); a device that reads
  as zeros there is formatted (one keyslot for the key file); anything else is refused with one line (data
  that is not LUKS2 is never overwritten). A wrong key file: one line, nothing written.
- **Data**: the layer's blocks are the segment's sectors (512 or 4096 bytes: the volume's block size), from
  the segment's offset on; each is encrypted on its way down and decrypted on its way up, with its
  position (in 512-byte units) plus iv_tweak as the XTS tweak, as dm-crypt does. The key lives in this
  process's memory only: the desired state holds the key file's path, never the key.
- **The cipher**: luks2.Xts, one OpenSSL context per direction kept with its key schedule, the tweak set per
  sector, a command's sectors walked in C (`_xts_sectors.c`) where it was built; the same bytes as a cipher
  object per sector (a test checks it).
- **The fast path**: read_now / write_now encrypt and decrypt in the loop's turn up to FAST_MAX bytes;
  larger commands decline to the normal path.
- **Unmap** does nothing unless `allow_discards = true` (dm-crypt's default too: discards show which blocks
  are in use). A sector that reads as zeros below (never written, or unmapped) reads as zeros through the
  layer, where dm-crypt shows the noise zeros decrypt to; write_zeroes writes encrypted zeros.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import numpy as np

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import BlockDevice, Buffer
from openvsan.block.errors import Locked
from openvsan.block.layer import Layer, read_only_stack, stack_of
from openvsan.volume import luks2 as L
from openvsan.volume.registry import StackLocked, register_layer, register_opener

log = logging.getLogger("openvsan.volume.crypt")

DEFAULT_SECTOR = 4096     # the sector (and the volume's block) size of a new container, unless sector_size says
FAST_MAX = 64 << 10        # bytes encrypted or decrypted in the loop's turn on the fast path
ZERO_CHUNK = 1 << 20       # write_zeroes writes encrypted zeros this much at a time
READ_CHUNK = 1 << 20       # the header region is read this much at a time
ZERO16 = bytes(16)
SCAN_MAX = 16              # up to this many sectors a read is scanned for blank ones by bytes.find, above by numpy


class CryptError(ValueError):
    """The encrypted volume cannot be opened; str() is one line for the user."""


@register_layer
class CryptLayer(Layer):
    type_name = "crypt"

    def __init__(self, below: BlockDevice, key: bytes, segment: L.Segment, settings: dict[str, Any], *,
                 uuid: str = "") -> None:
        super().__init__(below, name=f"crypt:{getattr(below, 'name', '?')}")
        bbs = below.block_size
        if segment.sector_size % bbs or segment.offset % bbs:
            raise CryptError(f"the LUKS2 segment (sector {segment.sector_size}, offset {segment.offset}) does not "
                             f"fit the device's {bbs}-byte blocks")
        self._xts = L.Xts(key)     # AES-XTS over many sectors per call (luks2.Xts)
        if self._xts._loop is None:
            log.warning("%s: encryption runs as %s", getattr(below, "name", "a volume"), self._xts.path)
        self._key = key            # for new keyslots (add_passphrase); never written anywhere
        self._header_lock = asyncio.Lock()
        self.segment, self.settings, self.uuid = segment, settings, uuid
        self._bs = segment.sector_size
        self._per = segment.sector_size // bbs           # device blocks per sector
        self._base = segment.offset // bbs               # the segment's first device block
        self._step = segment.sector_size // L.IV_SECTOR  # IV units per sector
        self._below_read_now = getattr(below, "read_now", None)
        self._below_write_now = getattr(below, "write_now", None)

    # ---- what it states

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def num_blocks(self) -> int:
        if self.segment.size is not None:
            return self.segment.size // self._bs
        return (self.below.num_blocks - self._base) // self._per

    @property
    def capabilities(self) -> Capabilities:
        caps = self.below.capabilities
        # unmapped below reads zeros here too (_decrypt); an unmap reaches below only with allow_discards
        zero = caps.unmap_reads_zero and bool(self.settings.get("allow_discards"))
        return caps.but(unmap_reads_zero=zero, write_zeroes=False, extents=False, thin=False, write_window=False)

    # ---- the cipher

    def _crypt(self, data: Buffer, lba: int, *, encrypt: bool) -> bytes:
        return self._xts.crypt(data, self.segment.iv_tweak + lba * self._step, self._bs, encrypt=encrypt)

    def _decrypt(self, raw: Buffer, lba: int) -> Buffer:
        """The plaintext of sectors read; a sector that reads as zeros below was never written (a new file or
        thin volume, an unmap passed down) and reads as zeros here too, not as the noise zeros decrypt to. (A
        written sector's ciphertext is all zeros with probability 2^-4096.)"""
        out = self._crypt(raw, lba, encrypt=False)
        bs = self._bs
        n = len(raw) // bs
        if n == 1:
            return bytes(bs) if raw[:16] == ZERO16 and raw == bytes(bs) else out
        if isinstance(raw, bytes) and n <= SCAN_MAX and ZERO16 not in raw:
            return out      # no 16 zero bytes anywhere, so no sector starts with them: one scan in C, no numpy
        heads = np.frombuffer(raw, dtype=np.uint64).reshape(n, bs // 8)[:, :2]
        blank = np.flatnonzero(~heads.any(axis=1))
        if not len(blank):
            return out
        mv = memoryview(raw)
        fixed = bytearray(out)
        zeros = bytes(bs)
        for i in blank.tolist():
            if mv[i * bs:(i + 1) * bs] == zeros:
                fixed[i * bs:(i + 1) * bs] = zeros
        return fixed

    # ---- I/O

    async def read(self, lba: int, blocks: int) -> Buffer:
        raw = await self.below.read(self._base + lba * self._per, blocks * self._per)
        return self._decrypt(raw, lba)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        await self.below.write(self._base + lba * self._per, self._crypt(data, lba, encrypt=True), fua=fua)

    def read_now(self, lba: int, blocks: int) -> Buffer | None:
        fn = self._below_read_now
        if fn is None or blocks * self._bs > FAST_MAX:
            return None
        raw = fn(self._base + lba * self._per, blocks * self._per)
        return None if raw is None else self._decrypt(raw, lba)

    def write_now(self, lba: int, data: Buffer) -> bool:
        fn = self._below_write_now
        if fn is None or len(data) > FAST_MAX:
            return False
        return bool(fn(self._base + lba * self._per, self._crypt(data, lba, encrypt=True)))

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        per = ZERO_CHUNK // self._bs
        zeros = bytes(min(blocks, per) * self._bs)
        while blocks:
            n = min(blocks, per)
            await self.write(lba, zeros[:n * self._bs])
            lba, blocks = lba + n, blocks - n

    async def unmap(self, lba: int, blocks: int) -> None:
        if self.settings.get("allow_discards"):
            await self.below.unmap(self._base + lba * self._per, blocks * self._per)

    async def lba_status(self, lba: int, blocks: int) -> Any:
        return [(lba, blocks, 0)]     # all mapped: what is below is ciphertext, its holes not told

    async def resize(self, num_blocks: int) -> None:
        await self.below.resize(self._base + num_blocks * self._per)  # type: ignore[attr-defined]

    def stats(self) -> dict[str, Any]:
        """What `vsan volume show` says of it (as crypt_stats): the container, never the key."""
        return {"format": "luks2", "cipher": self.segment.cipher, "key_bits": len(self._key) * 8,
                "sector_size": self.segment.sector_size, "data_offset": self.segment.offset, "uuid": self.uuid,
                "unlocked_with": (f"key command {self.settings['key_command'][0]}" if self.settings.get("key_command")
                                  else "a passphrase given at unlock" if self.settings.get("prompt")
                                  else f"key file {self.settings.get('key_file')}"),
                "discards": bool(self.settings.get("allow_discards")), "cipher_path": self._xts.path}

    # ---- passphrases, changed while the volume serves (the header region only: the data is not touched)

    async def _container(self) -> tuple[_Region, L.Luks2]:
        region = _Region(await _read_region(self.below, self.segment.offset))
        return region, L.Luks2.open(region)

    async def add_passphrase(self, passphrase: bytes) -> tuple[int, list[int]]:
        """The keyslot added, and every keyslot there is now (the header region read once)."""
        async with self._header_lock:
            region, c = await self._container()
            slot = await asyncio.to_thread(c.add_keyslot, self._key, passphrase, kdf_of(self.settings))
            await _write_dirty(self.below, region)
        log.info("%s: LUKS2 keyslot %d added", self.name, slot)
        return slot, c.keyslots()

    async def remove_passphrase(self, passphrase: bytes) -> tuple[int, list[int]]:
        """The keyslot wiped, and the keyslots left."""
        async with self._header_lock:
            region, c = await self._container()
            slot = await asyncio.to_thread(c.slot_of, passphrase)
            c.remove_keyslot(slot)
            await _write_dirty(self.below, region)
        log.info("%s: LUKS2 keyslot %d removed", self.name, slot)
        return slot, c.keyslots()

    # ---- its place in the desired state: the settings, never the key

    def layer_config(self) -> dict[str, Any]:
        return dict(self.settings)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], below: BlockDevice) -> Layer:
        raise CryptError("an encrypted volume is opened with its key (volume/crypt.py open_crypt), not from its "
                         "settings alone")


# ---- opening: header region read, unlocked (or a blank device formatted), then the layer


class _Region:
    """The device's first bytes in memory, as a luks2.Store; what LUKS2 writes is kept to be written down."""

    def __init__(self, data: bytearray) -> None:
        self.data = data
        self.dirty: list[tuple[int, int]] = []

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.data[offset:offset + length])

    def write(self, offset: int, data: bytes) -> None:
        if offset + len(data) > len(self.data):
            raise L.Luks2Error("the LUKS2 header does not fit the device")
        self.data[offset:offset + len(data)] = data
        self.dirty.append((offset, len(data)))


async def _read_region(below: BlockDevice, nbytes: int) -> bytearray:
    bs = below.block_size
    blocks = min(nbytes // bs, below.num_blocks)
    out = bytearray()
    lba = 0
    while lba < blocks:
        n = min(blocks - lba, READ_CHUNK // bs)
        out += bytes(await below.read(lba, n))
        lba += n
    return out


_READ_ONLY_BLANK = ("it is read-only (a snapshot) and holds no LUKS2 container: serve it without encryption, "
                    "or take the snapshot of an encrypted volume")


def _holds(region: _Region) -> str:
    """What the header region holds: "luks2" (either header copy's magic), "blank" (zeros: formatted at
    first use) or "other" (data that is never formatted over)."""
    d = region.data
    if bytes(d[:6]) == L.MAGIC or any(bytes(d[s:s + 6]) == L.MAGIC_COPY for s in L.HDR_SIZES):
        return "luks2"
    return "other" if any(d) else "blank"


async def _write_dirty(below: BlockDevice, region: _Region) -> None:
    """What LUKS2 changed in the region (header copies, keyslot areas: whole blocks), then a flush."""
    bs = below.block_size
    for offset, length in region.dirty:
        first, last = offset // bs, -(-(offset + length) // bs)
        await below.write(first, bytes(region.data[first * bs:last * bs]))
    region.dirty.clear()
    await below.flush()


def kdf_of(settings: dict[str, Any]) -> L.Kdf:
    kind = settings.get("kdf", "argon2id")
    if kind == "pbkdf2":
        return L.Kdf("pbkdf2", iterations=int(settings.get("kdf_iterations", L.Kdf.iterations)))
    return L.Kdf(kind, time=int(settings.get("kdf_time", L.Kdf.time)),
                 memory=int(settings.get("kdf_memory_kib", L.Kdf.memory)), cpus=int(settings.get("kdf_cpus", 2)))


KEY_COMMAND_TIMEOUT = 60.0


def run_key_command(argv: list[str]) -> bytes:
    """A key service hook: the passphrase is what `argv` prints on stdout (as-is); it must exit 0 in time."""
    import subprocess

    try:
        r = subprocess.run(argv, capture_output=True, timeout=KEY_COMMAND_TIMEOUT, check=False, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise CryptError(f"key command {argv[0]}: {e.strerror}") from None
    except subprocess.TimeoutExpired:
        raise CryptError(f"key command {argv[0]} gave no key within {KEY_COMMAND_TIMEOUT:g} s") from None
    if r.returncode != 0:
        said = " ".join(r.stderr.decode(errors="replace").split())[-200:]
        raise CryptError(f"key command {argv[0]} failed (exit {r.returncode}){': ' + said if said else ''}")
    if not r.stdout:
        raise CryptError(f"key command {argv[0]} printed no key")
    return r.stdout


async def passphrase_of(settings: dict[str, Any]) -> bytes:
    """The passphrase the settings name: the key file's bytes, or the key command's output (in a thread)."""
    if settings.get("prompt"):
        raise CryptError("its passphrase is given at unlock (prompt = true): `vsan volume unlock`")
    if settings.get("key_command"):
        return await asyncio.to_thread(run_key_command, [str(a) for a in settings["key_command"]])
    return read_key_file(settings["key_file"])


def read_key_file(path: str | Path) -> bytes:
    try:
        key = Path(path).read_bytes()
    except OSError as e:
        raise CryptError(f"key file {path}: {e.strerror}") from None
    if not key:
        raise CryptError(f"key file {path} is empty")
    return key


async def open_crypt(cfg: dict[str, Any], below: BlockDevice, *, name: str = "",
                     passphrase: bytes | None = None) -> CryptLayer:
    """The encryption layer over `below`: its LUKS2 container unlocked with `passphrase`, or else the key file
    (or key command) `cfg` names, or a blank device formatted first. CryptError with one line when it cannot
    be (nothing is written then). A volume whose passphrase is asked for (prompt = true) and not given stays
    locked (StackLocked: registry.open_stack puts a LockedLayer in its place)."""
    settings = {k: v for k, v in cfg.items() if k != "type"}
    if passphrase is None and settings.get("prompt"):
        raise StackLocked(lambda below, layers: locked_stack(below, layers, name=name))
    if settings.get("format", "luks2") != "luks2" or settings.get("cipher", "aes-xts-plain64") != "aes-xts-plain64":
        raise CryptError(f"encryption {settings.get('format')}/{settings.get('cipher')}: luks2 with aes-xts-plain64 "
                         "is supported")
    who = f"volume {name}: " if name else ""
    if any(getattr(d, "type_name", None) == "compress" for d in stack_of(below)):
        raise CryptError(f"{who}encryption over compression is the wrong order: ciphertext does not compress, and "
                         "data compressed below the cipher leaks its size; put the compress layer above crypt "
                         "(a volume's compression and encryption settings do)")
    try:
        if passphrase is None:
            passphrase = await passphrase_of(settings)
    except CryptError as e:
        raise CryptError(f"{who}{e}") from None
    if below.num_blocks * below.block_size <= L.DATA_OFFSET:
        raise CryptError(f"{who}the device ({below.num_blocks * below.block_size} bytes) is too small for a LUKS2 "
                         f"container: it needs more than {L.DATA_OFFSET >> 20} MiB")
    region = _Region(await _read_region(below, L.DATA_OFFSET))
    held = _holds(region)
    if held == "luks2":
        try:
            c = L.Luks2.open(region)
            key = await asyncio.to_thread(c.unlock, passphrase)
            segment = c.segment
        except L.Luks2Error as e:
            raise CryptError(f"{who}{e}") from None
        log.info("%sLUKS2 container %s unlocked (%s, %d-byte sectors)", who, c.header.uuid, segment.cipher,
                 segment.sector_size)
    elif held == "blank" and read_only_stack(below):
        raise CryptError(f"{who}{_READ_ONLY_BLANK}")
    elif held == "blank":
        # 4096 unless asked (cryptsetup's choice for LUKS2 too): a sector per 4 KiB command, 8x fewer tweaks
        sector = int(settings.get("sector_size", DEFAULT_SECTOR))
        key_bits = int(settings.get("key_size", 512))
        try:
            c, key = await asyncio.to_thread(L.Luks2.format, region, passphrase, key_size=key_bits // 8,
                                             sector_size=sector, kdf=kdf_of(settings), label=name[:47])
        except L.Luks2Error as e:
            raise CryptError(f"{who}{e}") from None
        segment = c.segment
        await _write_dirty(below, region)
        log.info("%sformatted a LUKS2 container %s on %s (aes-xts-plain64, %d-bit key, %d-byte sectors)", who,
                 c.header.uuid, getattr(below, "name", "its device"), key_bits, sector)
    else:
        raise CryptError(f"{who}its device holds data but no LUKS2 header: refusing to format over it (import a "
                         "LUKS2 container, or clear the device)")
    return CryptLayer(below, key, segment, settings, uuid=c.header.uuid)


register_opener("crypt", open_crypt)


# ---- a locked volume: served with its size, answering every command "not ready" until it is unlocked


@register_layer
class LockedLayer(Layer):
    """Stands for an encrypted volume's stack from its crypt layer up while the key is not in memory (`prompt
    = true` before `vsan volume unlock`, or after `vsan volume lock`): the volume keeps its geometry (read
    from the LUKS2 header, which needs no key), so initiators keep their sessions and see the same disk, and
    every command gets Locked (SCSI NOT READY / MANUAL INTERVENTION REQUIRED, NVMe Namespace Not Ready)."""

    type_name = "locked"

    def __init__(self, below: BlockDevice, block_size: int, num_blocks: int, layers: list[dict[str, Any]],
                 *, name: str = "") -> None:
        super().__init__(below, name=f"locked:{name or getattr(below, 'name', '?')}")
        self._bs, self._nb, self.layers, self.volume = block_size, num_blocks, layers, name

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def num_blocks(self) -> int:
        return self._nb

    @property
    def capabilities(self) -> Capabilities:
        return self.below.capabilities.but(sync_read=False, sync_write=False, write_window=False, extents=False,
                                           thin=False, resizable=False, unmap_reads_zero=False, write_zeroes=False)

    def _locked(self) -> Locked:
        return Locked(f"volume {self.volume} is locked: `vsan volume unlock {self.volume}` gives its passphrase")

    async def read(self, lba: int, blocks: int) -> Buffer:
        raise self._locked()

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        raise self._locked()

    async def flush(self) -> None:
        raise self._locked()

    async def unmap(self, lba: int, blocks: int) -> None:
        raise self._locked()

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        raise self._locked()

    async def lba_status(self, lba: int, blocks: int) -> Any:
        raise self._locked()

    async def resize(self, num_blocks: int) -> None:
        raise self._locked()

    def stats(self) -> dict[str, Any]:
        return {"locked": True}

    def layer_config(self) -> dict[str, Any]:
        return {"layers": self.layers}

    @classmethod
    def from_config(cls, cfg: dict[str, Any], below: BlockDevice) -> Layer:
        raise CryptError("a locked volume is made by open_stack (volume/crypt.py locked_stack)")


async def locked_stack(below: BlockDevice, layers: list[dict[str, Any]], *, name: str = "") -> LockedLayer:
    """A LockedLayer over `below` for `layers` (the crypt layer's config first): the block size and size the
    unlocked stack will have, from the LUKS2 header (or, on a blank device, from what formatting will make)."""
    region = _Region(await _read_region(below, min(L.DATA_OFFSET, below.num_blocks * below.block_size)))
    settings = layers[0]
    held = _holds(region)
    if held == "luks2":
        try:
            seg = L.Luks2.open(region).segment
        except L.Luks2Error as e:
            raise CryptError(f"volume {name}: {e}") from None
        bs, offset, size = seg.sector_size, seg.offset, seg.size
    elif held == "blank" and read_only_stack(below):
        raise CryptError(f"volume {name}: {_READ_ONLY_BLANK}")
    elif held == "blank":
        bs, offset, size = int(settings.get("sector_size", DEFAULT_SECTOR)), L.DATA_OFFSET, None
    else:
        raise CryptError(f"volume {name}: its device holds data but no LUKS2 header: refusing to format over it")
    nbytes = size if size is not None else below.num_blocks * below.block_size - offset
    for cfg in layers[1:]:
        if cfg.get("type") == "compress":
            from openvsan.volume.compress import DEFAULT_CHUNK, slot_bytes

            chunk = int(cfg.get("chunk_size", DEFAULT_CHUNK))
            nbytes = nbytes // (2 * slot_bytes(chunk)) * chunk
    log.info("volume %s is locked: `vsan volume unlock %s` gives its passphrase", name, name)
    return LockedLayer(below, bs, nbytes // bs, layers, name=name)
