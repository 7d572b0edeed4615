"""MultipathDevice over paths in memory: each fake path reaches one shared RamDevice (the volume) and has a
state the test flips, or fails. Path selection (optimized first, round-robin), retry on another path after
a path error, hold while no path is usable, the no_path_retry bound, errors of the volume itself returned
at once, and the identity check. Time is simulated (tests/support/fake_clock.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fake_clock import FakeClock

from openvsan.block import RamDevice
from openvsan.block.errors import DeviceFailed, MediumError
from openvsan.initiator.iscsi_conn import ConnectionLost
from openvsan.initiator.multipath import MultipathDevice, Path, PathState
from openvsan.initiator.nvme_tcp import AnaPathError
from openvsan.initiator.scsi import PathNotAccessible
from openvsan.protocol.scsi import sense as S

BS = 512


class FakePath:
    """A path to `volume`: I/O refused with the error its state implies; `fail` makes the next commands
    raise that error instead; `down` makes it unreachable (I/O and probes raise DeviceFailed)."""

    def __init__(self, volume: RamDevice, state: PathState = PathState.OPTIMIZED, ident: bytes = b"vol") -> None:
        self.volume = volume
        self.target_state = state
        self.ident = ident
        self.block_size, self.num_blocks = volume.block_size, volume.num_blocks
        self.capabilities = volume.capabilities
        self.writes = 0
        self.reads = 0
        self.probes = 0
        self.fail: list[BaseException] = []
        self.down = False
        self.closed = False

    async def identity(self) -> bytes:
        return self.ident

    async def state(self) -> PathState:
        self.probes += 1
        if self.down:
            raise DeviceFailed("cannot connect")
        return self.target_state

    def _admit(self) -> None:
        if self.down:
            raise ConnectionLost("connection reset")
        if self.fail:
            raise self.fail.pop(0)
        if self.target_state == PathState.STANDBY:
            raise PathNotAccessible("sense 2/04/0b", S.ASC_LU_NOT_ACCESSIBLE_STANDBY)
        if self.target_state == PathState.TRANSITIONING:
            raise AnaPathError("SCT 3 SC 03", 0x303)

    async def read(self, lba: int, blocks: int) -> Any:
        await asyncio.sleep(0)
        self._admit()
        self.reads += 1
        return await self.volume.read(lba, blocks)

    async def write(self, lba: int, data: Any, *, fua: bool = False) -> None:
        await asyncio.sleep(0)
        self._admit()
        self.writes += 1
        await self.volume.write(lba, data, fua=fua)

    async def flush(self) -> None:
        self._admit()

    async def unmap(self, lba: int, blocks: int) -> None:
        self._admit()

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        self._admit()
        await self.volume.write_zeroes(lba, blocks)

    async def close(self) -> None:
        self.closed = True

    def to_config(self) -> dict[str, Any]:
        return {"type": "fake"}


def setup(*states: PathState, clock: FakeClock, **kw: Any) -> tuple[RamDevice, list[FakePath], MultipathDevice]:
    vol = RamDevice(64, BS)
    fakes = [FakePath(vol, st) for st in states]
    dev = MultipathDevice([Path(f"p{i}", device=f) for i, f in enumerate(fakes)], clock=clock, sleep=clock.sleep,
                          **kw)
    return vol, fakes, dev


def run(body: Callable[[FakeClock], Awaitable[None]]) -> None:
    async def main() -> None:
        await asyncio.wait_for(body(FakeClock()), 10)
    asyncio.run(main())


def test_optimized_first_round_robin_among_them() -> None:
    async def body(clock: FakeClock) -> None:
        _, (a, b, c), dev = setup(PathState.NON_OPTIMIZED, PathState.OPTIMIZED, PathState.OPTIMIZED, clock=clock)
        await dev.open()
        try:
            for i in range(10):
                await dev.write(i, bytes([i]) * BS)
            assert (a.writes, b.writes, c.writes) == (0, 5, 5)
            b.target_state = c.target_state = PathState.STANDBY
            dev.probe_all()
            await clock.sleep(0.01)
            await dev.write(0, b"x" * BS)
            assert a.writes == 1                           # only non-optimized left: it serves
            assert [s["state"] for s in dev.stats()] == ["non-optimized", "standby", "standby"]
        finally:
            await dev.close()
        assert a.closed and b.closed and c.closed

    run(body)


@pytest.mark.parametrize("error", [PathNotAccessible("standby", S.ASC_LU_NOT_ACCESSIBLE_STANDBY),
                                   AnaPathError("inaccessible", 0x302), ConnectionLost("reset"),
                                   DeviceFailed("cannot reconnect")])
def test_a_path_error_sends_the_command_on_another_path(error: BaseException) -> None:
    async def body(clock: FakeClock) -> None:
        vol, (a, b), dev = setup(PathState.OPTIMIZED, PathState.NON_OPTIMIZED, clock=clock)
        await dev.open()
        try:
            a.fail.append(error)
            await dev.write(5, b"w" * BS)
            assert bytes(await vol.read(5, 1)) == b"w" * BS
            assert (a.writes, b.writes) == (0, 1) and dev.paths[0].errors == 1 and dev.retries == 1
            await clock.sleep(0.01)
            assert dev.paths[0].state == PathState.OPTIMIZED      # read again: the target says optimized
        finally:
            await dev.close()

    run(body)


def test_the_error_of_the_volume_is_not_retried() -> None:
    async def body(clock: FakeClock) -> None:
        _, (a, b), dev = setup(PathState.OPTIMIZED, PathState.OPTIMIZED, clock=clock)
        await dev.open()
        try:
            a.fail.append(MediumError("unrecovered read error", 3))
            b.fail.append(MediumError("unrecovered read error", 3))
            with pytest.raises(MediumError):
                await dev.read(3, 1)
            assert a.reads + b.reads == 0 and dev.retries == 0
        finally:
            await dev.close()

    run(body)


def test_io_is_held_while_no_path_serves_then_resumes() -> None:
    changes: list[tuple[str, str, str]] = []

    async def body(clock: FakeClock) -> None:
        vol, (a, b), dev = setup(PathState.OPTIMIZED, PathState.STANDBY, clock=clock, no_path_retry=30,
                                 check_interval=1.0, on_change=lambda p, o, n: changes.append((p.name, o.label, n.label)))
        await dev.open()
        try:
            a.down = True                                   # the primary dies; b is still standby
            t0 = clock()
            w = asyncio.ensure_future(dev.write(7, b"h" * BS))
            await clock.sleep(5)
            assert not w.done() and dev.held == 1           # held, not failed
            b.target_state = PathState.OPTIMIZED            # failover: b becomes the primary
            await asyncio.wait_for(w, 5)
            assert 5 <= clock() - t0 < 7                    # picked up within a check or a retry
            assert bytes(await vol.read(7, 1)) == b"h" * BS and b.writes == 1
            assert ("p0", "optimized", "failed") in changes and ("p1", "standby", "optimized") in changes
            a.down = False                                  # the old primary comes back: reconnected
            a.target_state = PathState.STANDBY
            await clock.sleep(2)
            assert dev.paths[0].state == PathState.STANDBY and a.probes > 2
        finally:
            await dev.close()

    run(body)


def test_no_path_retry_bounds_the_wait() -> None:
    async def body(clock: FakeClock) -> None:
        _, (a, _), dev = setup(PathState.OPTIMIZED, PathState.STANDBY, clock=clock, no_path_retry=12)
        await dev.open()
        try:
            a.down = True
            t0 = clock()
            with pytest.raises(DeviceFailed, match="no usable path for 12 s") as e:
                await dev.read(0, 1)
            assert 12 <= clock() - t0 < 13
            assert "p0 failed" in str(e.value) and "p1 standby" in str(e.value)
        finally:
            await dev.close()

    run(body)


def test_a_path_that_refuses_but_claims_optimized_does_not_spin() -> None:
    async def body(clock: FakeClock) -> None:
        _, (a,), dev = setup(PathState.OPTIMIZED, clock=clock, no_path_retry=3)
        await dev.open()
        try:
            a.fail.extend(PathNotAccessible("transition", S.ASC_LU_NOT_ACCESSIBLE_TRANSITION) for _ in range(1000))
            with pytest.raises(DeviceFailed, match="no usable path"):
                await dev.write(0, b"z" * BS)
            assert len(a.fail) > 900        # paced by retry_interval, not a loop of a thousand tries
        finally:
            await dev.close()

    run(body)


def test_a_path_of_another_volume_is_refused_at_open() -> None:
    async def body(clock: FakeClock) -> None:
        vol = RamDevice(64, BS)
        a, b = FakePath(vol), FakePath(vol, ident=b"other")
        dev = MultipathDevice([Path("a", device=a), Path("b", device=b)], clock=clock, sleep=clock.sleep)
        with pytest.raises(DeviceFailed, match="path b is another volume than path a: refused"):
            await dev.open()
        assert a.closed and b.closed

        c = FakePath(RamDevice(32, BS))
        dev = MultipathDevice([Path("a", device=FakePath(vol)), Path("c", device=c)], clock=clock, sleep=clock.sleep)
        with pytest.raises(DeviceFailed, match="32 blocks of 512 bytes, not 64 of 512"):
            await dev.open()

    run(body)


def test_a_path_opened_later_is_verified_before_use() -> None:
    async def body(clock: FakeClock) -> None:
        vol = RamDevice(64, BS)
        a = FakePath(vol)
        late = FakePath(vol, ident=b"other")
        tries: list[int] = []

        async def opener() -> Any:
            tries.append(1)
            if len(tries) < 3:
                raise DeviceFailed("cannot connect")
            return late

        dev = MultipathDevice([Path("a", device=a), Path("late", opener=opener)], clock=clock, sleep=clock.sleep)
        await dev.open()
        try:
            await clock.sleep(5)
            assert len(tries) == 3 and dev.paths[1].state == PathState.REFUSED
            assert "another volume" in dev.paths[1].last_error
            for i in range(4):
                await dev.write(i, b"a" * BS)
            assert late.writes == 0 and a.writes == 4
        finally:
            await dev.close()

    run(body)


def test_cli_usage_errors_for_several_paths() -> None:
    from typer.testing import CliRunner

    from openvsan.cli.main import app

    runner = CliRunner()
    r = runner.invoke(app, ["initiator", "attach", "iscsi://h/iqn.x:y/0", "nvme+tcp://h/nqn.x:y/1", "/tmp/f"])
    assert r.exit_code == 2 and "all be iscsi:// or all nvme+tcp://" in r.output
    r = runner.invoke(app, ["initiator", "attach", "iscsi://h/iqn.x:y/0", "iscsi://h", "/tmp/f"])
    assert r.exit_code == 2 and "must name the volume" in r.output
    r = runner.invoke(app, ["bench", "-d", "0.1"])
    assert r.exit_code == 2 and "--target URL once for each path" in r.output
    r = runner.invoke(app, ["bench", "--target", "nbd://h/x", "--target", "iscsi://h/iqn.x:y/0"])
    assert r.exit_code == 2 and "--target takes iscsi:// or nvme+tcp://" in r.output


def test_split_urls_and_the_bench_target_string() -> None:
    from openvsan.bench.target import redact
    from openvsan.initiator.multipath import split_urls

    assert split_urls("iscsi://a/iqn.x:y/0  iscsi://b/iqn.x:y/0 iscsi://a/iqn.x:y/0") == [
        "iscsi://a/iqn.x:y/0", "iscsi://b/iqn.x:y/0"]
    assert redact("iscsi://u%secret@a/iqn.x:y/0 iscsi://b/iqn.x:y/0") == \
        "iscsi://u%***@a:3260/iqn.x:y/0 iscsi://b:3260/iqn.x:y/0"
