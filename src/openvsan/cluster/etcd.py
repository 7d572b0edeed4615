"""The StateStore on a real etcd (v3 API over gRPC, through aetcd: native asyncio, nothing blocks the loop).

Same semantics as the SQLite store (node/statestore.py), mapped onto etcd's own: the revision is etcd's
store-wide revision, an entry's revision/created/version are the key's mod_revision/create_revision/version,
CAS is one etcd Txn comparing mod_revision (or version == 0 for "must not exist"), and watch is an etcd watch
from a revision. Every key lives under `prefix` (so one etcd can hold several clusters' state, and nothing
else's keys are touched); the caller sees keys without it.

Leases are etcd's: grant, keep-alive, revoke; a key put with a lease is deleted by etcd when the lease expires
(the replication issue's primary lease and epoch are built on this).

Why aetcd and not etcd3gw (bench/etcd_client_smoke.py, against etcd 3.4): both pass put, txn, lease keep-alive
and watch, but etcd3gw blocks on `requests` (every call a thread hop; watch a thread per stream) and did
~230 sequential puts/s against aetcd's ~770 on the same disk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import aetcd  # type: ignore[import-untyped]
import grpc  # type: ignore[import-untyped]
from aetcd import rpc

from openvsan.node.statestore import (
    Compacted,
    Conflict,
    Entry,
    Event,
    Lease,
    LeaseExpired,
    StateStore,
    StoreError,
    StoreUnavailable,
    check_key,
    check_prefix,
    check_txn,
    decode_value,
    encode_value,
)

T = TypeVar("T")

DEFAULT_PREFIX = "/openvsan"
TIMEOUT = 5.0  # seconds for one request; a member that does not answer in that is unavailable
CONNECT_TIMEOUT = 1.0  # seconds to wait for a member's channel to connect before trying the next member
# gRPC keepalive: how soon a connection whose packets are silently dropped (a cut link) is found dead, so
# a watch on it moves to another member. etcd refuses pings more often than --grpc-keepalive-min-time (5 s
# by default: it answers with GOAWAY too_many_pings), hence a little over that.
KEEPALIVE = 6.0
KEEPALIVE_TIMEOUT = 2.0
CHANNEL_OPTIONS = {
    "grpc.keepalive_time_ms": int(KEEPALIVE * 1000),
    "grpc.keepalive_timeout_ms": int(KEEPALIVE_TIMEOUT * 1000),
    "grpc.http2.max_pings_without_data": 0,  # an idle watch sends no data; keep pinging it anyway
    # a member that comes back is tried again within seconds, not gRPC's default of up to 2 minutes
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 2000,
}
# etcd's "require leader" request metadata (clientv3 WithRequireLeader): a member that has lost its leader (a
# minority after a partition) refuses the request at once with "etcdserver: no leader", before applying
# anything, instead of letting it wait for a timeout; on a watch stream it cancels the stream when the
# member loses its leader, so the watch moves to a member that still has one.
REQUIRE_LEADER = (("hasleader", "true"),)
# UNAVAILABLE answers given before anything was proposed: safe to retry a write on the next member. etcd's
# own refusals, and gRPC's when it had no connection to send the request on: the member died between our
# channel check (ready) and the call, and the reconnect was refused ("failed to connect to all addresses").
_NOT_APPLIED = (
    "etcdserver: no leader",
    "etcdserver: too many requests",
    "etcdserver: not capable",
    "failed to connect to all addresses",
)

_UNAVAILABLE = {rpc.StatusCode.UNAVAILABLE, rpc.StatusCode.DEADLINE_EXCEEDED, rpc.StatusCode.CANCELLED}


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end for a prefix)."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"  # every key
    b[-1] += 1
    return bytes(b)


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.removeprefix("http://").rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r}: must be host:port, e.g. 127.0.0.1:2379")
    return host, int(port)


class _Client(aetcd.Client):  # type: ignore[misc]
    """aetcd's client with etcd's require-leader metadata on every call it makes itself (leases, watch):
    aetcd sends `self.metadata` with each request and only sets it when it authenticates, which we do not."""

    def _init_channel_attrs(self) -> None:
        super()._init_channel_attrs()
        self.metadata = REQUIRE_LEADER


class _NotSent(Exception):
    """The member's channel is not connected: nothing was sent to it."""


class _Member:
    def __init__(self, endpoint: str, timeout: float) -> None:
        host, port = _parse_endpoint(endpoint)
        self.endpoint = f"{host}:{port}"
        self.client = _Client(host=host, port=port, timeout=timeout, options=CHANNEL_OPTIONS)

    async def ready(self) -> Any:
        """Connect (once) and wait until the channel is up; the client, or _NotSent."""
        try:
            await self.client.connect()
        except (TimeoutError, aetcd.exceptions.ClientError, rpc.AioRpcError) as e:
            raise _NotSent(f"cannot connect: {e}") from None
        channel = self.client.channel
        if channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            try:
                await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT)
            except TimeoutError:
                raise _NotSent(f"not connected after {CONNECT_TIMEOUT:g}s") from None
        return self.client


def _is_unavailable(e: BaseException) -> bool:
    if isinstance(e, rpc.AioRpcError):
        return e.code() in _UNAVAILABLE
    return isinstance(
        e,
        (
            aetcd.exceptions.ConnectionFailedError,
            aetcd.exceptions.ConnectionTimeoutError,
            aetcd.exceptions.WatchTimeoutError,
            asyncio.TimeoutError,
        ),
    )


def _is_stream_lost(e: BaseException) -> bool:
    if isinstance(e, rpc.AioRpcError):
        return bool(e.code() == rpc.StatusCode.INTERNAL)
    return isinstance(e, aetcd.exceptions.InternalError)


def _why(e: BaseException) -> str:
    if isinstance(e, rpc.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e) or type(e).__name__


class EtcdLease(Lease):
    def __init__(self, store: EtcdStateStore, lease_id: int, ttl: int) -> None:
        self.store, self.id, self.ttl = store, lease_id, ttl

    async def refresh(self) -> int:
        reply = await self.store._call("lease keep-alive", lambda c: c.refresh_lease(self.id), idempotent=True)
        if reply is None or reply.TTL <= 0:
            raise LeaseExpired(f"lease {self.id:x} has expired: its keys are gone")
        return int(reply.TTL)

    async def revoke(self) -> None:
        try:
            await self.store._call("lease revoke", lambda c: c.revoke_lease(self.id), idempotent=True)
        except StoreError as e:
            if "requested lease not found" not in str(e):  # a retry after a revoke that did land
                raise


class EtcdStateStore(StateStore):
    """`endpoints`: "host:port" (or "http://host:port") of each etcd member's client URL. Requests go to one
    member at a time; when it is unavailable (down, cut off, or without a leader) the next one is tried, and
    the one that answered is used from then on.

    A read is retried on the next member. A write is retried only when the member refused it before it could
    be applied (not connected, or "no leader"); a write that was sent and then timed out or lost its
    connection may or may not have been applied, so it raises StoreUnavailable saying so (the next call goes
    to the next member): the caller re-reads and decides, as with any CAS. A watch survives the loss of its
    member: it resumes on the next one from the revision after the last event it gave, so no event is lost or
    repeated. `prefix`: where this store's keys live in etcd; `timeout`: seconds for one request to one
    member, and at least as long for trying the others."""

    def __init__(
        self, endpoints: Sequence[str] | str, *, prefix: str = DEFAULT_PREFIX, timeout: float = TIMEOUT
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if not endpoints:
            raise ValueError("etcd endpoints: give at least one host:port, e.g. 127.0.0.1:2379")
        if prefix and (not prefix.startswith("/") or prefix.endswith("/")):
            raise ValueError(f"etcd prefix {prefix!r}: must start with '/' and not end with one, e.g. /openvsan")
        self.timeout = timeout
        self._members = [_Member(e, timeout) for e in endpoints]
        self._current = 0
        self.prefix = prefix
        self._pb = prefix.encode()

    @property
    def endpoint(self) -> str:
        """The member requests go to now."""
        return self._members[self._current].endpoint

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self._members]

    # -- plumbing --

    async def _call(self, what: str, call: Callable[[Any], Awaitable[T]], *, idempotent: bool) -> T:
        """`call(client)` on the current member, then on the others in turn while they are unavailable (for a
        write: only while nothing can have been applied). Rounds over the members go on, a little apart, until
        every member has been tried and `timeout` has passed: an election after the leader died takes about an
        election timeout, and every member answers "no leader" meanwhile."""
        n = len(self._members)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        failures: list[str] = []
        attempt = 0
        while attempt < n or loop.time() < deadline:
            if attempt and attempt % n == 0:
                await asyncio.sleep(min(0.05 * (attempt // n), 0.5))
            i = (self._current + attempt) % n
            attempt += 1
            member = self._members[i]
            try:
                client = await member.ready()
                result = await call(client)
            except _NotSent as e:
                failures.append(f"{member.endpoint}: {e}")
                continue
            except aetcd.exceptions.RevisionCompactedError:
                raise
            except (TimeoutError, aetcd.exceptions.ClientError, rpc.AioRpcError) as e:
                why = _why(e)
                # a member torn down under the call ends it as INTERNAL ("Internal error from Core") as often
                # as UNAVAILABLE (the watch's open too): for a call that may be repeated, the member is gone
                if not (_is_unavailable(e) or (idempotent and _is_stream_lost(e))):
                    raise StoreError(f"etcd at {member.endpoint}: {what}: {why}") from None
                if idempotent or any(s in why for s in _NOT_APPLIED):
                    failures.append(f"{member.endpoint}: {why}")
                    continue
                self._current = (i + 1) % n
                raise StoreUnavailable(
                    f"etcd at {member.endpoint}: {what}: {why}; it may or may not have been applied: "
                    "read it back before writing again"
                ) from None
            self._current = i
            return result
        last = dict(f.split(": ", 1) for f in failures[-n:])  # each member's last answer
        raise StoreUnavailable(
            f"etcd: {what}: no member answered in {self.timeout:g}s: {'; '.join(f'{k}: {v}' for k, v in last.items())}"
        )

    async def _kv(self, what: str, method: str, request: Any, *, idempotent: bool) -> Any:
        async def call(client: Any) -> Any:
            return await getattr(client.kvstub, method)(request, timeout=self.timeout, metadata=REQUIRE_LEADER)

        return await self._call(what, call, idempotent=idempotent)

    def _k(self, key: str) -> bytes:
        return self._pb + key.encode()

    def _entry(self, kv: Any) -> Entry:
        key = bytes(kv.key)[len(self._pb) :].decode()
        return Entry(key, decode_value(kv.value), int(kv.mod_revision), int(kv.create_revision), int(kv.version))

    # -- the StateStore --

    async def get(self, key: str) -> Entry | None:
        check_key(key)
        resp = await self._kv(f"get {key}", "Range", rpc.RangeRequest(key=self._k(key)), idempotent=True)
        return self._entry(resp.kvs[0]) if resp.kvs else None

    async def list(self, prefix: str) -> list[Entry]:
        check_prefix(prefix)
        start = self._k(prefix)
        req = rpc.RangeRequest(key=start, range_end=_prefix_end(start), sort_order=rpc.RangeRequest.ASCEND)
        resp = await self._kv(f"list {prefix}", "Range", req, idempotent=True)
        return [self._entry(x) for x in resp.kvs]

    async def revision(self) -> int:
        req = rpc.RangeRequest(key=self._pb + b"/", range_end=_prefix_end(self._pb + b"/"), count_only=True)
        resp = await self._kv("revision", "Range", req, idempotent=True)
        return int(resp.header.revision)

    async def put(
        self, key: str, value: Mapping[str, Any], *, expect: int | None = None, lease: Lease | None = None
    ) -> int:
        return await self._txn({} if expect is None else {key: expect}, {key: value}, (), lease)

    async def delete(self, key: str, *, expect: int | None = None) -> int:
        return await self._txn({} if expect is None else {key: expect}, {}, [key], None)

    async def txn(
        self,
        compares: Mapping[str, int],
        puts: Mapping[str, Mapping[str, Any]] = {},
        deletes: Sequence[str] = (),
    ) -> int:
        return await self._txn(compares, puts, deletes, None)

    async def _txn(
        self,
        compares: Mapping[str, int],
        puts: Mapping[str, Mapping[str, Any]],
        deletes: Sequence[str],
        lease: Lease | None,
    ) -> int:
        check_txn(compares, puts, deletes)
        texts = {key: encode_value(key, value).encode() for key, value in puts.items()}
        lease_id = 0 if lease is None else lease.id
        cmp = []
        for key, expected in compares.items():
            if expected == 0:  # absent: etcd gives a missing key version 0
                cmp.append(
                    rpc.Compare(key=self._k(key), result=rpc.Compare.EQUAL, target=rpc.Compare.VERSION, version=0)
                )
            else:
                cmp.append(
                    rpc.Compare(
                        key=self._k(key), result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, mod_revision=expected
                    )
                )
        success = [
            rpc.RequestOp(request_put=rpc.PutRequest(key=self._k(k), value=v, lease=lease_id)) for k, v in texts.items()
        ] + [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=self._k(k))) for k in deletes]
        # on failure, read the compared keys in the same txn: the Conflict then names what was really there
        failure = [rpc.RequestOp(request_range=rpc.RangeRequest(key=self._k(k))) for k in compares]
        what = f"write {', '.join([*puts, *deletes])}"
        req = rpc.TxnRequest(compare=cmp, success=success, failure=failure)
        resp = await self._kv(what, "Txn", req, idempotent=False)
        if resp.succeeded:
            return int(resp.header.revision)
        for (key, expected), op in zip(compares.items(), resp.responses, strict=True):
            kvs = op.response_range.kvs
            actual = int(kvs[0].mod_revision) if kvs else 0
            if actual != expected:
                raise Conflict(key, expected, actual)
        raise StoreError(f"etcd txn failed with every compare matching: {list(compares)}")  # not reachable

    async def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[Event]:
        check_prefix(prefix)
        start = self._k(prefix)
        # an explicit revision even for "from now": a watch that moves to another member resumes from it
        nxt = (await self.revision()) + 1 if start_revision is None else max(start_revision, 1)
        while True:
            # open on a member that answers (the failover of _call), from the revision after the last event
            def open_at(rev: int) -> Callable[[Any], Awaitable[Any]]:
                async def call(client: Any) -> Any:
                    return await client.watch(start, range_end=_prefix_end(start), start_revision=rev)

                return call

            try:
                w = await self._call(f"watch {prefix}", open_at(nxt), idempotent=True)
            except aetcd.exceptions.RevisionCompactedError as e:
                raise Compacted(nxt, int(e.compacted_revision)) from None
            where = self.endpoint
            try:
                async for ev in w:
                    kv = ev.kv
                    key = bytes(kv.key)[len(self._pb) :].decode()
                    if ev.kind == "PUT":
                        entry = Entry(key, decode_value(kv.value), kv.mod_revision, kv.create_revision, kv.version)
                        event = Event("put", entry, int(kv.mod_revision))
                    else:
                        event = Event("delete", Entry(key, {}, kv.mod_revision, 0, 0), int(kv.mod_revision))
                    # every event of one revision comes in one watch response, queued before any error
                    # that follows it: resuming at revision + 1 repeats nothing and skips nothing
                    nxt = event.revision + 1
                    yield event
                # the stream ended without an error: the member closed it (shutting down)
            except aetcd.exceptions.RevisionCompactedError as e:
                raise Compacted(nxt, int(e.compacted_revision)) from None
            except (aetcd.exceptions.ClientError, rpc.AioRpcError) as e:
                # a stream torn down with its member ends as INTERNAL ("Internal error from Core") as often
                # as UNAVAILABLE; a watch resumes by revision, so either is the member going away
                if not (_is_unavailable(e) or _is_stream_lost(e)):
                    raise StoreError(f"etcd at {where}: watch {prefix}: {_why(e)}") from None
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(w.cancel())
            self._fail_over(where)

    def _fail_over(self, endpoint: str) -> None:
        """Move on from `endpoint` (when it is still the current member)."""
        if self.endpoint == endpoint:
            self._current = (self._current + 1) % len(self._members)

    async def grant_lease(self, ttl: int) -> Lease:
        if ttl < 1:
            raise ValueError(f"lease ttl {ttl}: must be >= 1 second")
        # a retried grant after a lost answer leaves at most an unused lease, which expires by itself
        granted = await self._call("lease grant", lambda c: c.lease(ttl), idempotent=True)
        return EtcdLease(self, int(granted.id), int(granted.ttl))

    async def close(self) -> None:
        for member in self._members:
            with contextlib.suppress(Exception):
                await member.client.close()
