"""The unit tier's guard (tests/unit/conftest.py) on probe tests run by a child pytest: every way of opening a
socket fails with the rule, even when the code swallows the error or a module fixture opens it, and the
event loops' own socketpairs stay allowed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PROBES = '''
import asyncio, socket
import pytest
import uvloop


@pytest.fixture(scope="module")
def listener():
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s


def test_socket():
    socket.socket()


def test_swallowed():
    try:
        socket.socket(socket.AF_UNIX)
    except Exception:
        pass


def test_socketpair():
    socket.socketpair()


def test_server_on_asyncio():
    async def main():
        await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    asyncio.run(main())


def test_client_on_uvloop():
    async def main():
        await asyncio.open_connection("127.0.0.1", 9)
    uvloop.run(main())


def test_module_fixture(listener):
    pass


def test_loops_alone():
    asyncio.run(asyncio.sleep(0))
    uvloop.run(asyncio.sleep(0))
    asyncio.new_event_loop().close()
'''


def test_the_guard_fails_every_socket_and_lets_the_loops_be(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_probes.py").write_text(PROBES)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q", str(tmp_path)],
                       check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    found = re.findall(r"^(PASSED|FAILED|ERROR) test_probes.py::(\w+)", r.stdout, re.MULTILINE)
    outcome = {name: state for state, name in found}
    assert outcome == {"test_socket": "FAILED", "test_swallowed": "FAILED", "test_socketpair": "FAILED",
                       "test_server_on_asyncio": "FAILED", "test_client_on_uvloop": "FAILED",
                       "test_module_fixture": "ERROR", "test_loops_alone": "PASSED"}, r.stdout + r.stderr
    assert "opened a socket (socket.socket(family=1" in r.stdout  # the swallowed one still names what it opened
    assert r.stdout.count("tests/unit opens no socket (DESIGN.md, Layout)") >= 6
