"""`vsan snapshot`: snapshots and clones of volumes carved from a device or pool (volume/thin), on a running
`vsan serve` (its control socket). A snapshot is a read-only point-in-time copy taken without pausing I/O for
more than the writes in flight; a clone is a writable volume made from a snapshot. Errors are one line on
stderr, exit 1 (nothing is changed)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.table import Table

from openvsan.cli.pool import ConfigOpt, DataDir, JsonOpt, _call, _console, _print_json, _size

snapshot_app = typer.Typer(help="Snapshots and clones of volumes carved from a device or pool (volumes with a size).",
                           no_args_is_help=True)

VolumeArg = Annotated[str, typer.Argument(help="The volume (carved from a device or pool).")]
SnapArg = Annotated[str, typer.Argument(help="The snapshot's name (unique in the volume's device or pool).")]


def _show(info: dict[str, Any], as_json: bool, done: str) -> None:
    if as_json:
        _print_json(info)
    else:
        typer.echo(done)


@snapshot_app.command("create")
def create(volume: VolumeArg, name: SnapArg, data_dir: DataDir = None, config: ConfigOpt = None,
           as_json: JsonOpt = False) -> None:
    """Take snapshot NAME of VOLUME now (writes under way finish first; new ones wait for a moment)."""
    t0 = time.monotonic()
    info = _call(data_dir, config, "snapshot.create", volume=volume, name=name)
    _show(info, as_json, f"{volume}: snapshot {name} taken in {(time.monotonic() - t0) * 1000:.0f} ms "
                         f"({_size(info['mapped'])} mapped, shared with the volume)")


@snapshot_app.command("list")
def list_snapshots(volume: VolumeArg, every: Annotated[bool, typer.Option(
        "--all", help="Every snapshot of the volume's device or pool, not only this volume's.")] = False,
        data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """The snapshots of VOLUME (and of its snapshots' snapshots), oldest first."""
    snaps = sorted(_call(data_dir, config, "snapshot.list", volume=volume, all=every), key=lambda s: s["created"])
    if as_json:
        _print_json(snaps)
        return
    if not snaps:
        typer.echo(f"{volume}: no snapshots")
        return
    t = Table("snapshot", "of", "taken", "size", "mapped", "exclusive")
    for s in snaps:
        taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["created"]))
        t.add_row(s["name"], s["origin"] or "", taken, _size(s["size"]), _size(s["mapped"]), _size(s["exclusive"]))
    _console().print(t)


@snapshot_app.command("delete")
def delete(volume: VolumeArg, name: SnapArg, data_dir: DataDir = None, config: ConfigOpt = None,
           as_json: JsonOpt = False) -> None:
    """Delete snapshot NAME (or a clone NAME that no volume serves); the space only it held returns to the
    device or pool."""
    _show(_call(data_dir, config, "snapshot.delete", volume=volume, name=name), as_json,
          f"{volume}: snapshot {name} deleted")


@snapshot_app.command("rollback")
def rollback(volume: VolumeArg, name: SnapArg, data_dir: DataDir = None, config: ConfigOpt = None,
             as_json: JsonOpt = False) -> None:
    """VOLUME becomes what snapshot NAME holds (I/O waits while it switches; the snapshot stays)."""
    info = _call(data_dir, config, "snapshot.rollback", volume=volume, name=name)
    _show(info, as_json, f"{volume}: rolled back to {name} ({_size(info['size'])})")


@snapshot_app.command("clone")
def clone(volume: VolumeArg, name: SnapArg,
          new: Annotated[str, typer.Argument(help="The clone's name: a new thin volume in the same device or pool.")],
          data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """A writable thin volume NEW from snapshot NAME of VOLUME, sharing its clusters until written. Serve it by
    adding it to the config: a volume named NEW on the same device or pool, with a size."""
    info = _call(data_dir, config, "snapshot.clone", volume=volume, name=name, clone=new)
    _show(info, as_json, f"{volume}: clone {new} of {name} made ({_size(info['size'])})")


@snapshot_app.command("decouple")
def decouple(volume: VolumeArg, allocate: Annotated[bool, typer.Option(
        "--allocate", help="Also allocate (zeroed) every cluster it does not have yet (inflate): no later write "
                           "to it can run out of space.")] = False,
        data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """VOLUME (a clone, or a volume with snapshots) gets its own copy of every cluster it shares, while it
    serves; its snapshots and their space stay as they are."""
    info = _call(data_dir, config, "snapshot.decouple", timeout=3600.0, volume=volume, allocate=allocate)
    _show(info, as_json, f"{volume}: {info['copied']} clusters copied, {info['allocated']} allocated; "
                         f"{_size(info['exclusive'])} of its own now")
