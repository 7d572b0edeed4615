"""`vsan initiator`: talk to iSCSI and NVMe/TCP targets from userspace, and attach a volume as a file.

URLs: iscsi://[user%secret@]HOST[:PORT]/IQN/LUN and nvme+tcp://HOST[:PORT]/NQN/NSID (options after `?`,
see openvsan/initiator/url.py). Errors are one line on stderr: exit 2 for a bad URL or argument, 1 for a
target that cannot be reached or refuses.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from openvsan.block.errors import BlockError
from openvsan.initiator.url import TargetUrl, UrlError, parse_url

EXIT_FAILED = 1
EXIT_USAGE = 2
T = TypeVar("T")

initiator_app = typer.Typer(help="Userspace iSCSI and NVMe/TCP initiator: discover, inspect, read, write, attach.",
                            no_args_is_help=True)

UrlArg = Annotated[str, typer.Argument(help="iscsi://[user%secret@]HOST[:PORT]/IQN/LUN or "
                                            "nvme+tcp://HOST[:PORT]/NQN/NSID")]


def _fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    sys.stderr.write(f"vsan: {message}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def _url(url: str, *, need_unit: bool = True) -> TargetUrl:
    try:
        u = parse_url(url)
    except UrlError as e:
        _fail(str(e), EXIT_USAGE)
    if need_unit and (u.name is None or u.unit is None):
        what = "/IQN/LUN" if u.iscsi else "/NQN/NSID"
        _fail(f"{u.redacted()}: the URL must name the volume ({u.scheme}://HOST[:PORT]{what})", EXIT_USAGE)
    return u


def _run(make: Callable[[], Awaitable[T]]) -> T:
    import logging

    logging.basicConfig(level=logging.WARNING, format="vsan: %(name)s: %(message)s")
    try:
        return asyncio.run(make())  # type: ignore[arg-type]
    except UrlError as e:
        _fail(str(e), EXIT_USAGE)
    except (BlockError, OSError, TimeoutError, RuntimeError) as e:
        _fail(str(e) or type(e).__name__)
    except KeyboardInterrupt:
        _fail("interrupted", 130)


async def _open(url: str) -> Any:
    from openvsan.initiator import open_url

    return await open_url(url)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@initiator_app.command()
def discover(url: UrlArg) -> None:
    """List the targets (iSCSI SendTargets) or subsystems (NVMe discovery log) a portal offers."""
    u = _url(url, need_unit=False)

    async def go() -> list[tuple[str, list[str]]]:
        if u.iscsi:
            from openvsan.initiator.iscsi import discover as iscsi_discover

            return await iscsi_discover(url)
        from openvsan.initiator import nvme_tcp  # type: ignore[attr-defined,unused-ignore]

        result: list[tuple[str, list[str]]] = await nvme_tcp.discover(url)
        return result

    for name, addrs in _run(go):
        typer.echo(f"{name}\t{' '.join(addrs)}")


@initiator_app.command()
def inquiry(url: UrlArg) -> None:
    """INQUIRY, READ CAPACITY(16) and the block limits of an iSCSI LUN."""
    u = _url(url)
    if not u.iscsi:
        _fail("inquiry is for iscsi:// URLs; use `vsan initiator identify` for NVMe/TCP", EXIT_USAGE)

    async def go() -> list[str]:
        dev = await _open(url)
        try:
            inq, cap, lim, prov = dev.inquiry, dev.capacity, dev.limits, dev.provisioning
            return [
                f"target:     {u.name} LUN {u.unit} at {u.host}:{u.port}",
                f"vendor:     {inq.vendor}", f"product:    {inq.product}", f"revision:   {inq.revision}",
                (f"capacity:   {_size(cap.num_blocks * cap.block_size)} ({cap.num_blocks} blocks of "
                f"{cap.block_size} bytes)"),
                (f"thin:       {'yes' if cap.lbpme else 'no'} (unmapped reads zeroes: "
                f"{'yes' if cap.lbprz else 'no'}; UNMAP {'yes' if prov.lbpu else 'no'}, "
                f"WRITE SAME+UNMAP {'yes' if prov.lbpws else 'no'})"),
                f"max I/O:    {lim.max_transfer or 'unlimited'} blocks",
            ]
        finally:
            await dev.close()

    typer.echo("\n".join(_run(go)))


@initiator_app.command()
def identify(url: UrlArg) -> None:
    """Identify Controller and Namespace of an NVMe/TCP namespace."""
    u = _url(url)
    if u.iscsi:
        _fail("identify is for nvme+tcp:// URLs; use `vsan initiator inquiry` for iSCSI", EXIT_USAGE)

    async def go() -> list[str]:
        dev = await _open(url)
        try:
            lines: list[str] = dev.describe()
            return lines
        finally:
            await dev.close()

    typer.echo("\n".join(_run(go)))


@initiator_app.command()
def read(url: UrlArg,
         lba: Annotated[int, typer.Argument(min=0, help="First logical block.")],
         count: Annotated[int, typer.Argument(min=1, help="Number of blocks.")],
         out: Annotated[Path | None, typer.Option("--out", "-o", help="File to write (default: stdout).")] = None,
         ) -> None:
    """Read COUNT blocks from LBA."""
    _url(url)

    async def go() -> bytes:
        dev = await _open(url)
        try:
            return bytes(await dev.read(lba, count))
        finally:
            await dev.close()

    data = _run(go)
    if out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        out.write_bytes(data)


@initiator_app.command()
def write(url: UrlArg,
          lba: Annotated[int, typer.Argument(min=0, help="First logical block.")],
          infile: Annotated[Path, typer.Option("--in", "-i", help="File to write (a whole number of blocks).")],
          fua: Annotated[bool, typer.Option("--fua", help="Force Unit Access: durable when this returns.")] = False,
          ) -> None:
    """Write the contents of a file at LBA, then flush."""
    _url(url)
    try:
        data = infile.read_bytes()
    except OSError as e:
        _fail(f"{infile}: {e.strerror}", EXIT_USAGE)

    async def go() -> int:
        dev = await _open(url)
        try:
            if len(data) % dev.block_size:
                raise UrlError(f"{infile}: {len(data)} bytes is not a whole number of {dev.block_size}-byte blocks")
            await dev.write(lba, data, fua=fua)
            await dev.flush()
            return len(data) // dev.block_size
        finally:
            await dev.close()

    n = _run(go)
    typer.echo(f"wrote {n} blocks at LBA {lba}", err=True)


@initiator_app.command()
def attach(urls: Annotated[list[str], typer.Argument(
               help="The volume's URL; several: the paths of one volume (its replica nodes), followed by "
                    "ALUA/ANA state and failover.", metavar="URL [URL...]", show_default=False)],
           path: Annotated[Path, typer.Argument(help="A regular file (created if missing) the volume appears as.")],
           read_only: Annotated[bool, typer.Option("--read-only", help="Refuse writes.")] = False,
           allow_other: Annotated[bool, typer.Option("--allow-other", help="Let other users open the file.")] = False,
           no_path_retry: Annotated[float, typer.Option(
               help="With several URLs: seconds I/O is held while no path serves it, then fails.")] = 30.0,
           ) -> None:
    """Expose the volume as the file PATH through FUSE, until Ctrl-C, SIGTERM or `fusermount3 -u PATH`.

    Then: `losetup -f --show PATH`, mkfs, mount, as with a local disk. With several URLs, each path's
    state change is printed on stderr.
    """
    parsed = [_url(url) for url in dict.fromkeys(urls)]
    if no_path_retry < 0:
        _fail("--no-path-retry must not be negative", EXIT_USAGE)
    if len(parsed) > 1 and len({u.scheme for u in parsed}) > 1:
        _fail("one volume's paths must all be iscsi:// or all nvme+tcp://", EXIT_USAGE)
    shown = " + ".join(u.redacted() for u in parsed)

    async def go() -> None:
        from openvsan.initiator.fuse import attach as fuse_attach

        if len(parsed) > 1:
            from openvsan.initiator.multipath import Path as MPath
            from openvsan.initiator.multipath import PathState, open_paths

            def changed(p: MPath, old: PathState, new: PathState) -> None:
                why = f" ({p.last_error})" if p.last_error and not new.usable else ""
                sys.stderr.write(f"vsan: path {p.name}: {old.label} -> {new.label}{why}\n")
                sys.stderr.flush()

            dev: Any = await open_paths(list(dict.fromkeys(urls)), no_path_retry=no_path_retry, on_change=changed)
        else:
            dev = await _open(urls[0])
        size = dev.num_blocks * dev.block_size

        def ready() -> None:
            sys.stderr.write(f"vsan: attached {shown} ({_size(size)}) at {path}\n")
            if len(parsed) > 1:
                for st in dev.stats():
                    sys.stderr.write(f"vsan: path {st['path']}: {st['state']}\n")
            sys.stderr.flush()

        try:
            await fuse_attach(dev, str(path), read_only=read_only, allow_other=allow_other, ready=ready)
        finally:
            await dev.close()

    _run(go)
