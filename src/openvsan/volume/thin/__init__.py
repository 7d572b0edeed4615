"""Volumes carved from a device or pool: thick and thin, snapshots, clones (group.py; format in format.py)."""

from openvsan.volume.thin.device import LogicalVolume
from openvsan.volume.thin.group import GroupError, VolumeGroup

__all__ = ["GroupError", "LogicalVolume", "VolumeGroup"]
