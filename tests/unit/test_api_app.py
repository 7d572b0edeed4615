"""The REST API app (api/app.py) over a handler in memory: auth and roles, the failed-auth hold, the status of
each kind of refusal as RFC 9457 problem details, If-Match passed down as the expected revision, and the
OpenAPI document built from the typed request bodies. The real node behind it: tests/interop/test_api.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from openvsan.api.app import FAILURE_WINDOW, FAILURES_ALLOWED, FailedAuth, make_app
from openvsan.api.tokens import TokenBook
from openvsan.node.control import Conflict, ControlServer, NotFound, RequestError, Stale
from openvsan.node.workers import WorkerError


class FakeNode:
    def __init__(self) -> None:
        self.revision = 7
        self.calls: list[tuple[str, dict[str, Any], int | None]] = []

    async def __call__(self, cmd: str, args: dict[str, Any]) -> Any:
        from openvsan.node.live import EXPECTED_REVISION

        self.calls.append((cmd, args, EXPECTED_REVISION.get()))
        if cmd == "node.info":
            return {"name": "n", "revision": self.revision}
        if cmd == "volume.list":
            return [{"name": "v0", "read_only": False, "device": "v0", "pool": None}]
        if cmd == "volume.show":
            if args["name"] != "v0":
                raise NotFound(f"no volume named {args['name']!r}")
            return {"name": "v0"}
        if cmd == "volume.create":
            raise RequestError("size: missing; give the volume's size")
        if cmd == "volume.resize":
            expect = EXPECTED_REVISION.get()
            if expect is not None and expect != self.revision:
                raise Stale(f"at revision {self.revision}, not {expect}")
            self.revision += 1
            return {"changes": ["~ device v0"]}
        if cmd == "volume.delete":
            raise Conflict("volume v0 is exported")
        if cmd == "pool.list":
            raise RuntimeError("disk on fire")
        if cmd == "volume.status":      # a worker's refusal, as its supervisor passes it on
            raise WorkerError(f"no volume named {args['name']!r}", "not-found")
        if cmd == "node.sessions":
            raise WorkerError("worker 1 did not answer", "failed")
        raise RequestError(f"unknown command {cmd!r}")


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def call(app: Any, method: str, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        headers = dict(kw.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as c:
            return await c.request(method, path, headers=headers, **kw)
    return asyncio.run(go())


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Any, FakeNode, str, str, Clock]:
    book = TokenBook(tmp_path)
    _, admin = book.create("admin", "admin")
    _, reader = book.create("reader", "read-only")
    node, clock = FakeNode(), Clock()
    return make_app(node, book, failed=FailedAuth(clock)), node, admin, reader, clock


def test_healthz_needs_no_token_and_everything_else_does(setup: Any) -> None:
    app, _, admin, _, _ = setup
    assert call(app, "GET", "/healthz").json() == {"status": "ok"}
    r = call(app, "GET", "/api/v1/volumes")
    assert r.status_code == 401 and r.headers["content-type"] == "application/problem+json"
    assert r.headers["www-authenticate"] == "Bearer"
    assert "vsan token create" in r.json()["detail"]
    r = call(app, "GET", "/api/v1/volumes", admin)
    assert r.status_code == 200 and r.headers["etag"] == '"7"'


def test_a_read_only_token_reads_but_cannot_change(setup: Any) -> None:
    app, node, _, reader, _ = setup
    assert call(app, "GET", "/api/v1/volumes/v0", reader).status_code == 200
    r = call(app, "PUT", "/api/v1/volumes/v0", reader, json={"size": "1GiB"})
    assert r.status_code == 403 and "read-only" in r.json()["detail"]
    assert not any(c[0] == "volume.resize" for c in node.calls)


def test_refusals_map_to_their_status_with_the_one_line(setup: Any) -> None:
    app, _, admin, _, _ = setup
    cases = [("GET", "/api/v1/volumes/nope", None, 404, "no volume named 'nope'"),
             ("PUT", "/api/v1/volumes/v9", {"backing": "ram"}, 422, "size: missing; give the volume's size"),
             ("DELETE", "/api/v1/volumes/v0", None, 409, "volume v0 is exported"),
             ("GET", "/api/v1/pools", None, 500, "disk on fire"),
             ("GET", "/api/v1/volumes/w/replication", None, 404, "no volume named 'w'"),
             ("GET", "/api/v1/sessions", None, 500, "worker 1 did not answer")]
    for method, path, body, status, line in cases:
        r = call(app, method, path, admin, json=body)
        assert r.status_code == status, (path, r.text)
        p = r.json()
        assert p["status"] == status and p["detail"] == line and p["instance"] == path and p["title"]
    r = call(app, "PUT", "/api/v1/volumes/v0", admin, content=b"{nope")
    assert r.status_code == 400 and "not JSON" in r.json()["detail"]


def test_if_match_is_the_revision_the_change_expects(setup: Any) -> None:
    app, node, admin, _, _ = setup
    r = call(app, "PUT", "/api/v1/volumes/v0", admin, json={"size": "2GiB"}, headers={"If-Match": '"6"'})
    assert r.status_code == 412 and "not 6" in r.json()["detail"]
    r = call(app, "PUT", "/api/v1/volumes/v0", admin, json={"size": "2GiB"}, headers={"If-Match": '"7"'})
    assert r.status_code == 200, r.text
    assert r.headers["etag"] == '"8"' and r.json()["revision"] == 8
    assert [c[2] for c in node.calls if c[0] == "volume.resize"] == [6, 7]
    r = call(app, "PUT", "/api/v1/volumes/v0", admin, json={"size": "2GiB"}, headers={"If-Match": "soon"})
    assert r.status_code == 400


def test_an_address_that_keeps_failing_is_held_back_but_a_valid_token_still_works(setup: Any) -> None:
    app, _, admin, _, clock = setup
    codes = [call(app, "GET", "/api/v1/node", "vsan_00000000_" + "x" * 43).status_code
             for _ in range(FAILURES_ALLOWED + 2)]
    assert codes == [401] * FAILURES_ALLOWED + [429, 429]
    r = call(app, "GET", "/api/v1/node")
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    assert call(app, "GET", "/api/v1/node", admin).status_code == 200
    clock.now += FAILURE_WINDOW + 1
    assert call(app, "GET", "/api/v1/node").status_code == 401


def test_the_openapi_document_has_the_typed_request_bodies(setup: Any) -> None:
    app, _, _, _, _ = setup
    doc = call(app, "GET", "/api/v1/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert {"VolumeCreate", "ExportAdd", "QosSet"} <= set(schemas)
    assert "size" in schemas["VolumeCreate"]["properties"]
    body = doc["paths"]["/api/v1/volumes/{name}"]["put"]["requestBody"]["content"]["application/json"]["schema"]
    assert "name" not in body["properties"] and "size" in body["properties"]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_a_refusal_keeps_its_kind_across_a_control_socket() -> None:
    """What a worker's control socket answers carries the refusal's kind, and the supervisor's raises it again
    (node/workers.py WorkerError), so a volume's 404 is a 404 whichever process owns the volume."""
    async def handler(cmd: str, args: dict[str, Any]) -> Any:
        raise {"a": NotFound("no volume named 'x'"), "b": Conflict("taken"), "c": ValueError("size: too big"),
               "d": RuntimeError("device d0 failed"), "e": WorkerError("no volume named 'y'", "not-found")}[cmd]

    server = ControlServer(Path("/nonexistent"), handler)
    kinds = {cmd: asyncio.run(server._answer(f'{{"cmd": "{cmd}"}}'.encode()))["kind"] for cmd in "abcde"}
    assert kinds == {"a": "not-found", "b": "conflict", "c": "refused", "d": "failed", "e": "not-found"}
