"""Node.apply on a running node (in process, real iSCSI, NVMe/TCP and NBD servers on loopback): a desired
state whose last change fails leaves the node as it was (devices, volumes, what every server serves, the
portals it listens on), the store unchanged, and a client sees what it saw before; a volume whose removal
was undone is the very object it was, data and all. A successful apply and one back to the start leave no
listener behind."""

from __future__ import annotations

import asyncio
import copy
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import openvsan.node.node as node_module
from openvsan.block import BlockDevice
from openvsan.block.fault import FaultDevice
from openvsan.cluster.etcd_process import free_ports
from openvsan.initiator.iscsi import IscsiInitiator, discover
from openvsan.initiator.nbd import NbdInitiator
from openvsan.node.config import parse_config
from openvsan.node.node import Node, NodeError
from openvsan.node.specs import DeviceSpec
from openvsan.node.store import Store, StoredState

IQN = "iqn.2026-11.org.openvsan:disk0"
NQN = "nqn.2026-11.org.openvsan:disk0"
BLOCK = 512


class Ports:
    def __init__(self) -> None:
        # picked together (each held until all are picked): one by one, two can be the same port (CI saw the
        # iSCSI and NVMe/TCP portals given one port, and the config refused it)
        self.iscsi, self.nvme, self.nbd, *self.spare = free_ports(6)


def base_doc(p: Ports) -> dict[str, Any]:
    """disk0 and gone, each exported three ways; `gone` is what the failing plans remove."""
    return {
        "node": {"name": "live", "poll_us": 0},
        "devices": [{"name": "ram0", "type": "ram", "size": "1MiB"}, {"name": "ram1", "type": "ram", "size": "1MiB"}],
        "volumes": [{"name": "disk0", "device": "ram0"}, {"name": "gone", "device": "ram1"}],
        "iscsi": {"targets": [{"iqn": IQN, "portals": [f"127.0.0.1:{p.iscsi}"],
                               "luns": [{"lun": 0, "volume": "disk0"}, {"lun": 1, "volume": "gone"}]}]},
        "nvme": {"portals": [f"127.0.0.1:{p.nvme}"],
                 "subsystems": [{"nqn": NQN, "namespaces": [{"nsid": 1, "volume": "disk0"},
                                                            {"nsid": 2, "volume": "gone"}]}]},
        "nbd": {"portals": [f"127.0.0.1:{p.nbd}"],
                "exports": [{"name": "disk0", "volume": "disk0"}, {"name": "gone", "volume": "gone"}]},
    }


def without_gone(doc: dict[str, Any]) -> dict[str, Any]:
    d = copy.deepcopy(doc)
    d["devices"] = [x for x in d["devices"] if x["name"] != "ram1"]
    d["volumes"] = [x for x in d["volumes"] if x["name"] != "gone"]
    d["iscsi"]["targets"][0]["luns"] = [x for x in d["iscsi"]["targets"][0]["luns"] if x["volume"] != "gone"]
    sub = d["nvme"]["subsystems"][0]
    sub["namespaces"] = [x for x in sub["namespaces"] if x["volume"] != "gone"]
    d["nbd"]["exports"] = [x for x in d["nbd"]["exports"] if x["volume"] != "gone"]
    return d


def run(body: Callable[[], Awaitable[None]], timeout: float = 60) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout))


def make_node(tmp_path: Path, doc: dict[str, Any]) -> Node:
    data = tmp_path / "data"
    cfg = parse_config(doc, data_dir=data)
    with Store.open(data) as s:
        s.import_config(cfg)
        state = s.load()
    return Node(state, data)


def stored(node: Node) -> StoredState:
    with Store.open(node.data_dir) as s:
        return s.load()


def listening(node: Node) -> dict[str, set[tuple[str, int]]]:
    return {type(s).__name__: set(s._listening) for s in node._servers()}


def snapshot(node: Node) -> dict[str, Any]:
    """What the node holds and serves. Objects a plan sets aside and puts back are compared by identity;
    the frontend records an undo builds anew (a LUN's, a namespace's, an export's), by what they say."""
    return {
        "devices": dict(node.devices),
        "volumes": dict(node.volumes),
        "iscsi": {iqn: (t.portals, t.chap, t.allowed_initiators,
                        {n: (lun.volume, lun.read_only) for n, lun in t.scsi.luns.items()})
                  for iqn, t in node.server.targets.items()},
        "node.targets": sorted(t.iqn for t in node.targets),
        "nvme": {nqn: {n: (ns.volume, ns.read_only) for n, ns in sub.namespaces.items()}
                 for nqn, sub in node.nvme_server.fabric.subsystems.items()},
        "node.subsystems": sorted(s.nqn for s in node.subsystems),
        "nbd": {name: (e.volume, e.portals, e.read_only, e.tls) for name, e in node.nbd_server.exports.items()},
        "node.nbd_exports": sorted(e.name for e in node.nbd_exports),
        "listening": listening(node),
        "state": node.state,
    }


def port_is_free(port: int) -> bool:
    """Nobody listens there (connections of ours that linger in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


@contextmanager
def bound(port: int) -> Iterator[socket.socket]:
    """Another program listening on `port`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield s


async def nbd_read(port: int, export: str, blocks: int = 1) -> bytes:
    dev = await NbdInitiator.open_url(f"nbd://127.0.0.1:{port}/{export}")
    try:
        return bytes(await dev.read(0, blocks))
    finally:
        await dev.close()


async def iscsi_read(port: int, lun: int) -> bytes:
    dev = await IscsiInitiator.open_url(f"iscsi://127.0.0.1:{port}/{IQN}/{lun}")
    try:
        return bytes(await dev.read(0, 1))
    finally:
        await dev.close()


async def client_view(p: Ports) -> dict[str, Any]:
    return {"targets": sorted(t for t, _ in await discover(f"iscsi://127.0.0.1:{p.iscsi}")),
            "nbd disk0": await nbd_read(p.nbd, "disk0"), "nbd gone": await nbd_read(p.nbd, "gone"),
            "iscsi lun 0": await iscsi_read(p.iscsi, 0), "iscsi lun 1": await iscsi_read(p.iscsi, 1)}


async def started(node: Node) -> None:
    await node.start()
    await node.volumes["disk0"].write(0, b"D" * BLOCK)
    await node.volumes["gone"].write(0, b"G" * BLOCK)


async def fails_and_changes_nothing(node: Node, p: Ports, desired: dict[str, Any], words: str,
                                    ok: dict[str, Any]) -> None:
    """`desired` fails with `words`, and nothing changes; then `ok` (desired without its failing part)
    applies."""
    before, store_before, view_before = snapshot(node), stored(node), await client_view(p)
    gone_volume, gone_device = node.volumes["gone"], node.devices["ram1"]
    cfg = parse_config(desired, data_dir=node.data_dir)
    with pytest.raises(NodeError) as e:
        await node.apply(cfg)
    text = str(e.value)
    assert "\n" not in text and words in text and text.endswith("nothing was changed"), text
    assert snapshot(node) == before
    assert stored(node) == store_before
    assert await client_view(p) == view_before
    # the removal of `gone` was undone with the very objects, so its data is there
    assert node.volumes["gone"] is gone_volume and node.devices["ram1"] is gone_device
    assert bytes(await node.volumes["gone"].read(0, 1)) == b"G" * BLOCK
    assert view_before["nbd gone"] == view_before["iscsi lun 1"] == b"G" * BLOCK
    # and the node goes on: the same plan without the failing part applies
    await node.apply(parse_config(ok, data_dir=node.data_dir))
    assert "gone" not in node.volumes and "ram1" not in node.devices
    assert stored(node).config == node.state.config == parse_config(ok, data_dir=node.data_dir)


def with_new_volume(doc: dict[str, Any]) -> dict[str, Any]:
    d = copy.deepcopy(doc)
    d["devices"].append({"name": "ram2", "type": "ram", "size": "1MiB"})
    d["volumes"].append({"name": "new", "device": "ram2"})
    return d


def test_nbd_export_on_a_port_in_use(tmp_path: Path) -> None:
    p = Ports()
    node = make_node(tmp_path, base_doc(p))
    desired = with_new_volume(without_gone(base_doc(p)))
    busy = p.spare[0]
    desired["nbd"]["exports"].append({"name": "new", "volume": "new", "portals": [f"127.0.0.1:{busy}"]})

    async def body() -> None:
        await started(node)
        try:
            changes = await node.apply(parse_config(desired, data_dir=node.data_dir), dry_run=True)
            assert (changes[-1].op, changes[-1].kind, changes[-1].key) == ("add", "nbd export", "new")
            with bound(busy):
                await fails_and_changes_nothing(node, p, desired, f"cannot listen on 127.0.0.1:{busy}",
                                                without_gone(base_doc(p)))
            assert "new" not in node.volumes and "ram2" not in node.devices
        finally:
            await node.stop()

    run(body)
    assert all(port_is_free(x) for x in (p.iscsi, p.nvme, p.nbd, busy))


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_device_that_cannot_be_opened(tmp_path: Path, where: str) -> None:
    p = Ports()
    node = make_node(tmp_path, base_doc(p))
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_bytes(b"")
    path = tmp_path / "adir" if where == "a directory" else tmp_path / "afile" / "bad.img"
    desired = without_gone(base_doc(p))
    desired["devices"].append({"name": "bad", "type": "file", "path": str(path), "size": "1MiB"})

    async def body() -> None:
        await started(node)
        try:
            changes = await node.apply(parse_config(desired, data_dir=node.data_dir), dry_run=True)
            assert (changes[-1].op, changes[-1].kind, changes[-1].key) == ("add", "device", "bad")
            await fails_and_changes_nothing(node, p, desired, "bad", without_gone(base_doc(p)))
            assert "bad" not in node.devices
        finally:
            await node.stop()

    run(body)


def slow_devices(monkeypatch: pytest.MonkeyPatch) -> dict[str, FaultDevice]:
    """Devices named slow* open under a FaultDevice (block/fault.py), whose latency a test sets."""
    real = node_module.open_device
    made: dict[str, FaultDevice] = {}

    def open_device(spec: DeviceSpec, *, trust_foreign: bool = False, memfd: int | None = None) -> BlockDevice:
        dev = real(spec, trust_foreign=trust_foreign, memfd=memfd)
        if spec.name.startswith("slow"):
            dev = made[spec.name] = FaultDevice(dev, name=spec.name)   # type: ignore[assignment]
        return dev

    monkeypatch.setattr(node_module, "open_device", open_device)
    return made


@pytest.mark.parametrize("qos", ["added", "removed"])
def test_stack_swap_that_cannot_drain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qos: str) -> None:
    """A QoS layer added to (or taken from) a volume whose device holds a write longer than the swap may
    wait: the swap gives up, the plan is undone, and the write completes on the stack it started on."""
    faults = slow_devices(monkeypatch)
    p = Ports()
    doc = base_doc(p)
    doc["devices"].append({"name": "slow0", "type": "ram", "size": "1MiB"})
    doc["volumes"].append({"name": "slow", "device": "slow0"})
    doc["nbd"]["exports"].append({"name": "slow", "volume": "slow"})
    limits = {"iops_limit": 100000, "bps_limit": 10**10}
    if qos == "removed":
        doc["volumes"][-1]["qos"] = limits
    node = make_node(tmp_path, doc)
    desired = with_new_volume(without_gone(doc))
    if qos == "added":
        desired["volumes"][-2]["qos"] = limits
    else:
        del desired["volumes"][-2]["qos"]

    async def body() -> None:
        await started(node)
        try:
            changes = await node.apply(parse_config(desired, data_dir=node.data_dir), dry_run=True)
            assert (changes[-1].op, changes[-1].kind, changes[-1].key) == ("update", "volume", "slow")
            vol = node.volumes["slow"]
            stack = vol.stack
            qos_before = [getattr(d, "limits", None) for d in vol.layers]
            client = await NbdInitiator.open_url(f"nbd://127.0.0.1:{p.nbd}/slow")
            try:
                faults["slow0"].latency = 2.0
                write = asyncio.create_task(client.write(0, b"S" * BLOCK))
                while not vol._inflight:
                    await asyncio.sleep(0.01)
                node.plane.swap_timeout = 0.2
                await fails_and_changes_nothing(node, p, desired, "still in flight", without_gone(doc))
                assert vol.stack is stack and node.volumes["slow"] is vol
                assert [getattr(d, "limits", None) for d in vol.layers] == qos_before
                await write          # no error: the write finished where it began
                faults["slow0"].latency = 0.0
                assert bytes(await client.read(0, 1)) == b"S" * BLOCK
            finally:
                await client.close()
        finally:
            await node.stop()

    run(body)


def test_apply_and_back_leaves_nothing_behind(tmp_path: Path) -> None:
    p = Ports()
    start = base_doc(p)
    node = make_node(tmp_path, start)
    more = with_new_volume(start)
    nbd_port, iscsi_port, nvme_port = p.spare
    more["nbd"]["exports"].append({"name": "new", "volume": "new", "portals": [f"127.0.0.1:{nbd_port}"]})
    more["iscsi"]["targets"].append({"iqn": "iqn.2026-11.org.openvsan:new", "portals": [f"127.0.0.1:{iscsi_port}"],
                                     "luns": [{"lun": 0, "volume": "new"}]})
    more["nvme"]["subsystems"].append({"nqn": "nqn.2026-11.org.openvsan:new", "portals": [f"127.0.0.1:{nvme_port}"],
                                       "namespaces": [{"nsid": 1, "volume": "new"}]})
    more["devices"][0]["size"] = "2MiB"
    more["volumes"][0]["qos"] = {"iops_limit": 100000}

    async def body() -> None:
        await started(node)
        try:
            before, store_before, view_before = snapshot(node), stored(node), await client_view(p)
            await node.apply(parse_config(more, data_dir=node.data_dir))
            assert set(node.volumes) == {"disk0", "gone", "new"}
            assert node.volumes["disk0"].size == 2 << 20
            assert await nbd_read(nbd_port, "new") == bytes(BLOCK)
            assert "iqn.2026-11.org.openvsan:new" in [t for t, _ in await discover(f"iscsi://127.0.0.1:{iscsi_port}")]
            assert not any(port_is_free(x) for x in p.spare)
            assert stored(node).config == node.state.config
            # back: the device does not shrink, so it keeps its new size in the way back
            back = copy.deepcopy(start)
            back["devices"][0]["size"] = "2MiB"
            await node.apply(parse_config(back, data_dir=node.data_dir))
            assert all(port_is_free(x) for x in p.spare), "a listener was left behind"
            now = snapshot(node)
            assert now["devices"] == before["devices"] and now["volumes"] == before["volumes"]
            assert {k: now[k] for k in now if k not in ("state",)} == {k: before[k] for k in before
                                                                       if k not in ("state",)}
            assert node.state.config == parse_config(back, data_dir=node.data_dir)
            assert stored(node).config == node.state.config
            assert store_before.identities.items() <= stored(node).identities.items()
            assert await client_view(p) == view_before
            assert [type(d).__name__ for d in node.volumes["disk0"].layers] == ["RamDevice"]
        finally:
            await node.stop()

    run(body)
    assert all(port_is_free(x) for x in (p.iscsi, p.nvme, p.nbd, *p.spare))


def test_first_subsystem_added_live_serves_discovery_on_the_planned_portals(tmp_path: Path) -> None:
    """A node with no [nvme] gets one while serving: its discovery service listens on the [nvme] portals of
    the state being applied (not the node's own, which has none)."""
    p = Ports()
    start = base_doc(p)
    del start["nvme"]
    node = make_node(tmp_path, start)
    discovery, own = p.spare[0], p.spare[1]
    more = copy.deepcopy(start)
    more["nvme"] = {"portals": [f"127.0.0.1:{discovery}"],
                    "subsystems": [{"nqn": NQN, "portals": [f"127.0.0.1:{own}"],
                                    "namespaces": [{"nsid": 1, "volume": "disk0"}]}]}

    async def body() -> None:
        await started(node)
        try:
            assert node.nvme_server is None
            await node.apply(parse_config(more, data_dir=node.data_dir))
            assert node.nvme_server is not None
            assert node.nvme_server.discovery_portals == [("127.0.0.1", discovery)]
            assert {("127.0.0.1", discovery), ("127.0.0.1", own)} <= listening(node)["NvmeTcpServer"]
        finally:
            await node.stop()

    run(body)
