"""Which etcd client library the cluster StateStore uses: each candidate against a real etcd on 127.0.0.1.

Candidates: etcd3gw (etcd's JSON gateway at /v3/, blocking `requests`) and aetcd (gRPC, asyncio). For each:
put, a compare-and-swap transaction (one that must win, one that must lose), a lease that keep-alives hold
past its TTL and that then expires with its key, a prefix watch that sees a put and a delete in order, and
the rate of 1,000 sequential puts. Prints one line per check and a summary; exits non-zero when neither works.

    .venv/bin/pip install etcd3gw aetcd
    .venv/bin/python bench/etcd_client_smoke.py          (needs Debian etcd-server)
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from openvsan.cluster.etcd_process import EtcdProcess

N_PUTS = 1000
TTL = 2  # seconds; etcd raises a smaller one to its minimum (1.5 x election timeout)


class Report:
    def __init__(self, client: str) -> None:
        self.client = client
        self.results: dict[str, str] = {}

    async def check(self, name: str, fn: Callable[[], Awaitable[str]]) -> None:
        try:
            self.results[name] = "ok " + await fn()
        except Exception as e:  # noqa: BLE001  (a smoke test reports every failure and goes on)
            self.results[name] = f"FAIL {type(e).__name__}: {e}"
            traceback.print_exc(limit=3)
        print(f"{self.client:8} {name:10} {self.results[name]}", flush=True)

    @property
    def works(self) -> bool:
        return all(r.startswith("ok") for r in self.results.values())


async def smoke_aetcd(endpoint: str) -> Report:
    import aetcd

    rep = Report("aetcd")
    host, port = endpoint.rsplit(":", 1)
    client = aetcd.Client(host=host, port=int(port), timeout=5)
    tx = client.transactions

    async def put() -> str:
        r = await client.put(b"/smoke/a/k", b"v1")
        got = await client.get(b"/smoke/a/k")
        assert got is not None and got.value == b"v1", got
        return f"revision {r.header.revision}"

    async def txn() -> str:
        got = await client.get(b"/smoke/a/k")
        assert got is not None
        ok, _ = await client.transaction(
            compare=[tx.mod(b"/smoke/a/k") == got.mod_revision],
            success=[tx.put(b"/smoke/a/k", b"v2"), tx.put(b"/smoke/a/k2", b"x")],
            failure=[],
        )
        stale, _ = await client.transaction(
            compare=[tx.mod(b"/smoke/a/k") == got.mod_revision], success=[tx.put(b"/smoke/a/k", b"v3")], failure=[]
        )
        assert ok and not stale, (ok, stale)
        return "CAS on mod_revision: first wins, stale loses"

    async def lease() -> str:
        lease = await client.lease(TTL)
        await client.put(b"/smoke/lease", b"held", lease=lease)
        t0 = time.monotonic()
        while time.monotonic() - t0 < TTL * 2:
            await lease.refresh()
            await asyncio.sleep(0.3)
        assert await client.get(b"/smoke/lease") is not None, "key lost while kept alive"
        t1 = time.monotonic()
        while await client.get(b"/smoke/lease") is not None:
            assert time.monotonic() - t1 < TTL + 5, "key outlived its lease"
            await asyncio.sleep(0.1)
        gone = time.monotonic() - t1
        l2 = await client.lease(TTL)
        await client.put(b"/smoke/lease2", b"x", lease=l2)
        await l2.revoke()
        assert await client.get(b"/smoke/lease2") is None
        return f"kept {TTL * 2}s past a {TTL}s TTL, expired {gone:.1f}s after the last keep-alive; revoke ok"

    async def watch() -> str:
        start = (await client.put(b"/smoke/w/x", b"1")).header.revision
        await client.delete(b"/smoke/w/x")
        w = await client.watch_prefix(b"/smoke/w/", start_revision=start)
        seen = []
        async for ev in w:
            seen.append((ev.kind, ev.kv.key, ev.kv.mod_revision))
            if len(seen) == 2:
                break
        await w.cancel()
        assert [s[0] for s in seen] == ["PUT", "DELETE"] and seen[0][2] == start, seen
        return f"replay from {start}: {[s[0] for s in seen]}"

    async def rate() -> str:
        t0 = time.perf_counter()
        for i in range(N_PUTS):
            await client.put(b"/smoke/rate/%d" % i, b"v")
        dt = time.perf_counter() - t0
        return f"{N_PUTS / dt:,.0f} puts/s ({N_PUTS} sequential, {dt * 1e6 / N_PUTS:.0f} us each)"

    for name, fn in [("put", put), ("txn", txn), ("lease", lease), ("watch", watch), ("1000 puts", rate)]:
        await rep.check(name, fn)
    await client.close()
    return rep


async def smoke_etcd3gw(endpoint: str) -> Report:
    import etcd3gw

    rep = Report("etcd3gw")
    host, port = endpoint.rsplit(":", 1)
    client = etcd3gw.Etcd3Client(host=host, port=int(port), timeout=5, api_path="/v3/")

    def off(fn: Callable[..., Any], *a: Any, **kw: Any) -> Awaitable[Any]:
        return asyncio.to_thread(fn, *a, **kw)  # every etcd3gw call blocks on an HTTP round trip

    async def put() -> str:
        await off(client.put, "/smoke/a/k", "v1")
        got = await off(client.get, "/smoke/a/k", metadata=True)
        assert got and got[0][0] == b"v1", got
        return f"mod_revision {got[0][1]['mod_revision']}"

    def b64(s: str) -> str:
        import base64

        return base64.b64encode(s.encode()).decode()

    async def txn() -> str:
        got = await off(client.get, "/smoke/a/k", metadata=True)
        mod = int(got[0][1]["mod_revision"])
        body = {
            "compare": [{"key": b64("/smoke/a/k"), "result": "EQUAL", "target": "MOD", "mod_revision": mod}],
            "success": [
                {"request_put": {"key": b64("/smoke/a/k"), "value": b64("v2")}},
                {"request_put": {"key": b64("/smoke/a/k2"), "value": b64("x")}},
            ],
        }
        first = await off(client.transaction, body)
        second = await off(client.transaction, body)
        assert first.get("succeeded") and not second.get("succeeded"), (first, second)
        return "CAS on mod_revision: first wins, stale loses"

    async def lease() -> str:
        lease = await off(client.lease, TTL)
        await off(client.put, "/smoke/lease", "held", lease=lease)
        t0 = time.monotonic()
        while time.monotonic() - t0 < TTL * 2:
            await off(lease.refresh)
            await asyncio.sleep(0.3)
        assert await off(client.get, "/smoke/lease"), "key lost while kept alive"
        t1 = time.monotonic()
        while await off(client.get, "/smoke/lease"):
            assert time.monotonic() - t1 < TTL + 5, "key outlived its lease"
            await asyncio.sleep(0.1)
        return f"kept {TTL * 2}s past a {TTL}s TTL, expired {time.monotonic() - t1:.1f}s after the last keep-alive"

    async def watch() -> str:
        await off(client.put, "/smoke/w/x", "1")
        start = int((await off(client.get, "/smoke/w/x", metadata=True))[0][1]["mod_revision"])
        await off(client.delete, "/smoke/w/x")
        events, cancel = await off(client.watch_prefix, "/smoke/w/", start_revision=start)
        seen: list[str] = []

        def take() -> None:
            for ev in events:
                seen.append(ev.get("type", "PUT"))
                if len(seen) == 2:
                    return

        t = threading.Thread(target=take, daemon=True)
        t.start()
        t.join(10)
        cancel()
        assert seen == ["PUT", "DELETE"], seen
        return f"replay from {start}: {seen}"

    async def rate() -> str:
        t0 = time.perf_counter()
        for i in range(N_PUTS):
            await off(client.put, f"/smoke/rate/{i}", "v")
        dt = time.perf_counter() - t0
        return f"{N_PUTS / dt:,.0f} puts/s ({N_PUTS} sequential, {dt * 1e6 / N_PUTS:.0f} us each)"

    for name, fn in [("put", put), ("txn", txn), ("lease", lease), ("watch", watch), ("1000 puts", rate)]:
        await rep.check(name, fn)
    return rep


async def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        reports = []
        for smoke in (smoke_etcd3gw, smoke_aetcd):
            # a fresh etcd each, so neither client's rate is measured on the other's history
            with EtcdProcess(Path(tmp) / smoke.__name__) as etcd:
                ver = etcd.binary
                print(f"-- {smoke.__name__} against {ver} on {etcd.endpoint}", flush=True)
                try:
                    reports.append(await smoke(etcd.endpoint))
                except ImportError as e:
                    print(f"{smoke.__name__}: not installed ({e})")
    print()
    for r in reports:
        print(f"{r.client:8} {'WORKS' if r.works else 'BROKEN'}  {r.results.get('1000 puts', '')}")
    return 0 if any(r.works for r in reports) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
