"""The REST API inside `vsan serve`: uvicorn on the node's own event loop (the supervisor's when the node runs
worker processes, so the data path never waits for it), beside the control socket.

[api] (node/specs.py ApiSpec) says where. Without the table the node tries 127.0.0.1:8080 and goes on
without an API if that address is taken (a second node on one host, a test run); with it, an address that
cannot be bound, or a certificate that cannot be loaded, stops the start with one line. The address is
bound before the node reports itself up; the web framework is loaded after, off the event loop (it takes
about half a second), so a node restart serves its initiators no later for having an API: until then the
API's connections wait in the listen queue. At the first start with no token, an admin token is made and
printed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from openvsan.api.peers import api_url
from openvsan.api.tokens import TokenBook
from openvsan.node.specs import ApiSpec, NodeConfig

log = logging.getLogger("openvsan.api")
logging.getLogger("uvicorn.error").setLevel(logging.WARNING)   # not its "Started server process" lines


LOCAL_API = "api-local.json"     # in the data dir, 0600: the running node's API for its own CLI (cli/remote.py)


class ApiStartError(RuntimeError):
    """The API asked for in [api] cannot start (address in use, unreadable certificate)."""


def _bind(spec: ApiSpec) -> socket.socket:
    host, port = spec.listen.host, spec.listen.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _check_tls(spec: ApiSpec) -> None:
    if spec.tls is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(spec.tls.cert), str(spec.tls.key))
    except (OSError, ssl.SSLError) as e:
        raise ApiStartError(f"api.tls: cannot load the certificate {spec.tls.cert} with the key {spec.tls.key}: "
                            f"{getattr(e, 'strerror', None) or e}") from None


def _load_app(handler: Any, tokens: TokenBook, peers: Any) -> Any:
    """The app (imports FastAPI: run off the loop)."""
    from openvsan.api.app import make_app
    from openvsan.api.metrics import node_metrics

    async def metrics() -> bytes:
        return await node_metrics(handler)

    return make_app(handler, tokens, metrics=metrics, peers=peers)


class ApiServer:
    """uvicorn serving the API app on a socket bound at start (so the address is known, port 0 included)."""

    def __init__(self, sock: socket.socket, spec: ApiSpec, handler: Any, data_dir: Path,
                 cfg: NodeConfig | None = None) -> None:
        from openvsan.api.peers import Peers

        self.sock, self.spec, self.handler = sock, spec, handler
        self.peers = Peers(cfg) if cfg is not None and cfg.cluster is not None else None
        self.tokens = TokenBook(data_dir)
        self.scheme = "https" if spec.tls is not None else "http"
        self.server: Any = None
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        host, port = sock.getsockname()[:2]   # now: uvicorn closes the socket when it stops
        self.address = api_url(self.scheme, host, port)
        self.local_file = data_dir / LOCAL_API
        self._tell_local_cli(host, port)

    def _tell_local_cli(self, host: str, port: int) -> None:
        """Where the CLI on this host reaches this API, with a token made for it now (no file holds it but
        this one, readable by the user that runs the node, as the control socket is): so the local `vsan`
        commands go through the API, as remote ones do. Removed at stop; a node killed leaves it behind, with
        its pid, which the CLI checks."""
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1" if host == "0.0.0.0" else "::1"
        doc = {"url": api_url(self.scheme, host, port), "token": self.tokens.local_token(), "pid": os.getpid(),
               "cert": str(self.spec.tls.cert) if self.spec.tls is not None else None}
        tmp = self.local_file.with_name(LOCAL_API + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, json.dumps(doc).encode())
            finally:
                os.close(fd)
            os.replace(tmp, self.local_file)
        except OSError as e:
            log.warning("REST API: cannot write %s (%s); the local CLI uses the control socket", self.local_file,
                        e.strerror)

    def launch(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            app = await asyncio.to_thread(_load_app, self.handler, self.tokens, self.peers)
            import uvicorn

            class Embedded(uvicorn.Server):
                @contextlib.contextmanager
                def capture_signals(self) -> Iterator[None]:   # vsan serve's own handlers stay
                    yield

            tls = self.spec.tls
            config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, server_header=False,
                                    proxy_headers=False, timeout_graceful_shutdown=2,
                                    ssl_certfile=str(tls.cert) if tls is not None else None,
                                    ssl_keyfile=str(tls.key) if tls is not None else None)
            self.server = Embedded(config)
            if not self.tokens.entries():     # before the first request can be answered
                _, token = self.tokens.create("initial", "admin")
                log.warning("REST API: the first admin token (shown once; `vsan token create` makes more): %s",
                            token)
            serving = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
            while not self.server.started and not serving.done():
                await asyncio.sleep(0.01)
            if self.server.started and not self.server.should_exit:
                log.info("REST API and console on %s (OpenAPI: %s/api/v1/openapi.json)", self.address,
                         self.address)
                self.ready.set()
            await serving
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("REST API: stopped with an error; the node goes on serving its volumes without it")

    async def stop(self) -> None:
        if self._task is not None:
            if self.server is not None:
                self.server.should_exit = True
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._task), 5)
            if not self._task.done():
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._task
            self._task = None
        if self.peers is not None:
            with contextlib.suppress(Exception):
                await self.peers.close()
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.local_file.read_text()).get("pid") == os.getpid():
                self.local_file.unlink()
        self.sock.close()


async def start_api(cfg: NodeConfig, data_dir: Path, handler: Any) -> ApiServer | None:
    """The API of a node whose control commands `handler` answers (its address bound now, served shortly
    after), or None (off, or the default address taken). Raises ApiStartError when [api] asks for one that
    cannot start."""
    spec = cfg.api if cfg.api is not None else ApiSpec()
    if not spec.enabled:
        log.info("REST API: off ([api] enabled = false)")
        return None
    _check_tls(spec)
    try:
        sock = _bind(spec)
    except OSError as e:
        if cfg.api is None:
            log.warning("REST API: not started: %s is taken (%s); add an [api] table with listen = "
                        '"127.0.0.1:PORT" to serve it elsewhere', spec.listen, e.strerror)
            return None
        raise ApiStartError(f"api.listen: cannot listen on {spec.listen}: {e.strerror}") from None
    server = ApiServer(sock, spec, handler, data_dir, cfg)
    server.launch()
    return server
