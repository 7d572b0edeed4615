"""Device and layer types by name, so a volume's stack is data (SPDK save_config): a device config opens the
device at the bottom, a list of layer configs builds the stack over it, and to_config() gives them back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from openvsan.block.device import BlockDevice
from openvsan.block.layer import Layer, stack_of

DeviceFactory = Callable[[dict[str, Any]], BlockDevice]
LayerFactory = Callable[[dict[str, Any], BlockDevice], Layer]

LayerOpener = Callable[..., Awaitable[Layer]]

DEVICE_TYPES: dict[str, DeviceFactory] = {}
LAYER_TYPES: dict[str, LayerFactory] = {}
# layers that need I/O or a secret to open (crypt: its header read and unlocked): opened by open_stack
LAYER_OPENERS: dict[str, LayerOpener] = {}

L = TypeVar("L", bound=type[Layer])

# modules whose layers ship with openvsan (each decorates its classes with register_layer)
BUILTIN_LAYERS: list[str] = ["openvsan.volume.qos", "openvsan.volume.crypt", "openvsan.volume.compress"]


class StackLocked(Exception):
    """An opener that cannot open its layer now (an encrypted volume whose passphrase is to be given at unlock):
    `locked(below, layers)` makes the layer that stands for it and every layer above it until then."""

    def __init__(self, locked: Callable[[BlockDevice, list[dict[str, Any]]], Awaitable[Layer]]) -> None:
        super().__init__("locked")
        self.locked = locked


class UnknownType(ValueError):
    """A config names a device or layer type nobody registered; str() says which and what there is."""


def register_device(type_name: str, factory: DeviceFactory) -> None:
    DEVICE_TYPES[type_name] = factory


def register_layer(cls: L) -> L:
    """Class decorator: a Layer subclass with `type_name` and `from_config(cfg, below)`."""
    LAYER_TYPES[cls.type_name] = cls.from_config  # type: ignore[attr-defined]
    return cls


_loaded = False


def _builtin() -> None:
    # the leaf devices, and the layers that ship with openvsan, registered on first use (imports stay light);
    # once, by a flag: a type registered before the first use must not stand in for the built-in ones
    global _loaded
    if _loaded:
        return
    from openvsan.block.file import FileDevice
    from openvsan.block.null import NullDevice
    from openvsan.block.ram import RamDevice

    DEVICE_TYPES.setdefault("ram", RamDevice.from_config)
    DEVICE_TYPES.setdefault("file", FileDevice.from_config)
    DEVICE_TYPES.setdefault("null", NullDevice.from_config)
    import importlib
    for module in BUILTIN_LAYERS:
        importlib.import_module(module)  # each registers its layer types
    _loaded = True


def device_from_config(cfg: dict[str, Any]) -> BlockDevice:
    _builtin()
    factory = DEVICE_TYPES.get(str(cfg.get("type")))
    if factory is None:
        raise UnknownType(f"unknown device type {cfg.get('type')!r}; known: {', '.join(sorted(DEVICE_TYPES))}")
    return factory(cfg)


def build_stack(base: BlockDevice, layers: Sequence[dict[str, Any]]) -> BlockDevice:
    """The stack that `layers` (bottom first) describe, over `base`."""
    _builtin()
    top = base
    for cfg in layers:
        factory = LAYER_TYPES.get(str(cfg.get("type")))
        if factory is None:
            raise UnknownType(f"unknown layer type {cfg.get('type')!r}; known: {', '.join(sorted(LAYER_TYPES))}")
        top = factory(cfg, top)
    return top


def register_opener(type_name: str, opener: LayerOpener) -> None:
    """`await opener(cfg, below, name=volume)` opens layers of `type_name` (open_stack)."""
    LAYER_OPENERS[type_name] = opener


async def open_stack(base: BlockDevice, layers: Sequence[dict[str, Any]], *, name: str = "",
                     reuse: Sequence[BlockDevice] = (), passphrase: bytes | None = None) -> BlockDevice:
    """build_stack for a volume being opened: a layer with an opener (I/O, a key) is opened by it, or, when
    `reuse` holds one of the same config (a stack rebuilt over an unlocked layer), that one is kept. An opener
    that cannot open yet (StackLocked: a passphrase to be given at unlock) leaves the stack locked from there
    on; `passphrase` is the one given (volume.unlock)."""
    _builtin()
    top = base
    for i, cfg in enumerate(layers):
        kind = str(cfg.get("type"))
        kept = next((d for d in reuse if isinstance(d, Layer) and d.to_config() == dict(cfg)), None)
        if kind in LAYER_OPENERS:
            if kept is not None:
                top = kept
                continue
            try:
                top = await LAYER_OPENERS[kind](cfg, top, name=name, passphrase=passphrase)
            except StackLocked as e:
                return await e.locked(top, [dict(c) for c in layers[i:]])
            continue
        factory = LAYER_TYPES.get(kind)
        if factory is None:
            raise UnknownType(f"unknown layer type {cfg.get('type')!r}; known: {', '.join(sorted(LAYER_TYPES))}")
        top = factory(cfg, top)
    return top


def stack_config(top: BlockDevice) -> list[dict[str, Any]]:
    """The layer configs of a stack, bottom first (the device at the bottom is not among them)."""
    return [d.to_config() for d in reversed(stack_of(top)[:-1])]
