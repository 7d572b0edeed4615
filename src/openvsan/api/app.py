"""The REST API (FastAPI): the node's control commands (node/live.py, node/pools.py, node/groups.py) as
resources under /api/v1, with bearer tokens (api/tokens.py), RFC 9457 problem details and /metrics.

Every route calls the same command the CLI sends over the control socket, with the same typed request body
(node/requests.py: the OpenAPI schema of each body is generated from it), so both give the same answers and
the same one-line errors. A change is applied before the answer comes (the node reconciles while it serves),
so a write returns the new revision of the desired state (also as ETag) with actual state already matching;
`If-Match: "<revision>"` makes it conditional (412 if the state moved on). Reads need a token of any role,
writes an `admin` one; only /healthz needs none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException

from openvsan.api.peers import ANSWER_HEADERS, HEADER, Forwarded, Peers
from openvsan.api.tokens import TokenBook, TokenEntry
from openvsan.node import requests as R
from openvsan.node.control import KIND_STATUS, READ_COMMANDS, Conflict, NotFound, RequestError, Stale

log = logging.getLogger("openvsan.api")

Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]
PROBLEM = "application/problem+json"
FAILURES_ALLOWED = 10          # failed authentications from one address within FAILURE_WINDOW ...
FAILURE_WINDOW = 60.0          # ... seconds before its requests get 429 for the rest of the window


class Problem(Exception):
    """An RFC 9457 answer: status, a short title, and the one-line detail the CLI would print."""

    def __init__(self, status: int, detail: str, title: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers or {}
        self.title = title or _TITLES.get(status, "Error")


_TITLES = {400: "Bad request", 401: "Not authenticated", 403: "Forbidden", 404: "Not found",
           405: "Method not allowed", 409: "Conflict", 412: "Precondition failed", 422: "Invalid request",
           429: "Too many failed authentications", 500: "Internal error", 502: "Member not reachable",
           503: "Cluster store not reachable", 504: "Member did not answer"}


def _problem_response(p: Problem, instance: str) -> JSONResponse:
    return JSONResponse({"type": "about:blank", "title": p.title, "status": p.status, "detail": p.detail,
                         "instance": instance}, status_code=p.status, media_type=PROBLEM, headers=p.headers)


def _status_of(e: BaseException) -> int:
    """The HTTP status of a command's refusal (its line is the detail)."""
    if isinstance(e, NotFound):
        return 404
    if isinstance(e, Conflict):
        return 409
    if isinstance(e, Stale):
        return 412
    if getattr(e, "kind", None) in KIND_STATUS:     # a worker's refusal, passed on by its supervisor
        return KIND_STATUS[e.kind]  # type: ignore[attr-defined]
    if isinstance(e, (RequestError, ValueError, KeyError)):
        return 422
    return 500


def _line(e: BaseException) -> str:
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else (str(e) or type(e).__name__)
    return " ".join(text.split())


class FailedAuth:
    """Failed authentications per client address: each is logged; past FAILURES_ALLOWED in FAILURE_WINDOW
    seconds, the address gets 429 until the window has passed (a token cannot be guessed at request rate)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by: dict[str, list[float]] = {}

    def blocked(self, who: str) -> float:
        """Seconds `who` must wait, or 0."""
        now = self.clock()
        times = [t for t in self._by.get(who, ()) if now - t < FAILURE_WINDOW]
        if times:
            self._by[who] = times
        else:
            self._by.pop(who, None)
        return FAILURE_WINDOW - (now - times[0]) if len(times) >= FAILURES_ALLOWED else 0.0

    def failed(self, who: str, why: str) -> None:
        self._by.setdefault(who, []).append(self.clock())
        n = len(self._by[who])
        if n <= FAILURES_ALLOWED:
            log.warning("API: authentication failed from %s (%s)", who, why)
        if n == FAILURES_ALLOWED:
            log.warning("API: %s failed %d times in %g s; its requests are refused for a while", who, n,
                        FAILURE_WINDOW)


def _body_schema(body: type[Any]) -> dict[str, Any]:
    """The request body's JSON schema from its typed declaration (node/requests.py), referencing the
    components the custom OpenAPI document gathers."""
    return TypeAdapter(body).json_schema(ref_template="#/components/schemas/{model}")


def _body(body: type[Any], *, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    schema = _body_schema(body)
    schema.pop("$defs", None)
    for key in drop:
        schema.get("properties", {}).pop(key, None)
        if key in schema.get("required", ()):
            schema["required"] = [r for r in schema["required"] if r != key]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# ---- who is asking (module level: FastAPI reads these annotations from the module's names)

COOKIE = "vsan_session"       # the console's login: the token, HttpOnly, SameSite=Strict (web/console.py)
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


async def caller(request: Request, authorization: str | None = Header(default=None)) -> TokenEntry:
    """The token entry of the request's bearer token (or the console's session cookie, or another member's
    signature on a request it forwarded: api/peers.py); 401 without a valid one, 429 while its address is
    held back (a valid token is served even then). A change made with the cookie must come from the
    console's own scripts (an HX-Request or X-Requested-With header, which another site's page cannot send
    without CORS, which this API does not allow)."""
    tokens: TokenBook = request.app.state.tokens
    failures: FailedAuth = request.app.state.failures
    who = request.client.host if request.client is not None else "?"
    forwarded = request.headers.get(HEADER)
    if forwarded is not None and not authorization:
        return await _forwarded_by(request, forwarded, who)
    scheme, _, token = (authorization or "").partition(" ")
    cookie = request.cookies.get(COOKIE) if not authorization else None
    if cookie is not None:
        scheme, token = "bearer", cookie
    entry = tokens.verify(token.strip()) if scheme.lower() == "bearer" else None
    if entry is not None:
        if cookie is not None and request.method not in SAFE_METHODS and not (
                request.headers.get("hx-request") or request.headers.get("x-requested-with")):
            raise Problem(403, "a change made with the console's session must come from the console (cross-site "
                          "request refused)")
        request.state.token = entry
        return entry
    wait = failures.blocked(who)
    if wait:
        raise Problem(429, f"too many failed authentications from {who}; retry in {wait:.0f} s",
                      headers={"Retry-After": str(max(1, round(wait)))})
    if not authorization:
        failures.failed(who, "no token")
        raise Problem(401, "this request needs an API token: send 'Authorization: Bearer <token>' "
                      "(`vsan token create` makes one)", headers={"WWW-Authenticate": "Bearer"})
    failures.failed(who, "unknown or revoked token" if scheme.lower() == "bearer" else f"{scheme} scheme")
    raise Problem(401, "the API token is not valid (unknown, revoked or mistyped)",
                  headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})


async def _forwarded_by(request: Request, header: str, who: str) -> TokenEntry:
    """A request another member forwarded (api/peers.py): served with the role that member checked."""
    from openvsan.api.peers import ForwardError, verify

    failures: FailedAuth = request.app.state.failures
    peers: Peers | None = request.app.state.peers
    wait = failures.blocked(who)
    if wait:
        raise Problem(429, f"too many failed authentications from {who}; retry in {wait:.0f} s",
                      headers={"Retry-After": str(max(1, round(wait)))})
    if peers is None or not peers.clustered:
        failures.failed(who, "a forwarded request, and this node is in no cluster")
        raise Problem(401, "a forwarded request, and this node is in no cluster")
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    try:
        f = verify(await peers.key(), request.method, target, await request.body(), header, peers.seen)
    except ForwardError as e:
        failures.failed(who, str(e))
        raise Problem(401, f"{e}; refused") from None
    if f.role not in ("admin", "read-only"):
        raise Problem(403, f"a request forwarded by {f.node} with role {f.role!r}")
    entry = TokenEntry("peer", f"{f.token}@{f.node}", f.role, "", f.at)
    request.state.token = entry
    return entry


Reader = Annotated[TokenEntry, Depends(caller)]


def admin(entry: Reader) -> TokenEntry:
    if entry.role != "admin":
        raise Problem(403, f"token {entry.name} is {entry.role}: changes need an admin token")
    return entry


Admin = Annotated[TokenEntry, Depends(admin)]


def make_app(handler: Handler, tokens: TokenBook, *, metrics: Callable[[], Awaitable[bytes]] | None = None,
             failed: FailedAuth | None = None, peers: Peers | None = None) -> FastAPI:
    """The API app over `handler` (the node's control commands: Node.control or Supervisor.control);
    `peers`: the other members of its cluster, reached through /api/v1/nodes/{node}/..."""
    app = FastAPI(title="openvsan", version="1", summary="An open-source virtual SAN: its REST API",
                  docs_url="/api/docs", redoc_url=None, openapi_url="/api/v1/openapi.json")
    app.state.tokens, app.state.failures, app.state.peers = tokens, failed or FailedAuth(), peers
    bodies: list[type[Any]] = []

    # ---- errors: RFC 9457 problem details with the one line

    @app.exception_handler(Problem)
    async def _problem(request: Request, p: Problem) -> JSONResponse:
        return _problem_response(p, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _problem_response(Problem(e.status_code, str(e.detail)), request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("API: %s %s failed", request.method, request.url.path)
        return _problem_response(Problem(500, f"internal error: {type(e).__name__}: {_line(e)}"), request.url.path)


    async def run(cmd: str, args: dict[str, Any] | None = None) -> Any:
        try:
            return await handler(cmd, args or {})
        except Exception as e:
            status = _status_of(e)
            if status == 500 and isinstance(e, (RuntimeError, OSError)):
                # a device or worker that failed: its text is meant for the user (as on the control socket)
                log.warning("API: command %s failed: %s", cmd, _line(e))
            elif status == 500:
                log.exception("API: command %s failed", cmd)
            raise Problem(status, _line(e)) from None

    async def change(cmd: str, args: dict[str, Any], if_match: str | None, response: Response) -> Any:
        """A command that changes desired state: conditional on If-Match, answered with the new revision."""
        from openvsan.node.live import EXPECTED_REVISION

        expect = None
        if if_match is not None and if_match.strip() != "*":
            try:
                expect = int(if_match.strip().removeprefix("W/").strip('"'))
            except ValueError:
                raise Problem(400, f'If-Match {if_match!r}: give a revision, e.g. If-Match: "12"') from None
        mark = EXPECTED_REVISION.set(expect)
        try:
            out = await run(cmd, args)
        finally:
            EXPECTED_REVISION.reset(mark)
        info = await run("node.info")
        response.headers["ETag"] = f'"{info["revision"]}"'
        if isinstance(out, dict):
            out = {**out, "revision": info["revision"]}
        return out

    async def revision_tag(response: Response) -> None:
        info = await run("node.info")
        response.headers["ETag"] = f'"{info["revision"]}"'

    def documented(body: type[Any], **kw: Any) -> dict[str, Any]:
        bodies.append(body)
        return _body(body, **kw)

    async def json_body(request: Request) -> dict[str, Any]:
        if not await request.body():
            return {}
        try:
            doc = await request.json()
        except ValueError as e:
            raise Problem(400, f"the body is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise Problem(422, "the body must be a JSON object")
        return doc

    # ---- health, node, config

    @app.get("/healthz", tags=["node"], summary="Liveness (no token needed)")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1", tags=["node"], summary="What this API serves")
    async def index(_: Reader) -> dict[str, Any]:
        return {"resources": ["/api/v1/node", "/api/v1/cluster", "/api/v1/health", "/api/v1/config", "/api/v1/volumes", "/api/v1/devices", "/api/v1/exports",
                              "/api/v1/pools", "/api/v1/sessions", "/api/v1/events", "/api/v1/workers", "/api/v1/tokens/self", "/api/v1/nodes", "/metrics"],
                "openapi": "/api/v1/openapi.json"}

    @app.get("/api/v1/node", tags=["node"], summary="This node: name, version, desired-state revision")
    async def node(_: Reader, response: Response) -> Any:
        info = await run("node.info")
        response.headers["ETag"] = f'"{info["revision"]}"'
        return info

    @app.get("/api/v1/health", tags=["node"],
             summary="What is not right, why, and what to do (vsan health); status: healthy, warning, critical")
    async def health(_: Reader) -> Any:
        return await run("node.health")

    @app.get("/api/v1/stats", tags=["metrics"],
             summary="Every volume's I/O counters now (the console's live charts: rates are their differences)")
    async def stats(_: Reader) -> Any:
        m = await run("node.metrics")
        return {"t": time.time(), "volumes": [
            {"name": name, **{f"{d}_{k}": v["io"][d][k] for d in ("read", "write") for k in ("ops", "bytes",
                                                                                           "seconds")}}
            for name, v in sorted(m["volumes"].items())]}

    @app.get("/api/v1/tokens/self", tags=["node"], summary="The token this request was made with")
    async def token_self(entry: Reader) -> Any:
        return entry.public()

    @app.get("/api/v1/config", tags=["config"], summary="The whole desired state, as a config document")
    async def config_get(_: Reader, response: Response) -> Any:
        await revision_tag(response)
        return await run("config.show")

    @app.put("/api/v1/config", tags=["config"], summary="Replace the whole desired state (vsan config apply)",
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"type": "object", "description": "a config document, as GET /api/v1/config gives"}}}}})
    async def config_put(_: Admin, request: Request, response: Response, dry_run: bool = Query(False),
                         if_match: str | None = Header(default=None)) -> Any:
        return await change("config.put", {"document": await json_body(request), "dry_run": dry_run}, if_match,
                            response)

    # ---- volumes

    @app.get("/api/v1/volumes", tags=["volumes"], summary="Every volume, with its stack and statistics")
    async def volumes(_: Reader, response: Response) -> Any:
        await revision_tag(response)
        return await run("volume.list")

    @app.get("/api/v1/volumes/{name}", tags=["volumes"], summary="One volume")
    async def volume(_: Reader, name: str, response: Response) -> Any:
        await revision_tag(response)
        return await run("volume.show", {"name": name})

    @app.put("/api/v1/volumes/{name}", tags=["volumes"], status_code=200,
             summary="Create the volume, or bring an existing one to this spec (its size, its QoS)",
             openapi_extra=documented(R.VolumeCreate, drop=("name", "dry_run")))
    async def volume_put(_: Admin, name: str, request: Request, response: Response, dry_run: bool = Query(False),
                         if_match: str | None = Header(default=None)) -> Any:
        spec = await json_body(request)
        if spec.get("name", name) != name:
            raise Problem(422, f"name: the body names {spec['name']!r}, the path {name!r}; leave it out of the body")
        qos = spec.pop("qos", None)
        listed = {v["name"]: v for v in await run("volume.list")}
        if name not in listed:
            made = await change("volume.create", {**spec, "name": name, "dry_run": dry_run}, if_match, response)
            response.status_code = 201
            response.headers["Location"] = f"/api/v1/volumes/{name}"
            if qos:    # a second change (a failure here leaves the volume made, without its limits: 422 says so)
                made = await change("qos.set", {"volume": name, "limits": qos, "clear": True, "dry_run": dry_run},
                                    None, response)
            return made
        have = listed[name]
        fixed = {"read_only": have.get("read_only"), "device": have.get("device"), "pool": have.get("pool")}
        for key, value in fixed.items():
            if key in spec and spec[key] != value and not (key == "device" and spec[key] == name):
                raise Problem(409, f"{key}: volume {name} has {value!r}; it cannot change while it exists "
                              f"(delete it and create it anew)")
        out: Any = {"changes": [], "volume": have}
        if "size" in spec and spec["size"] is not None:
            out = await change("volume.resize", {"name": name, "size": spec["size"], "dry_run": dry_run}, if_match,
                               response)
            if_match = None
        if qos is not None:
            out = await change("qos.set", {"volume": name, "limits": qos, "clear": True, "dry_run": dry_run},
                               if_match, response)
        if not out.get("changes"):
            await revision_tag(response)
        return out

    @app.delete("/api/v1/volumes/{name}", tags=["volumes"], summary="Delete a volume (force: with its exports)")
    async def volume_delete(_: Admin, name: str, response: Response, force: bool = Query(False), dry_run: bool = Query(False),
                            if_match: str | None = Header(default=None)) -> Any:
        return await change("volume.delete", {"name": name, "force": force, "dry_run": dry_run}, if_match, response)

    @app.get("/api/v1/volumes/{name}/qos", tags=["volumes"], summary="A volume's QoS limits and counters")
    async def qos_get(_: Reader, name: str) -> Any:
        return await run("qos.show", {"volume": name})

    @app.put("/api/v1/volumes/{name}/qos", tags=["volumes"], summary="Set a volume's QoS limits (all of them)",
             openapi_extra=documented(R.QosSet, drop=("volume", "dry_run", "clear")))
    async def qos_put(_: Admin, name: str, request: Request, response: Response, dry_run: bool = Query(False),
                      if_match: str | None = Header(default=None)) -> Any:
        body = await json_body(request)
        limits = body.get("limits", body)
        return await change("qos.set", {"volume": name, "limits": limits, "clear": True, "dry_run": dry_run},
                            if_match, response)

    @app.get("/api/v1/volumes/{name}/replication", tags=["volumes"],
             summary="A replicated volume's role, epoch, replicas in and out of sync, resync progress")
    async def replication(_: Reader, name: str) -> Any:
        return await run("volume.status", {"name": name})

    @app.get("/api/v1/volumes/{name}/snapshots", tags=["snapshots"], summary="A volume's snapshots, oldest first")
    async def snapshots(_: Reader, name: str) -> Any:
        await run("volume.show", {"name": name})        # 404 for a volume that is not there
        return await run("snapshot.list", {"volume": name})

    @app.post("/api/v1/volumes/{name}/snapshots", tags=["snapshots"], status_code=201,
              summary="Take a snapshot of the volume",
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
                  "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}}})
    async def snapshot_create(_: Admin, name: str, request: Request) -> Any:
        body = await json_body(request)
        if not isinstance(body.get("name"), str):
            raise Problem(422, "name: missing; name the snapshot")
        await run("volume.show", {"name": name})
        return await run("snapshot.create", {"volume": name, "name": body["name"]})

    @app.delete("/api/v1/volumes/{name}/snapshots/{snapshot}", tags=["snapshots"], summary="Delete a snapshot")
    async def snapshot_delete(_: Admin, name: str, snapshot: str) -> Any:
        await run("volume.show", {"name": name})
        return await run("snapshot.delete", {"volume": name, "name": snapshot})

    # ---- exports

    @app.get("/api/v1/exports", tags=["exports"], summary="Every iSCSI LUN, NVMe namespace and NBD export")
    async def exports(_: Reader, response: Response) -> Any:
        await revision_tag(response)
        return await run("export.list")

    @app.post("/api/v1/exports", tags=["exports"], status_code=201,
              summary="Export a volume (a target, subsystem or NBD export is made with its first export)",
              openapi_extra=documented(R.ExportAdd, drop=("dry_run",)))
    async def export_add(_: Admin, request: Request, response: Response, dry_run: bool = Query(False),
                         if_match: str | None = Header(default=None)) -> Any:
        body = await json_body(request)
        return await change("export.add", {**body, "dry_run": dry_run}, if_match, response)

    @app.delete("/api/v1/exports/{protocol}/{name}", tags=["exports"],
                summary="Remove an export (lun or nsid: only that one; else the whole target or subsystem)")
    async def export_remove(_: Admin, protocol: str, name: str, response: Response, lun: int | None = Query(None),
                            nsid: int | None = Query(None), dry_run: bool = Query(False),
                            if_match: str | None = Header(default=None)) -> Any:
        args: dict[str, Any] = {"protocol": protocol, "name": name, "dry_run": dry_run}
        if lun is not None:
            args["lun"] = lun
        if nsid is not None:
            args["nsid"] = nsid
        return await change("export.remove", args, if_match, response)

    # ---- any node command (the CLI's `vsan --node URL ...`: cli/remote.py)

    @app.post("/api/v1/commands/{cmd}", tags=["commands"],
              summary="Run one of the node's commands, as the CLI sends them over the control socket; reads need "
                      "any token, changes an admin one",
              openapi_extra={"requestBody": {"content": {"application/json": {"schema": {
                  "type": "object", "description": "the command's arguments, as the CLI sends them"}}}}})
    async def command(cmd: str, request: Request, entry: Reader) -> Any:
        if cmd not in READ_COMMANDS and entry.role != "admin":
            raise Problem(403, f"token {entry.name} is {entry.role}: {cmd} changes the node and needs an admin token")
        if cmd == "config.apply":
            raise Problem(422, "config.apply names a file on the node; send the document itself: config.put "
                          "(`vsan --node URL config apply FILE` does)")
        return await run(cmd, await json_body(request))

    # ---- devices, pools and workers

    @app.get("/api/v1/cluster", tags=["node"],
             summary="The cluster this node is in: members up or not, every replicated volume's primary and replicas")
    async def cluster(_: Reader) -> Any:
        return await run("cluster.status")

    @app.get("/api/v1/devices", tags=["pools"], summary="The node's devices, and who uses each")
    async def devices(_: Reader) -> Any:
        return await run("device.list")

    @app.get("/api/v1/pools", tags=["pools"], summary="Every pool: level, members, state, rebuild and scrub")
    async def pools(_: Reader) -> Any:
        return await run("pool.list")

    @app.get("/api/v1/pools/{name}", tags=["pools"],
             summary="One pool: level, state, members (device, state), rebuild progress and speed, spares")
    async def pool(_: Reader, name: str) -> Any:
        return await run("pool.status", {"name": name})

    async def pool_body(request: Request, *keys: str) -> dict[str, Any]:
        body = await json_body(request)
        unknown = sorted(set(body) - set(keys))
        if unknown:
            raise Problem(422, f"{unknown[0]}: not a field of this request (fields: {', '.join(keys)})")
        return body

    @app.post("/api/v1/pools/{name}/scrub", tags=["pools"],
              summary="Read every stripe and check its parity or copies (repair: rewrite what disagrees); the "
                      "answer is the scrub's report")
    async def pool_scrub(_: Admin, name: str, request: Request) -> Any:
        body = await pool_body(request, "repair")
        return await run("pool.scrub", {"name": name, "repair": bool(body.get("repair", True))})

    @app.post("/api/v1/pools/{name}/members/{member}/fail", tags=["pools"],
              summary="Take a member out of service (its slot or device name): the pool runs degraded")
    async def pool_fail(_: Admin, name: str, member: str) -> Any:
        return await run("pool.fail", {"name": name, "member": int(member) if member.isdigit() else member})

    @app.post("/api/v1/pools/{name}/members/{index}/replace", tags=["pools"],
              summary="Rebuild a failed or missing slot onto a device (a config device in no use, or "
                      "file:PATH:SIZE); progress in GET /api/v1/pools/{name}")
    async def pool_replace(_: Admin, name: str, index: int, request: Request) -> Any:
        body = await pool_body(request, "device", "force")
        if not isinstance(body.get("device"), str):
            raise Problem(422, "device: missing; name the device to rebuild onto")
        return await run("pool.replace", {"name": name, "index": index, "device": body["device"],
                                          "force": bool(body.get("force", False))})

    @app.post("/api/v1/pools/{name}/spares", tags=["pools"],
              summary="Add a hot spare (a failed member is rebuilt onto it at once)")
    async def pool_spare(_: Admin, name: str, request: Request) -> Any:
        body = await pool_body(request, "device", "force")
        if not isinstance(body.get("device"), str):
            raise Problem(422, "device: missing; name the spare device")
        return await run("pool.add_spare", {"name": name, "device": body["device"],
                                            "force": bool(body.get("force", False))})

    @app.get("/api/v1/events", tags=["node"],
             summary="Alerts raised and cleared, and changes made, oldest first (after: only newer ids)")
    async def events(_: Reader, after: int = Query(0), limit: int = Query(100, ge=1, le=1000)) -> Any:
        return await run("node.events", {"after": after, "limit": limit})

    @app.get("/api/v1/sessions", tags=["node"],
             summary="Who is connected: every iSCSI, NVMe/TCP and NBD connection, from where, as whom, to what")
    async def sessions(_: Reader) -> Any:
        return await run("node.sessions")

    @app.get("/api/v1/workers", tags=["node"], summary="The node's worker processes and what each serves")
    async def workers(_: Reader) -> Any:
        try:
            return await handler("workers.list", {})
        except RequestError:
            return []          # a node in one process: no workers to list

    # ---- the other members of the cluster (api/peers.py)

    @app.get("/api/v1/nodes", tags=["cluster"],
             summary="The cluster's members: name, management address, up or not; /api/v1/nodes/{node}/... is "
                     "that member's /api/v1/...")
    async def nodes(_: Reader) -> Any:
        if peers is None or not peers.clustered:
            info = await run("node.info")
            return [{"name": info["name"], "management": None, "up": True, "this": True}]
        try:
            return await peers.members()
        except Exception as e:  # noqa: BLE001 - etcd unreachable: say so
            raise Problem(503, f"the cluster's store does not answer: {_line(e)}") from None

    async def on_node(node: str, rest: str, request: Request, entry: Reader) -> Response:
        target = f"/api/v1/{rest}" + (f"?{request.url.query}" if request.url.query else "")
        if entry.id == "peer":
            raise Problem(400, f"a request forwarded by {entry.name.rpartition('@')[2]} is not forwarded again")
        body = await request.body()
        if peers is None or not peers.clustered or node == peers.me:
            if node != (await run("node.info"))["name"]:
                raise Problem(404, f"no node named {node!r}: this node is in no cluster")
            return await _locally(request, target, body)
        who = Forwarded(peers.me, entry.role, entry.name, time.time())
        try:
            status, content, headers = await peers.forward(node, request.method, target, body,
                                                           dict(request.headers), who)
        except LookupError:
            names = ", ".join(m["name"] for m in await peers.members())
            raise Problem(404, f"no node named {node!r} in the cluster (members: {names})") from None
        except TimeoutError as e:
            raise Problem(504, str(e)) from None
        except ConnectionError as e:
            raise Problem(502, str(e)) from None
        return Response(content, status_code=status, headers=headers)

    for method in ("GET", "PUT", "POST", "DELETE", "PATCH"):
        app.add_api_route("/api/v1/nodes/{node}/{rest:path}", on_node, methods=[method], tags=["cluster"],
                          operation_id=f"on_node_{method.lower()}",
                          summary="Any /api/v1/... resource of the member `node` (the request is forwarded, signed "
                                  "for the cluster, with this token's role)")

    async def _locally(request: Request, target: str, body: bytes) -> Response:
        """This node's own resource, through its own routes (the same credentials)."""
        import httpx

        sent = {k: v for k, v in request.headers.items()
                if k in ("authorization", "cookie", "content-type", "if-match", "hx-request", "x-requested-with")}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as c:
            r = await c.request(request.method, target, content=body, headers=sent)
        kept = {k: v for k, v in r.headers.items() if k in ANSWER_HEADERS}
        return Response(r.content, status_code=r.status_code, headers=kept)

    # ---- metrics

    if metrics is not None:
        @app.get("/metrics", tags=["metrics"], summary="Prometheus metrics (text exposition format)")
        async def metrics_route(_: Reader) -> Response:
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(await metrics(), media_type=CONTENT_TYPE_LATEST)

    # ---- the OpenAPI document, with the request bodies' schemas as components

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for body in bodies:
                full = _body_schema(body)
                schemas.update(full.pop("$defs", {}))
                schemas[body.__name__] = full
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            doc["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    from openvsan.web.console import mount_console

    mount_console(app, handler)
    return app
