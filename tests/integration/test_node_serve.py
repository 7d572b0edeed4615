"""Node assembly, serving and shutdown in process around stand-ins of the protocol layers; the node's control
socket is real."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from node_fakes import (
    FakeExportServer,
    FakeServer,
    all_protocols,
    config,
    node_for,
)

from openvsan.block import FileDevice, NullDevice, RamDevice
from openvsan.node.node import NodeError, serve


def test_assembly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = node_for(tmp_path, config(tmp_path))

    async def go() -> None:
        with caplog.at_level(logging.INFO, "openvsan.node"):
            await node.start()
        assert isinstance(node.devices["ram0"], RamDevice)
        assert isinstance(node.devices["f0"], FileDevice)
        assert isinstance(node.devices["n0"], NullDevice)
        server = node.server
        assert server.events == ["start"]
        a, b = server.targets
        assert a.iqn == "iqn.2026-11.org.openvsan:a" and a.portals == [("127.0.0.1", 3260)]
        assert a.chap == ("chap", "alice", "twelve+chars") and a.mutual_chap is None
        assert a.allowed_initiators == ["iqn.2026-11.org.x:i"] and b.allowed_initiators is None
        assert b.portals == [("127.0.0.1", 3261)] and b.advertised_portals == [("192.0.2.1", 3260)]
        assert b.portal_group_tag == 2
        assert set(a.scsi.luns) == {0, 3}
        lun0, lun3 = a.scsi.luns[0], a.scsi.luns[3]
        assert b.scsi.luns[0] is lun0  # one Lun per volume, shared: one PR state, one identity
        ident = node.state.identities["disk0"]
        assert lun0.kw == {"read_only": False, "pr_state_path": tmp_path / "data" / "pr" / "disk0.json"}
        # the LU's identity is its volume's, kept by the store
        assert (lun0.volume.name, lun0.volume.uuid, lun0.volume.serial) == ("disk0", ident.uuid, ident.serial)
        assert lun3.kw["read_only"] is True and lun3.volume.device is node.devices["f0"]
        await lun0.volume.write(0, b"x" * 512)
        await node.stop()
        assert server.events == ["start", "stop"]
        assert a.scsi.flushed == 1 and b.scsi.flushed == 1
        assert node.devices == {}

    asyncio.run(go())
    text = caplog.text
    assert "serving iqn.2026-11.org.openvsan:a LUN 0 (disk0, 1.0 MiB) on 127.0.0.1:3260" in text
    assert "LUN 3 (disk1, 2.0 MiB, read-only)" in text
    assert "iqn.2026-11.org.openvsan:a: CHAP, 1 allowed initiator(s)" in text


def test_ram_backing_survives_restart(tmp_path: Path) -> None:
    data = config(tmp_path)
    data["devices"][0]["backing"] = str(tmp_path / "shm-ram0")

    async def cycle(write: bool) -> bytes:
        node = node_for(tmp_path, data)
        await node.start()
        if write:
            await node.volumes["disk0"].write(7, b"k" * 512)
        got = bytes(await node.volumes["disk0"].read(7, 1))
        await node.stop()
        return got

    assert asyncio.run(cycle(True)) == b"k" * 512
    assert asyncio.run(cycle(False)) == b"k" * 512


def test_serve_stops_on_sigterm(tmp_path: Path) -> None:
    node = node_for(tmp_path, config(tmp_path))

    async def go() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serve(node), 5)

    asyncio.run(go())
    assert FakeServer.instances[-1].events == ["start", "stop"]
    assert node.devices == {}


def test_second_signal_skips_the_drain(tmp_path: Path) -> None:
    class SlowServer(FakeServer):
        async def stop(self) -> None:
            await asyncio.sleep(30)

    node = node_for(tmp_path, config(tmp_path), server=SlowServer)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, os.kill, os.getpid(), signal.SIGINT)
        loop.call_later(0.3, os.kill, os.getpid(), signal.SIGINT)
        await asyncio.wait_for(serve(node), 5)

    asyncio.run(go())
    assert node.devices == {}


def test_signal_during_start_stops_once_up(tmp_path: Path) -> None:
    class SlowStart(FakeServer):
        async def start(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.1)
            await super().start()

    node = node_for(tmp_path, config(tmp_path), server=SlowStart)
    asyncio.run(asyncio.wait_for(serve(node), 5))
    assert FakeServer.instances[-1].events == ["start", "stop"]


def test_one_volume_on_three_protocols(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = node_for(tmp_path, all_protocols(tmp_path), nvme_server=FakeExportServer, nbd_server=FakeExportServer)

    async def go() -> None:
        with caplog.at_level(logging.INFO, "openvsan.node"):
            await node.start()
        nvme, nbd = node.nvme_server, node.nbd_server
        assert nvme.events == ["start"] and nbd.events == ["start"]
        assert nvme.kw == {"discovery_portals": [("127.0.0.1", 4420)]}
        (sub,) = nvme.targets
        assert sub.nqn == "nqn.2026-11.org.openvsan:disk0" and sub.portals == [("127.0.0.1", 4420)]
        assert sub.allowed_hosts == ["nqn.2014-08.org.nvmexpress:uuid:0c9a1d3e-1234-4567-89ab-0123456789ab"]
        assert len(sub.serial) == 20 and sub.serial.isascii() and sub.model == "openvsan"
        ns1, ns2 = sub.namespaces
        assert (ns1.nsid, ns1.volume.name, ns1.read_only) == (1, "disk0", False) and ns2.read_only
        assert ns1.volume is node.volumes["disk0"] and ns1.volume.uuid == node.state.identities["disk0"].uuid
        e0, e1, ro = nbd.targets
        assert (e0.name, e0.portals, e0.read_only) == ("disk0", [("127.0.0.1", 10809)], False)
        assert e0.volume is node.volumes["disk0"] is ns1.volume  # one volume handle for every protocol
        assert e1.read_only and ro.read_only and ro.portals == [("127.0.0.1", 10810)]
        await node.stop()
        assert nvme.events == nbd.events == ["start", "stop"] and node.devices == {}

    asyncio.run(go())
    assert "serving nqn.2026-11.org.openvsan:disk0 namespace 1 (disk0, 1.0 MiB) on 127.0.0.1:4420" in caplog.text
    assert "serving NBD export ro0 (disk0, 1.0 MiB, read-only) on 127.0.0.1:10810" in caplog.text


def test_nvme_section_without_nvme_server_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def no_nvme(name: str, *a: Any) -> Any:
        if name == "openvsan.frontend.nvme_tcp":
            raise ModuleNotFoundError("No module named 'openvsan.frontend.nvme_tcp'")
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", no_nvme)
    node = node_for(tmp_path, all_protocols(tmp_path), nbd_server=FakeExportServer)

    async def go() -> None:
        with pytest.raises(NodeError) as e:
            await node.start()
        assert "\n" not in str(e.value) and "cannot serve NVMe/TCP" in str(e.value)
        assert "remove the [nvme] section" in str(e.value)
        assert node.devices == {}

    asyncio.run(go())
    # without an [nvme] section the same build serves iSCSI and NBD
    data = all_protocols(tmp_path)
    del data["nvme"]
    node = node_for(tmp_path, data, nbd_server=FakeExportServer)

    async def go2() -> None:
        await node.start()
        assert node.nvme_server is None and node.nbd_server.events == ["start"]
        await node.stop()

    asyncio.run(go2())


@pytest.mark.parametrize("poll_us", [0, 80])
def test_one_busy_poller_for_every_server(tmp_path: Path, poll_us: int, caplog: pytest.LogCaptureFixture) -> None:
    data = all_protocols(tmp_path)
    data["node"]["poll_us"] = poll_us
    node = node_for(tmp_path, data, nvme_server=FakeExportServer, nbd_server=FakeExportServer)

    async def go() -> None:
        with caplog.at_level(logging.INFO, "openvsan.node"):
            await node.start()
            poller = node.busy_poll
            assert node.server.busy_poll is node.nvme_server.busy_poll is node.nbd_server.busy_poll is poller
            if poll_us:
                assert poller is not None and poller.window_ns == poll_us * 1000
            else:
                assert poller is None
            await node.stop()

    asyncio.run(go())
    if poll_us:
        assert ("adaptive polling: 80 µs window after each command, up to 500 µs learned from the gaps between "
                "commands") in caplog.text
        assert ("adaptive polling: 0 windows of 80-500 µs opened (0 sized from the gaps between commands), 0 wasted "
                "(0 of them ended because another task wanted the core), 0.0 s spent polling") in caplog.text
    else:
        assert "adaptive polling: off (poll_us = 0)" in caplog.text


def test_a_volume_that_fails_to_close_does_not_keep_the_others_or_the_devices_open(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A volume whose close fails (a compressed volume whose write cache cannot be written back: its group is
    full) is logged, and every other volume, group, pool and device is still closed (flushed, marked clean):
    before, the first failure ended the node's shutdown there."""
    node = node_for(tmp_path, config(tmp_path))

    async def go() -> None:
        await node.start()
        closed: list[str] = []
        for name, vol in node.volumes.items():
            async def close(name: str = name) -> None:
                closed.append(name)
                if name == "disk0":
                    raise OSError("volume group g: no free cluster")
            vol.close = close  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR):
            await node.stop()
        assert closed == ["disk0", "disk1", "disk2"] and node.devices == {}
        assert "disk0" in caplog.text and "no free cluster" in caplog.text

    asyncio.run(go())
