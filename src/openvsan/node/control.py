"""The node's control socket: `<data_dir>/control.sock`, served by `vsan serve`, used by `vsan pool ...` (and
later by the REST API).

A unix stream socket, mode 0600 in the 0700 data dir: whoever can reach it is the node's administrator. The
protocol is JSON lines, one request and one response per line, in order:

    {"cmd": "pool.status", "args": {"name": "pool0"}}
    {"ok": true, "result": {...}}          or          {"ok": false, "error": "one line for the user"}

The commands and their arguments are the node's (`Node.control`); this module only moves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("openvsan.node.control")

SOCKET_NAME = "control.sock"
MAX_LINE = 1 << 20
# sun_path holds 108 bytes with the NUL (unix(7)); a longer path is reached through the directory's fd
_SUN_PATH_MAX = 107


class ControlError(RuntimeError):
    """A request the node refused or could not do; str() is the node's one line."""


class NotRunning(ControlError):
    """No `vsan serve` answers on the socket."""


class RequestError(ValueError):
    """A request that names something that is not there, or asks for the impossible (sent back as the error)."""


class NotFound(RequestError):
    """The request names a volume, export or snapshot that is not there (the REST API's 404)."""


class Conflict(RequestError):
    """The request clashes with what is there: a name taken, a volume still exported, a change the node makes
    only at a restart (the REST API's 409)."""


class Stale(RequestError):
    """The request was made against a revision of the desired state that is no longer the node's (the REST
    API's 412, for If-Match)."""


def check_revision(now: int | None, expected: int | None) -> None:
    """Raise Stale unless the desired state is at `expected` (None: no condition)."""
    if expected is not None and now != expected:
        raise Stale(f"the node's desired state is at revision {now}, not {expected}: it changed since it was "
                    "read; read it again and retry")


# the commands that change nothing (a read-only API token may send them; the event log does not record them)
READ_COMMANDS = frozenset({"volume.list", "volume.show", "volume.status", "export.list", "qos.show", "config.show",
                           "node.info", "node.health", "device.list", "cluster.status", "node.sessions", "node.events", "node.metrics", "pool.list", "pool.status",
                           "snapshot.list", "workers.list"})

Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]


def socket_path(data_dir: Path) -> Path:
    return data_dir / SOCKET_NAME


@contextlib.contextmanager
def _reachable(path: Path) -> Iterator[str]:
    """A name for `path` that fits in sun_path: itself, or /proc/self/fd/N/NAME through an fd of its directory."""
    if len(os.fsencode(str(path))) <= _SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


@dataclass
class ControlServer:
    path: Path
    handler: Handler
    _server: asyncio.AbstractServer | None = None
    _clients: set[asyncio.Task[None]] | None = None

    async def start(self) -> None:
        # the data dir lock is held: a socket file left here is from a serve that died, never a live one
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._clients = set()
        with _reachable(self.path) as where:
            self._server = await asyncio.start_unix_server(self._client, path=where, limit=MAX_LINE)
        os.chmod(self.path, 0o600)
        log.debug("control socket %s", self.path)

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        self._server = None
        for task in list(self._clients or ()):
            task.cancel()
        if self._clients:
            await asyncio.gather(*self._clients, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self._clients is not None
        self._clients.add(task)
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    writer.write(_encode({"ok": False, "error": f"request longer than {MAX_LINE} bytes"}))
                    break
                if not line:
                    break
                writer.write(_encode(await self._answer(line)))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._clients.discard(task)
            writer.close()
            # a second cancel (a second SIGTERM cancels the node's stop, and the stop's gather cancels this
            # again) lands here: the task must still end normally, since asyncio's streams ask a cancelled
            # client task for its exception, which raises in their callback (a Traceback in the log)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer.wait_closed()

    async def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line)
            if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
                raise RequestError('a request is a JSON object {"cmd": "...", "args": {...}}')
            args = req.get("args") or {}
            if not isinstance(args, dict):
                raise RequestError("args must be a JSON object")
            return {"ok": True, "result": await self.handler(req["cmd"], args)}
        except json.JSONDecodeError as e:
            return {"ok": False, "error": f"not JSON: {e}"}
        except (RequestError, ValueError, KeyError, RuntimeError, OSError) as e:
            # PoolError is a ValueError, DeviceFailed a RuntimeError's cousin: their text is meant for the user
            # a refusal says why in its line; anything else may be a bug: its traceback, at debug level
            log.debug("control request refused: %s", _one_line(e), exc_info=not isinstance(e, RequestError))
            return {"ok": False, "error": _one_line(e), "kind": error_kind(e)}
        except Exception as e:
            log.exception("control request failed")
            return {"ok": False, "error": f"internal error: {type(e).__name__}: {_one_line(e)}", "kind": "internal"}


# a refusal's class, carried in the reply ("kind") so that a supervisor raises the same class as its worker
# did, and the REST API answers a volume's refusal with the same status whichever process owns the volume
_KINDS: dict[str, type[Exception]] = {"not-found": NotFound, "conflict": Conflict, "stale": Stale,
                                      "refused": RequestError}


def error_kind(e: BaseException) -> str:
    """The kind of a refusal: its class's, or the one a worker's reply gave it (node/workers.py WorkerError)."""
    kind = getattr(e, "kind", None)
    if kind in _KINDS:
        return str(kind)
    for kind, cls in _KINDS.items():
        if isinstance(e, cls):
            return kind
    return "refused" if isinstance(e, (ValueError, KeyError)) else "failed"


KIND_STATUS = {"not-found": 404, "conflict": 409, "stale": 412, "refused": 422}   # the REST API's status


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, KeyError) and e.args:
        text = str(e.args[0])
    return " ".join(text.split())


def _encode(obj: Any) -> bytes:
    return (json.dumps(obj, default=str) + "\n").encode()


def call(data_dir: Path, cmd: str, *, timeout: float | None = 30.0, **args: Any) -> Any:
    """Send one request to the serve of `data_dir` and return its result (blocking: for the CLI).

    Raises NotRunning when nothing answers there, ControlError with the node's line when it refuses."""
    path = socket_path(data_dir)
    if not path.exists():
        raise NotRunning(f"no vsan serve is running with data dir {data_dir} ({path} does not exist); start "
                         "`vsan serve`, or pass the --data-dir it uses")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            with _reachable(path) as where:
                s.connect(where)
        except (ConnectionRefusedError, FileNotFoundError):
            raise NotRunning(f"no vsan serve is running with data dir {data_dir} (nothing answers on {path}); "
                             "start `vsan serve`, or pass the --data-dir it uses") from None
        except PermissionError:
            raise ControlError(f"{path}: permission denied; run as the user that runs vsan serve") from None
        s.sendall(_encode({"cmd": cmd, "args": args}))
        buf = b""
        try:
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    raise ControlError("vsan serve closed the control connection without an answer (did it stop?)")
                buf += chunk
        except TimeoutError:
            raise ControlError(f"no answer from vsan serve within {timeout:g} s") from None
    reply = json.loads(buf)
    if not reply.get("ok"):
        raise ControlError(str(reply.get("error", "the node refused the request")))
    return reply.get("result")
