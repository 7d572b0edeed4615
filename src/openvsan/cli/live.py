"""`vsan volume|export|qos` and `vsan config apply`: change a running node (node/live.py, over its control
socket; the REST API later), the way targetcli or SPDK's RPC change theirs, with no restart.

Each command changes the node's desired state and has it applied at once; what it changed is printed (or,
with --dry-run, what it would change). Errors are one line on stderr: exit 2 when the node refused the
request (nothing was changed), 1 when no node answers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table

from openvsan.cli.pool import (
    EXIT_FAILED,
    EXIT_USAGE,
    ConfigOpt,
    DataDir,
    JsonOpt,
    _console,
    _data_dir,
    _fail,
    _print_json,
)

volume_app = typer.Typer(help="Volumes of a running node: create, list, show, resize, delete.", no_args_is_help=True)
export_app = typer.Typer(help="Exports of a running node: iSCSI LUNs, NVMe namespaces, NBD exports.",
                         no_args_is_help=True)
qos_app = typer.Typer(help="Per-volume QoS limits (IOPS and bytes/s, read, write and total, with bursts).",
                      no_args_is_help=True)

DryRun = Annotated[bool, typer.Option("--dry-run", help="Print what would change, change nothing.")]
VolumeArg = Annotated[str, typer.Argument(help="The volume's name.")]


def _call(data_dir: Path | None, config: Path | None, cmd: str, **args: Any) -> Any:
    from openvsan.cli.remote import node_call
    from openvsan.node.control import ControlError, NotRunning

    try:
        return node_call(lambda: _data_dir(data_dir, config), cmd, timeout=120.0, **args)
    except NotRunning as e:
        _fail(str(e), EXIT_FAILED)
    except ControlError as e:
        _fail(str(e), EXIT_USAGE)
    except OSError as e:
        _fail(f"control socket: {e.strerror or e}")


def _changes(result: dict[str, Any], as_json: bool, dry_run: bool) -> None:
    if as_json:
        _print_json(result)
        return
    changes = result.get("changes") or []
    if not changes:
        typer.echo("nothing to change")
    for line in changes:
        typer.echo(line)
    if dry_run and changes:
        typer.echo("(dry run: nothing was changed)")


def _size(text: str, what: str = "--size") -> int:
    from openvsan.node.values import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        _bad(f"{what}: {e}")


def _bad(message: str) -> NoReturn:
    _fail(message, EXIT_USAGE)


# ---- volumes

@volume_app.command("create")
def volume_create(
    name: VolumeArg,
    size: Annotated[str | None, typer.Option("--size", help="e.g. 256MiB, 10GiB (a volume with a device of its own).")] = None,
    backing: Annotated[str, typer.Option("--backing", help="Its own device: ram, file (under the data dir, or "
                                                           "--path) or null.")] = "ram",
    path: Annotated[Path | None, typer.Option("--path", help="The file of a --backing file volume.")] = None,
    block_size: Annotated[int, typer.Option("--block-size", help="512 or 4096.")] = 512,
    device: Annotated[str | None, typer.Option("--device", help="Put it on this existing device instead.")] = None,
    pool: Annotated[str | None, typer.Option("--pool", help="Put it on this pool instead.")] = None,
    read_only: Annotated[bool, typer.Option("--read-only", help="Initiators may read, not write.")] = False,
    thin: Annotated[bool, typer.Option("--thin/--thick", help="With --device/--pool and --size: carved from it, "
                                       "space allocated on first write (thin) or all at once (thick).")] = True,
    snapshot: Annotated[bool, typer.Option("--snapshot", help="With --device/--pool: serve the snapshot NAME of "
                                           "its volume group, read-only.")] = False,
    key_file: Annotated[Path | None, typer.Option("--key-file", help="Encrypt it (LUKS2, aes-xts-plain64): this "
                                                  "file's bytes unlock it; `cryptsetup open` takes the same file.")]
    = None,
    compression: Annotated[str | None, typer.Option("--compression", help="With --device/--pool and --size: "
                                                    "compress it (lz4, zstd or zstd:LEVEL) in 64 KiB chunks; the "
                                                    "device's or pool's clusters should be 4 KiB.")] = None,
    compression_chunk: Annotated[str | None, typer.Option("--compression-chunk", help="With --compression: the "
                                                          "chunk, 16KiB, 32KiB, 64KiB (default) or 128KiB; smaller "
                                                          "is cheaper for small random I/O, larger compresses "
                                                          "better.")] = None,
    compression_frame: Annotated[str | None, typer.Option("--compression-frame", help="With --compression: each "
                                                          "frame of this size in a chunk is compressed on its own, "
                                                          "0 (none, the default), 4KiB to 32KiB; a small read or "
                                                          "write then decodes or encodes only its frames.")] = None,
    compression_cache: Annotated[str | None, typer.Option("--compression-cache", help="With --compression: the most "
                                                          "small writes kept in memory until a flush or the cleaner "
                                                          "compresses them, 0 (none) or a size (default 32MiB).")]
    = None,
    dry_run: DryRun = False, as_json: JsonOpt = False, data_dir: DataDir = None, config: ConfigOpt = None,
) -> None:
    """Create a volume on a running node; it can be exported at once (`vsan export add`). With --device or --pool
    and --size, it is carved from that device or pool along with other volumes (thin unless --thick)."""
    if device is None and pool is None and size is None:
        _bad("--size: missing; give the volume's size (e.g. --size 256MiB), or --device/--pool to put it there")
    args: dict[str, Any] = {"name": name, "backing": backing, "block_size": block_size, "read_only": read_only,
                            "device": device, "pool": pool, "dry_run": dry_run, "thin": thin, "snapshot": snapshot,
                            "path": str(path.absolute()) if path else None}
    if size is not None:
        args["size"] = _size(size)
    if key_file is not None:
        args["key_file"] = str(key_file.absolute())
    if compression is not None:
        args["compression"] = compression
    if compression_chunk is not None:
        args["compression_chunk"] = _size(compression_chunk)
    if compression_frame is not None:
        args["compression_frame"] = 0 if compression_frame.strip() == "0" else _size(compression_frame)
    if compression_cache is not None:
        args["compression_cache"] = 0 if compression_cache.strip() == "0" else _size(compression_cache)
    _changes(_call(data_dir, config, "volume.create", **args), as_json, dry_run)


KeyFileOpt = Annotated[Path, typer.Option("--key-file", help="A file on the node whose bytes are the passphrase.")]


@volume_app.command("lock")
def volume_lock(name: VolumeArg, as_json: JsonOpt = False, data_dir: DataDir = None, config: ConfigOpt = None) -> None:
    """Lock an encrypted volume: writes under way finish and are flushed, its key leaves the node's memory, and
    it answers every command "not ready" (initiators stay connected) until `vsan volume unlock`."""
    r = _call(data_dir, config, "volume.lock", name=name)
    _show_done(r, as_json)


@volume_app.command("unlock")
def volume_unlock(
    name: VolumeArg,
    key_file: Annotated[Path | None, typer.Option("--key-file", help="A file on the node whose bytes are the "
                                                  "passphrase.")] = None,
    passphrase_stdin: Annotated[bool, typer.Option("--passphrase-stdin", help="Read the passphrase from standard "
                                                   "input (its first line, as cryptsetup does).")] = False,
    configured: Annotated[bool, typer.Option("--configured", help="Use the key file or key command the volume's "
                                             "config names (what a start uses).")] = False,
    as_json: JsonOpt = False, data_dir: DataDir = None, config: ConfigOpt = None,
) -> None:
    """Unlock a locked encrypted volume. Without an option the passphrase is asked for at the terminal (not
    echoed); it goes to the node over its API or control socket and is never stored."""
    args: dict[str, Any] = {"name": name}
    if key_file is not None:
        args["key_file"] = str(key_file.absolute())
    elif passphrase_stdin:
        args["passphrase"] = sys.stdin.readline().removesuffix("\n")
    elif not configured:
        if not sys.stdin.isatty():
            _bad("no terminal to ask the passphrase at: give --key-file, --passphrase-stdin or --configured")
        import getpass

        args["passphrase"] = getpass.getpass(f"Passphrase for volume {name}: ")
    r = _call(data_dir, config, "volume.unlock", **args)
    _show_done(r, as_json)


def _show_done(r: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _print_json(r)
    else:
        typer.echo(r["message"])


@volume_app.command("add-key")
def volume_add_key(name: VolumeArg, key_file: KeyFileOpt, as_json: JsonOpt = False, data_dir: DataDir = None,
                   config: ConfigOpt = None) -> None:
    """Let another key file open an encrypted volume (a new LUKS2 keyslot; the data is not re-encrypted)."""
    r = _call(data_dir, config, "volume.add_key", name=name, key_file=str(key_file.absolute()))
    _print_json(r) if as_json else typer.echo(r["message"])


@volume_app.command("remove-key")
def volume_remove_key(name: VolumeArg, key_file: KeyFileOpt, as_json: JsonOpt = False, data_dir: DataDir = None,
                      config: ConfigOpt = None) -> None:
    """Stop a key file from opening an encrypted volume (its keyslot is wiped). To rotate: add-key the new file,
    point encryption.key_file at it (vsan config apply), remove-key the old one."""
    r = _call(data_dir, config, "volume.remove_key", name=name, key_file=str(key_file.absolute()))
    _print_json(r) if as_json else typer.echo(r["message"])


@volume_app.command("resize")
def volume_resize(name: VolumeArg, size: Annotated[str, typer.Option("--size", help="The new size (it grows).")],
                  dry_run: DryRun = False, as_json: JsonOpt = False, data_dir: DataDir = None,
                  config: ConfigOpt = None) -> None:
    """Grow a volume while it is served: initiators are told (CAPACITY DATA HAS CHANGED, NVMe AEN)."""
    _changes(_call(data_dir, config, "volume.resize", name=name, size=_size(size), dry_run=dry_run), as_json,
             dry_run)


@volume_app.command("delete")
def volume_delete(name: VolumeArg,
                  force: Annotated[bool, typer.Option("--force", help="Remove its exports with it.")] = False,
                  dry_run: DryRun = False, as_json: JsonOpt = False, data_dir: DataDir = None,
                  config: ConfigOpt = None) -> None:
    """Delete a volume (and the device made for it); refused while it is exported, unless --force."""
    _changes(_call(data_dir, config, "volume.delete", name=name, force=force, dry_run=dry_run), as_json, dry_run)


def _fmt_size(n: Any) -> str:
    from openvsan.node.values import format_size

    return format_size(int(n)) if isinstance(n, int) else "-"


@volume_app.command("list")
def volume_list(as_json: JsonOpt = False, data_dir: DataDir = None, config: ConfigOpt = None) -> None:
    """The node's volumes: size, where they live, their stack and exports."""
    vols = _call(data_dir, config, "volume.list")
    if as_json:
        _print_json(vols)
        return
    t = Table("volume", "size", "on", "stack", "exports", "qos")
    for v in vols:
        on = f"pool {v['pool']}" if v.get("pool") else f"device {v.get('device')}"
        qos = " ".join(f"{k}={x}" for k, x in (v.get("qos") or {}).items()) or "-"
        t.add_row(v["name"], _fmt_size(v.get("size")), on, " > ".join(v.get("stack", [])),
                  "; ".join(v.get("exports", [])) or "-", qos)
    _console().print(t)


@volume_app.command("show")
def volume_show(name: VolumeArg, as_json: JsonOpt = False, data_dir: DataDir = None,
                config: ConfigOpt = None) -> None:
    """One volume in full: identity (UUID, NAA, EUI-64, NGUID, serial), stack, capabilities, exports, QoS."""
    v = _call(data_dir, config, "volume.show", name=name)
    if as_json:
        _print_json(v)
        return
    out = _console()
    for key in ("name", "size", "block_size", "device", "pool", "read_only", "uuid", "serial", "naa", "eui64",
                "nguid"):
        if v.get(key) is not None:
            out.print(f"{key:>12}: {_fmt_size(v[key]) if key == 'size' else v[key]}", soft_wrap=True)
    out.print(f"{'stack':>12}: {' > '.join(v.get('stack', []))}", soft_wrap=True)
    out.print(f"{'exports':>12}: {'; '.join(v.get('exports', [])) or '-'}", soft_wrap=True)
    out.print(f"{'qos':>12}: {' '.join(f'{k}={x}' for k, x in (v.get('qos') or {}).items()) or 'none'}",
              soft_wrap=True)
    caps = v.get("capabilities") or {}
    out.print(f"{'capabilities':>12}: " + ", ".join(k for k, x in caps.items() if x is True), soft_wrap=True)
    if (v.get("locked_stats") or {}).get("locked"):
        out.print(f"{'encryption':>12}: LOCKED (every command answered not ready): `vsan volume unlock "
                  f"{v.get('name', 'NAME')}`", soft_wrap=True)
    crypt = v.get("crypt_stats")
    if crypt:
        out.print(f"{'encryption':>12}: LUKS2 {crypt['uuid']}, {crypt['cipher']} {crypt['key_bits']}-bit, "
                  f"{crypt['sector_size']}-byte sectors, data at {_fmt_size(crypt['data_offset'])}, unlocked with "
                  f"{crypt['unlocked_with']}" + (", discards passed down" if crypt["discards"] else ""),
                  soft_wrap=True)
        if crypt.get("cipher_path"):
            out.print(f"{'cipher':>12}: {crypt['cipher_path']}", soft_wrap=True)
    squeeze = v.get("compress_stats")
    if squeeze:
        frames = f" in {squeeze['frame_size'] >> 10} KiB frames" if squeeze.get("frame_size") else ""
        out.print(f"{'compression':>12}: {squeeze['algorithm']}, {squeeze['chunk_size'] >> 10} KiB chunks{frames}, "
                  f"ratio {squeeze['ratio']:.2f}x ({_fmt_size(squeeze['plain_bytes'])} in "
                  f"{_fmt_size(squeeze['stored_bytes'])}; {squeeze['raw_chunks']} of {squeeze['chunks']} chunks "
                  "stored raw)", soft_wrap=True)
        if squeeze.get("cache_size"):
            out.print(f"{'write cache':>12}: {_fmt_size(squeeze['cached_bytes'])} of "
                      f"{_fmt_size(squeeze['cache_size'])} held, in {squeeze['cached_chunks']} chunks (written at the "
                      "next flush)", soft_wrap=True)
    carved = v.get("carved")
    if carved:
        out.print(f"{'carved':>12}: {'thin' if carved['thin'] else 'thick'}, {_fmt_size(carved['mapped'])} mapped "
                  f"({_fmt_size(carved['exclusive'])} its own)" + (f", from {carved['origin']}" if carved["origin"]
                                                                   else ""), soft_wrap=True)
    if v.get("volume_group"):
        from openvsan.cli.pool import print_group

        print_group(v["volume_group"], out)


# ---- exports

ProtocolArg = Annotated[str, typer.Argument(help="iscsi, nvme or nbd.")]
ExportName = Annotated[str, typer.Argument(help="The target IQN, the subsystem NQN or the NBD export name.")]


@export_app.command("add")
def export_add(
    protocol: ProtocolArg, name: ExportName,
    volume: Annotated[str, typer.Option("--volume", help="The volume to export.")],
    lun: Annotated[int | None, typer.Option("--lun", help="iSCSI: the LUN (default: the lowest free).")] = None,
    nsid: Annotated[int | None, typer.Option("--nsid", help="NVMe: the namespace ID (default: the lowest free).")] = None,
    portal: Annotated[list[str] | None, typer.Option("--portal", help="HOST:PORT for a new target, subsystem or "
                                                                      "export (default: those of the others, "
                                                                      "else 127.0.0.1 and the standard port).")] = None,
    read_only: Annotated[bool, typer.Option("--read-only", help="NBD: export it read-only.")] = False,
    dry_run: DryRun = False, as_json: JsonOpt = False, data_dir: DataDir = None, config: ConfigOpt = None,
) -> None:
    """Export a volume: a LUN of an iSCSI target, a namespace of an NVMe subsystem or an NBD export (the
    target or subsystem is made if it does not exist). Initiators see it at once."""
    _changes(_call(data_dir, config, "export.add", protocol=protocol, name=name, volume=volume, lun=lun, nsid=nsid,
                   portals=portal or [], read_only=read_only, dry_run=dry_run), as_json, dry_run)


@export_app.command("remove")
def export_remove(
    protocol: ProtocolArg, name: ExportName,
    lun: Annotated[int | None, typer.Option("--lun", help="iSCSI: only this LUN (default: the whole target).")] = None,
    nsid: Annotated[int | None, typer.Option("--nsid", help="NVMe: only this namespace (default: the subsystem).")] = None,
    dry_run: DryRun = False, as_json: JsonOpt = False, data_dir: DataDir = None, config: ConfigOpt = None,
) -> None:
    """Stop exporting: a LUN or a whole target, a namespace or a whole subsystem, an NBD export."""
    _changes(_call(data_dir, config, "export.remove", protocol=protocol, name=name, lun=lun, nsid=nsid,
                   dry_run=dry_run), as_json, dry_run)


@export_app.command("list")
def export_list(as_json: JsonOpt = False, data_dir: DataDir = None, config: ConfigOpt = None) -> None:
    """Every export of the node."""
    rows = _call(data_dir, config, "export.list")
    if as_json:
        _print_json(rows)
        return
    t = Table("protocol", "name", "unit", "volume", "portals")
    for r in rows:
        unit = f"LUN {r['lun']}" if "lun" in r else f"namespace {r['nsid']}" if "nsid" in r else "-"
        t.add_row(r["protocol"], r["name"], unit, r["volume"], ", ".join(r["portals"]))
    _console().print(t)


# ---- replication

@volume_app.command("status")
def volume_status(name: VolumeArg, as_json: JsonOpt = False, data_dir: DataDir = None,
                  config: ConfigOpt = None) -> None:
    """A replicated volume on this node: role, epoch, primary, replicas in and out of sync, resync progress."""
    r = _call(data_dir, config, "volume.status", name=name)
    if as_json:
        _print_json(r)
        return
    if not r.get("replicated"):
        typer.echo(f"volume {name}: not replicated (one copy, on this node)")
        return
    typer.echo(f"volume {name}: {r['role']} on this node; epoch {r['epoch']}, primary {r.get('primary') or 'none'}")
    typer.echo(f"  replicas: {', '.join(r['nodes'])}; in sync: {', '.join(r['in_sync']) or 'none'}")
    for n, since in (r.get("out_of_sync") or {}).items():
        typer.echo(f"  {n}: out of sync since epoch {since}")
    for n, p in (r.get("peers") or {}).items():
        state = "connected" if p["connected"] else "not connected"
        left = p["dirty_regions"] * r.get("region_size", 0)
        resync = f", resyncing ({left} bytes left)" if p["resyncing"] else (f", {left} bytes to resync" if left else "")
        typer.echo(f"  peer {n} at {p['address']}: {state}{resync}")
    m = r.get("mirror")
    if m:
        typer.echo(f"  writes {m['writes']}, peer failures {m['peer_failures']}, resync {m['resync_bytes']} bytes")
    typer.echo(f"  fence: floor {r['fence']['floor']}, stale-epoch commands refused {r['fence']['refused']}")


@volume_app.command("move-primary")
def volume_move_primary(name: VolumeArg, as_json: JsonOpt = False, data_dir: DataDir = None,
                        config: ConfigOpt = None) -> None:
    """Planned switchover: this node (the primary) drains and steps down; an in-sync peer becomes primary."""
    r = _call(data_dir, config, "volume.move_primary", name=name)
    if as_json:
        _print_json(r)
        return
    typer.echo(f"volume {name}: this node stepped down (it is {r['role']} now); an in-sync peer takes over")


@volume_app.command("force-in-sync")
def volume_force_in_sync(name: VolumeArg, yes: Annotated[bool, typer.Option("--yes-lose-writes", help=(
        "Confirm: writes this replica missed are lost."))] = False, as_json: JsonOpt = False,
        data_dir: DataDir = None, config: ConfigOpt = None) -> None:
    """Last resort when NO replica is in sync (every node lost its state, or the in-sync one is gone for good):
    this node's replica is declared in sync as it is and can be elected; writes it missed are lost."""
    if not yes:
        _bad("this can lose acknowledged writes; add --yes-lose-writes if no in-sync replica will come back")
    r = _call(data_dir, config, "volume.force_in_sync", name=name)
    if as_json:
        _print_json(r)
        return
    typer.echo(f"volume {name}: this node's replica is in sync by force (epoch {r['epoch']}); it can be elected")


# ---- QoS

QOS_KNOBS = [f"{scope}{kind}_{part}" for kind in ("iops", "bps") for scope in ("read_", "write_", "")
             for part in ("limit", "burst", "burst_seconds")]


@qos_app.command("set", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def qos_set(ctx: typer.Context, name: VolumeArg,
            clear: Annotated[bool, typer.Option("--clear", help="Remove every limit first.")] = False,
            dry_run: DryRun = False, as_json: JsonOpt = False, data_dir: DataDir = None,
            config: ConfigOpt = None) -> None:
    """Set QoS limits on a live volume, Ceph librbd style, e.g. `vsan qos set vol1 --read-iops-limit 1000
    --bps-limit 100MB --iops-burst 2000 --iops-burst-seconds 5`; 0 removes a limit. Takes effect at once,
    with no reconnect; a volume with no limits has no QoS layer at all."""
    limits: dict[str, Any] = {}
    extra = list(ctx.args)
    while extra:
        flag = extra.pop(0)
        key, _, value = flag.removeprefix("--").partition("=")
        key = key.replace("-", "_")
        if key not in QOS_KNOBS:
            _bad(f"{flag}: not a QoS knob; use --KNOB VALUE with KNOB one of: "
                 + ", ".join(k.replace("_", "-") for k in QOS_KNOBS))
        if not value:
            if not extra:
                _bad(f"{flag}: needs a value")
            value = extra.pop(0)
        limits[key] = _qos_value(key, value, flag)
    if not limits and not clear:
        _bad("give at least one limit, e.g. --read-iops-limit 1000 (or --clear)")
    result = _call(data_dir, config, "qos.set", volume=name, limits=limits, clear=clear, dry_run=dry_run)
    _changes(result, as_json, dry_run)


def _qos_value(key: str, value: str, flag: str) -> float:
    if "bps" in key and not key.endswith("seconds"):
        return _size(value, flag)
    try:
        n = float(value)
    except ValueError:
        _bad(f"{flag}: {value!r} is not a number")
    return int(n) if n.is_integer() else n


@qos_app.command("show")
def qos_show(name: VolumeArg, as_json: JsonOpt = False, data_dir: DataDir = None, config: ConfigOpt = None) -> None:
    """A volume's QoS limits and what they did (commands throttled, time waited, current rates)."""
    r = _call(data_dir, config, "qos.show", volume=name)
    if as_json:
        _print_json(r)
        return
    out = _console()
    out.print(f"{name}: " + (" ".join(f"{k}={v}" for k, v in r["qos"].items()) or "no limits (no QoS layer)"),
              soft_wrap=True)
    for k, v in (r.get("stats") or {}).items():
        out.print(f"  {k}: {v}", soft_wrap=True)


# ---- the whole config

def config_apply(
    file: Annotated[Path, typer.Argument(help="The TOML config to make the node's desired state.")],
    dry_run: DryRun = False, as_json: JsonOpt = False, data_dir: DataDir = None,
) -> None:
    """Apply a whole config file to a running node: print the plan, then carry it out (all or nothing)."""
    from openvsan.cli.main import read_config

    read_config(file, data_dir)     # checked here first: a bad file gets its one line without a round trip
    if data_dir is None:
        data_dir = _data_dir(None, file)
    if not dry_run and not as_json:
        plan = _call(data_dir, None, "config.apply", path=str(file.absolute()), dry_run=True)
        for line in plan.get("changes") or ["nothing to change"]:
            typer.echo(f"plan: {line}")
        if not plan.get("changes"):
            return
    _changes(_call(data_dir, None, "config.apply", path=str(file.absolute()), dry_run=dry_run), as_json, dry_run)


# ---- worker processes (vsan serve --workers N)

workers_app = typer.Typer(help="The worker processes of a running node (vsan serve --workers N): with no command, "
                          "list them; `move` moves a volume to another worker while serving.",
                          invoke_without_command=True)


@workers_app.command("move")
def workers_move(
    volume: VolumeArg,
    to: Annotated[int, typer.Option("--to", min=0, help="The worker to move it to (see `vsan workers`).")],
    data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False,
) -> None:
    """Move a volume, and the volumes exported together with it, to another worker while serving: its NBD
    clients pause and go on there; iSCSI sessions and NVMe controllers must log out first (for now)."""
    out = _call(data_dir, config, "workers.move", volume=volume, to=to)
    if as_json:
        _print_json(out)
        return
    typer.echo(out["message"] + (f"; {out['connections']} connection(s) went with it" if out.get("connections")
                                 else "") + (f" ({out['seconds'] * 1000:.0f} ms)" if "seconds" in out else ""))
    if out.get("closed"):
        typer.echo(f"{out['closed']} connection(s) could not move and were closed")


@workers_app.command("balance")
def workers_balance(
    seconds: Annotated[float, typer.Option("--seconds", min=0.5, max=60.0,
                                           help="How long to watch the load before deciding.")] = 2.0,
    dry_run: DryRun = False, data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False,
) -> None:
    """Even out the workers' load: watch each worker's core and each volume's share of it for a while, then
    move volumes (with what exports them) from the busiest workers to the least busy ones."""
    out = _call(data_dir, config, "workers.balance", seconds=seconds, dry_run=dry_run)
    if as_json:
        _print_json(out)
        return
    t = Table("worker", "core busy", "volumes (share of the core)")
    for w, busy in out["workers"].items():
        mine = [g for g in out["groups"] if str(g["worker"]) == w]
        t.add_row(w, f"{busy * 100:.0f} %", ", ".join(f"{'+'.join(g['volumes'])} ({g['load'] * 100:.0f} %)"
                                                      for g in mine) or "-")
    _console().print(t)
    if not out["plan"]:
        typer.echo("balanced: nothing to move")
    for step in out["plan"]:
        typer.echo(f"{'would move' if dry_run else 'move'} {'+'.join(step['volumes'])} "
                   f"({step['load'] * 100:.0f} % of a core) to worker {step['to']}")
    for m in out["moved"]:
        typer.echo(m["message"] + (f"; {m['connections']} connection(s) went with it" if m.get("connections") else ""))


@workers_app.callback()
def workers(ctx: typer.Context, data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """The worker processes of a running node: pid, core, what each serves, restarts."""
    if ctx.invoked_subcommand is not None:
        return
    from openvsan.cli.remote import node_call
    from openvsan.node.control import ControlError, NotRunning

    try:
        rows = node_call(lambda: _data_dir(data_dir, config), "workers.list", timeout=30.0)
    except NotRunning as e:
        _fail(str(e), EXIT_FAILED)
    except ControlError as e:
        if "unknown command" in str(e):
            _fail("this node runs in one process (workers = 1): no worker processes to list", EXIT_USAGE)
        _fail(str(e), EXIT_USAGE)
    if as_json:
        _print_json(rows)
        return
    t = Table("worker", "pid", "cpu", "state", "restarts", "volumes", "exports")
    for r in rows:
        exports = [*r["targets"], *r["subsystems"], *(f"nbd:{x}" for x in r["nbd_exports"])]
        state = "serving" if r["serving"] else "starting" + (f" (last: {r['last_exit']})" if r["last_exit"] else "")
        t.add_row(str(r["worker"]), str(r["pid"] or "-"), "-" if r["cpu"] is None else str(r["cpu"]), state,
                  str(r["restarts"]), ", ".join(r["volumes"]) or "-", ", ".join(exports) or "-")
    _console().print(t)
