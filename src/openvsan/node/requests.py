"""The bodies of the live node's control commands (node/live.py), typed as the desired-state specs are
(node/specs.py: strict scalars, unknown keys refused, the same field types and messages), so the control
socket and the REST API to come take one declaration of each request and give the same one-line errors.
What a request names (a volume, a target) is checked by the command against the node's state; what it makes
is checked again as part of the whole desired state (node/config.py)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from openvsan.node.specs import BlockSize, Bool, Hint, Int, Name, PortalT, Size, Str, one_of

REQUEST = ConfigDict(extra="forbid", arbitrary_types_allowed=True, defer_build=True)
BACKINGS = ("ram", "file", "null")
PROTOCOLS = ("iscsi", "nvme", "nbd")
VolumeName = Annotated[Str, Hint("name the volume")]


@dataclass(frozen=True, config=REQUEST)
class Plain:
    """A request with no arguments (volume.list, export.list, config.show)."""


@dataclass(frozen=True, config=REQUEST)
class VolumeCreate:
    """A new volume: on a device of its own (`backing`, `size`, `block_size`, `path` of a file), or on an
    existing `device` or `pool`."""

    name: Annotated[Name, Hint("name the volume")]
    size: Size | None = None
    backing: Annotated[Str, one_of(BACKINGS, "a backing")] = "ram"
    block_size: BlockSize = 512
    path: Str | None = None        # a file backing: its file (default: <data_dir>/volumes/<name>.img)
    device: Str | None = None
    pool: Str | None = None
    read_only: Bool = False
    dry_run: Bool = False
    thin: Bool = True              # with device or pool and size: carved from it (volume/thin), thin or thick
    snapshot: Bool = False         # with device or pool: serve that group's snapshot named `name`, read-only
    key_file: Str | None = None    # encrypted (volume/crypt.py): a LUKS2 container unlocked by this file's bytes
    compression: Str | None = None  # compressed (volume/compress.py): "lz4", "zstd" or "zstd:LEVEL"
    compression_chunk: Int | None = None   # its chunk in bytes (16, 32, 64 or 128 KiB; None: 64 KiB)
    compression_frame: Int | None = None   # its frames in bytes (0: none, 4 to 32 KiB; None: the default)
    compression_cache: Int | None = None   # its write cache in bytes (0: none; None: the default, 32 MiB)


@dataclass(frozen=True, config=REQUEST)
class VolumeResize:
    name: VolumeName
    size: Annotated[Size, Hint("give the new size, e.g. 512MiB")]
    dry_run: Bool = False


@dataclass(frozen=True, config=REQUEST)
class VolumeDelete:
    name: VolumeName
    force: Bool = False            # remove its exports with it
    dry_run: Bool = False


@dataclass(frozen=True, config=REQUEST)
class VolumeShow:
    name: VolumeName


@dataclass(frozen=True, config=REQUEST)
class VolumeUnlock:
    """The passphrase of a locked encrypted volume: typed (`passphrase`, sent to the node, never stored or
    logged), the bytes of `key_file` on the node, or neither: the key file or key command its config names."""

    name: VolumeName
    passphrase: Str | None = None
    key_file: Str | None = None


@dataclass(frozen=True, config=REQUEST)
class VolumeKey:
    """A passphrase of an encrypted volume's LUKS2 container: the bytes of `key_file` (on the node)."""

    name: VolumeName
    key_file: Annotated[Str, Hint("give the key file, e.g. /etc/openvsan/v1-new.key")]


Protocol = Annotated[Str, Hint("add protocol: iscsi, nvme or nbd"), one_of(PROTOCOLS, "a protocol")]


@dataclass(frozen=True, config=REQUEST)
class ExportAdd:
    """Export `volume` as a LUN of iSCSI target `name`, a namespace of NVMe subsystem `name` or NBD export
    `name` (a target or subsystem is made with its first export)."""

    protocol: Protocol
    name: Annotated[Str, Hint("name the target, subsystem or NBD export")]
    volume: VolumeName
    lun: Int | None = None         # default: the lowest free
    nsid: Int | None = None        # default: the lowest free
    portals: tuple[PortalT, ...] = ()   # a new target, subsystem or export: default those of the others
    read_only: Bool = False        # NBD
    dry_run: Bool = False


@dataclass(frozen=True, config=REQUEST)
class ExportRemove:
    protocol: Protocol
    name: Annotated[Str, Hint("name the target, subsystem or NBD export")]
    lun: Int | None = None         # only this LUN (default: the whole target)
    nsid: Int | None = None        # only this namespace (default: the whole subsystem)
    dry_run: Bool = False


@dataclass(frozen=True, config=REQUEST)
class QosSet:
    """Set (a value), or clear (0 or null) the QoS knobs named in `limits`; `clear`: start from none."""

    volume: VolumeName
    limits: Annotated[dict[str, Any], Hint("give the knobs, e.g. limits = { read_iops_limit = 1000 }")]
    clear: Bool = False
    dry_run: Bool = False


@dataclass(frozen=True, config=REQUEST)
class QosShow:
    volume: VolumeName


@dataclass(frozen=True, config=REQUEST)
class ConfigPut:
    """The whole desired state as a config document (the TOML file's tables, as JSON): applied as
    `vsan config apply` applies a file."""

    document: Annotated[dict[str, Any], Hint("give the config document, e.g. as GET /api/v1/config returns it")]
    dry_run: Bool = False


@dataclass(frozen=True, config=REQUEST)
class ConfigApply:
    path: Annotated[Str, Hint("name the config file")]
    dry_run: Bool = False
