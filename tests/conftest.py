"""Fixtures for the tests that run a real `vsan serve` (tests/interop, tests/fault).

The helpers live in tests/interop/vsan_harness.py and tests/support/; this puts those folders on sys.path
so every test folder can `import vsan_harness` and the shared helpers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "interop"))
sys.path.insert(0, str(Path(__file__).parent / "support"))  # helpers shared by the test tiers

from vsan_harness import VsanServer, free_port, make_device

# fixtures shared by the tiers (tests/support/cli_stubs.py: files, stubbed)
pytest_plugins = ["cli_stubs"]

StartVsan = Callable[..., VsanServer]


@pytest.fixture
def vsan(tmp_path: Path) -> Iterator[StartVsan]:
    """A factory: `vsan(device="ram"|"shm"|"file"|"null", size="64MiB", chap=(u, s), allowed_initiators=[...],
    start=True)` writes a config like examples/single-node.toml on a free port and starts `vsan serve` on it.

    Teardown SIGTERMs every server still running and fails the test unless each exited 0 with no Traceback
    in its log: a crash of the target is a test failure even when the initiator did not notice.
    """
    servers: list[VsanServer] = []

    def start(
        device: str = "ram", size: str = "64MiB", *, block_size: int = 512, start: bool = True, **kwargs: object
    ) -> VsanServer:
        workdir = tmp_path / f"vsan{len(servers)}"
        server = VsanServer(workdir, free_port(), make_device(device, workdir, size, block_size), **kwargs)
        servers.append(server)
        if start:
            server.start()
        return server

    yield start
    problems = []
    for server in servers:
        try:
            server.cleanup()
        except BaseException as e:  # noqa: BLE001  (pytest.fail raises an OutcomeException, a BaseException)
            problems.append(f"{server.workdir}: {e}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def _quiet_connection_log() -> None:
    """Every test starts with no interval open in the rate-limited connection log (frontend/ratelog.py): a
    connection an earlier test dropped must not hold back the line this one looks for."""
    ratelog = sys.modules.get("openvsan.frontend.ratelog")  # only when loaded: this file imports no openvsan
    if ratelog is not None:
        ratelog.connection_log.reset()
