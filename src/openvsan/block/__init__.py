"""Block layer: the BlockDevice interface, capabilities, the Layer base, typed errors and the leaf devices."""

from openvsan.block.capabilities import Capabilities
from openvsan.block.device import BlockDevice, Buffer, check_range
from openvsan.block.errors import BlockError, Busy, DeviceFailed, MediumError, NoSpace, OutOfRange, ReadOnly
from openvsan.block.fault import FaultDevice, FaultRule
from openvsan.block.file import FileDevice
from openvsan.block.layer import Layer
from openvsan.block.null import NullDevice
from openvsan.block.ram import RamDevice

__all__ = [
    "BlockDevice",
    "BlockError",
    "Buffer",
    "Busy",
    "Capabilities",
    "DeviceFailed",
    "FaultDevice",
    "FaultRule",
    "FileDevice",
    "Layer",
    "MediumError",
    "NoSpace",
    "NullDevice",
    "OutOfRange",
    "RamDevice",
    "ReadOnly",
    "check_range",
]
