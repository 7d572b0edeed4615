"""Connection events logged at a bounded rate: the first of a kind is logged whole, and while more of that
kind keep coming, one line per interval says how many there were and from where. A flood of 2,000 dropped
connections is then a handful of lines, each with its counts, and a single drop is still logged at once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_INTERVAL = 10.0   # seconds
MAX_SOURCES = 64          # addresses tallied by name per kind and interval; the rest count as "others"
SHOWN_SOURCES = 5         # addresses a summary names, most frequent first

Schedule = Callable[[float, Callable[[], None]], object]


def call_later(delay: float, fn: Callable[[], None]) -> object:
    """The default timer for summaries: the running loop's; with no loop the next event writes them."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.call_later(delay, fn)


@dataclass
class _Window:
    start: float
    noun: str
    verb: str
    count: int = 0                                        # events held back since start
    sources: dict[str, int] = field(default_factory=dict)
    others: int = 0                                       # held-back events from addresses past MAX_SOURCES
    detail: str = ""                                      # what the last held-back event said


class RateLog:
    """One logger line per interval per kind. `event` logs its line at once when its kind has been quiet for
    an interval; otherwise it is counted, and the interval's summary names the count and the sources:
    "152 connections dropped in the last 10 s (iSCSI: login not finished in 30 s) from 127.0.0.1 x150, ..."."""

    def __init__(self, logger: logging.Logger, *, interval: float = DEFAULT_INTERVAL, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic, schedule: Schedule | None = call_later) -> None:
        self.logger = logger
        self.interval = interval
        self.level = level
        self.clock = clock
        self.schedule = schedule
        self.windows: dict[str, _Window] = {}
        self.total: dict[str, int] = {}      # kind -> events since start, logged or not
        self._armed = False                  # a summary timer is set

    def event(self, kind: str, source: str, line: str, *, noun: str = "connection", verb: str = "dropped",
              detail: str = "") -> bool:
        """Log `line` now, or count it under `kind` (a phrase that stays the same for every event of its kind)
        from address `source`. True when it was logged now."""
        now = self.clock()
        self.flush(now)
        self.total[kind] = self.total.get(kind, 0) + 1
        w = self.windows.get(kind)
        if w is None:
            self.windows[kind] = _Window(now, noun, verb)
            self.logger.log(self.level, "%s", line)
            return True
        w.count += 1
        w.detail = detail
        if source in w.sources or len(w.sources) < MAX_SOURCES:
            w.sources[source] = w.sources.get(source, 0) + 1
        else:
            w.others += 1
        self._arm(now)
        return False

    def reset(self) -> None:
        """Forget every interval and count (tests: what one dropped must not hold back the next one's line)."""
        self.windows.clear()
        self.total.clear()
        self._armed = False

    def flush(self, now: float | None = None) -> None:
        """Write the summary of every kind whose interval is over; a kind with nothing held back goes quiet."""
        if now is None:
            now = self.clock()
        for kind, w in list(self.windows.items()):
            if now - w.start < self.interval:
                continue
            if not w.count:
                del self.windows[kind]
                continue
            self.logger.log(self.level, "%s", self.summary(kind, w, now))
            # still busy: the next interval is counted too, so a lasting flood is one line per interval
            self.windows[kind] = _Window(now, w.noun, w.verb)

    def summary(self, kind: str, w: _Window, now: float) -> str:
        tally = sorted(w.sources.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = [f"{src} x{n}" for src, n in tally[:SHOWN_SOURCES]]
        rest = w.others + sum(n for _, n in tally[SHOWN_SOURCES:])
        if rest:
            shown.append(f"{rest} from other addresses")
        noun = w.noun if w.count == 1 else w.noun + "s"
        line = f"{w.count} {noun} {w.verb} in the last {now - w.start:.0f} s ({kind}) from {', '.join(shown)}"
        return f"{line}; the last: {w.detail}" if w.detail else line

    def _arm(self, now: float) -> None:
        if self._armed or self.schedule is None:
            return
        due = min(w.start for w in self.windows.values() if w.count) + self.interval
        self._armed = self.schedule(max(0.0, due - now), self._expired) is not None

    def _expired(self) -> None:
        self._armed = False
        now = self.clock()
        self.flush(now)
        if any(w.count for w in self.windows.values()):
            self._arm(now)


# the node's one instance: every protocol server's connection events share its intervals
connection_log = RateLog(logging.getLogger("openvsan.frontend"))
