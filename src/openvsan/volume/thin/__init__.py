"""Volumes carved from a device or pool: thick and thin, snapshots, clones (group.py: the operations; state.py:
the mappings in memory; store.py: committing them; io.py: reads and writes; format.py: the on-disk format)."""

from openvsan.volume.thin.device import LogicalVolume
from openvsan.volume.thin.group import GroupError, VolumeGroup

__all__ = ["GroupError", "LogicalVolume", "VolumeGroup"]
