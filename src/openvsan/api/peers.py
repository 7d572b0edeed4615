"""The whole cluster through any member's API: `/api/v1/nodes` lists the members, and
`/api/v1/nodes/{node}/...` is that member's own `/api/v1/...`, forwarded to its management address.

Tokens stay per node (each node's `api-tokens.json`); the member that receives a request checks its token and
role as for its own routes, then forwards the request signed for the cluster: the signature is an HMAC-SHA256,
keyed from the cluster's secret (made once at `vsan cluster init`, kept in etcd; the replication path's keys
come from it too), over the method, the path and query, the body's digest, who forwards, the role and token
name, and the time. The other member accepts a forwarded request only when the signature holds, the time is
within FRESH seconds and the signature was not seen before (no replay), and then serves it with the role the
first member checked: a read-only token can read every member and change none. What a member answers (its
status, problem details, ETag) comes back as it was.

A member publishes its management address when it joins (`[cluster] management`, or else its `[api]`
address, a wildcard one replaced by its replication host): published_api().
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from openvsan.node.specs import NodeConfig

log = logging.getLogger("openvsan.api")

HEADER = "x-openvsan-forwarded"
FRESH = 30.0                     # seconds a forwarded request stays valid (clocks of members: NTP)
FORWARD_TIMEOUT = 60.0           # a member's answer (a volume made on a pool, a resize: seconds at most)
_KEY_LABEL = b"openvsan api forwarding v1"


# what a member's answer keeps of its headers when it is passed on (here, and app.py's own-node shortcut)
ANSWER_HEADERS = ("content-type", "etag", "location", "retry-after", "www-authenticate")


def api_url(scheme: str, host: str, port: int) -> str:
    """http(s)://host:port, an IPv6 host in brackets."""
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def published_api(cfg: NodeConfig) -> str | None:
    """The management address this node publishes to the cluster (its API's URL), or None (no [api] table and
    no [cluster] management: the default 127.0.0.1:8080 may not even be this node's)."""
    if cfg.cluster is not None and cfg.cluster.management:
        m = cfg.cluster.management
        return m if "://" in m else f"http://{m}"
    if cfg.api is None or not cfg.api.enabled:
        return None
    host, port = cfg.api.listen.host, cfg.api.listen.port
    if host in ("0.0.0.0", "::", "") and cfg.cluster is not None:
        host = cfg.cluster.replication.host
    scheme = "https" if cfg.api.tls is not None else "http"
    return api_url(scheme, host, port)


def forwarding_key(cluster_secret: bytes) -> bytes:
    return hmac.new(cluster_secret, _KEY_LABEL, hashlib.sha256).digest()


@dataclass(frozen=True)
class Forwarded:
    """Who a forwarded request comes from: the member, and the token it checked there."""

    node: str
    role: str
    token: str          # the token's name on that member
    at: float


def _message(method: str, target: str, body: bytes, f: Forwarded) -> bytes:
    return "\n".join([method.upper(), target, hashlib.sha256(body).hexdigest(), f.node, f.role, f.token,
                      f"{f.at:.3f}"]).encode()


def sign(key: bytes, method: str, target: str, body: bytes, f: Forwarded) -> str:
    """The header value for a request forwarded as `f` (`target`: path and query, as sent)."""
    mac = hmac.new(key, _message(method, target, body, f), hashlib.sha256).hexdigest()
    return f"node={f.node};role={f.role};token={f.token};t={f.at:.3f};sig={mac}"


class ForwardError(ValueError):
    """A forwarded request refused; str() is the line (the member logs it and answers 401)."""


class SeenSignatures:
    """Signatures accepted within FRESH seconds: the same one again is a replay."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def first(self, sig: str, now: float) -> bool:
        if len(self._seen) > 1024:
            self._seen = {s: t for s, t in self._seen.items() if now - t < 2 * FRESH}
        if sig in self._seen:
            return False
        self._seen[sig] = now
        return True


def verify(key: bytes, method: str, target: str, body: bytes, header: str, seen: SeenSignatures,
           now: float | None = None) -> Forwarded:
    """Who forwarded this request, if its signature holds, is fresh and new; else ForwardError."""
    now = time.time() if now is None else now
    fields = dict(part.partition("=")[::2] for part in header.split(";"))
    try:
        f = Forwarded(fields["node"], fields["role"], fields["token"], float(fields["t"]))
        sig = fields["sig"]
    except (KeyError, ValueError):
        raise ForwardError("a forwarded request with a malformed header") from None
    want = hmac.new(key, _message(method, target, body, f), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, sig):
        raise ForwardError(f"a request said to be forwarded by {f.node!r} with a wrong signature")
    if abs(now - f.at) > FRESH:
        raise ForwardError(f"a request forwarded by {f.node} {now - f.at:+.0f} s ago (more than {FRESH:g} s: "
                           "are the members' clocks in step?)")
    if not seen.first(sig, now):
        raise ForwardError(f"a request forwarded by {f.node} sent again (a replay)")
    return f


class Peers:
    """This member's view of the others, for its API: their addresses, and the key forwarded requests are
    signed with. Reads etcd itself (its own client), so it works the same in one process and beside workers."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.me = cfg.node.name
        self.seen = SeenSignatures()
        self._store: Any = None
        self._key: bytes | None = None
        self._client: Any = None

    @property
    def clustered(self) -> bool:
        return self.cfg.cluster is not None

    def _open(self) -> Any:
        if self._store is None:
            from openvsan.cluster.etcd import EtcdStateStore
            from openvsan.node.replicas import ETCD_PREFIX

            assert self.cfg.cluster is not None
            self._store = EtcdStateStore(list(self.cfg.cluster.etcd), prefix=ETCD_PREFIX)
        return self._store

    async def key(self) -> bytes:
        if self._key is None:
            from openvsan.cluster import membership as M

            assert self.cfg.cluster is not None
            self._key = forwarding_key(await M.secret(self._open(), self.cfg.cluster.id))
        return self._key

    async def members(self) -> list[dict[str, Any]]:
        """Every member: its name, management address, whether it is up, whether it is this node."""
        from openvsan.cluster import membership as M

        store = self._open()
        listed, up = await M.members(store), await M.alive(store)
        return [{"name": n, "management": m.management, "up": n in up, "this": n == self.me}
                for n, m in sorted(listed.items(), key=lambda x: x[1].number)]

    async def forward(self, node: str, method: str, target: str, body: bytes, headers: dict[str, str],
                      who: Forwarded) -> tuple[int, bytes, dict[str, str]]:
        """Send the request to `node`'s API (`target`: /api/v1/... with its query); its status, body and the
        headers that matter. LookupError: no such member; ConnectionError: it has no address or does not
        answer (the line says which)."""
        import httpx

        member = next((m for m in await self.members() if m["name"] == node), None)
        if member is None:
            raise LookupError(node)
        url = member["management"]
        if not url:
            raise ConnectionError(f"node {node} publishes no management address (give it an [api] listen "
                                  "address, or [cluster] management)")
        key = await self.key()
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=FORWARD_TIMEOUT)
        sent = {k: v for k, v in headers.items() if k in ("content-type", "if-match", "accept")}
        sent[HEADER] = sign(key, method, target, body, who)
        try:
            r = await self._client.request(method, url.rstrip("/") + target, content=body, headers=sent)
        except httpx.TimeoutException:
            raise TimeoutError(f"node {node} ({url}) did not answer within {FORWARD_TIMEOUT:g} s") from None
        except httpx.HTTPError as e:
            state = "" if member["up"] else " (the cluster has it down)"
            raise ConnectionError(f"node {node}: its API at {url} does not answer{state}: {e}") from None
        kept = {k: v for k, v in r.headers.items() if k in ANSWER_HEADERS}
        if "location" in kept and kept["location"].startswith("/api/v1/"):
            kept["location"] = f"/api/v1/nodes/{node}/" + kept["location"][len("/api/v1/"):]
        return r.status_code, r.content, kept

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._store is not None:
            await asyncio.shield(self._store.close())
            self._store = None
