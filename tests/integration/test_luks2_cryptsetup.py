"""LUKS2 headers both ways with the real cryptsetup (Debian cryptsetup-bin), on files: a container
`cryptsetup luksFormat` made is unlocked by openvsan (volume/luks2.py) to the volume key cryptsetup dumps;
one openvsan made is accepted by cryptsetup (luksDump, --test-passphrase for each keyslot and KDF, the
wrong passphrase refused, the same volume key dumped), and keyslots added or removed on either side count
on the other. Data through dm-crypt needs a kernel with device-mapper (the guest test does that)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptsetup_tool import cryptsetup, dumped_volume_key

from openvsan.volume import luks2 as L

FAST = L.Kdf("pbkdf2", iterations=1000)


def volume_key(image: Path, passphrase: bytes) -> bytes:
    return dumped_volume_key(image, key=passphrase)


def opened(image: Path) -> tuple[int, L.Luks2]:
    fd = os.open(image, os.O_RDWR)
    return fd, L.Luks2.open(L.FileStore(fd))


def test_a_cryptsetup_container_unlocks_here(tmp_path: Path) -> None:
    image = tmp_path / "cs.img"
    image.write_bytes(b"")
    os.truncate(image, 32 << 20)
    r = cryptsetup("luksFormat", "--type", "luks2", "--batch-mode", "--pbkdf", "argon2id", "--pbkdf-memory", "8192",
                   "--pbkdf-force-iterations", "4", "--sector-size", "4096", str(image), key=b"from cryptsetup")
    assert r.returncode == 0, r.stderr
    newkey = tmp_path / "new.key"
    newkey.write_bytes(b"added there")
    r = cryptsetup("luksAddKey", "--batch-mode", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000",
                   str(image), str(newkey), key=b"from cryptsetup")
    assert r.returncode == 0, r.stderr
    want = volume_key(image, b"from cryptsetup")
    fd, c = opened(image)
    try:
        assert c.keyslots() == [0, 1]
        assert c.unlock(b"from cryptsetup") == want
        assert c.unlock(b"added there") == want
        assert c.segment.sector_size == 4096 and c.segment.offset == 16 << 20
        with pytest.raises(L.WrongPassphrase):
            c.unlock(b"nope")
        c.remove_keyslot(1)            # removed here: cryptsetup no longer opens with it
    finally:
        os.close(fd)
    assert cryptsetup("open", "--test-passphrase", str(image), key=b"added there").returncode != 0
    assert cryptsetup("open", "--test-passphrase", str(image), key=b"from cryptsetup").returncode == 0


def test_an_openvsan_container_opens_in_cryptsetup(tmp_path: Path) -> None:
    image = tmp_path / "ov.img"
    image.write_bytes(b"")
    os.truncate(image, 32 << 20)
    fd = os.open(image, os.O_RDWR)
    try:
        c, key = L.Luks2.format(L.FileStore(fd), b"made here", kdf=L.Kdf("argon2id", time=2, memory=8192, cpus=2),
                                label="openvsan-test", sector_size=512)
        c.add_keyslot(key, b"pbkdf2 slot", FAST)
    finally:
        os.close(fd)
    dump = cryptsetup("luksDump", str(image))
    assert dump.returncode == 0, dump.stderr
    text = dump.stdout.decode()
    assert "Label:         \topenvsan-test" in text and "PBKDF:      argon2id" in text and "sector: 512" in text
    for passphrase in (b"made here", b"pbkdf2 slot"):
        r = cryptsetup("open", "--test-passphrase", str(image), key=passphrase)
        assert r.returncode == 0, (passphrase, r.stderr)
    r = cryptsetup("open", "--test-passphrase", str(image), key=b"wrong")
    assert r.returncode == 2 and b"No key available" in r.stderr
    assert volume_key(image, b"pbkdf2 slot") == key
    # a keyslot cryptsetup adds is one we open with; one it kills is gone here too
    newkey = tmp_path / "k"
    newkey.write_bytes(b"from cryptsetup")
    r = cryptsetup("luksAddKey", "--batch-mode", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000",
                   str(image), str(newkey), key=b"made here")
    assert r.returncode == 0, r.stderr
    r = cryptsetup("luksKillSlot", "--batch-mode", str(image), "0", key=b"pbkdf2 slot")
    assert r.returncode == 0, r.stderr
    fd, c = opened(image)
    try:
        assert c.unlock(b"from cryptsetup") == key
        with pytest.raises(L.WrongPassphrase):
            c.unlock(b"made here")
    finally:
        os.close(fd)
