"""Stand-ins of the protocol layers around a real Node, and the configs the node tests assemble: shared by
tests/unit/test_node_assembly.py and tests/integration/test_node_serve.py (tests/conftest.py puts this folder
on sys.path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openvsan.node.config import parse_config
from openvsan.node.node import Factories, Node
from openvsan.node.store import Store


class FakeLun:
    def __init__(self, volume: Any, **kw: Any) -> None:
        self.volume = volume
        self.kw = kw


class FakeScsiTarget:
    def __init__(self, name: str, luns: dict[int, Any]) -> None:
        self.name, self.luns = name, luns
        self.flushed = 0

    async def flush_all(self) -> None:
        self.flushed += 1
        for lun in self.luns.values():
            await lun.volume.flush()


class FakeTargetConfig:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class FakeServer:
    instances: list[FakeServer] = []  # noqa: RUF012

    def __init__(self, targets: list[Any], fail: OSError | None = None) -> None:
        self.targets = targets
        self.events: list[str] = []
        self.fail = fail
        FakeServer.instances.append(self)

    async def start(self) -> None:
        if self.fail:
            raise self.fail
        self.events.append("start")

    async def stop(self) -> None:
        self.events.append("stop")


def fakes(**kw: Any) -> Factories:
    return Factories(FakeLun, FakeScsiTarget, FakeTargetConfig, lambda u, s: ("chap", u, s),
                     kw.get("server", FakeServer), nvme_server=kw.get("nvme_server"),
                     nbd_server=kw.get("nbd_server"))


def node_for(tmp_path: Path, data: dict[str, Any], **kw: Any) -> Node:
    cfg = parse_config(data)
    with Store.open(tmp_path / "data") as s:
        s.import_config(cfg)
        state = s.load()
    return Node(state, tmp_path / "data", factories=fakes(**kw))


def config(tmp_path: Path) -> dict[str, Any]:
    return {
        "node": {"name": "n1"},
        "devices": [{"name": "ram0", "type": "ram", "size": "1MiB"},
                    {"name": "f0", "type": "file", "path": str(tmp_path / "f0.img"), "size": "2MiB",
                     "block_size": 4096},
                    {"name": "n0", "type": "null", "size": "1GiB"}],
        "volumes": [{"name": "disk0", "device": "ram0"}, {"name": "disk1", "device": "f0", "read_only": True},
                    {"name": "disk2", "device": "n0"}],
        "iscsi": {"portals": ["127.0.0.1:3260"], "targets": [
            {"iqn": "iqn.2026-11.org.openvsan:a", "luns": [{"lun": 0, "volume": "disk0"},
                                                          {"lun": 3, "volume": "disk1"}],
             "chap": {"user": "alice", "secret": "twelve+chars"}, "allowed_initiators": ["iqn.2026-11.org.x:i"]},
            {"iqn": "iqn.2026-11.org.openvsan:b", "luns": [{"lun": 0, "volume": "disk0"}],
             "portals": ["127.0.0.1:3261"], "advertised_portals": ["192.0.2.1:3260"], "portal_group_tag": 2,
             "allow_unauthenticated": True},  # disk0 behind CHAP on target a, open here on purpose
        ]},
    }


class FakeExportServer(FakeServer):
    def __init__(self, exports: list[Any], **kw: Any) -> None:
        super().__init__(exports)
        self.kw = kw


def all_protocols(tmp_path: Path) -> dict[str, Any]:
    data = config(tmp_path)
    del data["iscsi"]["targets"][0]["chap"]   # one policy per volume: disk0 is open on NVMe/TCP and NBD here
    data["nvme"] = {"portals": ["127.0.0.1:4420"], "subsystems": [
        {"nqn": "nqn.2026-11.org.openvsan:disk0", "namespaces": [{"nsid": 1, "volume": "disk0"},
                                                                 {"nsid": 2, "volume": "disk1"}],
         "allowed_hosts": ["nqn.2014-08.org.nvmexpress:uuid:0c9a1d3e-1234-4567-89ab-0123456789ab"]}]}
    data["nbd"] = {"portals": ["127.0.0.1:10809"], "exports": [
        {"name": "disk0", "volume": "disk0"}, {"name": "d1", "volume": "disk1"},
        {"name": "ro0", "volume": "disk0", "read_only": True, "portals": ["127.0.0.1:10810"]}]}
    return data
