"""Node assembly and shutdown, around stand-ins of the SCSI and iSCSI layers."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from node_fakes import (
    FakeExportServer,
    FakeServer,
    all_protocols,
    config,
    node_for,
)

from openvsan.node.logs import HumanFormatter
from openvsan.node.node import DataDirLock, NodeError


def test_port_in_use_closes_devices(tmp_path: Path) -> None:
    err = OSError(98, "cannot listen on 127.0.0.1:3260: address already in use")
    node = node_for(tmp_path, config(tmp_path), server=lambda t: FakeServer(t, fail=err))

    async def go() -> None:
        with pytest.raises(OSError, match="127.0.0.1:3260"):
            await node.start()
        assert node.devices == {}

    asyncio.run(go())


def test_device_that_cannot_open(tmp_path: Path) -> None:
    data = config(tmp_path)
    data["devices"][1]["path"] = str(tmp_path / "no-such-dir" / "f0.img")
    node = node_for(tmp_path, data)

    async def go() -> None:
        with pytest.raises(NodeError, match=r"^device f0: .*no-such-dir/f0.img: No such file or directory$"):
            await node.start()
        assert node.devices == {}

    asyncio.run(go())


def test_data_dir_lock(tmp_path: Path) -> None:
    with DataDirLock(tmp_path), pytest.raises(NodeError, match="another vsan serve is using"), DataDirLock(tmp_path):
        pass
    with DataDirLock(tmp_path):
        pass


def test_log_format() -> None:
    rec = logging.LogRecord("openvsan.node", logging.INFO, __file__, 1, "serving %s", ("x",), None)
    line = HumanFormatter().format(rec)
    date, time, rest = line.split(" ", 2)
    assert len(date) == 10 and len(time) == 8
    assert rest == "INFO  node: serving x"


# --- NVMe/TCP and NBD ---------------------------------------------------------------------------------
def test_serial_is_stable(tmp_path: Path) -> None:
    from openvsan.node.node import subsystem_serial
    assert subsystem_serial("nqn.2026-11.org.x:a") == subsystem_serial("nqn.2026-11.org.x:a") != \
        subsystem_serial("nqn.2026-11.org.x:b")


def test_nbd_port_in_use_stops_the_servers_already_started(tmp_path: Path) -> None:
    err = OSError(98, "cannot listen on 127.0.0.1:10809: address already in use")
    node = node_for(tmp_path, all_protocols(tmp_path), nvme_server=FakeExportServer,
                    nbd_server=lambda e: FakeServer(e, fail=err))

    async def go() -> None:
        with pytest.raises(OSError, match="127.0.0.1:10809"):
            await node.start()
        assert node.devices == {} and node.server is None and node.nvme_server is None
        iscsi, nvme = FakeServer.instances[-3:-1]
        assert iscsi.events == ["start", "stop"] and nvme.events == ["start", "stop"]

    asyncio.run(go())
