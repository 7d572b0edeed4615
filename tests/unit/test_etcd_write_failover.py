"""Which failed writes EtcdStateStore moves on to the next member with, and which it reports as "may or may not
have been applied". The members here are stand-ins that answer a Txn with a chosen gRPC error; the real thing
(a 3-member etcd with members killed and cut off) is tests/fault/test_etcd_failover.py.

The case that made this file: the member died between the store's channel check and the call, gRPC found no
connection to send on and said UNAVAILABLE "failed to connect to all addresses". Nothing was sent, so the
write must go on to the next member, not fail (a CI run's test_watch_survives_member_loss hit it once)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc  # type: ignore[import-untyped]
import pytest
from grpc import aio

from openvsan.cluster.etcd import EtcdStateStore
from openvsan.node.statestore import StoreUnavailable


class _Stub:
    """A member's KV stub: the first `errors` Txn calls fail, then it answers as etcd does to a bare put."""

    def __init__(self, errors: list[aio.AioRpcError]) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def Txn(self, request: Any, **_: Any) -> Any:  # the gRPC method's name
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return SimpleNamespace(succeeded=True, header=SimpleNamespace(revision=7), responses=[])


def _store(monkeypatch: pytest.MonkeyPatch, *stubs: _Stub) -> EtcdStateStore:
    store = EtcdStateStore([f"127.0.0.1:{2379 + 2 * i}" for i in range(len(stubs))], timeout=0.5)
    for member, stub in zip(store._members, stubs, strict=True):

        async def ready(stub: _Stub = stub) -> Any:
            return SimpleNamespace(kvstub=stub)

        monkeypatch.setattr(member, "ready", ready)
    return store


REFUSED = aio.AioRpcError(
    grpc.StatusCode.UNAVAILABLE,
    details="failed to connect to all addresses; last error: UNKNOWN: ipv4:10.77.0.1:2379: "
    "Failed to connect to remote host: Connection refused",
)
LOST = aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details="Socket closed")
NO_LEADER = aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details="etcdserver: no leader")


@pytest.mark.parametrize("error", [REFUSED, NO_LEADER], ids=["no-connection", "no-leader"])
def test_a_write_nothing_was_sent_for_goes_on_to_the_next_member(
    monkeypatch: pytest.MonkeyPatch, error: aio.AioRpcError
) -> None:
    dead, alive = _Stub([error]), _Stub([])
    store = _store(monkeypatch, dead, alive)
    assert asyncio.run(store.put("/k", {"n": 1})) == 7
    assert (dead.calls, alive.calls) == (1, 1)
    assert store.endpoint == "127.0.0.1:2381"  # and the next calls go there


def test_a_write_lost_in_flight_may_have_been_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    dead, alive = _Stub([LOST]), _Stub([])
    store = _store(monkeypatch, dead, alive)
    with pytest.raises(StoreUnavailable, match="may or may not have been applied"):
        asyncio.run(store.put("/k", {"n": 1}))
    assert (dead.calls, alive.calls) == (1, 0)  # not sent again blindly
    assert store.endpoint == "127.0.0.1:2381"
