"""The management commands: `vsan token` (the REST API's bearer tokens), `vsan health` (the node's health
report) and `vsan sessions` (who is connected).

Tokens (api/tokens.py) are kept hashed in the node's data dir: `vsan token` works whether or not `vsan serve`
runs (a running node sees a change at its next request); whoever may write the data dir is the node's
administrator, as for the control socket. A new token is printed once and kept nowhere."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from openvsan.cli.pool import ConfigOpt, DataDir, JsonOpt, _console, _data_dir, _fail, _print_json

token_app = typer.Typer(help="The REST API's tokens: create (shown once), list, revoke.", no_args_is_help=True)


def _book(data_dir: DataDir, config: ConfigOpt):  # type: ignore[no-untyped-def]
    from openvsan.api.tokens import TokenBook

    where = _data_dir(data_dir, config)
    if not where.is_dir():
        _fail(f"no data dir {where}: give the --data-dir of the node (or --config), or start `vsan serve` once")
    return TokenBook(where)


@token_app.command("create")
def create(name: Annotated[str, typer.Argument(help="A name for the token (who or what uses it).")],
           role: Annotated[str, typer.Option("--role", help="admin (may change things) or read-only.")] = "admin",
           data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Make a token for the REST API and the console; it is printed once: keep it."""
    from openvsan.api.tokens import TokenError

    try:
        entry, token = _book(data_dir, config).create(name, role)
    except (TokenError, OSError) as e:
        _fail(str(e))
    if as_json:
        _print_json({**entry.public(), "token": token})
        return
    typer.echo(token)
    typer.echo(f"(token {entry.name}, {entry.role}; shown once: send it as 'Authorization: Bearer TOKEN')", err=True)


@token_app.command("list")
def list_tokens(data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """The tokens there are (names, roles, when made; never the tokens)."""
    from openvsan.api.tokens import TokenError

    try:
        entries = [e.public() for e in _book(data_dir, config).entries()]
    except TokenError as e:
        _fail(str(e))
    if as_json:
        _print_json(entries)
        return
    if not entries:
        typer.echo("no API tokens")
        return
    table = Table("name", "id", "role", "created")
    for e in entries:
        table.add_row(str(e["name"]), str(e["id"]), str(e["role"]), str(e["created"]))
    _console().print(table)


@token_app.command("revoke")
def revoke(which: Annotated[str, typer.Argument(help="The token's name or id.")], data_dir: DataDir = None,
           config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Revoke a token: requests made with it are refused from now on."""
    from openvsan.api.tokens import TokenError

    try:
        entry = _book(data_dir, config).revoke(which)
    except (TokenError, OSError) as e:
        _fail(str(e))
    if as_json:
        _print_json(entry.public())
    else:
        typer.echo(f"token {entry.name} ({entry.id}) revoked")


SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
HEALTH_EXIT = {"healthy": 0, "warning": 1, "critical": 2}   # monitoring plugins' convention: OK, WARNING, CRITICAL


def health(data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """What is not right on the running node, why, and what to do (worst first). Exit 0 healthy, 1 warning,
    2 critical."""
    from openvsan.cli.pool import _call

    r = _call(data_dir, config, "node.health")
    if as_json:
        _print_json(r)
    else:
        out = _console()
        style = {"healthy": "green", **SEVERITY_STYLE}[r["status"]]
        out.print(f"node health: [{style}]{r['status']}[/]", highlight=False)
        for f in r["findings"]:
            out.print(f"[{SEVERITY_STYLE[f['severity']]}]{f['severity']:8}[/] {f['what']}", highlight=False,
                      soft_wrap=True)
            out.print(f"         why: {f['why']}", highlight=False, soft_wrap=True)
            out.print(f"         do:  {f['action']}", highlight=False, soft_wrap=True)
    raise typer.Exit(HEALTH_EXIT[r["status"]])


def sessions(data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Who is connected to the running node: every iSCSI, NVMe/TCP and NBD connection, from where, as whom."""
    from openvsan.cli.pool import _call

    rows = _call(data_dir, config, "node.sessions")
    if as_json:
        _print_json(rows)
        return
    if not rows:
        typer.echo("nobody is connected")
        return
    table = Table("protocol", "from", "state", "who", "to", "session", *(["worker"] if any("worker" in r for r in rows)
                                                                      else []))
    for r in rows:
        ident = (f"TSIH {r['tsih']}, ISID {r['isid']}" if "tsih" in r
                 else f"controller {r['controller']}, queue {r['queue']}" if "controller" in r else "")
        to = (r.get("target") or r.get("subsystem") or r.get("export") or "") + (" (TLS)" if r.get("tls") else "")
        table.add_row(r["protocol"], r["peer"], r["state"], r.get("initiator") or r.get("host") or "", to, ident,
                      *([str(r.get("worker", ""))] if "worker" in r else []))
    _console().print(table)


def events(after: Annotated[int, typer.Option("--after", help="Only events with a higher id.")] = 0,
           limit: Annotated[int, typer.Option("--limit", help="At most this many (the newest).")] = 50,
           follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events.")] = False,
           data_dir: DataDir = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """The running node's events, oldest first: alerts raised and cleared (from the health report), and the
    changes made to it (by the CLI, the API or the console)."""
    import json
    import time

    from openvsan.cli.pool import _call

    while True:
        rows = _call(data_dir, config, "node.events", after=after, limit=limit)
        if as_json and not follow:
            _print_json(rows)
            return
        for e in rows:
            if as_json:
                typer.echo(json.dumps(e))
            else:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"]))
                typer.echo(f"{e['id']:>6} {when} {e['kind']:8} {e['severity']:8} {e['object']}: {e['message']}")
            after = max(after, e["id"])
        if not follow:
            return
        time.sleep(1.0)
