"""A replica's epoch fence (replication/fence.py): NVMe reservations keyed by epoch, whose epochs only go up."""

from __future__ import annotations

from pathlib import Path

import pytest

from openvsan.protocol.nvme import status as S
from openvsan.protocol.nvme.reservations import EXCLUSIVE_ACCESS, WRITE_EXCLUSIVE
from openvsan.replication.fence import EpochFence
from openvsan.replication.peer import FloorFile

OLD, NEW, OTHER = b"o" * 16, b"n" * 16, b"x" * 16
REGISTER, REPLACE = 0, 2
ACQUIRE, PREEMPT = 0, 1


def primary(f: EpochFence, host: bytes, epoch: int, *, preempt: int | None = None) -> int:
    st = f.register(host, REGISTER, False, 0, 0, epoch)
    if st != S.SUCCESS:
        return st
    if preempt is None:
        return f.acquire(host, ACQUIRE, WRITE_EXCLUSIVE, False, epoch, 0)
    return f.acquire(host, PREEMPT, WRITE_EXCLUSIVE, False, epoch, preempt)


def test_a_new_epoch_preempts_the_old_and_the_old_can_neither_write_nor_come_back() -> None:
    floors: list[int] = []
    f = EpochFence(persist=floors.append)
    assert not f.allows(OLD, write=True)                  # nobody writes before a primary holds it
    assert primary(f, OLD, 5) == S.SUCCESS and floors == [5]
    assert f.allows(OLD, write=True) and not f.allows(OTHER, write=True)
    assert primary(f, NEW, 9, preempt=5) == S.SUCCESS and floors == [5, 9]
    assert f.allows(NEW, write=True) and not f.allows(OLD, write=True)
    assert f.allows(OLD, write=False)                     # reads stay open (Write Exclusive)
    # the old primary wakes and tries again with its epoch, or any epoch below the floor
    assert f.register(OLD, REGISTER, False, 0, 0, 5) == S.RESERVATION_CONFLICT
    assert f.register(OLD, REGISTER, False, 0, 0, 8) == S.RESERVATION_CONFLICT
    assert f.refused >= 3 and f.holder == NEW


def test_registrants_below_a_raised_floor_are_dropped() -> None:
    f = EpochFence()
    assert primary(f, OLD, 5) == S.SUCCESS
    assert f.register(OTHER, REGISTER, False, 0, 0, 6) == S.SUCCESS   # registered, waiting
    assert primary(f, NEW, 9, preempt=5) == S.SUCCESS
    assert set(f.registrants) == {NEW}                    # 6 < 9: dropped with the old epoch
    assert f.acquire(OTHER, PREEMPT, WRITE_EXCLUSIVE, False, 6, 9) == S.RESERVATION_CONFLICT


def test_the_floor_survives_a_restart() -> None:
    saved: list[int] = []
    f = EpochFence(persist=saved.append)
    assert primary(f, NEW, 12) == S.SUCCESS
    again = EpochFence(floor=saved[-1])                   # the replica restarted from its saved floor
    assert primary(again, OLD, 7) == S.RESERVATION_CONFLICT
    assert primary(again, NEW, 12) == S.SUCCESS and again.allows(NEW, write=True)


def test_only_write_exclusive_is_taken() -> None:
    f = EpochFence()
    assert f.register(NEW, REGISTER, False, 0, 0, 3) == S.SUCCESS
    assert f.acquire(NEW, ACQUIRE, EXCLUSIVE_ACCESS, False, 3, 0) == S.INVALID_FIELD
    assert f.floor == 0


def test_the_floor_file_round_trips_and_refuses_a_torn_one(tmp_path: Path) -> None:
    f = FloorFile(tmp_path / "v.floor")
    assert f.load() == 0                                  # a new replica: no epoch has held it
    f.save(12)
    f.save(40)
    assert f.load() == 40 and not (tmp_path / "v.floor.new").exists()
    (tmp_path / "v.floor").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a fence floor"):
        f.load()


def test_a_primary_takes_its_own_replica_in_process_and_loses_it_to_a_newer_epoch() -> None:
    floors: list[int] = []
    f = EpochFence(persist=floors.append)
    assert f.take_local(OLD, 5) and f.holds(OLD, 5) and floors == [5]
    # the same node elected again (a later epoch of its own): it holds it for that epoch now
    assert f.take_local(OLD, 7) and f.holds(OLD, 7) and not f.holds(OLD, 5) and floors == [5, 7]
    # another node's epoch preempts it over the wire: this node's in-process writes are refused from then on
    assert primary(f, NEW, 9, preempt=7) == S.SUCCESS
    assert not f.holds(OLD, 7) and f.holds(NEW, 9)
    # and it cannot take it back with its old epoch
    before = f.refused
    assert not f.take_local(OLD, 7) and f.refused == before + 1 and f.holds(NEW, 9)


def test_the_primary_s_own_replica_takes_fast_writes_only_while_its_epoch_holds_the_fence() -> None:
    """LocalReplica (the mirror's local device) passes write_now and write_soon (a compressed replica's write
    cache) to the stack below while its epoch holds the fence; once a newer epoch preempted it, both decline
    and write() refuses, so no write of the old epoch reaches the replica by any path."""
    import asyncio

    from openvsan.block import RamDevice
    from openvsan.replication.controller import LocalReplica, ReplicaFenced

    class Soon(RamDevice):
        def write_soon(self, lba: int, data: bytes, fua: bool, done: object) -> bool:
            self._put(lba, data)
            done(None)  # type: ignore[operator]
            return True

    async def go() -> None:
        f = EpochFence()
        assert f.take_local(OLD, 5)
        dev = Soon(64, 512)
        local = LocalReplica(dev, f, OLD, 5, "v")
        answers: list[BaseException | None] = []
        assert local.write_now(0, b"a" * 512)
        assert local.write_soon(1, b"b" * 512, False, answers.append) and answers == [None]
        assert bytes(await dev.read(0, 2)) == b"a" * 512 + b"b" * 512
        assert primary(f, NEW, 9, preempt=5) == S.SUCCESS
        assert not local.write_now(2, b"c" * 512)
        assert not local.write_soon(3, b"d" * 512, False, answers.append) and answers == [None]
        with pytest.raises(ReplicaFenced):
            await local.write(4, b"e" * 512)
        assert bytes(await dev.read(2, 3)) == bytes(3 * 512)
    asyncio.run(go())
