"""Layer: a pass-through over one device below it (SPDK's passthru vbdev). A layer subclass overrides only
what it changes; everything else, the fast path and the capabilities included, is the device below's.

A method the subclass does not override is bound straight to the device below at construction, so an empty
layer costs no call of its own on any path (tests/unit/test_layer.py checks it is byte-identical). The one
exception is the fast path of a method the subclass changes (PAIRED): it declines rather than go around it."""

from __future__ import annotations

from typing import Any, ClassVar

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import BlockDevice, Buffer, WriteDone

# the methods forwarded as they are unless a subclass overrides them
FORWARDED = ("read", "write", "flush", "unmap", "write_zeroes", "read_now", "write_now", "write_soon",
             "write_window", "lba_status")

# A fast-path method goes with its normal ones: a layer that changes read() (QoS, crypt, a cache) and says
# nothing of read_now() must not let read_now reach the device below around it. It declines, and the
# capability goes with it. A write window (the device's memory lent to receive a write into) goes around
# every write of the layer, so a layer that changes write() or write_now() takes it away too.
PAIRED: dict[str, tuple[tuple[str, ...], str]] = {
    "read_now": (("read",), "sync_read"),
    "write_now": (("write",), "sync_write"),
    "write_soon": (("write",), ""),          # no capability states it (block/device.py WriteSoon)
    "write_window": (("write", "write_now"), "write_window"),
}


def _decline_read(lba: int, blocks: int) -> None:
    return None


def _decline_write(lba: int, data: Buffer) -> bool:
    return False


def _decline_soon(lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
    return False


def _decline_window(lba: int, blocks: int) -> None:
    return None


_DECLINE: dict[str, Any] = {"read_now": _decline_read, "write_now": _decline_write, "write_soon": _decline_soon,
                            "write_window": _decline_window}


class Layer:
    type_name: ClassVar[str] = "layer"   # its type in a stack config (block/registry.py)

    def __init__(self, below: BlockDevice, *, name: str | None = None) -> None:
        self.below = below
        self.name = name or f"{self.type_name}:{getattr(below, 'name', '?')}"
        self._fast_off: dict[str, bool] = {}   # capabilities this layer takes away (PAIRED)
        cls = type(self)
        for method in FORWARDED:
            if getattr(cls, method) is not getattr(Layer, method):
                continue
            slow, capability = PAIRED.get(method, ((), ""))
            if any(getattr(cls, m) is not getattr(Layer, m) for m in slow):
                setattr(self, method, _DECLINE[method])
                if capability:
                    self._fast_off[capability] = False
            elif hasattr(below, method):
                setattr(self, method, getattr(below, method))

    # ---- what a layer states: by default, what the device below does

    @property
    def block_size(self) -> int:
        return self.below.block_size

    @property
    def num_blocks(self) -> int:
        return self.below.num_blocks

    @property
    def capabilities(self) -> Capabilities:
        caps = self.below.capabilities
        return caps.but(**self._fast_off) if self._fast_off else caps

    # ---- BlockDevice, forwarded (replaced by the device's own bound methods in __init__)

    async def read(self, lba: int, blocks: int) -> Buffer:
        return await self.below.read(lba, blocks)

    async def write(self, lba: int, data: Buffer, *, fua: bool = False) -> None:
        await self.below.write(lba, data, fua=fua)

    async def flush(self) -> None:
        await self.below.flush()

    async def unmap(self, lba: int, blocks: int) -> None:
        await self.below.unmap(lba, blocks)

    async def write_zeroes(self, lba: int, blocks: int) -> None:
        await self.below.write_zeroes(lba, blocks)

    def read_now(self, lba: int, blocks: int) -> Buffer | None:
        fn = getattr(self.below, "read_now", None)
        return fn(lba, blocks) if fn is not None else None

    def write_now(self, lba: int, data: Buffer) -> bool:
        fn = getattr(self.below, "write_now", None)
        return bool(fn(lba, data)) if fn is not None else False

    def write_soon(self, lba: int, data: Buffer, fua: bool, done: WriteDone) -> bool:
        fn = getattr(self.below, "write_soon", None)
        return bool(fn(lba, data, fua, done)) if fn is not None else False

    def write_window(self, lba: int, blocks: int) -> memoryview | None:
        fn = getattr(self.below, "write_window", None)
        return fn(lba, blocks) if fn is not None else None

    async def lba_status(self, lba: int, blocks: int) -> Any:
        return await self.below.lba_status(lba, blocks)  # type: ignore[attr-defined]

    async def resize(self, num_blocks: int) -> None:
        await self.below.resize(num_blocks)  # type: ignore[attr-defined]

    async def close(self) -> None:
        """A layer closes itself only; the device below belongs to whoever opened it (the node)."""
        return

    # ---- its place in the desired state (block/registry.py)

    def layer_config(self) -> dict[str, Any]:
        """This layer's own settings, without its type (a subclass adds its parameters)."""
        return {}

    def to_config(self) -> dict[str, Any]:
        return {"type": self.type_name, **self.layer_config()}


def stack_of(top: BlockDevice) -> list[BlockDevice]:
    """The devices of a stack from the top down to (and with) the device at its bottom."""
    out = [top]
    while isinstance(out[-1], Layer):
        out.append(out[-1].below)
    return out


def read_only_stack(top: BlockDevice) -> bool:
    """Whether anything in the stack takes no writes (a thin volume's snapshot: its `read_only`)."""
    return any(getattr(d, "read_only", False) for d in stack_of(top))
