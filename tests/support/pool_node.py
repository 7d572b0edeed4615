"""A Node serving in a thread of this process with stand-ins for its protocol servers (its pools and control
socket are real), and the pool configs the `vsan pool` tests serve: shared by tests/unit/test_cli_pool.py and
tests/integration/test_cli_pool_online.py."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from openvsan.node.config import parse_config
from openvsan.node.node import Factories, Node
from openvsan.node.store import Store


class StubServer:
    def __init__(self, targets: list[Any], **kw: Any) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def stub_factories() -> Factories:
    return Factories(lambda dev, **kw: dev, lambda n, luns: None, lambda **kw: None, lambda u, s: None, StubServer)


class NodeThread:
    """A Node serving in its own event loop thread, as `vsan serve` would, minus the protocol servers."""

    def __init__(self, data_dir: Path, config: dict[str, Any]) -> None:
        with Store.open(data_dir) as s:
            s.import_config(parse_config(config))
            state = s.load()
        self.node = Node(state, data_dir, factories=stub_factories())
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> NodeThread:
        try:
            self.run(self.node.start())
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        try:
            if self.node.control_server is not None or self.node.pools:
                self.run(self.node.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def pool_config(tmp_path: Path, level: str = "raid5", members: int = 4, extra: int = 2,
                spares: int = 0) -> dict[str, Any]:
    n = members + spares + extra
    devs = [{"name": f"d{i}", "type": "file", "path": str(tmp_path / f"d{i}.img"), "size": "3MiB"} for i in range(n)]
    devs.append({"name": "raw", "type": "ram", "size": "1MiB"})
    return {
        "node": {"name": "t"},
        "devices": devs,
        "pools": [{"name": "pool0", "level": level, "members": [f"d{i}" for i in range(members)],
                   "spares": [f"d{members + i}" for i in range(spares)], "chunk": "16KiB"}],
        "volumes": [{"name": "vol0", "pool": "pool0"}, {"name": "other", "device": "raw"}],
    }
