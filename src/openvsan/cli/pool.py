"""`vsan pool`: storage pools (RAID 0/1/10/5/6, openvsan.pool).

Online commands talk to a running `vsan serve` through its control socket (`<data_dir>/control.sock`, see
node/control.py): list, status, scrub, fail, replace, add-spare. Offline commands work on member files with no
serve running: create (writes the superblocks), inspect (reads them), destroy (erases them).

Errors are one line on stderr: exit 2 for an impossible request or a bad argument (nothing is changed), 1 for
a node that is not running or a device that cannot be read or written.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.table import Table

EXIT_FAILED = 1
EXIT_USAGE = 2
T = TypeVar("T")

pool_app = typer.Typer(help="Storage pools: RAID 0/1/10/5/6 over devices. Online commands need a running "
                            "`vsan serve`; create, inspect and destroy work on member files.",
                       no_args_is_help=True)

DataDir = Annotated[Path | None, typer.Option(
    "--data-dir", help="The data dir of the running vsan serve (default: as vsan serve's, [node].data_dir "
                       "of --config, else $XDG_STATE_HOME/openvsan or ~/.local/state/openvsan).")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="Take the data dir from this config file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the node's answer as JSON.")]
NameArg = Annotated[str, typer.Argument(help="The pool's name, as in [[pools]] of the config.")]


def _fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    sys.stderr.write(f"vsan: {message}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def _console() -> Console:
    # a pipe or log file gets whole rows, not a table folded to 80 columns
    return Console(width=None if sys.stdout.isatty() else 200)


def _size(n: float | None) -> str:
    from openvsan.node.values import format_size

    return "-" if n is None else format_size(int(n))


def _data_dir(data_dir: Path | None, config: Path | None) -> Path:
    from openvsan.cli.main import read_config
    from openvsan.node.paths import effective_data_dir

    configured = read_config(config).node.data_dir if config is not None and data_dir is None else None
    return effective_data_dir(configured, data_dir)


def _call(data_dir: Path | None, config: Path | None, cmd: str, *, timeout: float | None = 30.0,
          **args: Any) -> Any:
    from openvsan.cli.remote import node_call
    from openvsan.node.control import ControlError

    try:
        return node_call(lambda: _data_dir(data_dir, config), cmd, timeout=timeout, **args)
    except ControlError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"control socket: {e.strerror or e}")


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


# --- online: through the control socket ------------------------------------------------------------------------


@pool_app.command("list")
def list_pools(data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """The pools the running node serves: level, state, size, members."""
    pools = _call(data_dir, config, "pool.list")
    if as_json:
        _print_json(pools)
        return
    if not pools:
        typer.echo("no pools")
        return
    t = Table("pool", "level", "state", "size", "members", "spares", "volume", "progress")
    for p in pools:
        progress = ""
        if p["rebuild_progress"] is not None:
            progress = f"rebuild {p['rebuild_progress']:.1f} %"
        elif p["resync_progress"] is not None:
            progress = f"resync {p['resync_progress']:.1f} %"
        t.add_row(p["name"], f"RAID {p['level']}", p["state"], _size(p["size"]), str(p["members"]),
                  str(p["spares"]), p["volume"] or "", progress)
    _console().print(t)


def print_status(st: dict[str, Any], out: Console) -> None:
    head = (f"[bold]{st['name']}[/]  RAID {st['level']}  [bold]{st['state']}[/]  {_size(st['size'])}  "
            f"chunk {_size(st['chunk_size'])}  event {st['event']}  uuid {st['uuid']}")
    lines = [head]
    if st["rebuild_progress"] is not None:
        speed = f" at {_size(st['rebuild_speed'])}/s" if st.get("rebuild_speed") else ""
        limit = st.get("rebuild_rate_limit")
        lines.append(f"rebuild {st['rebuild_progress']:.1f} %{speed}"
                     + (f" (limit {_size(limit)}/s)" if limit else " (no rate limit)"))
    if st["resync_progress"] is not None:
        lines.append(f"resync {st['resync_progress']:.1f} % (stripes of regions written when the pool stopped "
                     "uncleanly)")
    if st.get("error"):
        lines.append(f"[red]background work stopped: {st['error']}[/]")
    for line in lines:
        out.print(line, soft_wrap=True, highlight=False)
    t = Table("slot", "device", "state", "rebuilt")
    for m in st["members"]:
        done = f"{m['rebuild_progress']:.1f} %" if m["rebuild_progress"] is not None else ""
        t.add_row(str(m["index"]), m.get("device") or m["name"], m["state"], done)
    out.print(t)
    if st["spares"]:
        out.print("spares: " + ", ".join(st["spares"]), soft_wrap=True, highlight=False)
    if st.get("volume_group"):
        print_group(st["volume_group"], out)


def print_group(g: dict[str, Any], out: Console) -> None:
    """The volume group carved from a pool or device (volume/thin): space, then its volumes and snapshots."""
    used = g["used"] / g["capacity"] * 100 if g["capacity"] else 0.0
    out.print(f"volume group: {_size(g['used'])} of {_size(g['capacity'])} in use ({used:.1f} %), "
              f"{_size(g['free'])} free; {g['volumes']} volumes, {g['snapshots']} snapshots; provisioned "
              f"{_size(g['provisioned'])} (over-commit {g['overcommit']:.2f}x); cluster {_size(g['cluster_size'])}; "
              f"metadata {g['metadata_used'] * 100:.1f} % used; soft threshold {g.get('soft_threshold', '-')} %",
              soft_wrap=True, highlight=False)
    t = Table("name", "kind", "size", "provisioning", "mapped", "exclusive", "origin", "served")
    for v in g.get("listing", []):
        kind = "clone" if v["kind"] == "volume" and v["origin"] else v["kind"]
        t.add_row(v["name"], kind, _size(v["size"]), "thin" if v["thin"] else "thick", _size(v["mapped"]),
                  _size(v["exclusive"]), v["origin"] or "", "yes" if v.get("served") else "no")
    out.print(t)


@pool_app.command()
def status(name: NameArg, data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """State (optimal, degraded, rebuilding, failed), members, rebuild and resync progress of pool NAME."""
    st = _call(data_dir, config, "pool.status", name=name)
    if as_json:
        _print_json(st)
    else:
        print_status(st, _console())


@pool_app.command()
def scrub(name: NameArg,
          repair: Annotated[bool, typer.Option("--repair/--no-repair",
                                               help="Rewrite what does not agree (default), or only report.")] = True,
          data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Read every stripe of NAME, check parity or copies, repair; exit 1 if a stripe could not be repaired."""
    r = _call(data_dir, config, "pool.scrub", timeout=None, name=name, repair=repair)
    if as_json:
        _print_json(r)
    else:
        out = _console()
        out.print(f"{name}: {r['checked']} of {r['stripes']} stripes checked in {r['seconds']:.1f} s: "
                  f"{r['mismatches']} inconsistent, {r['repaired']} repaired, {r['unrepairable']} unrepairable, "
                  f"{r['skipped']} skipped", soft_wrap=True, highlight=False)
        for d in r["details"]:
            out.print(f"  stripe {d['row']}: {d['what']} (members {', '.join(map(str, d['members']))})",
                      soft_wrap=True, highlight=False)
    if r["unrepairable"] or (not repair and r["mismatches"]):
        raise typer.Exit(EXIT_FAILED)


@pool_app.command()
def fail(name: NameArg,
         member: Annotated[str, typer.Argument(help="The member's slot number or device name.")],
         data_dir: DataDir = None, config: ConfigOpt = None) -> None:
    """Mark a member failed (like mdadm --fail): it is no longer read or written until replaced."""
    st = _call(data_dir, config, "pool.fail", name=name, member=member)
    typer.echo(f"{name}: member {member} failed; the pool is {st['state']}")


@pool_app.command()
def replace(name: NameArg,
            index: Annotated[int, typer.Argument(help="The slot to fill (a failed or missing member).")],
            device: Annotated[str, typer.Argument(help="A config device in no use, or file:PATH:SIZE.")],
            force: Annotated[bool, typer.Option("--force", help="Overwrite a device that carries a superblock of "
                                                               "this or another pool.")] = False,
            data_dir: DataDir = None, config: ConfigOpt = None) -> None:
    """Put DEVICE in slot INDEX of NAME and rebuild it in the background (see `vsan pool status`)."""
    st = _call(data_dir, config, "pool.replace", name=name, index=index, device=device, force=force)
    typer.echo(f"{name}: {device} is member {index}; the pool is {st['state']}")


@pool_app.command("add-spare")
def add_spare(name: NameArg,
              device: Annotated[str, typer.Argument(help="A config device in no use, or file:PATH:SIZE.")],
              force: Annotated[bool, typer.Option("--force", help="Overwrite a device that carries a superblock "
                                                                 "of this or another pool.")] = False,
              data_dir: DataDir = None, config: ConfigOpt = None) -> None:
    """Add a hot spare to NAME: it takes over a failed member at once, or the next that fails."""
    st = _call(data_dir, config, "pool.add_spare", name=name, device=device, force=force)
    typer.echo(f"{name}: spare {device} added; the pool is {st['state']}")


# --- offline: on member files ----------------------------------------------------------------------------------

FilesArg = Annotated[list[Path], typer.Argument(help="Member files (or block devices).", show_default=False)]


def _offline(make: Callable[[], Awaitable[T]]) -> T:
    from openvsan.block.errors import BlockError
    from openvsan.pool import PoolError

    try:
        return asyncio.run(make())  # type: ignore[arg-type]
    except PoolError as e:
        _fail(str(e).replace("pass force=True", "pass --force").replace("force=True", "--force"), EXIT_USAGE)
    except OSError as e:
        _fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    except BlockError as e:
        _fail(str(e))


def _open_files(paths: list[Path], *, size: int | None = None, block_size: int = 512) -> list[Any]:
    from openvsan.block import FileDevice

    if len({p.resolve() for p in paths}) != len(paths):
        _fail("a file is named twice; name each member once", EXIT_USAGE)
    devs = []
    try:
        for p in paths:
            devs.append(FileDevice(p, size=size if not p.exists() else None, block_size=block_size, name=str(p)))
    except FileNotFoundError:
        _fail(f"{p}: no such file; create it first, or pass --size to create missing members", EXIT_USAGE)
    except (OSError, ValueError) as e:
        _fail(f"{p}: {getattr(e, 'strerror', None) or e}")
    return devs


async def _close_all(devs: list[Any]) -> None:
    for d in devs:
        await d.close()


@pool_app.command()
def create(files: FilesArg,
           level: Annotated[str, typer.Option("--level", "-l", help="raid0, raid1, raid10, raid5 or raid6.")],
           chunk: Annotated[str, typer.Option(help="Chunk size: a power of two from 4KiB to 16MiB.")] = "64KiB",
           name: Annotated[str, typer.Option("--name", "-n", help="The pool's name (the config's [[pools]] "
                                                                   "name).")] = "pool0",
           spare: Annotated[list[Path] | None, typer.Option("--spare", help="A hot spare file (repeatable).")]
           = None,
           size: Annotated[str | None, typer.Option(help="Create missing files of this size (sparse).")] = None,
           block_size: Annotated[int, typer.Option("--block-size", help="512 or 4096.")] = 512,
           force: Annotated[bool, typer.Option("--force", help="Overwrite files that carry a pool superblock.")]
           = False,
           ) -> None:
    """Make a pool of the member FILES (slot order as given): zero them and write their superblocks."""
    from openvsan.node.values import check_object_name, parse_size
    from openvsan.pool import Level

    try:
        lvl = Level.parse(level)
        chunk_b = parse_size(chunk)
        size_b = parse_size(size) if size is not None else None
        check_object_name(name)
    except ValueError as e:
        _fail(str(e), EXIT_USAGE)
    if block_size not in (512, 4096):
        _fail(f"--block-size {block_size}: use 512 or 4096", EXIT_USAGE)
    members = _open_files(list(files) + list(spare or ()), size=size_b, block_size=block_size)

    async def go() -> dict[str, Any]:
        from openvsan.pool import Pool

        try:
            pool = await Pool.create(members[:len(files)], lvl, chunk_b, name=name, force=force)
        except BaseException:
            await _close_all(members)
            raise
        try:
            # one by one after create: Pool.create(spares=...) fails on a zip of unequal lengths
            for d in members[len(files):]:
                await pool.add_spare(d, force=force)
        except BaseException:
            await pool.destroy()
            await _close_all(members[len(files):])
            raise
        st = pool.status().as_dict()
        await pool.close()
        return st

    st = _offline(go)
    typer.echo(f"created pool {name} ({st['uuid']}): RAID {st['level']} over {len(st['members'])} members"
               f"{f' and {len(spare or ())} spares' if spare else ''}, {_size(st['size'])}, chunk "
               f"{_size(st['chunk_size'])}")


@pool_app.command()
def inspect(files: FilesArg, as_json: JsonOpt = False) -> None:
    """Read the pool superblocks of FILES: pool, level, slot, state, event counter (what the disks say)."""
    from openvsan.pool.superblock import read_superblock

    devs = _open_files(list(files))

    async def go() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            for p, d in zip(files, devs, strict=True):
                sb = await read_superblock(d)
                if sb is None:
                    out.append({"file": str(p), "pool": None})
                    continue
                out.append({
                    "file": str(p), "pool": sb.name, "pool_uuid": str(sb.pool_uuid), "level": sb.level,
                    "chunk_size": sb.chunk_size, "block_size": sb.block_size, "members": sb.member_count,
                    "index": None if sb.is_spare else sb.member_index, "member_uuid": str(sb.member_uuid),
                    "state": sb.state.name.lower(), "event": sb.event, "clean": sb.clean,
                    "size": sb.data_size * sb.block_size,
                    "roles": [{"uuid": str(r.uuid), "state": r.state.name.lower()} for r in sb.roles],
                })
        finally:
            await _close_all(devs)
        return out

    rows = _offline(go)
    if as_json:
        _print_json(rows)
        return
    t = Table("file", "pool", "uuid", "level", "slot", "state", "event", "clean", "chunk")
    for r in rows:
        if r["pool"] is None:
            t.add_row(r["file"], "(no superblock)", "", "", "", "", "", "", "")
            continue
        t.add_row(r["file"], r["pool"], r["pool_uuid"], f"RAID {r['level']}",
                  "spare" if r["index"] is None else f"{r['index']} of {r['members']}", r["state"], str(r["event"]),
                  "yes" if r["clean"] else "no", _size(r["chunk_size"]))
    _console().print(t)


@pool_app.command()
def destroy(files: FilesArg,
            yes: Annotated[bool, typer.Option("--yes", help="Really erase the superblocks.")] = False) -> None:
    """Erase the pool superblocks of FILES (the data stays), so they can join another pool. Stop vsan serve first."""
    from openvsan.pool.superblock import erase_superblock, read_superblock

    devs = _open_files(list(files))

    async def go() -> list[tuple[Path, str | None]]:
        found: list[tuple[Path, str | None]] = []
        try:
            sbs = [await read_superblock(d) for d in devs]
            found = [(p, f"{sb.name} ({sb.pool_uuid})" if sb else None) for p, sb in zip(files, sbs, strict=True)]
            if yes:
                for d, sb in zip(devs, sbs, strict=True):
                    if sb is not None:
                        await erase_superblock(d)
        finally:
            await _close_all(devs)
        return found

    found = _offline(go)
    carrying = [(p, what) for p, what in found if what is not None]
    for p, what in found:
        if what is None:
            typer.echo(f"{p}: no pool superblock; nothing to erase")
    if not carrying:
        return
    if not yes:
        pools = sorted({what for _, what in carrying if what})
        _fail(f"this would erase the superblocks of {len(carrying)} file(s) of pool {', '.join(pools)}; "
              "add --yes to do it", EXIT_USAGE)
    for p, what in carrying:
        typer.echo(f"{p}: superblock of pool {what} erased")
