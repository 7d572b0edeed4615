"""The node daemon: desired state (from the store) -> devices -> volumes -> LUNs -> iSCSI targets -> server.

Assembly is a chain of small factories so each step can be replaced (later layers: pools, thin volumes,
caches) and so tests can assemble a node around stand-ins of the SCSI and iSCSI layers.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from openvsan.block import BlockDevice, FileDevice, NullDevice, RamDevice
from openvsan.node.config import DeviceSpec, TargetSpec, VolumeSpec
from openvsan.node.store import StoredState, VolumeIdentity
from openvsan.node.values import format_size

log = logging.getLogger("openvsan.node")


class NodeError(RuntimeError):
    """The node cannot be assembled or served; str() is one line for the user."""


def open_device(spec: DeviceSpec) -> BlockDevice:
    if spec.type == "ram":
        assert spec.size is not None
        return RamDevice(spec.size // spec.block_size, spec.block_size,
                         backing=str(spec.backing) if spec.backing else None, name=spec.name)
    if spec.type == "file":
        assert spec.path is not None
        return FileDevice(spec.path, size=spec.size, block_size=spec.block_size, direct=spec.direct, name=spec.name)
    if spec.type == "null":
        assert spec.size is not None
        return NullDevice(spec.size // spec.block_size, spec.block_size, name=spec.name)
    raise NodeError(f"device {spec.name}: unknown type {spec.type!r}")


def open_volume(spec: VolumeSpec, device: BlockDevice) -> BlockDevice:
    # The seam for the volume stack (thin, cache, crypt, QoS...): today a volume is its device.
    return device


@dataclass
class Factories:
    """How the node builds the protocol objects; defaults are the real SCSI and iSCSI layers."""

    lun: Callable[..., Any]
    scsi_target: Callable[[str, dict[int, Any]], Any]
    target_config: Callable[..., Any]
    chap: Callable[[str, str], Any]
    server: Callable[[list[Any]], Any]

    @classmethod
    def default(cls) -> Factories:
        # imported here: the node module stays importable (and testable) on its own
        try:
            from openvsan.protocol.scsi import Lun, ScsiTarget
            from openvsan.target.config import ChapCredential, IscsiTargetConfig
            from openvsan.target.iscsi import IscsiServer
        except ImportError as e:
            raise NodeError(f"this build cannot serve iSCSI: {e}") from e
        return cls(Lun, ScsiTarget, IscsiTargetConfig, ChapCredential, IscsiServer)


@dataclass
class Node:
    state: StoredState
    data_dir: Path
    factories: Factories | None = None
    devices: dict[str, BlockDevice] = field(default_factory=dict)
    volumes: dict[str, BlockDevice] = field(default_factory=dict)
    luns: dict[str, Any] = field(default_factory=dict)       # volume name -> Lun (shared by its targets)
    targets: list[Any] = field(default_factory=list)         # IscsiTargetConfig
    server: Any = None

    async def start(self) -> None:
        cfg = self.state.config
        f = self.factories or Factories.default()
        try:
            for spec in cfg.devices:
                try:
                    self.devices[spec.name] = open_device(spec)
                except (OSError, ValueError) as e:
                    raise NodeError(f"device {spec.name}: {_why(e)}") from e
            for vspec in cfg.volumes:
                self.volumes[vspec.name] = open_volume(vspec, self.devices[vspec.device])
            pr_dir = self.data_dir / "pr"
            pr_dir.mkdir(mode=0o700, exist_ok=True)
            for t in cfg.targets:
                self.targets.append(self._build_target(t, f, pr_dir))
            self.server = f.server(self.targets)
            await self.server.start()
        except BaseException:
            await self.close_devices()
            raise
        for t in cfg.targets:
            where = ", ".join(str(p) for p in t.portals)
            for lun in t.luns:
                dev = self.volumes[lun.volume]
                log.info("serving %s LUN %d (%s, %s%s) on %s", t.iqn, lun.lun, lun.volume,
                         format_size(dev.num_blocks * dev.block_size),
                         ", read-only" if cfg.volume(lun.volume).read_only else "", where)
            auth = ("mutual CHAP" if t.mutual_chap else "CHAP") if t.chap else "no authentication"
            acl = ("any initiator" if t.allowed_initiators is None
                   else f"{len(t.allowed_initiators)} allowed initiator(s)")
            log.info("%s: %s, %s", t.iqn, auth, acl)
        if not cfg.targets:
            log.warning("no iSCSI targets are configured; nothing is exported")

    def _build_target(self, t: TargetSpec, f: Factories, pr_dir: Path) -> Any:
        luns = {}
        for x in t.luns:
            if x.volume not in self.luns:
                vspec = self.state.config.volume(x.volume)
                ident: VolumeIdentity = self.state.identities[x.volume]
                self.luns[x.volume] = f.lun(self.volumes[x.volume], name=x.volume, uuid=ident.uuid,
                                            serial=ident.serial, read_only=vspec.read_only,
                                            pr_state_path=pr_dir / f"{x.volume}.json")
            luns[x.lun] = self.luns[x.volume]
        return f.target_config(
            iqn=t.iqn, scsi=f.scsi_target(t.iqn, luns),
            portals=[(p.host, p.port) for p in t.portals],
            advertised_portals=[(p.host, p.port) for p in t.advertised_portals],
            allowed_initiators=list(t.allowed_initiators) if t.allowed_initiators is not None else None,
            chap=f.chap(t.chap.user, t.chap.secret) if t.chap else None,
            mutual_chap=f.chap(t.mutual_chap.user, t.mutual_chap.secret) if t.mutual_chap else None,
            alias=t.alias, portal_group_tag=t.portal_group_tag)

    async def stop(self) -> None:
        """Stop accepting, drain in-flight commands, make everything acknowledged durable, close."""
        if self.server is not None:
            log.info("stopping: draining in-flight commands")
            await self.server.stop()
            self.server = None
        for t in self.targets:
            try:
                await t.scsi.flush_all()
            except Exception as e:  # noqa: BLE001 - keep flushing the rest
                log.error("%s: flush failed: %s", t.iqn, e)
        self.targets.clear()
        await self.close_devices()
        log.info("stopped")

    async def close_devices(self) -> None:
        for name, dev in reversed(list(self.devices.items())):
            try:
                await dev.flush()
                await dev.close()
            except Exception as e:  # noqa: BLE001 - one bad device must not keep the others unflushed
                log.error("device %s: flush/close failed: %s", name, e)
        self.devices.clear()
        self.volumes.clear()
        self.luns.clear()


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


class DataDirLock:
    """One `vsan serve` per data dir: a second one would fight over state.db and the devices."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "serve.lock"
        self._fd: int | None = None

    def __enter__(self) -> Self:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NodeError(f"another vsan serve is using {self.path.parent}; stop it or pass another "
                            "--data-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


async def serve(node: Node, *, stop: asyncio.Event | None = None) -> None:
    """Start the node and serve until SIGTERM/SIGINT (or `stop` is set), then shut down cleanly."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    draining: asyncio.Task[None] | None = None

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            log.info("%s: shutting down", sig.name)
            stop.set()
        elif draining is not None and not draining.done():
            # a second signal: stop waiting for the drain; devices are still flushed and closed
            log.warning("%s again: not waiting for in-flight commands", sig.name)
            draining.cancel()

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
    try:
        # a signal during start is kept in `stop` and acted on as soon as the node is up
        await node.start()
        await stop.wait()
        draining = asyncio.ensure_future(node.stop())
        try:
            await asyncio.shield(draining)
        except asyncio.CancelledError:
            if not draining.cancelled():
                raise
            node.server = None
            await node.close_devices()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def run(node: Node) -> None:
    """Run `serve(node)` on uvloop when it is importable (OPENVSAN_LOOP=asyncio to opt out)."""
    if os.environ.get("OPENVSAN_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(serve(node))
            return
    asyncio.run(serve(node))
