"""Where the CLI sends a running node's commands: its REST API. With `vsan --node URL` (or $VSAN_NODE) that
node's, with a bearer token (`--token`, $VSAN_TOKEN, or `--token-file`); else the local node's, with the
token it made for its local CLI at start (`<data_dir>/api-local.json`, readable only by the user that runs
it). The control socket stays for a local node without an API (`[api] enabled = false`, or a node run in a
test's process), for a node whose API is not up yet, and for `vsan config apply FILE` (the file as this host
sees it, relative paths included). Both carry the same commands with the same arguments and give the same
one-line refusals, so every `vsan volume|export|qos|pool|snapshot|workers|health` command works the same on
a remote node as on a local one.

Over the API a command is `POST /api/v1/commands/{cmd}` with its arguments as the JSON body (api/app.py);
with `--member NAME` it is `POST /api/v1/nodes/NAME/commands/{cmd}`: the node forwards it to that member of
its cluster (api/peers.py), so one node's address and token reach the whole cluster;
`vsan config apply FILE` reads the file here and sends its contents (paths in it are the remote node's).
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openvsan.node.control import ControlError, NotRunning


class Unreachable(NotRunning):
    """Nothing listens at the API's address: the request was not sent."""


@dataclass
class Remote:
    url: str
    token: str
    ca: Path | None = None
    member: str | None = None    # another member of the node's cluster, reached through it (api/peers.py)
    pinned: bool = False         # `ca` is the node's own certificate (the local API): trust it, whatever its name

    def _tls(self) -> ssl.SSLContext | None:
        if self.ca is None:
            return None
        ctx = ssl.create_default_context(cafile=str(self.ca))
        if self.pinned:
            ctx.check_hostname = False
            ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN    # the certificate itself, CA-signed or not
        return ctx

    def call(self, cmd: str, timeout: float | None, args: dict[str, Any]) -> Any:
        if cmd == "config.apply":     # the file is here, the node is there: send what it says
            path = Path(args.pop("path"))
            try:
                args["document"] = tomllib.loads(path.read_text())
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ControlError(f"{path}: {e}") from None
            cmd = "config.put"
        via = f"/api/v1/nodes/{self.member}" if self.member else "/api/v1"
        req = urllib.request.Request(f"{self.url.rstrip('/')}{via}/commands/{cmd}", method="POST",
                                     data=json.dumps(args).encode(),
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self._tls()) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            try:
                problem = json.loads(e.read())
                detail = problem.get("detail") or problem.get("title")
            except ValueError:
                detail = None
            raise ControlError(str(detail or f"{self.url}: HTTP {e.code} {e.reason}")) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise ControlError(f"no answer from {self.url} within {timeout:g} s") from None
            if isinstance(e.reason, (ConnectionRefusedError, FileNotFoundError)):
                raise Unreachable(f"no node answers at {self.url}: {e.reason}") from None
            raise NotRunning(f"no node answers at {self.url}: {e.reason}") from None
        except TimeoutError:
            raise ControlError(f"no answer from {self.url} within {timeout:g} s") from None
        except (http.client.HTTPException, ConnectionError) as e:   # sent, and no answer came back
            raise ControlError(f"{self.url} closed the connection without an answer ({type(e).__name__}): the "
                               "command may or may not have been done; look before doing it again") from None


REMOTE: Remote | None = None     # set by `vsan --node URL` (cli/main.py)
SOCKET_ONLY = ("config.apply",)  # names a file as this host sees it: the control socket reads it there


def local_api(data_dir: Path) -> Remote | None:
    """The API of the node running with `data_dir`, as it told its local CLI (api/server.py LOCAL_API), or None
    (no API, or the file of a node that is gone)."""
    from openvsan.api.server import LOCAL_API

    try:
        doc = json.loads((data_dir / LOCAL_API).read_text())
        os.kill(int(doc["pid"]), 0)
        return Remote(str(doc["url"]), str(doc["token"]), Path(doc["cert"]) if doc.get("cert") else None,
                      pinned=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def node_call(data_dir: Callable[[], Path], cmd: str, *, timeout: float | None = 30.0, **args: Any) -> Any:
    """One command to the node: over the REST API (the one --node names, else the local node's), or, for a
    local node without an API (or for a command that names a file here), its control socket in `data_dir()`."""
    if REMOTE is not None:
        return REMOTE.call(cmd, timeout, args)
    from openvsan.node.control import call

    where = data_dir()
    local = local_api(where) if cmd not in SOCKET_ONLY else None
    if local is not None:
        try:
            return local.call(cmd, timeout, dict(args))
        except Unreachable:
            pass        # the node is stopping (its API closed first) or was killed: the socket says which
    return call(where, cmd, timeout=timeout, **args)
