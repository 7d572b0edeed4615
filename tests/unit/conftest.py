"""The unit tier opens no socket (DESIGN.md, "Layout": unit/ no sockets, no clock; integration/ in-process over
loopback; interop/ third-party tools).

While a test in tests/unit is set up, run and torn down (fixtures of every scope included), creating a socket
raises SocketInUnitTest, and the test fails at the end even if the code under test caught that error. Two
things stay allowed: wrapping a descriptor that already exists (socket(fileno=...), as accept() and
socketpair() do inside the socket module) and the socketpair an event loop makes for itself (asyncio's
self-pipe, uvloop's signal wake-up). A test that needs a socket belongs in tests/integration (in-process
server over loopback) or tests/interop (third-party client against `vsan serve`).
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

RULE = ("tests/unit opens no socket (DESIGN.md, Layout): drive the protocol machine with bytes, or move the "
        "test to tests/integration (in-process server over loopback) or tests/interop (third-party tools)")


class SocketInUnitTest(AssertionError):
    """Not an OSError, so code that handles a failed bind or connect does not take it for one."""


_violations: list[str] = []


def _refuse(what: str) -> SocketInUnitTest:
    _violations.append(what)
    return SocketInUnitTest(f"{what}: {RULE}")


def _from_loop_self_pipe() -> bool:
    # frame 0 is this function, 1 the guard, 2 the Python frame the call came from.
    caller = sys._getframe(2)
    if caller.f_code.co_name == "_make_self_pipe" and caller.f_globals.get("__name__") == "asyncio.selector_events":
        return True  # BaseSelectorEventLoop makes its self-pipe when the loop is created
    # uvloop makes its signal wake-up pair from compiled code inside run_until_complete: then the Python frame
    # on top of the stack is the one that called into uvloop, and its code never names socketpair.
    return "uvloop" in sys.modules and "socketpair" not in caller.f_code.co_names


@contextmanager
def no_sockets() -> Iterator[None]:
    real_init = socket.socket.__init__
    real_socketpair = socket.socketpair

    def guarded_init(self: socket.socket, family: Any = -1, type: Any = -1, proto: Any = -1,
                     fileno: Any = None) -> None:
        if fileno is None:
            raise _refuse(f"socket.socket(family={family}, type={type})")
        real_init(self, family, type, proto, fileno)

    def guarded_socketpair(*args: Any, **kwargs: Any) -> tuple[socket.socket, socket.socket]:
        if not _from_loop_self_pipe():
            raise _refuse("socket.socketpair()")
        return real_socketpair(*args, **kwargs)

    # uvloop makes a client socket inside libuv, out of the socket module's sight: refuse the stream helpers
    # by name as well (a listener, which every loopback test needs, is caught above on either loop).
    real_streams = {name: getattr(asyncio.streams, name) for name in ("open_connection", "open_unix_connection")}

    def refuse_stream(name: str) -> Any:
        async def refused(*args: Any, **kwargs: Any) -> Any:
            raise _refuse(f"asyncio.{name}()")
        return refused

    socket.socket.__init__ = guarded_init  # type: ignore[method-assign]
    socket.socketpair = guarded_socketpair
    for name in real_streams:
        setattr(asyncio.streams, name, refuse_stream(name))
        setattr(asyncio, name, getattr(asyncio.streams, name))
    try:
        yield
    finally:
        socket.socket.__init__ = real_init  # type: ignore[method-assign]
        socket.socketpair = real_socketpair
        for name, real in real_streams.items():
            setattr(asyncio.streams, name, real)
            setattr(asyncio, name, real)


def _guarded(item: pytest.Item) -> Generator[None, None, None]:
    del _violations[:]
    with no_sockets():
        yield
    if _violations:
        what = "; ".join(dict.fromkeys(_violations))
        del _violations[:]
        pytest.fail(f"{item.nodeid} opened a socket ({what}): {RULE}", pytrace=False)


# runtest hooks in this conftest only see items under tests/unit. Wrapping setup and teardown as well as the
# call covers module- and session-scoped fixtures, which set up inside the first test that uses them.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _guarded(item))
