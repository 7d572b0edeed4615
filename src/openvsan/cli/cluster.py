"""`vsan cluster init|join|leave|status`: a cluster's membership in etcd (cluster/membership.py).

`init` makes the cluster once (its ID); `join` adds a node (vsan serve with a [cluster] table also joins by
itself at start); `leave` removes one that holds no replica; `status` shows the members, which are up, and
every replicated volume's primary, epoch and replicas in sync. Each talks to etcd directly (`--etcd`, or the
[cluster] table of `--config`). Errors are one line on stderr: exit 2 for a refused change, 1 when etcd
does not answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.table import Table

from openvsan.cli.pool import EXIT_FAILED, EXIT_USAGE, JsonOpt, _console, _fail, _print_json

cluster_app = typer.Typer(help="A cluster of nodes sharing state in etcd: init, join, leave, status.",
                          no_args_is_help=True)

T = TypeVar("T")
EtcdOpt = Annotated[str | None, typer.Option("--etcd", help="etcd client URLs, comma-separated (host:port,...); "
                                                            "default: [cluster] etcd of --config.")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="A node's config file (its [cluster]).")]


def _cluster_of(config: Path | None) -> Any:
    if config is None:
        return None
    from openvsan.node.config import ConfigError, load_config

    try:
        return load_config(config).cluster
    except ConfigError as e:
        _fail(str(e), EXIT_USAGE)


def _endpoints(etcd: str | None, config: Path | None) -> list[str]:
    if etcd:
        return [e.strip() for e in etcd.split(",") if e.strip()]
    c = _cluster_of(config)
    if c is None:
        _fail("give --etcd host:port[,host:port...] or --config FILE with a [cluster] table", EXIT_USAGE)
    return list(c.etcd)


def _run(endpoints: list[str], work: Callable[[Any], Awaitable[T]]) -> T:
    from openvsan.cluster import membership as M
    from openvsan.cluster.etcd import EtcdStateStore
    from openvsan.node.replicas import ETCD_PREFIX
    from openvsan.node.statestore import StoreError

    async def go() -> T:
        store = EtcdStateStore(endpoints, prefix=ETCD_PREFIX, timeout=5.0)
        try:
            return await work(store)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except (M.ClusterError, ValueError) as e:
        _fail(str(e), EXIT_USAGE)
    except StoreError as e:
        _fail(f"etcd at {', '.join(endpoints)}: {e}", EXIT_FAILED)


@cluster_app.command("etcd")
def cluster_etcd(
    name: Annotated[str, typer.Option("--name", help="This member's name (one of --peers).")],
    peers: Annotated[str, typer.Option("--peers", help="Every member: name=host[:peer_port],... (the two nodes "
                                                       "and the witness); peer port default 2380.")],
    client_port: Annotated[int, typer.Option("--client-port", help="Port for clients (vsan) on this member's "
                                                                  "host.")] = 2379,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="etcd's data (default ./etcd-NAME).")] = None,
) -> None:
    """Run one etcd member of the cluster's store in the foreground (Debian etcd-server): on each node and on
    a witness, a small third host whose only job is the third vote (StarWind's node majority)."""
    import os
    import shutil

    from openvsan.cluster.etcd_process import ETCD_PACKAGE

    members: dict[str, str] = {}
    for item in peers.split(","):
        n, _, where = item.strip().partition("=")
        if not n or not where:
            _fail(f"--peers: {item!r} is not name=host[:port]", EXIT_USAGE)
        members[n] = where if ":" in where.rsplit("]", 1)[-1] else f"{where}:2380"
    if name not in members:
        _fail(f"--name {name}: not one of --peers ({', '.join(members)})", EXIT_USAGE)
    binary = shutil.which("etcd")
    if binary is None:
        _fail(f"etcd not found on PATH: apt-get install -y {ETCD_PACKAGE}", EXIT_FAILED)
    host = members[name].rsplit(":", 1)[0]
    data = data_dir or Path(f"etcd-{name}")
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    argv = [binary, "--name", name, "--data-dir", str(data),
            "--listen-client-urls", f"http://{host}:{client_port}", "--advertise-client-urls",
            f"http://{host}:{client_port}", "--listen-peer-urls", f"http://{members[name]}",
            "--initial-advertise-peer-urls", f"http://{members[name]}",
            "--initial-cluster", ",".join(f"{n}=http://{w}" for n, w in members.items()),
            "--initial-cluster-state", "new", "--initial-cluster-token", "openvsan"]
    typer.echo(f"etcd member {name}: clients on {host}:{client_port}, peers {', '.join(members)}", err=True)
    os.execv(binary, argv)


@cluster_app.command("init")
def cluster_init(cluster_id: Annotated[str, typer.Option("--id", help="The cluster's ID ([cluster] id).")],
                 etcd: EtcdOpt = None, config: ConfigOpt = None) -> None:
    """Make the cluster in etcd, once (again with the same ID: nothing changes)."""
    from openvsan.cluster import membership as M

    _run(_endpoints(etcd, config), lambda s: M.init(s, cluster_id))
    typer.echo(f"cluster {cluster_id}: ready in etcd")


@cluster_app.command("join")
def cluster_join(name: Annotated[str, typer.Argument(help="The node's name ([node] name).")],
                 replication: Annotated[str, typer.Option("--replication",
                                                          help="host:port where peers reach its replicas.")],
                 cluster_id: Annotated[str, typer.Option("--id", help="The cluster's ID.")],
                 management: Annotated[str | None, typer.Option("--management", help="Its management address.")]
                 = None,
                 etcd: EtcdOpt = None, config: ConfigOpt = None) -> None:
    """Add a node to the cluster (vsan serve with a cluster table in its config does this itself at start)."""
    from openvsan.cluster import membership as M

    m = _run(_endpoints(etcd, config), lambda s: M.join(s, cluster_id, name, replication, management))
    typer.echo(f"node {m.name}: member {m.number} of cluster {cluster_id}, replicas at {m.replication}")


@cluster_app.command("leave")
def cluster_leave(name: Annotated[str, typer.Argument(help="The node's name.")],
                  etcd: EtcdOpt = None, config: ConfigOpt = None) -> None:
    """Remove a node that holds no replica."""
    from openvsan.cluster import membership as M
    from openvsan.replication import record as R

    async def work(store: Any) -> None:
        holds = [e.key[len(R.VOLUMES):] for e in await store.list(R.VOLUMES) if name in e.value.get("nodes", ())]
        await M.leave(store, name, holds=holds)

    _run(_endpoints(etcd, config), work)
    typer.echo(f"node {name}: left the cluster")


@cluster_app.command("status")
def cluster_status(etcd: EtcdOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Members (up or not), and every replicated volume's primary, epoch and replicas."""
    from openvsan.cluster import membership as M

    r = _run(_endpoints(etcd, config), M.status)
    if as_json:
        _print_json(r)
        return
    typer.echo(f"cluster {r['id']}")
    t = Table("node", "number", "up", "replication", "management")
    for n in r["nodes"]:
        t.add_row(n["name"], str(n["number"]), "yes" if n["up"] else "NO", n["replication"], n["management"] or "-")
    _console().print(t)
    if r["volumes"]:
        v = Table("volume", "primary", "epoch", "replicas", "out of sync")
        for x in r["volumes"]:
            v.add_row(x["volume"], x["primary"] or "none (election)", str(x["epoch"]), ", ".join(x["nodes"]),
                      ", ".join(f"{n} (since {e})" for n, e in x["out_of_sync"].items()) or "-")
        _console().print(v)
