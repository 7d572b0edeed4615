"""ConnectionLimits and the rate-limited connection log: counts and lines, with an injected clock, no sockets."""

from __future__ import annotations

import logging
import re
import resource
from collections.abc import Callable

import pytest

from openvsan.frontend.limits import FD_RESERVE, ConnectionLimits, Ticket, raise_fd_limit, source_address
from openvsan.frontend.ratelog import MAX_SOURCES, RateLog


def admitted(limits: ConnectionLimits, source: str, fd: int | None = None) -> Ticket:
    t = limits.admit(source, fd)
    assert isinstance(t, Ticket), t
    return t


# --- ConnectionLimits ---------------------------------------------------------------------------------------

def test_per_source_cap_refuses_that_address_only() -> None:
    lim = ConnectionLimits(100, 50, 3)
    for _ in range(3):
        admitted(lim, "10.0.0.1")
    why = lim.admit("10.0.0.1")
    assert why == "3 connections not logged in from one address, [node] max_unauthenticated_per_source"
    admitted(lim, "10.0.0.2")  # another address is not held back by the first one's flood
    assert lim.refused == {why: 1}
    assert (lim.total, lim.unauthenticated, lim.per_source) == (4, 4, {"10.0.0.1": 3, "10.0.0.2": 1})


def test_logged_in_stops_counting_as_unauthenticated() -> None:
    lim = ConnectionLimits(100, 50, 2)
    a, b = admitted(lim, "h"), admitted(lim, "h")
    assert isinstance(lim.admit("h"), str)
    a.logged_in()
    a.logged_in()  # twice: counted once
    c = admitted(lim, "h")
    assert (lim.total, lim.unauthenticated, lim.per_source) == (3, 2, {"h": 2})
    a.release()
    a.release()
    b.release()
    c.logged_in()
    c.release()
    assert (lim.total, lim.unauthenticated, lim.per_source) == (0, 0, {})  # no entry left per address


def test_logged_in_after_release_does_not_count() -> None:
    lim = ConnectionLimits(10, 10, 10)
    t = admitted(lim, "h")
    t.release()
    t.logged_in()
    assert (lim.total, lim.unauthenticated, lim.per_source) == (0, 0, {})


def test_global_unauthenticated_cap() -> None:
    lim = ConnectionLimits(100, 4, 3)
    for src in ("a", "b", "c", "d"):
        admitted(lim, src)
    assert lim.admit("e") == "4 connections not logged in, [node] max_unauthenticated"
    assert lim.evicted == 0   # among equals no room is made: the newcomer is refused


def test_max_connections_counts_logged_in_ones_too() -> None:
    lim = ConnectionLimits(3, 3, 3)
    for _ in range(3):
        admitted(lim, "a").logged_in()
    assert lim.unauthenticated == 0
    assert lim.admit("b") == "3 connections open, [node] max_connections"


def test_descriptor_cap() -> None:
    lim = ConnectionLimits(10_000, 10_000, 10_000, fd_limit=1024)
    admitted(lim, "a", fd=1024 - FD_RESERVE - 1)
    assert lim.admit("a", fd=1024 - FD_RESERVE) == "file descriptors nearly used up: soft RLIMIT_NOFILE 1024"
    admitted(lim, "a", fd=None)  # no socket to judge by: the other caps still count


def test_source_address() -> None:
    assert source_address(("127.0.0.2", 5555)) == "127.0.0.2"
    assert source_address(("::ffff:192.0.2.7", 5555, 0, 0)) == "192.0.2.7"
    assert source_address(("::1", 5555, 0, 0)) == "::1"
    assert source_address(None) == "?"


def test_raise_fd_limit(caplog: pytest.LogCaptureFixture) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        with caplog.at_level(logging.INFO, "openvsan.frontend"):
            before, after = raise_fd_limit(128)
        assert (before, after) == (low, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
        msgs = [r.getMessage() for r in caplog.records]
        assert (f"file descriptors: soft limit raised from {low} to {hard}" in msgs) != (low == hard)
        caplog.clear()
        with caplog.at_level(logging.INFO, "openvsan.frontend"):
            raise_fd_limit(hard)  # more than the hard limit holds: a warning naming the key
        assert any(r.levelno == logging.WARNING and "[node] max_connections" in r.getMessage()
                   for r in caplog.records)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- RateLog ------------------------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.ratelog"]


def ratelog(clock: Clock, schedule: Callable[[float, Callable[[], None]], object] | None = None) -> RateLog:
    return RateLog(logging.getLogger("test.ratelog"), interval=10.0, clock=clock, schedule=schedule)


def test_first_event_is_logged_whole_the_rest_counted(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    rl = ratelog(clock)
    kind = "iSCSI: login not finished in 30 s"
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        assert rl.event(kind, "127.0.0.1", "127.0.0.1:1000: login not finished in 30 s; closing the connection")
        for i in range(150):
            clock.now += 0.01
            assert not rl.event(kind, "127.0.0.1", f"127.0.0.1:{1001 + i}: ...")
        rl.event(kind, "127.0.0.2", "...")
        rl.event(kind, "127.0.0.2", "...")
        assert len(lines(caplog)) == 1
        clock.now = 1010.0
        rl.flush()
    assert lines(caplog) == [
        "127.0.0.1:1000: login not finished in 30 s; closing the connection",
        ("152 connections dropped in the last 10 s (iSCSI: login not finished in 30 s) from 127.0.0.1 x150, "
         "127.0.0.2 x2"),
    ]
    assert rl.total == {kind: 153}


def test_lasting_flood_is_one_line_per_interval(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    rl = ratelog(clock)
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        for _ in range(2000):   # 2,000 events over 40 s
            clock.now += 0.02
            rl.event("NBD: refused", "10.1.1.1", "line", verb="refused")
        clock.now += 10
        rl.flush()
    got = lines(caplog)
    assert got[0] == "line"
    assert 4 <= len(got) <= 6, got
    assert all(re.fullmatch(r"(\d+) connections refused in the last (10|20) s \(NBD: refused\) from 10\.1\.1\.1 x\1", x)
               for x in got[1:]), got
    assert sum(int(x.split()[0]) for x in got[1:]) == 1999


def test_quiet_kind_logs_the_next_event_at_once(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    rl = ratelog(clock)
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        assert rl.event("k", "a", "one")
        clock.now += 11
        assert rl.event("k", "a", "two")      # nothing held back in between: no summary, logged whole
        assert rl.event("other", "a", "three")  # kinds are apart
    assert lines(caplog) == ["one", "two", "three"]


def test_summary_written_by_the_next_event_after_the_interval(clock: Clock,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    rl = ratelog(clock)
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        rl.event("k", "a", "first")
        rl.event("k", "a", "x", detail="bad opcode 0x7f")
        clock.now += 12
        rl.event("k", "b", "y")
    assert lines(caplog) == ["first", "1 connection dropped in the last 12 s (k) from a x1; the last: bad opcode 0x7f"]


def test_timer_writes_the_summary(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    timers: list[tuple[float, Callable[[], None]]] = []
    rl = ratelog(clock, lambda delay, fn: timers.append((delay, fn)) or True)
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        rl.event("k", "a", "first")
        assert timers == []                 # one event: nothing to sum up later
        clock.now += 3
        rl.event("k", "a", "second")
        rl.event("k", "a", "third")
        assert len(timers) == 1 and timers[0][0] == pytest.approx(7.0)
        clock.now += 7
        timers.pop()[1]()
        assert lines(caplog)[-1] == "2 connections dropped in the last 10 s (k) from a x2"
        assert timers == []                 # nothing more held back
    assert len(lines(caplog)) == 2


def test_many_sources_are_bounded(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    rl = ratelog(clock)
    with caplog.at_level(logging.WARNING, "test.ratelog"):
        rl.event("k", "x", "first")
        for i in range(MAX_SOURCES * 3):
            rl.event("k", f"10.0.{i // 256}.{i % 256}", "...")
        rl.event("k", "10.0.0.9", "...")
        w = rl.windows["k"]
        assert len(w.sources) == MAX_SOURCES
        clock.now += 10
        rl.flush()
    last = lines(caplog)[-1]
    assert last.startswith(f"{MAX_SOURCES * 3 + 1} connections dropped in the last 10 s (k) from 10.0.0.9 x2, ")
    assert last.endswith(f"{MAX_SOURCES * 3 + 1 - 2 - 4} from other addresses")


# --- accept() failures ----------------------------------------------------------------------------------------

def test_accept_failures_are_counted_not_logged_each(caplog: pytest.LogCaptureFixture) -> None:
    """asyncio's selector loop hands an accept() that failed with EMFILE to the exception handler (and listens
    again a second later); watch_accept_errors turns that into rate-limited lines with counts, and passes
    everything else on to the handler that was there before."""
    import asyncio
    import errno
    import os

    from openvsan.frontend import ratelog
    from openvsan.frontend.portals import watch_accept_errors

    seen: list[dict[str, object]] = []
    loop = asyncio.new_event_loop()
    saved = ratelog.connection_log.windows.copy(), ratelog.connection_log.total.copy()
    try:
        loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
        watch_accept_errors(loop)
        watch_accept_errors(loop)  # a second server on the loop: still one handler
        emfile = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        with caplog.at_level(logging.WARNING, "openvsan.frontend"):
            for _ in range(50):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": emfile})
            loop.call_exception_handler({"message": "something else"})
        got = [r.getMessage() for r in caplog.records if r.name == "openvsan.frontend"]
        assert got == [f"a portal: accept() failed: {emfile}; listening again in 1 s"]
        assert ratelog.connection_log.total["accept() on a portal: EMFILE"] >= 50
        assert [c["message"] for c in seen] == ["something else"]
    finally:
        loop.close()
        ratelog.connection_log.windows, ratelog.connection_log.total = saved


def test_full_cap_makes_room_by_closing_the_busiest_address_oldest_first() -> None:
    """A flood from many addresses fills max_unauthenticated; a host with none waiting still gets in, and the
    connection closed for it is the oldest of the address holding the most."""
    lim = ConnectionLimits(100, 6, 3)
    closed: list[str] = []
    tickets = []
    for i, src in enumerate(("a", "a", "a", "b", "b", "c")):
        t = admitted(lim, src)
        t.evict = lambda name=f"{src}{i}": closed.append(name)  # type: ignore[misc]
        tickets.append(t)
    newcomer = admitted(lim, "d")
    assert closed == ["a0"] and lim.evicted == 1
    assert tickets[0].released and not tickets[1].released
    assert (lim.total, lim.unauthenticated, lim.per_source) == (6, 6, {"a": 2, "b": 2, "c": 1, "d": 1})
    tickets[0].release()  # its connection_lost later: already spent, counts nothing
    assert lim.total == 6
    # an address as busy as the busiest cannot push others out with a flood of its own
    admitted(lim, "e")    # a or b (2) > e (0) + 1: room is made again
    assert closed == ["a0", "a1"]
    assert lim.admit("b") == "6 connections not logged in, [node] max_unauthenticated"
    newcomer.logged_in()
    admitted(lim, "b")    # a slot freed by a login, no eviction needed
    assert closed == ["a0", "a1"]

