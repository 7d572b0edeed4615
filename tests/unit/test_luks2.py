"""LUKS2 headers and keyslots (volume/luks2.py) on a store in memory: AES-XTS against IEEE 1619's known
answers, the AF splitter, format/unlock round trips with each KDF, a damaged copy (the other one serves), both
damaged (one line, nothing written), a wrong passphrase (one line, nothing written), adding, removing and
changing passphrases. cryptsetup itself reads and writes the same headers in
tests/integration/test_luks2_cryptsetup.py."""

from __future__ import annotations

import pytest

from openvsan.volume import luks2 as L

FAST = L.Kdf("pbkdf2", iterations=1000)
SMALL_ARGON = L.Kdf("argon2id", time=1, memory=1024, cpus=1)


class MemStore:
    def __init__(self, size: int = 17 << 20) -> None:
        self.data = bytearray(size)
        self.writes = 0

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.data[offset:offset + length])

    def write(self, offset: int, data: bytes) -> None:
        self.data[offset:offset + len(data)] = data
        self.writes += 1


def test_xts_gives_ieee_1619s_known_answers() -> None:
    # IEEE 1619-2007 annex B, vector 2: AES-128 keys 11.. and 22.., data unit 0x3333333333, 32 bytes of 0x44
    key = bytes([0x11]) * 16 + bytes([0x22]) * 16
    out = L.xts(key, bytes([0x44]) * 32, 0x3333333333, 32, encrypt=True)
    assert out.hex() == "c454185e6a16936e39334038acef838bfb186fff7480adc4289382ecd6d394f0"
    assert L.xts(key, out, 0x3333333333, 32, encrypt=False) == bytes([0x44]) * 32


def test_xts_tweaks_count_512_byte_sectors_whatever_the_sector_size() -> None:
    key = bytes(range(64))
    data = bytes(range(256)) * 32                       # 8 KiB
    big = L.xts(key, data, 16, 4096, encrypt=True)      # two 4 KiB sectors: tweaks 16 and 24
    assert big[:4096] == L.xts(key, data[:4096], 16, 4096, encrypt=True)
    assert big[4096:] == L.xts(key, data[4096:], 24, 4096, encrypt=True)
    assert big[4096:] != L.xts(key, data[4096:], 17, 4096, encrypt=True)
    with pytest.raises(L.Luks2Error, match="whole number"):
        L.xts(key, data[:1000], 0, 512, encrypt=True)


def test_the_af_splitter_needs_every_stripe() -> None:
    key = bytes(range(64))
    material = L.af_split(key, 100, "sha256")
    assert len(material) == 6400
    assert L.af_merge(material, 64, 100, "sha256") == key
    broken = bytearray(material)
    broken[1234] ^= 1
    assert L.af_merge(bytes(broken), 64, 100, "sha256") != key


@pytest.mark.parametrize("kdf", [FAST, SMALL_ARGON, L.Kdf("argon2i", time=1, memory=1024, cpus=1)],
                         ids=["pbkdf2", "argon2id", "argon2i"])
@pytest.mark.parametrize("key_size,sector_size", [(64, 512), (32, 4096)])
def test_format_then_unlock(kdf: L.Kdf, key_size: int, sector_size: int) -> None:
    store = MemStore()
    c, key = L.Luks2.format(store, b"correct horse", key_size=key_size, sector_size=sector_size, kdf=kdf,
                            label="vol1")
    again = L.Luks2.open(store)
    assert again.unlock(b"correct horse") == key and len(key) == key_size
    seg = again.segment
    assert (seg.offset, seg.sector_size, seg.iv_tweak, seg.cipher, seg.size) == (
        L.DATA_OFFSET, sector_size, 0, "aes-xts-plain64", None)
    assert again.header.label == "vol1" and again.header.uuid == c.header.uuid
    assert again.keyslots() == [0]


def test_a_wrong_passphrase_is_one_line_and_writes_nothing() -> None:
    store = MemStore()
    L.Luks2.format(store, b"right", kdf=FAST)
    before, writes = bytes(store.data), store.writes
    with pytest.raises(L.WrongPassphrase, match="no keyslot opens with this passphrase"):
        L.Luks2.open(store).unlock(b"wrong")
    assert store.writes == writes and bytes(store.data) == before


def test_a_damaged_copy_leaves_the_other_and_two_leave_a_clear_error() -> None:
    store = MemStore()
    _, key = L.Luks2.format(store, b"pw", kdf=FAST)
    store.data[L.BINARY + 10] ^= 0xFF                   # the primary's JSON
    assert L.Luks2.open(store).unlock(b"pw") == key     # the secondary serves
    store.data[L.DEFAULT_HDR_SIZE + L.BINARY + 10] ^= 0xFF
    before, writes = bytes(store.data), store.writes
    with pytest.raises(L.Luks2Error, match="primary: the header checksum does not match.*secondary: the header "
                                           "checksum does not match"):
        L.Luks2.open(store)
    assert store.writes == writes and bytes(store.data) == before
    with pytest.raises(L.Luks2Error, match="not a LUKS2 device"):
        L.Luks2.open(MemStore(1 << 20))


def test_the_newer_copy_wins() -> None:
    store = MemStore()
    c, key = L.Luks2.format(store, b"pw", kdf=FAST)
    old_primary = store.read(0, L.DEFAULT_HDR_SIZE)
    c.add_keyslot(key, b"second", FAST)                 # seqid + 1 in both copies
    store.write(0, old_primary)                         # a crash between the two writes: the primary is older
    assert L.Luks2.open(store).keyslots() == [0, 1]


def test_passphrases_added_removed_and_changed() -> None:
    store = MemStore()
    c, key = L.Luks2.format(store, b"first", kdf=FAST)
    assert c.add_keyslot(key, b"second", SMALL_ARGON) == 1
    with pytest.raises(L.Luks2Error, match="not this container's volume key"):
        c.add_keyslot(bytes(64), b"third", FAST)
    c = L.Luks2.open(store)
    assert c.unlock(b"second") == key
    area = c.header.meta["keyslots"]["0"]["area"]
    c.remove_keyslot(0)
    c = L.Luks2.open(store)
    assert c.keyslots() == [1]
    with pytest.raises(L.WrongPassphrase):
        c.unlock(b"first")
    assert store.read(int(area["offset"]), 64) != bytes(64)        # overwritten, not left as it was
    with pytest.raises(L.Luks2Error, match="last keyslot"):
        c.remove_keyslot(1)
    with pytest.raises(L.Luks2Error, match="no keyslot 7"):
        c.remove_keyslot(7)
    new = c.change_passphrase(b"second", b"third", FAST)
    c = L.Luks2.open(store)
    assert c.keyslots() == [new] and c.unlock(b"third") == key
    with pytest.raises(L.WrongPassphrase):
        c.unlock(b"second")


@pytest.mark.parametrize("key_size", [32, 64])
@pytest.mark.parametrize("size,sector_size,iv", [
    (4096, 512, 5), (1536, 512, 2**64 - 2), (16384, 4096, 77), (1 << 20, 512, 123456789), (1 << 20, 4096, 0),
    (3 * 4096, 4096, 2**63 - 1), (40960, 4096, 9), (512, 512, 1)])
def test_the_kept_openssl_context_gives_the_bytes_of_a_cipher_per_sector(key_size: int, size: int, sector_size: int, iv: int) -> None:
    """luks2.Xts (OpenSSL's EVP context kept, only the tweak set per sector, the sectors walked in C or in
    Python) is a shortcut: the same bytes as `cryptography`'s XTS one cipher object per sector, both ways,
    IVs wrapping past 2**64 included."""
    import os

    key = bytes(range(key_size))[::-1]
    data = os.urandom(size)
    cipher = L.xts(key, data, iv, sector_size, encrypt=True)
    # libgcrypt's XTS (where it loads), OpenSSL's walked in C, OpenSSL's walked in Python
    for fast in (L.Xts(key), L.Xts(key, gcrypt=False)):
        assert fast._lib is not None        # libcrypto loaded: the shortcut is what is tested
        assert fast.crypt(data, iv, sector_size, encrypt=True) == cipher
        assert fast.crypt(data, iv, sector_size, encrypt=True, in_python=True) == cipher
        assert fast.crypt(cipher, iv, sector_size, encrypt=False) == data
        assert fast.crypt(cipher, iv, sector_size, encrypt=False, in_python=True) == data
        # any buffer, read by address with no copy: a slice of bytes (read-only) and of a bytearray (a receive
        # buffer)
        for held in (b"\1" * 512 + data + b"\2" * 512, bytearray(512) + bytearray(data) + bytearray(512)):
            part = memoryview(held)[512:512 + size]
            assert fast.crypt(part, iv, sector_size, encrypt=True) == cipher
            assert fast.crypt(part, iv, sector_size, encrypt=True, in_python=True) == cipher
            assert fast.crypt(memoryview(bytearray(cipher)), iv, sector_size, encrypt=False) == data


def test_the_sector_walk_is_built_where_a_compiler_is() -> None:
    """`pip install` builds _xts_sectors.c where there is a C compiler (as CI has: .ci/run installs gcc) and
    goes on without it where there is none. Where there is one the C walk must have been built and load
    (installed before the compiler was: `pip install -e .` again). In CI a missing compiler fails."""
    import os
    import shutil

    if not (shutil.which("cc") or shutil.which("gcc")):
        if os.environ.get("CI"):
            pytest.fail("no C compiler in CI (.ci/run installs gcc): the sector walk cannot have been built")
        pytest.skip("no C compiler here: openvsan was installed with the sector walk in Python")
    assert L._sector_loop() is not None, "openvsan was installed without its sector walk: pip install -e . again"


def test_libgcrypt_runs_the_sectors_where_it_loads() -> None:
    """Where libgcrypt (1.9 or later) loads and the C walk was built, an Xts runs its sectors through libgcrypt's
    XTS (faster than OpenSSL 3.0's per 4 KiB sector); CI has both (.ci/run installs libgcrypt20 and gcc), so there
    a missing one fails; `gcrypt=False` keeps OpenSSL's."""
    import os

    key = os.urandom(64)
    if L._libgcrypt() is None or L._sector_loop_gcry() is None:
        if os.environ.get("CI"):
            pytest.fail("libgcrypt or the C walk is missing in CI (.ci/run installs libgcrypt20 and gcc)")
        pytest.skip("no libgcrypt 1.9+ or no C walk here: Xts runs OpenSSL's XTS")
    assert L.Xts(key).path == "libgcrypt, sectors walked in C"
    assert L.Xts(key, gcrypt=False).path == "OpenSSL, sectors walked in C"
    with pytest.raises(L.Luks2Error, match="whole number of 4096-byte sectors"):
        L.Xts(key).crypt(bytes(1000), 0, 4096, encrypt=True)
