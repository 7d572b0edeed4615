"""Fixtures for tests/integration: in-process parts over loopback, with real servers where a test needs one.

`store` is the StateStore under test, once per implementation: "sqlite" (a file in the test's tmp dir),
"memory" (node/memstore.py) and "etcd" (a real etcd on a free 127.0.0.1 port pair, data in tmp, started once per module and killed after).
A test gets a `StoreMaker`: `maker.run(body)` runs `async def body(store)` on a fresh event loop with a
store opened for it (`n=2`: two independent clients of the same state, as two nodes or two processes).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from openvsan.cluster.etcd_process import ETCD_PACKAGE, EtcdMissing, EtcdProcess
from openvsan.node.statestore import SqliteStateStore, StateStore

_prefixes = itertools.count()


class StoreMaker:
    def __init__(self, kind: str, tmp: Path, etcd: EtcdProcess | None) -> None:
        self.kind = kind
        self.tmp = tmp
        self.etcd = etcd
        self._space = 0
        self._memory: tuple[int, Any] | None = None
        self.new_space()

    def new_space(self) -> None:
        """Stores opened from now on see an empty state (a new file; on etcd, a new key prefix)."""
        self._space = next(_prefixes)

    async def open(self) -> StateStore:
        if self.kind == "memory":   # every store opened in one space shares its state, as clients of one etcd
            from openvsan.node.memstore import MemoryState, MemoryStateStore

            if self._memory is None or self._memory[0] != self._space:
                self._memory = (self._space, MemoryState())
            return MemoryStateStore(self._memory[1])
        if self.kind == "sqlite":
            return SqliteStateStore(self.tmp / f"state-{self._space}.db")
        from openvsan.cluster.etcd import EtcdStateStore

        assert self.etcd is not None
        return EtcdStateStore([self.etcd.endpoint], prefix=f"/test{self._space}")

    def run(self, body: Callable[..., Awaitable[Any]], *, n: int = 1, timeout: float = 60) -> Any:
        async def main() -> Any:
            stores = [await self.open() for _ in range(n)]
            try:
                return await asyncio.wait_for(body(*stores), timeout)
            finally:
                for s in stores:
                    await s.close()

        return asyncio.run(main())


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    try:
        proc = EtcdProcess(tmp_path_factory.mktemp("etcd") / "data")
    except EtcdMissing:
        pytest.fail(f"missing etcd: apt-get install {ETCD_PACKAGE} (or run `sudo bash .ci/run`)", pytrace=False)
    with proc:
        yield proc


def _maker(request: pytest.FixtureRequest, tmp_path: Path) -> StoreMaker:
    etcd = request.getfixturevalue("etcd_server") if request.param == "etcd" else None
    return StoreMaker(request.param, tmp_path, etcd)


@pytest.fixture(params=["sqlite", "memory", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreMaker:
    return _maker(request, tmp_path)


@pytest.fixture(params=["sqlite", "etcd"])
def durable_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreMaker:
    """The stores a node keeps its desired state in (the memory one keeps nothing)."""
    return _maker(request, tmp_path)
