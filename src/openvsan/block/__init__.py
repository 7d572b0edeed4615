"""Block layer: the BlockDevice interface, typed errors and the leaf devices."""

from openvsan.block.device import BlockDevice, Buffer, check_range
from openvsan.block.errors import BlockError, Busy, DeviceFailed, MediumError, NoSpace, OutOfRange, ReadOnly

__all__ = [
    "BlockDevice", "Buffer", "check_range",
    "BlockError", "Busy", "DeviceFailed", "MediumError", "NoSpace", "OutOfRange", "ReadOnly",
]
