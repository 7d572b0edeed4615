"""Durability: a write acknowledged after FUA, or followed by an acknowledged SYNCHRONIZE CACHE, survives
`kill -9` of `vsan serve` and a restart (FileDevice), over many random crash points.

QEMU's initiator (an interactive qemu-io) writes patterns with and without FUA (`write -f`) and flushes;
each command is sent only after the previous one completed, so the test knows exactly which writes the
target acknowledged. A timer SIGKILLs the target at a random moment, usually with a write in flight. After
a restart the whole LUN is read back through iSCSI and every byte must hold either its durable value or
the value of a write that was not yet durable (in flight, or acknowledged without FUA and not flushed).

    VSAN_KILL9_ROUNDS=200 VSAN_KILL9_SEED=1234 .venv/bin/python -m pytest tests/fault/test_kill9.py

Each round's crash point (seed, commands, kill delay, what was acknowledged) is written to
kill9-rounds.json in the test's tmp dir and named in a failure. The kill lands on wall-clock time, so a
rerun with the same seed replays the same commands and delay but not necessarily the same instant.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
from vsan_harness import TEST_INITIATOR, VSAN, VsanServer, qemu_io, require_tools, run

pytestmark = pytest.mark.interop

ROUNDS = int(os.environ.get("VSAN_KILL9_ROUNDS", "20"))
SEED = int(os.environ.get("VSAN_KILL9_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)
SIZE = 32 * 1024 * 1024
SECTOR = 512
PROMPT = b"qemu-io> "


@dataclass
class Write:
    off: int
    length: int
    pattern: int
    fua: bool


@dataclass
class Round:
    number: int
    seed: int
    kill_after_s: float
    sent: list[str] = field(default_factory=list)
    acked: int = 0  # commands completed before the kill
    in_flight: str | None = None
    note: str = ""


class InteractiveQemuIo:
    """qemu-io reading commands from a pipe: it prints each command's result and a new prompt when done."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(
            ["qemu-io", "-f", "raw", url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.buf = b""
        if self._until_prompt(time.monotonic() + 30, None) is None:
            raise AssertionError(f"qemu-io did not start: {self.buf!r}")

    def _until_prompt(self, deadline: float, stop: threading.Event | None) -> bytes | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        stop_deadline: float | None = None
        while PROMPT not in self.buf:
            now = time.monotonic()
            if stop is not None and stop.is_set() and stop_deadline is None:
                stop_deadline = now + 1.5  # the target is dead: an answer now can only be one already on its way
            if now > deadline or (stop_deadline is not None and now > stop_deadline):
                return None
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self.buf += chunk
        out, self.buf = self.buf.split(PROMPT, 1)
        return out

    def command(self, cmd: str, stop: threading.Event) -> bytes | None:
        """The command's output once it completed, or None if it did not complete (the target was killed)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd.encode() + b"\n")
        self.proc.stdin.flush()
        return self._until_prompt(time.monotonic() + 60, stop)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class DurableModel:
    """What the LUN must hold: durable bytes, plus writes that may or may not have reached the medium."""

    def __init__(self, size: int) -> None:
        self.image = bytearray(size)
        self.maybe: list[Write] = []  # acknowledged without FUA and not flushed yet, or in flight

    def durable(self, w: Write) -> None:
        self.image[w.off : w.off + w.length] = bytes([w.pattern]) * w.length
        # an earlier write that is not durable yet can no longer show where this later one landed
        end, kept = w.off + w.length, []
        for m in self.maybe:
            if m is w or m.off >= end or m.off + m.length <= w.off:
                kept.append(m)
                continue
            if m.off < w.off:
                kept.append(Write(m.off, w.off - m.off, m.pattern, m.fua))
            if m.off + m.length > end:
                kept.append(Write(end, m.off + m.length - end, m.pattern, m.fua))
        self.maybe = kept

    def flushed(self) -> None:
        for w in self.maybe:  # in the order they were acknowledged: later writes win
            self.image[w.off : w.off + w.length] = bytes([w.pattern]) * w.length
        self.maybe = []

    def check(self, actual: bytes) -> str | None:
        """None if actual is allowed, else a description of the first bad range."""
        if actual == self.image:
            return None
        step = 4096
        for base in range(0, len(actual), step):
            got, want = actual[base : base + step], self.image[base : base + step]
            if got == want:
                continue
            for i in range(len(got)):
                if got[i] == want[i]:
                    continue
                pos = base + i
                allowed = {want[i]} | {w.pattern for w in self.maybe if w.off <= pos < w.off + w.length}
                if got[i] not in allowed:
                    return (
                        f"byte {pos} (LBA {pos // SECTOR}) is {got[i]:#04x}; durable value {want[i]:#04x}, "
                        f"allowed {sorted(allowed)}"
                    )
        return None


def next_command(rnd: random.Random, counter: list[int]) -> tuple[str, Write | None]:
    r = rnd.random()
    if r < 0.12:
        return "flush", None
    sectors = rnd.choice([1, 1, 2, 8, 8, 16, 64, 128, 256, 2048, 8192])  # 512 B .. 4 MiB
    length = sectors * SECTOR
    off = rnd.randrange(0, SIZE // SECTOR - sectors + 1) * SECTOR
    if rnd.random() < 0.1 and off + length < SIZE:  # QEMU turns these into read-modify-write of whole sectors
        delta = rnd.randrange(1, SECTOR)
        off, length = off + delta, max(1, min(length - delta, SIZE - off - delta))
    counter[0] = counter[0] % 255 + 1
    fua = r < 0.56
    return f"write {'-f ' if fua else ''}-P {counter[0]} {off} {length}", Write(off, length, counter[0], fua)


def read_lun(server: VsanServer, out: Path) -> bytes:
    out.unlink(missing_ok=True)
    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", server.url(), out], timeout=300)
    data = out.read_bytes()
    assert len(data) == SIZE, len(data)
    return data


def crash_rounds(server: VsanServer, tmp_path: Path, rounds_n: int, sig: signal.Signals) -> None:
    """Write, stop the target with sig at a random moment, restart, check; rounds_n times on one volume.

    SIGKILL: only FUA writes and flushed writes must survive. SIGTERM: the target drains, flushes and exits
    0, so every acknowledged write must survive, flushed or not.
    """
    assert server.device.path is not None
    model = DurableModel(SIZE)
    counter = [0]
    rounds: list[Round] = []
    record = tmp_path / f"{sig.name.lower()}-rounds.json"
    print(f"{sig.name} durability: seed {SEED}, {rounds_n} rounds; crash points in {record}")
    for n in range(rounds_n):
        rnd = random.Random(f"{SEED}:{sig.name}:{n}")
        rnd_round = Round(n, SEED, round(rnd.uniform(0.02, 1.5), 3))
        rounds.append(rnd_round)
        stopped = threading.Event()
        proc = server.proc
        assert proc is not None

        def stop_target(proc: subprocess.Popen[bytes] = proc, stopped: threading.Event = stopped) -> None:
            stopped.set()
            os.killpg(proc.pid, sig)

        qio = InteractiveQemuIo(server.url())
        timer: threading.Timer | None = None
        in_flight: Write | None = None
        try:
            while True:
                cmd, write = next_command(rnd, counter)
                rnd_round.sent.append(cmd)
                if write is not None:
                    model.maybe.append(write)  # in flight: it may land before the kill even if never acked
                out = qio.command(cmd, stopped)
                if out is None or b"failed" in out:
                    rnd_round.in_flight = cmd
                    rnd_round.note = "no answer" if out is None else out.decode(errors="replace").strip()
                    in_flight = write
                    break
                rnd_round.acked += 1
                if write is None:
                    model.flushed()
                elif write.fua:
                    model.maybe.remove(write)
                    model.durable(write)
                if timer is None:  # the first completed command: the session is up; arm the crash
                    timer = threading.Timer(rnd_round.kill_after_s, stop_target)
                    timer.start()
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()
            qio.kill()
        assert stopped.is_set(), f"round {n}: a command failed before the {sig.name}: {rnd_round.note}"
        if sig == signal.SIGKILL:
            server.kill9()
        else:
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill9()
                pytest.fail(f"round {n}: vsan serve did not exit within 30 s of SIGTERM under load", pytrace=False)
            assert rc == 0, f"round {n}: vsan serve exited {rc} after SIGTERM under load:\n{server.log_tail()}"
            # a clean stop flushes: every acknowledged write is durable; only the one in flight may be either
            model.maybe = [w for w in model.maybe if w is not in_flight]
            model.flushed()
            if in_flight is not None:
                model.maybe.append(in_flight)
        server.start()
        record.write_text(json.dumps([asdict(r) for r in rounds], indent=1))
        actual = read_lun(server, tmp_path / "lun.raw")
        problem = model.check(actual)
        if problem:
            on_file = model.check(server.device.path.read_bytes()[:SIZE])
            pytest.fail(
                f"round {n} (VSAN_KILL9_SEED={SEED}, {sig.name}): acknowledged data lost: {problem}\n"
                f"the backing file itself: {on_file or 'holds every acknowledged write (the read path is wrong)'}\n"
                f"stopped {rnd_round.kill_after_s}s after the first ack; {rnd_round.acked} commands acked; "
                f"in flight: {rnd_round.in_flight}; last commands: {rnd_round.sent[-8:]}\nrecord: {record}",
                pytrace=False,
            )
        model.image[:] = actual  # what is there now is durable, whichever of the allowed values it took
        model.maybe = []
    acked = sum(r.acked for r in rounds)
    print(f"{rounds_n} crash points ({sig.name}), {acked} acknowledged commands, all durable (seed {SEED})")
    # the LUN is still usable: one ordinary write and read after all the crashes
    qemu_io(server.url(), "write -P 0xee 0 64k", "read -P 0xee 0 64k")
    run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, server.url()])


def test_acknowledged_writes_survive_kill9(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    require_tools("qemu-io", "qemu-img")
    crash_rounds(vsan("file", "32MiB"), tmp_path, ROUNDS, signal.SIGKILL)


def test_sigterm_under_load_drains_and_keeps_every_acknowledged_write(
    vsan: Callable[..., VsanServer], tmp_path: Path
) -> None:
    """SIGTERM with writes in flight: exit 0 within 30 s, and no acknowledged write lost, FUA or not."""
    require_tools("qemu-io", "qemu-img")
    crash_rounds(vsan("file", "32MiB"), tmp_path, max(3, ROUNDS // 4), signal.SIGTERM)


def test_model_catches_lost_and_torn_writes() -> None:
    """The checker itself: a lost FUA write, a lost flushed write and a stray value are all caught."""
    m = DurableModel(64 * 1024)
    m.durable(Write(0, 4096, 7, True))
    m.maybe.append(Write(8192, 1024, 9, False))
    m.flushed()
    m.maybe.append(Write(16384, 512, 11, False))  # not flushed: either value is fine
    good = bytearray(m.image)
    assert m.check(bytes(good)) is None
    good[16384:16896] = bytes([11]) * 512
    assert m.check(bytes(good)) is None
    lost_fua = bytearray(good)
    lost_fua[100] = 0
    assert m.check(bytes(lost_fua)) is not None
    lost_flushed = bytearray(good)
    lost_flushed[8192:9216] = bytes(1024)
    assert m.check(bytes(lost_flushed)) is not None
    stray = bytearray(good)
    stray[16384] = 12
    assert m.check(bytes(stray)) is not None
    # a later FUA write over an unflushed earlier one: only the later value is allowed there
    m.maybe.append(Write(20480, 4096, 13, False))
    m.durable(Write(20480, 2048, 14, True))
    after = bytearray(m.image)
    after[20480:22528] = bytes([13]) * 2048
    assert m.check(bytes(after)) is not None


class SnapshotChurn(threading.Thread):
    """Takes and deletes snapshots of disk0 through `vsan snapshot` while the crash rounds run (each call may
    fail: the target is down between a kill and its restart); counts what it did.

    A call the kill cut off may still have been carried out: a create whose answer never came is deleted once
    the target answers again (else it would hold what the volume overwrites from then on, and a few of them
    fill the pool), and a delete whose answer never came is done once a listing no longer shows the name.
    A new one is taken only when those are settled and at most two are kept, so at most three exist at once:
    it took one more after each delete a kill refused, and the pool filled (CI, seed 1145310857)."""

    def __init__(self, server: VsanServer) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.stopping = threading.Event()
        self.taken = self.deleted = 0
        self.kept: list[str] = []       # acknowledged creates not (yet) deleted, oldest first
        self.unsure: list[str] = []     # creates whose answer never came: they may exist

    def cli(self, *args: str) -> subprocess.CompletedProcess[bytes] | None:
        try:
            p = subprocess.run([str(VSAN), "snapshot", *args, "--data-dir", str(self.server.data_dir)],
                               capture_output=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:
            return None
        return p if p.returncode == 0 else None

    def listed(self) -> set[str] | None:
        p = self.cli("list", "disk0", "--json")
        return None if p is None else {s["name"] for s in json.loads(p.stdout)}

    def gone(self, name: str) -> bool:
        """Deletes name; True once it no longer exists (deleted now, or by a call whose answer was cut off)."""
        if self.cli("delete", "disk0", name) is not None:
            return True
        names = self.listed()
        return names is not None and name not in names

    def settle(self) -> None:
        """The unanswered creates that did happen are deleted; those a listing does not show are forgotten
        (one listing for all of them: while the target is down every create fails, and they pile up)."""
        names = self.listed()
        if names is not None:
            self.unsure = [n for n in self.unsure if n in names and self.cli("delete", "disk0", n) is None]

    def run(self) -> None:
        n = 0
        while not self.stopping.wait(0.1):
            if self.unsure:
                self.settle()
            # at most two kept: each holds what the volume overwrote since. Only acknowledged creates are
            # deleted, so the newest two acknowledged snapshots always remain.
            while len(self.kept) > 2 and not self.stopping.is_set() and self.gone(self.kept[0]):
                self.deleted += 1
                del self.kept[0]
            if len(self.kept) > 2 or self.unsure:
                continue    # the target is down: no new snapshot until the old ones are gone (else they pile up)
            n += 1
            if self.cli("create", "disk0", f"s{n}") is not None:
                self.taken += 1
                self.kept.append(f"s{n}")
            else:
                self.unsure.append(f"s{n}")


def test_acknowledged_writes_survive_kill9_on_a_thin_volume_while_snapshots_come_and_go(
    vsan: Callable[..., VsanServer], tmp_path: Path
) -> None:
    """The same crash rounds on a thin volume carved from a file device (volume/thin: mappings committed at
    FUA and flush), with snapshots taken and deleted all along; afterwards the group lists its snapshots and
    every one of them reads whole."""
    require_tools("qemu-io", "qemu-img")
    server = vsan("file", "160MiB", carve="32MiB")   # room for the volume and three snapshots fully rewritten
    churn = SnapshotChurn(server)
    churn.start()
    try:
        crash_rounds(server, tmp_path, max(5, ROUNDS // 2), signal.SIGKILL)
    finally:
        churn.stopping.set()
        churn.join()
    print(f"snapshots taken {churn.taken}, deleted {churn.deleted}")
    assert churn.taken > 0
    snaps = json.loads(run([VSAN, "snapshot", "list", "disk0", "--json", "--data-dir", server.data_dir]).stdout)
    names = {s["name"] for s in snaps}
    assert set(churn.kept) <= names, f"acknowledged snapshots lost: {sorted(set(churn.kept) - names)}"
    for s in snaps[-3:]:
        assert s["size"] == SIZE


def test_acknowledged_writes_survive_kill9_on_a_compressed_volume(vsan: Callable[..., VsanServer],
                                                                  tmp_path: Path) -> None:
    """The same crash rounds on a compressed volume (volume/compress.py: chunk versions in two slots, the old
    one unmapped once the new one is durable) carved from a file device with 4 KiB clusters: every FUA and
    flushed write survives SIGKILL, and what the volume holds afterwards was written there."""
    require_tools("qemu-io", "qemu-img")
    server = vsan("file", "160MiB", carve="32MiB", cluster="4KiB", compression="lz4")
    crash_rounds(server, tmp_path, max(5, ROUNDS // 2), signal.SIGKILL)
    shown = json.loads(run([VSAN, "volume", "show", "disk0", "--json", "--data-dir", server.data_dir]).stdout)
    squeeze = shown["compress_stats"]
    print(f"compression after the rounds: {squeeze}")
    assert squeeze["chunks"] > 0 and squeeze["stored_bytes"] > 0
