"""The nemesis: faults as small actions with apply() and heal(), and a seeded random schedule of them.

    primary = lambda: nodes["n1"].proc                       # a handle: the node's *current* Popen
    schedule = Schedule(seed, choose(
        lambda rng: Kill9(primary, restart=lambda: nodes["n1"].start()),
        lambda rng: Pause(primary, rng.uniform(2, 4) * LEASE_S),
        lambda rng: Cut(lab, *rng.sample(["n1", "n2", "n3"], 2)),
        lambda rng: EtcdMemberLoss(cluster, rng.choice(["e1", "e2", "e3"])),
    ), cycles=20, hold=(0.5, 3.0))
    schedule.run(after=lambda n: check_progress(n))          # apply, hold, heal; cycle after cycle
    ... assert ok, f"{report} ({schedule.where()})"          # a failure names its seed and cycle

An action is what the fault is; the schedule decides when and for how long. Each action's str() names it
and its target ("pause(n1 pid 1234, 2.50s)"), and the schedule logs every step with its seed and cycle, so
a failed run is replayed by its seed (the same seed and factory give the same actions and holds; the
moments they land at are wall-clock time, as in Jepsen).

Process handles are callables returning the current subprocess.Popen (or None), because a killed node is
restarted by the test and its Popen changes. Signals go to the process group when the process leads one
(Lab.popen and EtcdCluster start each in a session of its own), so its children get them too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

log = logging.getLogger("openvsan.tests.nemesis")

ProcHandle = Callable[[], "subprocess.Popen[Any] | None"]


class Action(Protocol):
    hold: float | None  # a hold of its own (Pause's seconds), used in place of the schedule's random one

    def apply(self) -> None: ...

    def heal(self) -> None: ...


class NemesisError(RuntimeError):
    """An action failed; the message names the seed, the cycle and the action."""


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _who(proc: subprocess.Popen[Any] | None) -> str:
    return "no process" if proc is None else f"pid {proc.pid}"


class Kill9:
    """SIGKILL of the handle's process (and its group), waited for. heal() calls `restart` (the test's own
    way of bringing the node back) if given; the handle then returns the new process."""

    hold: float | None = None

    def __init__(self, proc: ProcHandle, *, name: str = "", restart: Callable[[], object] | None = None) -> None:
        self.proc, self.name, self.restart = proc, name, restart
        self.killed: int | None = None

    def __str__(self) -> str:
        return f"kill9({self.name or 'proc'})"

    def apply(self) -> None:
        p = self.proc()
        self.killed = None
        if p is None or p.poll() is not None:
            log.info("%s: %s already gone", self, _who(p))
            return
        _signal(p.pid, signal.SIGKILL)
        p.wait(timeout=15)
        self.killed = p.pid

    def heal(self) -> None:
        if self.restart is not None:
            self.restart()


class Pause:
    """SIGSTOP of the handle's process group for `seconds` (hold), then SIGCONT of that same process: it
    keeps its sockets, wakes up believing it still holds its lease, and must find out it does not."""

    def __init__(self, proc: ProcHandle, seconds: float, *, name: str = "") -> None:
        self.proc, self.hold, self.name = proc, seconds, name
        self.stopped: int | None = None

    def __str__(self) -> str:
        return f"pause({self.name or 'proc'}, {self.hold:.2f}s)"

    def apply(self) -> None:
        p = self.proc()
        self.stopped = None
        if p is None or p.poll() is not None:
            log.info("%s: %s not running", self, _who(p))
            return
        _signal(p.pid, signal.SIGSTOP)
        self.stopped = p.pid

    def heal(self) -> None:
        if self.stopped is not None:
            _signal(self.stopped, signal.SIGCONT)
            self.stopped = None

    def run(self, sleep: Callable[[float], None] = time.sleep) -> None:
        """SIGSTOP, sleep, SIGCONT, outside a schedule."""
        self.apply()
        try:
            sleep(self.hold or 0.0)
        finally:
            self.heal()


class Cut:
    """Every packet between Lab nodes a and b dropped, both ways (tests/support/netns.py Lab.cut)."""

    hold: float | None = None

    def __init__(self, lab: Any, a: str, b: str) -> None:
        self.lab, self.a, self.b = lab, a, b

    def __str__(self) -> str:
        return f"cut({self.a}<->{self.b})"

    def apply(self) -> None:
        self.lab.cut(self.a, self.b)

    def heal(self) -> None:
        self.lab.heal(self.a, self.b)


class CutOneWay(Cut):
    """a's packets to b dropped; b's to a still arrive."""

    def __str__(self) -> str:
        return f"cut({self.a}->{self.b})"

    def apply(self) -> None:
        self.lab.cut_one_way(self.a, self.b)


class Isolate:
    """A node's only link down (`ip link set down`): its sends fail at once, nobody reaches it."""

    hold: float | None = None

    def __init__(self, lab: Any, name: str) -> None:
        self.lab, self.name = lab, name

    def __str__(self) -> str:
        return f"isolate({self.name})"

    def apply(self) -> None:
        self.lab.isolate(self.name)

    def heal(self) -> None:
        self.lab.rejoin(self.name)


class Partition:
    """Every node of `side` cut from every Lab node not in it (both ways): a clean split of the cluster."""

    hold: float | None = None

    def __init__(self, lab: Any, side: Sequence[str]) -> None:
        self.lab, self.side = lab, list(side)
        self.rest = [n for n in lab.names if n not in self.side]

    def __str__(self) -> str:
        return f"partition({'+'.join(self.side)} | {'+'.join(self.rest)})"

    def apply(self) -> None:
        for a in self.side:
            for b in self.rest:
                self.lab.cut(a, b)

    def heal(self) -> None:
        for a in self.side:
            for b in self.rest:
                self.lab.heal(a, b)


class EtcdMemberLoss:
    """An etcd member killed (tests/support/etcd_cluster.py EtcdCluster.kill: SIGKILL, or SIGTERM with
    graceful=True); heal() restarts it on its data dir and waits until it is healthy again."""

    hold: float | None = None

    def __init__(self, cluster: Any, name: str, *, graceful: bool = False, wait: bool = True) -> None:
        self.cluster, self.name, self.graceful, self.wait = cluster, name, graceful, wait

    def __str__(self) -> str:
        return f"etcd-loss({self.name}{', sigterm' if self.graceful else ''})"

    def apply(self) -> None:
        if self.graceful:
            self.cluster.stop(self.name)
        else:
            self.cluster.kill(self.name)

    def heal(self) -> None:
        self.cluster.restart(self.name, wait=self.wait)


class Compose:
    """Several faults at once: applied in order, healed in reverse order (every one, even if one fails)."""

    def __init__(self, *actions: Action) -> None:
        self.actions = list(actions)
        holds = [a.hold for a in actions if a.hold is not None]
        self.hold = max(holds) if holds else None
        self._applied: list[Action] = []

    def __str__(self) -> str:
        return " + ".join(str(a) for a in self.actions)

    def apply(self) -> None:
        self._applied = []
        for a in self.actions:
            a.apply()
            self._applied.append(a)

    def heal(self) -> None:
        errors: list[BaseException] = []
        for a in reversed(self._applied):
            try:
                a.heal()
            except Exception as e:  # noqa: BLE001  (heal the others first, then raise)
                errors.append(e)
        self._applied = []
        if errors:
            raise errors[0]


ActionFactory = Callable[[random.Random], "Action | Sequence[Action]"]


def choose(*makers: Callable[[random.Random], Action]) -> ActionFactory:
    """A factory that picks one of `makers` with the schedule's rng and lets it build its action."""
    return lambda rng: rng.choice(makers)(rng)


class Schedule:
    """`cycles` faults from `actions_factory(rng)` (an action, or a list to pick one from), each held for
    its own hold or a random one in `hold` seconds; iterating yields (action, hold) and logs it, run()
    applies, holds, heals. Every random choice comes from one random.Random(seed), factory's first."""

    def __init__(
        self,
        seed: int,
        actions_factory: ActionFactory,
        cycles: int,
        *,
        hold: tuple[float, float] = (0.5, 3.0),
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.seed, self.factory, self.cycles, self.hold = seed, actions_factory, cycles, hold
        self.rng = random.Random(seed)
        self.cycle = 0  # the cycle in progress (1-based), 0 before the first
        self.current: Action | None = None
        self.lines: list[str] = []
        self.log_path = log_path

    def _log(self, text: str) -> None:
        line = f"nemesis seed={self.seed} cycle={self.cycle}/{self.cycles}: {text}"
        self.lines.append(line)
        log.info("%s", line)
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(f"{time.monotonic():.3f} {line}\n")

    def __iter__(self) -> Iterator[tuple[Action, float]]:
        for n in range(1, self.cycles + 1):
            self.cycle = n
            made = self.factory(self.rng)
            action = self.rng.choice(list(made)) if isinstance(made, Sequence) else made
            hold = action.hold if action.hold is not None else round(self.rng.uniform(*self.hold), 3)
            self.current = action
            self._log(f"{action} hold={hold:.3f}s")
            yield action, hold

    def where(self) -> str:
        """For a failure message: the seed, the cycle, the action in it."""
        return f"nemesis seed {self.seed}, cycle {self.cycle} of {self.cycles}" + (
            f" ({self.current})" if self.current is not None else ""
        )

    def plan(self) -> list[str]:
        """The (action, hold) sequence this seed gives, as text, without applying anything."""
        dry = Schedule(self.seed, self.factory, self.cycles, hold=self.hold)
        return [f"{a} hold={h:.3f}s" for a, h in dry]

    def run(
        self,
        *,
        sleep: Callable[[float], None] = time.sleep,
        after: Callable[[int], object] | None = None,
        settle: float = 0.0,
    ) -> None:
        """Each cycle: apply, hold, heal, `settle` seconds of quiet, then after(cycle) (a progress check).
        A failing apply or heal raises NemesisError naming the seed and cycle (the fault is healed first)."""
        for action, hold in self:
            try:
                action.apply()
            except Exception as e:
                with contextlib.suppress(Exception):
                    action.heal()
                raise NemesisError(f"{self.where()}: apply failed: {type(e).__name__}: {e}") from e
            try:
                sleep(hold)
            finally:
                try:
                    action.heal()
                except Exception as e:
                    raise NemesisError(f"{self.where()}: heal failed: {type(e).__name__}: {e}") from e
            self._log(f"{action} healed")
            if settle:
                sleep(settle)
            if after is not None:
                after(self.cycle)
