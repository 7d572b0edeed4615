"""The encryption layer (volume/crypt.py) over devices in memory: a blank device is formatted as LUKS2 and
unlocked again from the key file; what is below is ciphertext in the data segment (the XTS of what was
written, tweaked by its place); the fast path gives the same bytes as the normal path both ways; 4 KiB
sectors over 512-byte blocks; a wrong key file or a device holding other data is refused with one line and
nothing written; unmap does nothing unless allowed; write_zeroes reads back zeros."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from openvsan.block.ram import RamDevice
from openvsan.volume import luks2 as L
from openvsan.volume.crypt import CryptError, CryptLayer, open_crypt
from openvsan.volume.registry import open_stack

MiB = 1 << 20


def settings(key_file: Path, **kw: Any) -> dict[str, Any]:
    return {"type": "crypt", "key_file": str(key_file), "kdf": "pbkdf2", "kdf_iterations": 1000, "sector_size": 512,
            **kw}


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    p = tmp_path / "v.key"
    p.write_bytes(b"a passphrase in a file\n")
    return p


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_blank_device_is_formatted_then_unlocked_and_holds_ciphertext(key_file: Path) -> None:
    dev = RamDevice((32 * MiB) // 512)
    layer = run(open_crypt(settings(key_file), dev, name="v1"))
    assert isinstance(layer, CryptLayer) and layer.block_size == 512
    assert layer.num_blocks == (32 * MiB - L.DATA_OFFSET) // 512
    data = bytes(range(256)) * 64                       # 16 KiB at block 10
    run(layer.write(10, data))
    assert bytes(run(layer.read(10, 32))) == data
    raw = bytes(run(dev.read(L.DATA_OFFSET // 512 + 10, 32)))
    c = L.Luks2.open(_snapshot(dev))
    key = c.unlock(key_file.read_bytes())
    assert raw == L.xts(key, data, 10, 512, encrypt=True) and raw != data
    again = run(open_crypt(settings(key_file), dev, name="v1"))      # the container is found, not made again
    assert again.uuid == layer.uuid and bytes(run(again.read(10, 32))) == data
    cfg = again.to_config()                # the desired state gets the settings, never the key
    assert cfg == settings(key_file) and key.hex() not in repr(cfg) and key not in repr(cfg).encode()


def test_the_fast_path_gives_the_normal_paths_bytes(key_file: Path) -> None:
    dev = RamDevice((32 * MiB) // 512)
    layer = run(open_crypt(settings(key_file), dev))
    data = (bytes(range(251)) * 33)[:8192]           # 8 KiB, no pattern on sector bounds
    assert layer.write_now(100, data)                 # the fast path writes what the normal path would
    run(layer.write(200, data))
    key = L.Luks2.open(_snapshot(dev)).unlock(key_file.read_bytes())
    below = L.DATA_OFFSET // 512
    assert bytes(run(dev.read(below + 100, 16))) == L.xts(key, data, 100, 512, encrypt=True)
    assert bytes(run(dev.read(below + 200, 16))) == L.xts(key, data, 200, 512, encrypt=True)
    assert layer.read_now(100, 16) == bytes(run(layer.read(100, 16))) == data   # and reads what it reads
    assert layer.read_now(200, 16) == bytes(run(layer.read(200, 16))) == data
    assert layer.read_now(0, 129) is None and not layer.write_now(0, bytes(129 * 512))   # past FAST_MAX


def test_4k_sectors_by_default_over_512_byte_blocks(key_file: Path) -> None:
    dev = RamDevice((32 * MiB) // 512)
    default = {k: v for k, v in settings(key_file).items() if k != "sector_size"}   # 4096 unless asked
    layer = run(open_crypt(default, dev))
    assert layer.block_size == 4096 and layer.num_blocks == (32 * MiB - L.DATA_OFFSET) // 4096
    data = bytes(range(256)) * 32
    run(layer.write(3, data))
    assert bytes(run(layer.read(3, 2))) == data
    key = L.Luks2.open(_snapshot(dev)).unlock(key_file.read_bytes())
    raw = bytes(run(dev.read(L.DATA_OFFSET // 512 + 24, 16)))
    assert raw == L.xts(key, data, 24, 4096, encrypt=True)          # IV in 512-byte units: 3 * 8


def test_refusals_are_one_line_and_write_nothing(key_file: Path, tmp_path: Path) -> None:
    dev = RamDevice((32 * MiB) // 512)
    run(open_crypt(settings(key_file), dev))
    before = bytes(run(dev.read(0, (32 * MiB) // 512)))
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(b"not it")
    with pytest.raises(CryptError, match="^volume v1: no keyslot opens with this passphrase$"):
        run(open_crypt(settings(wrong), dev, name="v1"))
    with pytest.raises(CryptError, match="key file .*missing.key: No such file"):
        run(open_crypt(settings(tmp_path / "missing.key"), dev))
    assert bytes(run(dev.read(0, (32 * MiB) // 512))) == before
    used = RamDevice((32 * MiB) // 512)
    run(used.write(5, b"an ext4 superblock, say".ljust(512, b"\0")))
    with pytest.raises(CryptError, match="holds data but no LUKS2 header: refusing to format"):
        run(open_crypt(settings(key_file), used))
    with pytest.raises(CryptError, match="too small for a LUKS2 container"):
        run(open_crypt(settings(key_file), RamDevice(8 * MiB // 512)))


def test_unmap_only_when_allowed_and_write_zeroes_reads_zeros(key_file: Path) -> None:
    dev = RamDevice((32 * MiB) // 512)
    layer = run(open_crypt(settings(key_file), dev))
    run(layer.write(0, b"\xaa" * 4096))
    run(layer.unmap(0, 8))
    assert bytes(run(layer.read(0, 8))) == b"\xaa" * 4096
    assert not layer.capabilities.unmap_reads_zero
    run(layer.write_zeroes(0, 8))
    assert bytes(run(layer.read(0, 8))) == bytes(4096)
    assert bytes(run(dev.read(L.DATA_OFFSET // 512, 8))) != bytes(4096)        # encrypted zeros below
    allowed = run(open_crypt(settings(key_file, allow_discards=True), dev))
    run(allowed.unmap(0, 8))
    assert bytes(run(dev.read(L.DATA_OFFSET // 512, 8))) == bytes(4096)


def test_a_stack_rebuilt_over_an_unlocked_layer_keeps_it(key_file: Path) -> None:
    dev = RamDevice((32 * MiB) // 512)
    layers = [settings(key_file)]
    top = run(open_stack(dev, layers, name="v"))
    again = run(open_stack(dev, [*layers, {"type": "qos", "read_iops_limit": 100}], name="v", reuse=[top]))
    assert again.below is top       # type: ignore[attr-defined]


def _snapshot(dev: RamDevice) -> Any:
    region = bytes(run(dev.read(0, L.DATA_OFFSET // 512)))

    class Snap:
        def read(self, offset: int, length: int) -> bytes:
            return region[offset:offset + length]

        def write(self, offset: int, data: bytes) -> None:
            raise AssertionError("read only")
    return Snap()


def test_a_key_command_is_a_key_service_hook(key_file: Path) -> None:
    dev = RamDevice((32 * MiB) // 512)
    made = run(open_crypt(settings(key_file), dev))
    hooked = {k: v for k, v in settings(key_file).items() if k != "key_file"}
    again = run(open_crypt({**hooked, "key_command": ["cat", str(key_file)]}, dev, name="v1"))
    assert again.uuid == made.uuid
    with pytest.raises(CryptError, match=r"^volume v1: key command sh failed \(exit 3\): the vault is sealed$"):
        run(open_crypt({**hooked, "key_command": ["sh", "-c", "echo the vault is sealed >&2; exit 3"]}, dev,
                       name="v1"))
    with pytest.raises(CryptError, match="printed no key"):
        run(open_crypt({**hooked, "key_command": ["true"]}, dev))


def test_the_spec_takes_a_key_file_or_a_key_command(tmp_path: Path) -> None:
    from openvsan.node.config import ConfigError, parse_config

    def cfg(encryption: dict[str, Any]) -> Any:
        return parse_config({"node": {"name": "n", "data_dir": str(tmp_path)},
                             "devices": [{"name": "d0", "type": "ram", "size": "64MiB"}],
                             "volumes": [{"name": "v", "device": "d0", "encryption": encryption}]}, base_dir=tmp_path)

    assert cfg({"key_file": "k"}).volumes[0].layers[0]["key_file"] == str(tmp_path / "k")
    assert cfg({"key_command": ["get-key", "v"]}).volumes[0].layers[0]["key_command"] == ["get-key", "v"]
    assert cfg({"prompt": True}).volumes[0].layers[0]["prompt"] is True
    for bad, line in (({}, "one of the three"), ({"key_file": "k", "key_command": ["x"]}, "one of the three"),
                      ({"key_file": "k", "prompt": True}, "one of the three"),
                      ({"key_file": "k", "key_size": 384}, "use 256"), ({"key_file": "k", "sector_size": 1000},
                                                                       "use 512 or 4096"),
                      ({"key_file": "k", "cipher": "serpent-xts-plain64"}, "cipher")):
        with pytest.raises(ConfigError, match=line):
            cfg(bad)


def test_a_prompt_volume_opens_locked_with_the_geometry_it_will_have_and_unlocks_with_its_passphrase() -> None:
    """prompt = true: open_stack leaves a LockedLayer of the size the unlocked stack has (a blank device: as
    formatting will make it; a container: from its header, no key needed), every command refused with Locked;
    with the passphrase the container is formatted or unlocked; a wrong one is refused, nothing written."""
    from openvsan.block.errors import Locked
    from openvsan.volume.crypt import LockedLayer

    cfg = {"type": "crypt", "prompt": True, "kdf": "pbkdf2", "kdf_iterations": 1000}

    async def go() -> None:
        dev = RamDevice((32 * MiB) // 512)
        locked = await open_stack(dev, [cfg, {"type": "qos", "read_iops_limit": 1000}], name="v")
        assert isinstance(locked, LockedLayer)
        assert (locked.block_size, locked.num_blocks) == (4096, (32 * MiB - L.DATA_OFFSET) // 4096)
        for call in (locked.read(0, 1), locked.write(0, bytes(4096)), locked.flush(), locked.unmap(0, 1)):
            with pytest.raises(Locked, match="volume v is locked: `vsan volume unlock v`"):
                await call
        assert not any(bytes(await dev.read(0, 64)))             # nothing written while locked
        top = await open_stack(dev, [cfg], name="v", passphrase=b"typed at a prompt")
        assert isinstance(top, CryptLayer) and (top.block_size, top.num_blocks) == (locked.block_size,
                                                                                   locked.num_blocks)
        await top.write(3, b"x" * 4096)
        assert top.stats()["unlocked_with"] == "a passphrase given at unlock"
        again = await open_stack(dev, [cfg], name="v")           # formatted now: the header gives the size
        assert isinstance(again, LockedLayer) and again.num_blocks == top.num_blocks
        with pytest.raises(CryptError, match="no keyslot opens with this passphrase"):
            await open_stack(dev, [cfg], name="v", passphrase=b"wrong")
        opened = await open_stack(dev, [cfg], name="v", passphrase=b"typed at a prompt")
        assert bytes(await opened.read(3, 1)) == b"x" * 4096
    run(go())


def test_the_block_errors_of_a_locked_volume_in_each_protocol() -> None:
    from openvsan.block.errors import Locked
    from openvsan.protocol.nvme.status import NS_NOT_READY, block_error_status
    from openvsan.protocol.scsi.sense import NOT_READY, block_error_result, parse_sense

    r = block_error_result(Locked("locked"), write=False)
    assert parse_sense(r.sense) == (NOT_READY, 0x0403)
    assert block_error_status(Locked("locked"), write=True) == NS_NOT_READY


def test_sectors_never_written_read_as_zeros_and_so_do_unmapped_ones_with_discards(key_file: Path) -> None:
    async def go() -> None:
        for sector in (512, 4096):
            dev = RamDevice((32 * MiB) // 512)
            layer = await open_crypt(settings(key_file, sector_size=sector, allow_discards=True), dev)
            assert layer.capabilities.unmap_reads_zero
            assert bytes(await layer.read(0, 8)) == bytes(8 * sector)          # a new device: zeros, not noise
            data = bytes(range(256)) * (3 * sector // 256)
            await layer.write(2, data)
            got = bytes(await layer.read(0, 8))
            assert got[2 * sector:5 * sector] == data and got[:2 * sector] == bytes(2 * sector)
            assert bytes(layer.read_now(3, 1) or b"") == data[sector:2 * sector]   # the fast path agrees
            assert bytes(layer.read_now(6, 1) or b"") == bytes(sector)
            await layer.unmap(3, 1)
            assert bytes(await layer.read(2, 3)) == data[:sector] + bytes(sector) + data[2 * sector:]
            plain = await open_crypt(settings(key_file, sector_size=sector), dev)  # no discards: not stated
            assert not plain.capabilities.unmap_reads_zero
    run(go())


def test_a_layer_without_the_c_walk_says_so_and_reads_what_the_c_walk_wrote(
        key_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Installed without a C compiler, a volume still serves the same bytes (the Python walk), and says why it
    is slower: a warning when it opens and its `cipher_path` in `vsan volume show`."""
    import os

    async def go() -> None:
        dev = RamDevice((32 * MiB) // 512)
        fast = await open_crypt(settings(key_file, sector_size=4096), dev)
        if L._sector_loop() is not None:        # built (test_luks2: it must be where there is a compiler)
            lib = "libgcrypt" if L._libgcrypt() is not None else "OpenSSL"
            assert fast.stats()["cipher_path"] == f"{lib}, sectors walked in C"
        data = os.urandom(256 << 10)
        await fast.write(3, data)
        monkeypatch.setattr(L, "_WALKS", {"ovs_xts_sectors": None})   # as if _xts_sectors.c had not been built
        with caplog.at_level("WARNING", logger="openvsan.volume.crypt"):
            slow = await open_crypt(settings(key_file, sector_size=4096), dev)
        assert "sectors walked in Python" in slow.stats()["cipher_path"]
        assert any("sectors walked in Python" in r.getMessage() for r in caplog.records)
        assert bytes(await slow.read(3, 64)) == data
        await slow.write(100, data)
        assert bytes(await fast.read(100, 64)) == data
    run(go())
