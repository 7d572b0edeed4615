"""A primary's dirty-region files (replication/dirty.py), and a restarted primary resyncing by them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from openvsan.block import FaultDevice, RamDevice
from openvsan.node.memstore import MemoryState, MemoryStateStore
from openvsan.replication import record as R
from openvsan.replication.dirty import DirtyFile, DirtyFileError, decode, encode
from openvsan.replication.mirror import MirrorLayer

BS = 512
BLOCKS = 2048
REGION = 64 * 1024     # 16 regions


def test_round_trip_and_what_is_not_trusted(tmp_path: Path) -> None:
    raw = encode({0, 3, 15}, 16, REGION, since=7)
    assert decode(raw) == ({0, 3, 15}, 16, REGION, 7)
    for bad, why in ((raw[:10], "shorter than the header"), (b"X" + raw[1:], "bad magic"),
                     (raw[:-1] + bytes([raw[-1] ^ 1]), "checksum"), (raw + b"\0", "bitmap bytes")):
        with pytest.raises(DirtyFileError, match=why):
            decode(bad)
    with pytest.raises(ValueError, match="outside"):
        encode({16}, 16, REGION, since=1)
    f = DirtyFile(tmp_path / "v.b.dirty", 16, REGION)
    assert f.load(since=7) is None                         # no file: a full copy
    f.save({2, 5}, since=7)
    assert f.load(since=7) == {2, 5}
    assert f.load(since=8) is None                         # another outage's
    assert DirtyFile(f.path, 32, REGION).load(since=7) is None     # another shape's
    f.path.write_bytes(f.path.read_bytes()[:-1])           # torn
    assert f.load(since=7) is None
    f.remove()
    assert not f.path.exists()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_restarted_primary_resyncs_only_what_its_file_says(tmp_path: Path) -> None:
    async def go() -> None:
        clock = Clock()
        store = MemoryStateStore(MemoryState(clock=clock))
        await R.create(store, "v", ("a", "b"))
        local, b = RamDevice(BLOCKS, BS), FaultDevice(RamDevice(BLOCKS, BS))
        view = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        m = MirrorLayer(local, me="a", view=view, store=store, peers={"b": b}, region_size=REGION,
                        dirty_dir=tmp_path)
        b.fail_device()
        await m.write(0, b"x" * BS)                        # b falls out of sync: region 0
        f = DirtyFile(tmp_path / "v.b.dirty", 16, REGION)
        assert f.load(since=m.view.epoch) == {0}           # on disk when the write was acknowledged
        await asyncio.gather(*(m.write(r * (REGION // BS), b"y" * BS) for r in (4, 9, 4)))
        since = m.view.out_of_sync["b"]
        assert f.load(since=since) == {0, 4, 9}
        # a crashes and comes back as primary (a new epoch; b's outage began at `since`)
        clock.now += 6
        view2 = await R.claim_primary(store, "v", "a", await store.grant_lease(5))
        assert view2.epoch > since and view2.out_of_sync == {"b": since}
        b.clear_faults()
        m2 = MirrorLayer(local, me="a", view=view2, store=store, peers={"b": b}, region_size=REGION,
                         dirty_dir=tmp_path)
        assert m2.dirty == {"b": {0, 4, 9}}                # not all 16
        assert await m2.resync("b") == 3 * REGION
        assert bytes(await b.read(0, BLOCKS)) == bytes(await local.read(0, BLOCKS))
        assert not f.path.exists() and (await R.load(store, "v")).out_of_sync == {}
        # without the file (another node, or lost), the peer gets everything
        m3 = MirrorLayer(local, me="a", view=view2, store=store, peers={"b": b}, region_size=REGION,
                         dirty_dir=tmp_path / "elsewhere")
        assert m3.dirty == {"b": set(range(16))}
    asyncio.run(go())
