"""A member's API forwarding to another's (api/peers.py): the signature covers what it must (method, path and
query, body, who forwards, role, token), holds only for a fresh request seen once, and the app serves a
forwarded request with the role the first member checked. The real two-node cluster:
tests/interop/test_api_cluster.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from openvsan.api import peers as P
from openvsan.api.app import make_app
from openvsan.api.tokens import TokenBook
from openvsan.node.config import parse_config

KEY = P.forwarding_key(b"s" * 32)
NOW = 1_800_000_000.0


def who(role: str = "admin") -> P.Forwarded:
    return P.Forwarded("a", role, "ops", NOW)


def test_a_signed_request_verifies_once_and_only_as_sent() -> None:
    header = P.sign(KEY, "PUT", "/api/v1/volumes/x?dry_run=true", b'{"size":"1GiB"}', who())
    seen = P.SeenSignatures()
    f = P.verify(KEY, "PUT", "/api/v1/volumes/x?dry_run=true", b'{"size":"1GiB"}', header, seen, now=NOW + 1)
    assert f == who()
    with pytest.raises(P.ForwardError, match="replay"):
        P.verify(KEY, "PUT", "/api/v1/volumes/x?dry_run=true", b'{"size":"1GiB"}', header, seen, now=NOW + 2)
    changed = [("DELETE", "/api/v1/volumes/x?dry_run=true", b'{"size":"1GiB"}', header),
               ("PUT", "/api/v1/volumes/y?dry_run=true", b'{"size":"1GiB"}', header),
               ("PUT", "/api/v1/volumes/x", b'{"size":"1GiB"}', header),
               ("PUT", "/api/v1/volumes/x?dry_run=true", b'{"size":"9GiB"}', header),
               ("PUT", "/api/v1/volumes/x?dry_run=true", b'{"size":"1GiB"}', header.replace("role=admin", "role=x")),
               ("PUT", "/api/v1/volumes/x?dry_run=true", b'{"size":"1GiB"}', header.replace("node=a", "node=c"))]
    for method, target, body, h in changed:
        with pytest.raises(P.ForwardError, match="wrong signature"):
            P.verify(KEY, method, target, body, h, P.SeenSignatures(), now=NOW)
    with pytest.raises(P.ForwardError, match="wrong signature"):
        P.verify(P.forwarding_key(b"t" * 32), "PUT", "/api/v1/volumes/x?dry_run=true", b'{"size":"1GiB"}', header,
               P.SeenSignatures(), now=NOW)


def test_a_stale_or_malformed_forward_is_refused() -> None:
    header = P.sign(KEY, "GET", "/api/v1/node", b"", who())
    with pytest.raises(P.ForwardError, match="ago"):
        P.verify(KEY, "GET", "/api/v1/node", b"", header, P.SeenSignatures(), now=NOW + P.FRESH + 1)
    with pytest.raises(P.ForwardError, match="ago"):
        P.verify(KEY, "GET", "/api/v1/node", b"", header, P.SeenSignatures(), now=NOW - P.FRESH - 1)
    with pytest.raises(P.ForwardError, match="malformed"):
        P.verify(KEY, "GET", "/api/v1/node", b"", "node=a;role=admin", P.SeenSignatures(), now=NOW)


def _cfg(tmp_path: Path, **tables: dict[str, Any]) -> Any:
    return parse_config({"node": {"name": "a", "data_dir": str(tmp_path)}, **tables}, base_dir=tmp_path)


def test_the_management_address_a_member_publishes(tmp_path: Path) -> None:
    cluster = {"id": "c1", "etcd": ["127.0.0.1:2379"], "replication": "10.0.1.1:4430"}
    assert P.published_api(_cfg(tmp_path, cluster=cluster)) is None      # the default API may not be its own
    assert P.published_api(_cfg(tmp_path, cluster=cluster, api={"listen": "10.0.0.1:8443"})) == "http://10.0.0.1:8443"
    assert P.published_api(_cfg(tmp_path, cluster=cluster, api={"listen": "0.0.0.0:8080"})) == "http://10.0.1.1:8080"
    assert P.published_api(_cfg(tmp_path, cluster={**cluster, "management": "https://mgmt.example:8443"},
                              api={"listen": "0.0.0.0:8080"})) == "https://mgmt.example:8443"
    assert P.published_api(_cfg(tmp_path, cluster=cluster, api={"listen": "10.0.0.1:8080", "enabled": False})) is None


class FakePeers:
    me = "n"
    clustered = True

    def __init__(self) -> None:
        self.seen = P.SeenSignatures()

    async def key(self) -> bytes:
        return KEY


async def _node(cmd: str, args: dict[str, Any]) -> Any:
    if cmd == "node.info":
        return {"name": "n", "revision": 3}
    if cmd == "volume.list":
        return []
    if cmd == "volume.delete":
        return {"changes": ["- volume x"]}
    raise AssertionError(cmd)


def request(app: Any, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as c:
            return await c.request(method, path, headers=headers)
    return asyncio.run(go())


def test_the_app_serves_a_forwarded_request_with_the_role_checked_where_it_came_in(tmp_path: Path) -> None:
    import time

    app = make_app(_node, TokenBook(tmp_path), peers=FakePeers())  # type: ignore[arg-type]
    now = time.time()
    read = P.sign(KEY, "GET", "/api/v1/volumes", b"", P.Forwarded("a", "read-only", "viewer", now))
    assert request(app, "GET", "/api/v1/volumes", {P.HEADER: read}).status_code == 200
    r = request(app, "GET", "/api/v1/volumes", {P.HEADER: read})
    assert r.status_code == 401 and "replay" in r.json()["detail"]
    change = P.sign(KEY, "DELETE", "/api/v1/volumes/x", b"", P.Forwarded("a", "read-only", "viewer", now))
    r = request(app, "DELETE", "/api/v1/volumes/x", {P.HEADER: change})
    assert r.status_code == 403 and "viewer@a is read-only" in r.json()["detail"], r.text
    change = P.sign(KEY, "DELETE", "/api/v1/volumes/x", b"", P.Forwarded("a", "admin", "ops", now))
    assert request(app, "DELETE", "/api/v1/volumes/x", {P.HEADER: change}).status_code == 200
    # a forwarded request is not forwarded again
    again = P.sign(KEY, "GET", "/api/v1/nodes/b/node", b"", P.Forwarded("a", "admin", "ops", now))
    r = request(app, "GET", "/api/v1/nodes/b/node", {P.HEADER: again})
    assert r.status_code == 400 and "not forwarded again" in r.json()["detail"]


def test_a_node_in_no_cluster_refuses_forwarded_requests_and_is_its_only_member(tmp_path: Path) -> None:
    book = TokenBook(tmp_path)
    _, token = book.create("admin", "admin")
    app = make_app(_node, book)
    forged = P.sign(KEY, "GET", "/api/v1/volumes", b"", P.Forwarded("a", "admin", "ops", 0.0))
    r = request(app, "GET", "/api/v1/volumes", {P.HEADER: forged})
    assert r.status_code == 401 and "in no cluster" in r.json()["detail"]
    auth = {"Authorization": f"Bearer {token}"}
    assert request(app, "GET", "/api/v1/nodes", auth).json() == [
        {"name": "n", "management": None, "up": True, "this": True}]
    r = request(app, "GET", "/api/v1/nodes/n/node", auth)
    assert r.status_code == 200 and r.json()["name"] == "n" and r.headers["etag"] == '"3"'
    assert request(app, "GET", "/api/v1/nodes/n/node", {}).status_code == 401
    r = request(app, "GET", "/api/v1/nodes/m/node", auth)
    assert r.status_code == 404 and "in no cluster" in r.json()["detail"]
