"""Typed block-layer errors, raised by the layer that knows and mapped to SCSI sense / NVMe status once
per protocol (see protocol/scsi/sense.py)."""


class BlockError(Exception):
    """Base of every block-layer error."""


class OutOfRange(BlockError):
    """The LBA range runs past the end of the device."""


class MediumError(BlockError):
    """An unrecovered read or write error on some LBA."""

    def __init__(self, message: str = "medium error", lba: int | None = None, *, write: bool = False) -> None:
        super().__init__(message)
        self.lba = lba
        self.write = write


class DeviceFailed(BlockError):
    """The device is gone or has failed as a whole."""


class NoSpace(BlockError):
    """A thin device could not allocate space for a write."""


class ReadOnly(BlockError):
    """The device does not accept writes."""


class Locked(BlockError):
    """An encrypted volume that is locked (its key not in memory): nothing is served until it is unlocked."""


class Busy(BlockError):
    """The device cannot take the request now; the initiator may retry."""
