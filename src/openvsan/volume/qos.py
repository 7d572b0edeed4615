"""QoS: per-volume limits on operations and bytes per second, the first layer of the volume stack (issue 11).

The knobs are Ceph librbd's `rbd_qos_*` options without the prefix: for each of `iops` and `bps`, and for
reads (`read_`), writes (`write_`) and both together (no prefix), a `*_limit`, a `*_burst` and a
`*_burst_seconds`; eighteen in all. 0 (the default) is no limit; `*_burst_seconds` defaults to 1, as in Ceph.

Semantics, per knob, as token buckets refilled continuously at the rate:

- `limit` is the sustained rate (operations or bytes per second). Its bucket holds one tick's worth of it
  (limit x TICK) when there is no burst, so an idle volume may start with at most 50 ms of work at once.
- `burst` (>= limit) is the rate allowed while the burst budget lasts, and `burst_seconds` how long a burst at
  `burst` rate may last: the sustained bucket holds (burst - limit) x burst_seconds tokens of excess more,
  refilled at the sustained rate when the volume is below its limit, and a second bucket, refilled at `burst`
  and holding one tick of it, keeps the rate at or below `burst` meanwhile. Over any window of t seconds a
  volume moves at most limit x (t + TICK) + (burst - limit) x burst_seconds.
- A command takes from every bucket that applies: a read from the read and total IOPS and bps buckets, a write
  from the write and total ones. Unmap and write-zeroes move no data: they count as one write operation and
  no bytes. Flush passes untouched.
- Commands are served first in, first out on each bucket: a command goes when every bucket it uses holds
  what it needs and no earlier waiting command uses any of them, so small I/O never starves large I/O. A
  command larger than a bucket's capacity goes when that bucket is full and runs it negative (no deadlock);
  a bucket's debt is bounded by MAX_WAIT seconds of its rate.
- A throttled command waits (it is never failed): one timer for the whole queue, set at the earliest time a
  waiting command can go but never more than TICK (50 ms, Ceph's rbd_qos_schedule_tick_min) ahead, so a
  limit changed by set_limits() acts at once and no timer is more than a tick stale; and never less than
  MIN_DELAY (5 ms) ahead, so the commands due within it go on one loop wake-up (docs/benchmarks.md).
- No command waits longer than MAX_WAIT (10 s): past it, it goes regardless (taking its tokens, so the limit
  is paid back after). 10 s is a third of the 30 s a command is given by default by Linux's SCSI disk
  (/sys/block/sdX/device/timeout), NVMe (nvme_core.io_timeout) and NBD (nbd-client -timeout) initiators, so
  the device's own time and one retry still fit. Waits over WARN_AFTER (5 s) are logged, one line per
  LOG_INTERVAL per volume: the limits are then too low for the initiators' queue depths.

The fast path stays: read_now / write_now take their tokens at once when every bucket they use holds enough
and nothing waits on them; otherwise they decline (None / False) and the frontend takes the normal path,
read() / write(), which waits. They take tokens in advance, at most CREDIT_SPAN (1 ms) of a bucket's rate at
a time, so a command far below its limits costs two comparisons; those go back when a command has to wait. A volume with no limits has no QoS layer at all (DESIGN.md: absent, not a
no-op); set_limits() to all zeros leaves a pass-through until the node swaps the layer out.

The clock and the timer are injected (`clock`, `call_later`), so the unit tests run on simulated time."""

from __future__ import annotations

import asyncio
import difflib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

from openvsan.block.device import BlockDevice, Buffer
from openvsan.block.layer import Layer
from openvsan.volume.registry import register_layer

log = logging.getLogger("openvsan.volume.qos")

TICK = 0.05            # seconds: the most a waiting queue's timer is set ahead, and a bucket's base depth
MAX_WAIT = 10.0        # seconds a command waits at most (see the module docstring for why)
WARN_AFTER = 5.0       # seconds of waiting that get logged
LOG_INTERVAL = 10.0    # seconds between two such lines for one volume
CREDIT_SPAN = 0.001    # seconds of a bucket's rate the fast path may take in advance (see _grant)
# seconds: the shortest timer. Commands due within it go together, on one loop wake-up (about 100 µs of CPU
# on these VMs: at 1,000 IOPS a wake-up per command cost 100 µs each, with this 50); the bucket refills
# meanwhile, so the rate holds. And a coarse loop clock (uvloop's is 1 ms) must not spin on a due time.
MIN_DELAY = 0.005
EPS = 1e-6             # relative slack on a bucket's level against the float error of refill arithmetic

KINDS = ("iops", "bps")
SCOPES = ("read", "write", "total")
PARTS = ("limit", "burst", "burst_seconds")


def knob(scope: str, kind: str, part: str) -> str:
    """The Ceph-style name: `read_iops_limit`, `bps_burst`, `write_bps_burst_seconds`..."""
    return f"{'' if scope == 'total' else scope + '_'}{kind}_{part}"


class QosError(ValueError):
    """A QoS setting that cannot work; str() is one line naming the key and the mend."""


Number = int | float


@dataclass(frozen=True, slots=True)
class QosLimits:
    iops_limit: Number = 0
    iops_burst: Number = 0
    iops_burst_seconds: Number = 1
    read_iops_limit: Number = 0
    read_iops_burst: Number = 0
    read_iops_burst_seconds: Number = 1
    write_iops_limit: Number = 0
    write_iops_burst: Number = 0
    write_iops_burst_seconds: Number = 1
    bps_limit: Number = 0
    bps_burst: Number = 0
    bps_burst_seconds: Number = 1
    read_bps_limit: Number = 0
    read_bps_burst: Number = 0
    read_bps_burst_seconds: Number = 1
    write_bps_limit: Number = 0
    write_bps_burst: Number = 0
    write_bps_burst_seconds: Number = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise QosError(f"qos: {f.name} is {v!r}; give a number (0 for no limit)")
            if v < 0:
                raise QosError(f"qos: {f.name} is {v:g}; a rate cannot be negative (0 for no limit)")
        for kind in KINDS:
            for scope in SCOPES:
                limit, burst, seconds = self.knobs(scope, kind)
                lk, bk, sk = (knob(scope, kind, p) for p in PARTS)
                if seconds <= 0:
                    raise QosError(f"qos: {sk} is {seconds:g}; a burst lasts more than 0 seconds (default 1)")
                if burst and not limit:
                    raise QosError(f"qos: {bk} is {burst:g} but {lk} is 0 (no limit); set {lk} to the sustained "
                                   f"rate, or remove {bk}")
                if burst and burst < limit:
                    raise QosError(f"qos: {bk} {burst:g} is below {lk} {limit:g}; a burst is at least the limit "
                                   f"(or 0 for none)")

    def knobs(self, scope: str, kind: str) -> tuple[float, float, float]:
        """(limit, burst, burst_seconds) of one scope and kind."""
        return (getattr(self, knob(scope, kind, "limit")), getattr(self, knob(scope, kind, "burst")),
                getattr(self, knob(scope, kind, "burst_seconds")))

    @property
    def unlimited(self) -> bool:
        return not any(self.knobs(s, k)[0] for s in SCOPES for k in KINDS)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> QosLimits:
        known = [f.name for f in fields(cls)]
        for key in cfg:
            if key not in known:
                near = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {near[0]}?" if near else f"known: {', '.join(known)}"
                raise QosError(f"qos: {key} is not a QoS knob; {hint}")
        return cls(**cfg)

    def to_dict(self) -> dict[str, Number]:
        """The knobs that differ from the defaults (what a config file would say)."""
        out: dict[str, Number] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                out[f.name] = v
        return out

    def __str__(self) -> str:
        return " ".join(f"{k}={v:g}" for k, v in self.to_dict().items()) or "unlimited"


class TokenBucket:
    """Tokens (operations or bytes) refilled continuously at `rate` up to `capacity`; the level may go below
    zero (a command larger than the bucket), down to MAX_WAIT seconds of the rate."""

    __slots__ = ("capacity", "floor", "level", "name", "rate", "stamp", "waiting")

    def __init__(self, name: str, rate: float, capacity: float, now: float) -> None:
        self.name = name
        self.rate = self.capacity = self.floor = self.level = 0.0
        self.set_rate(rate, capacity)
        self.level = self.capacity   # a new limit starts with a full bucket: the burst is there at once
        self.stamp = now
        self.waiting = 0             # queued commands that use this bucket

    def set_rate(self, rate: float, capacity: float) -> None:
        """A new rate and depth; the level stays, within them."""
        self.rate, self.capacity = float(rate), float(capacity)
        self.floor = -self.rate * MAX_WAIT
        self.level = max(min(self.level, self.capacity), self.floor)

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def ready(self, need: float) -> bool:
        want = min(need, self.capacity)
        return self.level >= want - EPS * max(1.0, want)

    def take(self, need: float) -> None:
        self.level = max(self.level - need, self.floor)

    def give_back(self, need: float) -> None:
        self.level = min(self.capacity, self.level + need)

    def due(self, need: float, now: float) -> float:
        """When the level will be ready for `need` (refilled up to `now`)."""
        return now + max(0.0, (min(need, self.capacity) - self.level) / self.rate)

    def __repr__(self) -> str:
        return f"TokenBucket({self.name}, {self.level:g}/{self.capacity:g} at {self.rate:g}/s)"


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


CallLater = Callable[[float, Callable[[], None]], TimerHandle]
# what one command uses: (bucket, counts bytes rather than operations)
Plan = tuple[tuple[TokenBucket, bool], ...]
Needs = tuple[tuple[TokenBucket, float], ...]


def _loop_call_later(delay: float, fn: Callable[[], None]) -> TimerHandle:
    return asyncio.get_running_loop().call_later(delay, fn)


class _Waiter:
    __slots__ = ("future", "gone", "nbytes", "needs", "op", "since", "warned")

    def __init__(self, op: str, nbytes: int, needs: Needs, since: float, future: asyncio.Future[None]) -> None:
        self.op = op
        self.nbytes = nbytes
        self.needs = needs
        self.since = since
        self.future = future
        self.warned = False
        self.gone = False        # out of the queue (let go, or dropped when cancelled)


def _needs(plan: Plan, nbytes: int) -> Needs:
    return tuple((b, float(nbytes) if by_bytes else 1.0) for b, by_bytes in plan if nbytes or not by_bytes)


@register_layer
class QosLayer(Layer):
    type_name = "qos"

    def __init__(self, below: BlockDevice, limits: QosLimits | None = None, *, name: str | None = None,
                 clock: Callable[[], float] = time.monotonic, call_later: CallLater = _loop_call_later) -> None:
        super().__init__(below, name=name)
        self._clock = clock
        self._call_later = call_later
        self._bs = below.block_size
        self._below_read_now: Callable[[int, int], Buffer | None] | None = getattr(below, "read_now", None)
        self._below_write_now: Callable[[int, Buffer], bool] | None = getattr(below, "write_now", None)
        self._queue: deque[_Waiter] = deque()
        self._timer: TimerHandle | None = None
        self._timer_at = 0.0
        self._buckets: dict[str, TokenBucket] = {}
        self._read_plan: Plan = ()
        self._write_plan: Plan = ()
        self._r_ops = self._r_bytes = self._w_ops = self._w_bytes = math.inf   # prepaid tokens (_grant)
        # counters for stats()
        self.read_ops = self.read_bytes = self.write_ops = self.write_bytes = 0
        self.throttled = 0           # commands that waited
        self.capped = 0              # commands let go at MAX_WAIT, their limit not yet met
        self.wait_seconds = 0.0      # summed over commands that are done waiting
        self._sample = (clock(), (0, 0, 0, 0))
        self._rates = (0.0, 0.0, 0.0, 0.0)
        self._rated = False          # rates measured over a whole second at least once
        self._slow = 0               # commands past WARN_AFTER not yet logged
        self._slow_logged_at = -math.inf
        self.limits = QosLimits()
        self.set_limits(limits or QosLimits())

    # ---- limits

    def set_limits(self, limits: QosLimits) -> None:
        """Change the limits of a live volume: the buckets take the new rates now (a bucket that stays keeps
        its level, within the new depth), and waiting commands are judged by them at once."""
        self._return_credit(True)
        self._return_credit(False)
        now = self._clock()
        old = self._buckets
        for b in old.values():
            b.refill(now)
        buckets: dict[str, TokenBucket] = {}
        uses: dict[str, list[tuple[TokenBucket, bool]]] = {"read": [], "write": []}
        for scope in SCOPES:
            for kind in KINDS:
                limit, burst, seconds = limits.knobs(scope, kind)
                if not limit:
                    continue
                excess = (burst - limit) * seconds if burst > limit else 0.0
                made = [self._bucket(buckets, old, f"{scope}_{kind}", limit, limit * TICK + excess, now)]
                if burst > limit:
                    made.append(self._bucket(buckets, old, f"{scope}_{kind}:burst", burst, burst * TICK, now))
                for op in ("read", "write") if scope == "total" else (scope,):
                    uses[op] += [(b, kind == "bps") for b in made]
        self._buckets = buckets
        self.limits = limits
        self._read_plan, self._write_plan = tuple(uses["read"]), tuple(uses["write"])
        self._reset_credit()
        for b in buckets.values():
            b.waiting = 0
        for w in list(self._queue):
            w.needs = _needs(self._plan_of(w.op), w.nbytes)
            if not w.needs:           # no limit applies to it any more: it goes now
                w.gone = True
                self._queue.remove(w)
                if not w.future.done():
                    w.future.set_result(None)
            for b, _ in w.needs:
                b.waiting += 1
        if old or buckets:
            log.info("%s: qos limits %s", self.name, limits)
        self._pump()

    @staticmethod
    def _bucket(into: dict[str, TokenBucket], old: dict[str, TokenBucket], name: str, rate: float,
                capacity: float, now: float) -> TokenBucket:
        b = old.get(name)
        if b is None:
            b = TokenBucket(name, rate, capacity, now)
        else:
            b.set_rate(rate, capacity)
        into[name] = b
        return b

    def _plan_of(self, op: str) -> Plan:
        return self._read_plan if op == "read" else self._write_plan

    # ---- the fast path: tokens at once, or decline
    #
    # Tokens are taken in advance, up to CREDIT_SPAN of each bucket's rate at a time (and never more than
    # it holds), so that a volume far below its limits pays two comparisons per command, not a bucket's
    # arithmetic; at low rates a grant is the command's own tokens, exactly. Prepaid tokens go back to their
    # buckets when a command has to wait (so nobody passes it on the fast path) or the limits change.

    def _reset_credit(self) -> None:
        inf = math.inf
        self._r_ops = 0.0 if any(not by for _, by in self._read_plan) else inf
        self._r_bytes = 0.0 if any(by for _, by in self._read_plan) else inf
        self._w_ops = 0.0 if any(not by for _, by in self._write_plan) else inf
        self._w_bytes = 0.0 if any(by for _, by in self._write_plan) else inf

    def _return_credit(self, read: bool) -> bool:
        """Prepaid tokens of reads (or writes) back into their buckets; True if there were any."""
        plan = self._read_plan if read else self._write_plan
        ops, nbytes = (self._r_ops, self._r_bytes) if read else (self._w_ops, self._w_bytes)
        returned = False
        for b, by_bytes in plan:
            left = nbytes if by_bytes else ops
            if 0 < left < math.inf:
                b.give_back(left)
                returned = True
        ops, nbytes = (0.0 if ops < math.inf else ops), (0.0 if nbytes < math.inf else nbytes)
        if read:
            self._r_ops, self._r_bytes = ops, nbytes
        else:
            self._w_ops, self._w_bytes = ops, nbytes
        return returned

    def _grant(self, read: bool, nbytes: int) -> bool:
        """Tokens for one command of `nbytes` (and a credit for those after it), or False: it must wait."""
        plan = self._read_plan if read else self._write_plan
        for b, _ in plan:
            if b.waiting:
                return False
        self._return_credit(read)
        now = self._clock()
        for b, by_bytes in plan:
            b.refill(now)
            if (nbytes or not by_bytes) and not b.ready(nbytes if by_bytes else 1):
                return False
        g_ops = g_bytes = math.inf
        for b, by_bytes in plan:
            room = min(b.level, b.rate * CREDIT_SPAN)
            if by_bytes:
                g_bytes = min(g_bytes, room)
            else:
                g_ops = min(g_ops, room)
        if g_ops < math.inf:
            g_ops = max(1.0, math.floor(g_ops))
        if g_bytes < math.inf:
            g_bytes = max(float(nbytes), g_bytes)
        for b, by_bytes in plan:
            b.take(g_bytes if by_bytes else g_ops)
        if read:
            self._r_ops, self._r_bytes = g_ops - 1.0, g_bytes - nbytes
        else:
            self._w_ops, self._w_bytes = g_ops - 1.0, g_bytes - nbytes
        return True

    def read_now(self, lba: int, blocks: int) -> Buffer | None:
        fn = self._below_read_now
        if fn is None:
            return None
        n = blocks * self._bs
        if self._r_ops >= 1.0 and self._r_bytes >= n:
            self._r_ops -= 1.0
            self._r_bytes -= n
        elif not self._grant(True, n):
            return None
        data = fn(lba, blocks)
        if data is None:              # the device declined: the tokens stay for read()
            self._r_ops += 1.0
            self._r_bytes += n
            return None
        self.read_ops += 1
        self.read_bytes += n
        return data

    def write_now(self, lba: int, data: Buffer) -> bool:
        fn = self._below_write_now
        if fn is None:
            return False
        n = len(data) if type(data) is bytes else memoryview(data).nbytes
        if self._w_ops >= 1.0 and self._w_bytes >= n:
            self._w_ops -= 1.0
            self._w_bytes -= n
        elif not self._grant(False, n):
            return False
        if not fn(lba, data):
            self._w_ops += 1.0
            self._w_bytes += n
            return False
        self.write_ops += 1
        self.write_bytes += n
        return True

    # ---- the normal path: tokens at once, or wait for them

    async def read(self, lba: int, blocks: int) -> Buffer:
        n = blocks * self._bs
        if self._r_ops >= 1.0 and self._r_bytes >= n:
            self._r_ops -= 1.0
            self._r_bytes -= n
        elif not self._grant(True, n):
            await self._wait("read", n)
        self.read_ops += 1
        self.read_bytes += n
        return await self.below.read(lba, blocks)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        n = memoryview(data).nbytes
        if self._w_ops >= 1.0 and self._w_bytes >= n:
            self._w_ops -= 1.0
            self._w_bytes -= n
        elif not self._grant(False, n):
            await self._wait("write", n)
        self.write_ops += 1
        self.write_bytes += n
        await self.below.write(lba, data, fua=fua)

    async def unmap(self, lba: int, blocks: int) -> None:
        await self._one_write_op()
        await self.below.unmap(lba, blocks)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        await self._one_write_op()
        await self.below.write_zeroes(lba, blocks)

    async def _one_write_op(self) -> None:
        if self._w_ops >= 1.0:
            self._w_ops -= 1.0
        elif not self._grant(False, 0):
            await self._wait("write", 0)
        self.write_ops += 1

    async def _wait(self, op: str, nbytes: int) -> None:
        # prepaid tokens back: nobody passes this one on the fast path (and they may be what it lacked)
        returned = self._return_credit(True) | self._return_credit(False)
        if returned and self._grant(op == "read", nbytes):
            return
        now = self._clock()
        w = _Waiter(op, nbytes, _needs(self._plan_of(op), nbytes), now, asyncio.get_running_loop().create_future())
        first = not any(b.waiting for b, _ in w.needs)
        self._queue.append(w)
        for b, _ in w.needs:
            b.waiting += 1
        self.throttled += 1
        if first:
            # nobody waits ahead of it on its buckets: its own due time may be the queue's next (those behind
            # someone are judged when that one goes, so a new command costs no scan of the queue)
            due = max((b.due(need, now) for b, need in w.needs), default=now)
            self._arm(max(min(due, now + TICK), now + MIN_DELAY), now)
        try:
            await w.future
        except asyncio.CancelledError:
            if not w.gone:            # the initiator aborted it, or the connection went: it takes nothing
                self._pump()          # (the pump drops it) and those behind it may go now
            raise
        finally:
            self.wait_seconds += self._clock() - w.since

    def _pump(self) -> None:
        """Let go every waiting command whose buckets are ready, first come first served on each bucket;
        then set the timer for the next one. The scan stops as soon as every bucket has someone waiting
        that cannot go yet, so it costs the commands let go, not the length of the queue."""
        queue = self._queue
        if not queue:
            self._cancel_timer()
            return
        now = self._clock()
        for b in self._buckets.values():
            b.refill(now)
        every = len(self._buckets)
        blocked: set[TokenBucket] = set()
        front = 0                     # commands gone from the head of the queue
        gone: list[_Waiter] = []      # and from behind someone who stays (another bucket's turn)
        next_at = now + TICK
        for i, w in enumerate(queue):
            if w.future.done():       # cancelled, its task not yet told: it takes nothing
                go = True
            elif any(b in blocked for b, _ in w.needs):
                go = False
            elif now - w.since >= MAX_WAIT or all(b.ready(need) for b, need in w.needs):
                go = True
                for b, need in w.needs:
                    b.take(need)
                self.capped += now - w.since >= MAX_WAIT
                w.future.set_result(None)
            else:
                go = False
                next_at = min(next_at, max(b.due(need, now) for b, need in w.needs))
            if go:
                w.gone = True
                for b, _ in w.needs:
                    b.waiting -= 1
                if i == front:
                    front += 1
                else:
                    gone.append(w)
                continue
            blocked.update(b for b, _ in w.needs)
            if len(blocked) >= every:
                break
        for _ in range(front):
            queue.popleft()
        for w in gone:
            queue.remove(w)
        for w in queue:               # the oldest first: those waiting long are at the head
            if now - w.since < WARN_AFTER:
                break
            if not w.warned:
                w.warned = True
                self._slow += 1
        if self._slow and now - self._slow_logged_at >= LOG_INTERVAL:
            log.warning("%s: %d command(s) waited over %g s for QoS limits (%s); none waits over %g s, but "
                        "the limits are low for the initiators' queue depth", self.name, self._slow, WARN_AFTER,
                        self.limits, MAX_WAIT)
            self._slow = 0
            self._slow_logged_at = now
        if not queue:
            self._cancel_timer()
            return
        next_at = min(next_at, queue[0].since + MAX_WAIT)
        self._arm(max(next_at, now + MIN_DELAY), now)

    def _arm(self, when: float, now: float) -> None:
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._call_later(when - now, self._fire)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self._pump()

    # ---- what it reports, and its place in the desired state

    def stats(self) -> dict[str, Any]:
        """Counters since the layer was made, and the rates measured since the last stats() call that was
        at least a second ago (the first call: since the layer was made)."""
        now = self._clock()
        totals = (self.read_ops, self.read_bytes, self.write_ops, self.write_bytes)
        at, then = self._sample
        span = now - at
        if span >= 1.0 or (not self._rated and span > 0):
            r_iops, r_bps, w_iops, w_bps = ((a - b) / span for a, b in zip(totals, then, strict=True))
            self._rates = (r_iops, r_bps, w_iops, w_bps)
            if span >= 1.0:
                self._sample = (now, totals)
                self._rated = True
        r_iops, r_bps, w_iops, w_bps = self._rates
        return {
            "limits": self.limits.to_dict(),
            "waiting": len(self._queue),
            "throttled": self.throttled,
            "capped": self.capped,
            "wait_seconds": self.wait_seconds + sum(now - w.since for w in self._queue),
            "read_ops": self.read_ops, "read_bytes": self.read_bytes,
            "write_ops": self.write_ops, "write_bytes": self.write_bytes,
            "read_iops": r_iops, "read_bps": r_bps, "write_iops": w_iops, "write_bps": w_bps,
            "buckets": {name: b.level for name, b in self._buckets.items()},
        }

    @classmethod
    def from_config(cls, cfg: dict[str, Any], below: BlockDevice) -> QosLayer:
        return cls(below, QosLimits.from_dict({k: v for k, v in cfg.items() if k != "type"}))

    def layer_config(self) -> dict[str, Any]:
        return dict(self.limits.to_dict())

    async def close(self) -> None:
        """Waiting commands go (a closing layer holds nobody back); the device below is its owner's."""
        for w in self._queue:
            w.gone = True
            if not w.future.done():
                w.future.set_result(None)
        self._queue.clear()
        for b in self._buckets.values():
            b.waiting = 0
        self._cancel_timer()
