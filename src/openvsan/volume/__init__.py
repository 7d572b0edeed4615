"""Volumes: the handle frontends hold (volume.py) and the layers of a volume's stack (qos.py, later thin
volumes, snapshots, the cache tier, crypt and compress)."""

from openvsan.volume.volume import Volume, VolumeListener

__all__ = ["Volume", "VolumeListener"]
