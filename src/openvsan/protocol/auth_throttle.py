"""Failed authentications, counted per peer: a doubling delay, then a lockout (sans-IO: the clock is passed in).

Shared by the iSCSI CHAP login (protocol/iscsi/login.py) and NVMe/TCP DH-HMAC-CHAP. A key is whatever names
the peer that guesses, e.g. (initiator name, source address). After a failure, every further attempt from
that key is answered late, by `delay_base` doubled per failure in a row, up to `delay_max`; after
`lockout_failures` failures in a row it is refused outright for `lockout_seconds`. A success forgets the key.

Memory is bounded: an entry is forgotten `forget_after` seconds after its last failure (once any lockout has
ended), and at most `max_entries` are kept; when full, the oldest entry that is not locked out goes first, so a
flood of made-up initiator names cannot push a locked-out guesser out of the table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

DELAY_BASE = 0.25          # seconds: the delay after the first failure
DELAY_MAX = 8.0
LOCKOUT_FAILURES = 10      # 0: never lock out
LOCKOUT_SECONDS = 300.0
FORGET_AFTER = 900.0       # seconds without a failure after which a key starts afresh
MAX_ENTRIES = 10_000
_EVICT_SCAN = 64           # entries looked at for an unlocked one to evict before taking the oldest


@dataclass(frozen=True)
class Verdict:
    """What an attempt from a key gets: answered `delay` seconds late, or refused at once while `locked_for` > 0."""

    delay: float = 0.0
    locked_for: float = 0.0         # seconds of lockout left; 0: not locked out
    failures: int = 0               # failures in a row so far
    started_lockout: bool = False   # from failed(): this failure began the lockout (log it, once)

    @property
    def locked(self) -> bool:
        return self.locked_for > 0


OPEN = Verdict()


@dataclass
class _Entry:
    failures: int
    last: float              # time of the last failure
    locked_until: float = 0.0


class AuthThrottle:
    def __init__(self, *, delay_base: float = DELAY_BASE, delay_max: float = DELAY_MAX,
                 lockout_failures: int = LOCKOUT_FAILURES, lockout_seconds: float = LOCKOUT_SECONDS,
                 forget_after: float = FORGET_AFTER, max_entries: int = MAX_ENTRIES) -> None:
        if delay_base < 0 or delay_max < 0 or lockout_failures < 0 or lockout_seconds < 0 or max_entries < 1:
            raise ValueError("auth throttle: delays, counts and times must not be negative")
        self.delay_base = min(delay_base, delay_max)
        self.delay_max = delay_max
        self.lockout_failures = lockout_failures
        self.lockout_seconds = lockout_seconds
        self.forget_after = max(forget_after, lockout_seconds)
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()   # oldest failure first

    def __len__(self) -> int:
        return len(self._entries)

    def _delay(self, failures: int) -> float:
        if failures <= 0 or self.delay_max <= 0:
            return 0.0
        return float(min(self.delay_base * 2.0 ** min(failures - 1, 64), self.delay_max))

    def _live(self, key: Hashable, now: float) -> _Entry | None:
        e = self._entries.get(key)
        if e is None:
            return None
        if e.locked_until:
            if now < e.locked_until:
                return e
            # the lockout is over: the key starts afresh (a guesser gets the next round of tries, delayed again)
            del self._entries[key]
            return None
        if now - e.last > self.forget_after:
            del self._entries[key]
            return None
        return e

    def check(self, key: Hashable, now: float) -> Verdict:
        """Before an attempt is evaluated: how late to answer it, or that the key is locked out."""
        e = self._live(key, now)
        if e is None:
            return OPEN
        if e.locked_until:
            return Verdict(0.0, e.locked_until - now, e.failures)
        return Verdict(self._delay(e.failures), 0.0, e.failures)

    def failed(self, key: Hashable, now: float) -> Verdict:
        """An attempt from `key` failed: count it. Returns what the next attempt gets."""
        e = self._live(key, now)
        if e is not None and e.locked_until:
            # a failure that was already under way when another connection's failure locked the key out
            return Verdict(0.0, e.locked_until - now, e.failures)
        if e is None:
            self._make_room(now)
            e = self._entries[key] = _Entry(0, now)
        e.failures += 1
        e.last = now
        self._entries.move_to_end(key)
        if self.lockout_failures and e.failures >= self.lockout_failures and self.lockout_seconds > 0:
            e.locked_until = now + self.lockout_seconds
            return Verdict(0.0, self.lockout_seconds, e.failures, started_lockout=True)
        return Verdict(self._delay(e.failures), 0.0, e.failures)

    def succeeded(self, key: Hashable) -> None:
        """The key proved its secret: its failures are forgotten."""
        self._entries.pop(key, None)

    def _make_room(self, now: float) -> None:
        entries = self._entries
        # forget what has expired, oldest first (the order is by last failure)
        while entries:
            key, e = next(iter(entries.items()))
            if e.locked_until and now < e.locked_until or not e.locked_until and now - e.last <= self.forget_after:
                break
            del entries[key]
        if len(entries) < self.max_entries:
            return
        for i, (key, e) in enumerate(entries.items()):
            if i >= _EVICT_SCAN:
                break
            if not (e.locked_until and now < e.locked_until):
                del entries[key]
                return
        entries.popitem(last=False)
