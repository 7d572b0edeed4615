"""Where the CLI sends a running node's commands: its control socket (the local default, and the way in before
any token exists), or, with `vsan --node URL` (or $VSAN_NODE), that node's REST API with a bearer token
(`--token`, $VSAN_TOKEN, or `--token-file`). Both carry the same commands with the same arguments and give
the same one-line refusals, so every `vsan volume|export|qos|pool|snapshot|workers|health` command works on
a remote node as on a local one.

Over the API a command is `POST /api/v1/commands/{cmd}` with its arguments as the JSON body (api/app.py);
with `--member NAME` it is `POST /api/v1/nodes/NAME/commands/{cmd}`: the node forwards it to that member of
its cluster (api/peers.py), so one node's address and token reach the whole cluster;
`vsan config apply FILE` reads the file here and sends its contents (paths in it are the remote node's).
"""

from __future__ import annotations

import json
import ssl
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Remote:
    url: str
    token: str
    ca: Path | None = None
    member: str | None = None    # another member of the node's cluster, reached through it (api/peers.py)

    def call(self, cmd: str, timeout: float | None, args: dict[str, Any]) -> Any:
        from openvsan.node.control import ControlError, NotRunning

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
        ctx = ssl.create_default_context(cafile=str(self.ca)) if self.ca is not None else None
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            try:
                problem = json.loads(e.read())
                detail = problem.get("detail") or problem.get("title")
            except ValueError:
                detail = None
            raise ControlError(str(detail or f"{self.url}: HTTP {e.code} {e.reason}")) from None
        except urllib.error.URLError as e:
            raise NotRunning(f"no node answers at {self.url}: {e.reason}") from None
        except TimeoutError:
            raise ControlError(f"no answer from {self.url} within {timeout:g} s") from None


REMOTE: Remote | None = None     # set by `vsan --node URL` (cli/main.py)


def node_call(data_dir: Callable[[], Path], cmd: str, *, timeout: float | None = 30.0, **args: Any) -> Any:
    """One command to the node: over the REST API with --node, else its control socket in `data_dir()`."""
    if REMOTE is not None:
        return REMOTE.call(cmd, timeout, args)
    from openvsan.node.control import call

    return call(data_dir(), cmd, timeout=timeout, **args)
