"""The `vsan` command: `vsan serve`, `vsan config check|apply`, `vsan volume|export|qos` (cli/live.py),
`vsan pool`, `vsan bench`, `vsan initiator`, `vsan --version`.

Errors a user can mend are one line on stderr and a non-zero exit: 2 for a bad config or command line
(nothing stored is touched), 1 for a node that cannot start (port in use, device missing).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from openvsan import __version__
from openvsan.cli.bench import bench
from openvsan.cli.cluster import cluster_app
from openvsan.cli.initiator import initiator_app
from openvsan.cli.live import config_apply, export_app, qos_app, volume_app, workers_app
from openvsan.cli.manage import events, health, sessions, token_app
from openvsan.cli.pool import pool_app
from openvsan.cli.snapshot import snapshot_app
from openvsan.node.paths import effective_data_dir

if TYPE_CHECKING:
    from openvsan.node.specs import NodeConfig, VolumeSpec

EXIT_FAILED = 1
EXIT_USAGE = 2  # bad config or arguments, as click uses for usage errors
LOG_LEVELS = ("debug", "info", "warning", "error")

app = typer.Typer(name="vsan", help="openvsan: a virtual SAN. Serve block volumes over iSCSI.",
                  no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False)
config_app = typer.Typer(help="Work with config files.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(initiator_app, name="initiator")  # cli/initiator.py: discover, inquiry/identify, read, write, attach
app.add_typer(snapshot_app, name="snapshot")  # cli/snapshot.py: create, list, delete, rollback, clone
app.add_typer(pool_app, name="pool")  # cli/pool.py: list, status, scrub, fail, replace, add-spare; create, inspect
app.command("bench")(bench)  # cli/bench.py: IOPS, MB/s, latency of a target (docs/benchmarks.md)
app.add_typer(volume_app, name="volume")  # cli/live.py: a running node's volumes, exports and QoS
app.add_typer(export_app, name="export")
app.add_typer(qos_app, name="qos")
app.add_typer(workers_app, name="workers")  # cli/live.py: the worker processes of a node (list, move)
app.command("health")(health)  # cli/manage.py: the node's health report (exit 0 healthy, 1 warning, 2 critical)
app.command("events")(events)  # cli/manage.py: alerts raised and cleared, changes made
app.command("sessions")(sessions)  # cli/manage.py: who is connected, from where, as whom
app.add_typer(token_app, name="token")  # cli/manage.py: the REST API's tokens (create, list, revoke)
app.add_typer(cluster_app, name="cluster")  # cli/cluster.py: init, join, leave, status (membership in etcd)
config_app.command("apply")(config_apply)

log = logging.getLogger("openvsan.cli")


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    # plain write, not rich: a message must stay one line however narrow the terminal is
    sys.stderr.write(f"vsan: {message}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def read_config(path: Path, data_dir: Path | None = None) -> NodeConfig:
    """Load, validate and preflight CONFIG; `data_dir` is the command's --data-dir (what ${data_dir} means)."""
    # the specs are loaded by the commands that read a config: `vsan volume list` and the like need none
    from openvsan.node.config import ConfigError, load_config, preflight

    try:
        cfg = load_config(path, data_dir=data_dir)
        preflight(cfg, data_dir=data_dir)
    except ConfigError as e:
        fail(f"config error: {e}", EXIT_USAGE)
    return cfg


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vsan (openvsan) {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False,
          node: Annotated[str | None, typer.Option(
              "--node", envvar="VSAN_NODE", help="Send the commands to this node's REST API (e.g. "
              "https://10.0.0.1:8080) instead of the local node's control socket.")] = None,
          token: Annotated[str | None, typer.Option(
              "--token", envvar="VSAN_TOKEN", help="The API token for --node (`vsan token create`; better from "
              "$VSAN_TOKEN or --token-file than on the command line).")] = None,
          token_file: Annotated[Path | None, typer.Option(
              "--token-file", help="Read the API token for --node from this file.")] = None,
          ca: Annotated[Path | None, typer.Option(
              "--ca", envvar="VSAN_CA", help="CA certificate that signed the node's API certificate (https).")] = None,
          member: Annotated[str | None, typer.Option(
              "--member", envvar="VSAN_MEMBER", help="With --node: run the command on this member of the node's "
              "cluster, through the node's API (with the node's token).")] = None,
          ) -> None:
    """openvsan: a virtual SAN. Serve block volumes over iSCSI, NVMe/TCP and NBD."""
    if node is None:
        if member is not None:
            fail("--member goes through a node's REST API: give --node URL too", EXIT_USAGE)
        return
    from openvsan.cli import remote

    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            fail(f"--token-file {token_file}: {e.strerror}", EXIT_USAGE)
    if not token:
        fail("--node needs an API token: --token, $VSAN_TOKEN or --token-file (`vsan token create` on the node "
             "makes one)", EXIT_USAGE)
    remote.REMOTE = remote.Remote(node, token, ca, member)


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="The node's TOML config file: it becomes the desired state (what it does not "
                               "declare is removed). Without it, serve the desired state stored in the data dir, "
                               "with every change made while serving (vsan volume / export / qos / config "
                               "apply).")] = None,
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", help="Where desired state (state-kv.db) and persistent reservations live. Default: "
                           "[node].data_dir, else $XDG_STATE_HOME/openvsan or ~/.local/state/openvsan.")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")] = "info",
    workers: Annotated[int | None, typer.Option(
        "--workers", "-w", min=1, max=256,
        help="Worker processes, each serving its share of the volumes on its own core (1: one process). "
             "Default: [node] workers, whose default is one per core the node may use (--cpus).")] = None,
    cpus: Annotated[str | None, typer.Option(
        "--cpus", help="Cores to pin the workers to, e.g. 0-3 or 0,2 (worker i on the i-th, round robin). "
                       "Default: [node] worker_cpus, else every core this process may use.")] = None,
) -> None:
    """Serve what CONFIG declares (or, without --config, what the data dir holds) until SIGTERM or SIGINT, then
    drain, flush and exit 0."""
    # imported here so `vsan --version` and `vsan config check` stay quick
    from openvsan.frontend.limits import raise_fd_limit
    from openvsan.node import access
    from openvsan.node.config import exposed_secrets
    from openvsan.node.logs import setup_logging
    from openvsan.node.node import DataDirLock, Node, NodeError, os_error_line, run
    from openvsan.node.store import Store, StoreError

    if log_level.lower() not in LOG_LEVELS:
        fail(f"--log-level: unknown level {log_level!r}; use one of: {', '.join(LOG_LEVELS)}", EXIT_USAGE)
    cfg = read_config(config, data_dir) if config is not None else None  # validated before anything is stored
    setup_logging(log_level)
    if cfg is not None:
        if (exposed := exposed_secrets(cfg)) is not None:
            log.warning("%s", exposed)
        for line in access.open_exports(cfg):
            log.warning("%s", line)
    data = effective_data_dir(cfg.node.data_dir if cfg is not None else None, data_dir)
    if cfg is None and not Store.holds_state(data):
        fail(f"no desired state in {data} (no state-kv.db): give --config FILE the first time, or the --data-dir "
             "of a node that ran before", EXIT_USAGE)
    try:
        data.mkdir(parents=True, exist_ok=True, mode=0o700)
        with DataDirLock(data):
            with Store.open(data) as store:
                if cfg is not None:
                    store.import_config(cfg)
                state = store.load()
            log.info("node %s: %s, data dir %s", state.config.node.name,
                     f"config {config}" if config is not None else "the desired state stored there", data)
            raise_fd_limit(state.config.node.max_connections)
            from openvsan.node import workers as wk

            try:
                pinned = (wk.parse_cpus(cpus) if cpus is not None
                          else list(state.config.node.worker_cpus) or wk.usable_cpus())
            except ValueError as e:
                fail(f"--cpus: {e}", EXIT_USAGE)
            if pinned is not None and (bad := sorted(set(pinned) - set(wk.usable_cpus()))):
                fail(f"--cpus: cpu {bad[0]} is not one this process may run on ({wk.usable_cpus()})", EXIT_USAGE)
            n = wk.worker_count(workers if workers is not None else state.config.node.workers, pinned)
            if n == 1:
                run(Node(state, data))
                return
            try:
                wk.serve_workers(state, data, n, pinned, log_level)
            except wk.WorkerSetupError as e:
                fail(str(e))
    except (NodeError, StoreError) as e:
        fail(str(e))
    except OSError as e:
        fail(os_error_line(e))   # binding a portal (the server names the address) or making the data dir
    except KeyboardInterrupt:
        fail("interrupted", 130)


@config_app.command("check")
def config_check(config: Annotated[Path, typer.Argument(help="The TOML config file to check.")]) -> None:
    """Validate CONFIG and print what it would serve; exit 2 with one line if it is wrong."""
    from openvsan.node import access
    from openvsan.node.config import exposed_secrets
    from openvsan.node.values import format_size

    cfg = read_config(config)
    if (exposed := exposed_secrets(cfg)) is not None:
        sys.stderr.write(f"warning: {exposed}\n")
    out = Console()
    out.print(f"[bold]{config}[/]: valid config for node [bold]{cfg.node.name}[/]"
              + (f", data dir {cfg.node.data_dir}" if cfg.node.data_dir else "")
              + (f", adaptive polling {cfg.node.poll_us}"
                 + (f"-{cfg.node.poll_max_us}" if cfg.node.poll_max_us > cfg.node.poll_us else "") + " µs"
                 if cfg.node.poll_us else ", no polling"), soft_wrap=True)
    out.print(f"connection limits: {cfg.node.max_connections} in all, {cfg.node.max_unauthenticated} not logged in, "
              f"{cfg.node.max_unauthenticated_per_source} not logged in from one address", soft_wrap=True)
    if cfg.devices:
        t = Table("device", "type", "size", "block", "where", title="devices", title_justify="left")
        for d in cfg.devices:
            where = str(d.path or d.backing or "")
            if d.direct:
                where += " (O_DIRECT)"
            t.add_row(d.name, d.type, format_size(d.size) if d.size else "file's size", str(d.block_size), where)
        out.print(t)
    if cfg.pools:
        t = Table("pool", "level", "members", "spares", "chunk", title="pools", title_justify="left")
        for p in cfg.pools:
            t.add_row(p.name, p.level, ", ".join(p.members), ", ".join(p.spares) or "none", format_size(p.chunk))
        out.print(t)
    if cfg.targets:
        t = Table(title="iSCSI", title_justify="left")
        t.add_column("target", overflow="fold")
        for col in ("LUN", "volume", "device", "portals", "access"):
            t.add_column(col, overflow="fold")
        for tgt in cfg.targets:
            auth = access.iscsi_auth(tgt)[1]
            acl = "any initiator" if tgt.allowed_initiators is None else f"{len(tgt.allowed_initiators)} initiator(s)"
            for x in tgt.luns:
                v = cfg.volume(x.volume)
                t.add_row(tgt.iqn, str(x.lun), x.volume + (" (ro)" if v.read_only else ""), _backing(v),
                          ", ".join(str(p) for p in tgt.portals), f"{auth}, {acl}")
        out.print(t)
    if cfg.subsystems:
        t = Table(title="NVMe/TCP", title_justify="left")
        t.add_column("subsystem", overflow="fold")
        for col in ("NSID", "volume", "device", "portals", "access"):
            t.add_column(col, overflow="fold")
        for sub in cfg.subsystems:
            acl = "any host" if sub.allowed_hosts is None else f"{len(sub.allowed_hosts)} host(s)"
            ok, how = access.nvme_auth(sub)
            auth = how if ok else "no DH-HMAC-CHAP" if not sub.hosts else f"open: {how}"
            for ns in sub.namespaces:
                v = cfg.volume(ns.volume)
                t.add_row(sub.nqn, str(ns.nsid), ns.volume + (" (ro)" if v.read_only else ""), _backing(v),
                          ", ".join(str(p) for p in sub.portals), f"{auth}, {acl}")
        out.print(t)
    if cfg.nbd_exports:
        t = Table("export", "volume", "device", "portals", "access", title="NBD", title_justify="left")
        for e in cfg.nbd_exports:
            v = cfg.volume(e.volume)
            ok, how = access.nbd_auth(e, cfg)
            t.add_row(e.name, e.volume + (" (ro)" if e.read_only or v.read_only else ""), _backing(v),
                      ", ".join(str(p) for p in e.portals), how if ok else f"no auth ({how})")
        out.print(t)
    for line in access.open_exports(cfg):
        out.print(f"[yellow]warning:[/] {line}", soft_wrap=True)
    if not cfg.exports_anything():
        out.print("no iSCSI targets, NVMe subsystems or NBD exports: nothing would be exported")


def _backing(v: VolumeSpec) -> str:
    # a volume lives on a device or on a pool; `pool:` keeps a pool apart from a device of the same name
    return v.device if v.device is not None else f"pool:{v.pool}"


def main() -> None:
    app(prog_name="vsan")


if __name__ == "__main__":
    main()
