"""The whole cluster through one member's REST API (issue 15, api/peers.py): two real `vsan serve` nodes in a
cluster on a real etcd, each with its own API and its own tokens. With a token of node a only, an
administrator lists the members, reads node b, makes a volume on b and exports it there (a real initiator
then reads its capacity from b's portal), and the CLI does the same with `--node A --member B`. A read-only
token reads b and changes nothing there; a request that claims to be forwarded without the cluster's
signature is refused; a member that is down is a 502 with its address."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from replica_nodes import two_nodes, vsan
from vsan_harness import TEST_INITIATOR, require_tools, run

pytestmark = pytest.mark.interop

MiB = 1 << 20
IQN_X = "iqn.2026-12.org.openvsan.test:x"


def wait_api(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"no API on {url}"
        time.sleep(0.2)


def test_one_members_api_and_token_manage_every_member(tmp_path: Path) -> None:
    require_tools("iscsi-readcapacity16", "etcd")
    with two_nodes(tmp_path, api=True) as cluster:
        a, b = cluster["a"], cluster["b"]
        for n in (a, b):
            wait_api(n.api_url)
        admin_token, viewer_token = a.api_token("ops"), a.api_token("viewer", "read-only")
        ops = httpx.Client(base_url=a.api_url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=60)
        viewer = httpx.Client(base_url=a.api_url, headers={"Authorization": f"Bearer {viewer_token}"}, timeout=60)

        members = ops.get("/api/v1/nodes")
        assert members.status_code == 200, members.text
        assert [(m["name"], m["management"], m["up"], m["this"]) for m in members.json()] == [
            ("a", a.api_url, True, True), ("b", b.api_url, True, False)]

        # b's own resources, with a's token (b has never seen it: tokens are per node)
        assert httpx.get(f"{b.api_url}/api/v1/node", headers=ops.headers).status_code == 401
        r = ops.get("/api/v1/nodes/b/node")
        assert r.status_code == 200 and r.json()["name"] == "b", r.text
        rev_b = int(r.headers["etag"].strip('"'))
        assert ops.get("/api/v1/nodes/a/node").json()["name"] == "a"          # this node, the same way
        repl = ops.get("/api/v1/nodes/b/volumes/v1/replication").json()
        assert repl["epoch"] == b.status()["epoch"] and set(repl["in_sync"]) == {"a", "b"}, repl

        # a volume made and exported on b through a: a real initiator reads it from b's portal
        r = ops.put("/api/v1/nodes/b/volumes/x", json={"size": "16MiB"}, headers={"If-Match": f'"{rev_b}"'})
        assert r.status_code == 201, r.text
        assert r.headers["location"] == "/api/v1/nodes/b/volumes/x"
        assert int(r.headers["etag"].strip('"')) > rev_b
        r = ops.put("/api/v1/nodes/b/volumes/x", json={"size": "32MiB"}, headers={"If-Match": f'"{rev_b}"'})
        assert r.status_code == 412 and r.headers["content-type"] == "application/problem+json", r.text
        r = ops.post("/api/v1/nodes/b/exports", json={"protocol": "iscsi", "name": IQN_X, "volume": "x", "lun": 0})
        assert r.status_code == 201, r.text
        cap = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, "-s",
                   f"iscsi://127.0.0.1:{b.iscsi_port}/{IQN_X}/0"]).stdout
        assert int(cap.strip()) == 16 * MiB
        on_b = json.loads(vsan("volume", "list", "--data-dir", str(b.data_dir), "--json").stdout)
        on_a = json.loads(vsan("volume", "list", "--data-dir", str(a.data_dir), "--json").stdout)
        assert "x" in {v["name"] for v in on_b} and "x" not in {v["name"] for v in on_a}

        # the CLI: a's address and token, b's volumes
        r = vsan("--node", a.api_url, "--token", admin_token, "--member", "b", "volume", "list", "--json")
        assert r.returncode == 0, r.stderr
        assert {v["name"] for v in json.loads(r.stdout)} == {"v1", "x"}
        r = vsan("--node", a.api_url, "--token", viewer_token, "--member", "b", "volume", "delete", "x", "--force")
        assert r.returncode != 0 and "read-only" in r.stderr, r.stderr

        # read-only: reads b, changes nothing there
        assert viewer.get("/api/v1/nodes/b/volumes/x").status_code == 200
        r = viewer.delete("/api/v1/nodes/b/volumes/x", params={"force": True})
        assert r.status_code == 403 and "read-only" in r.json()["detail"], r.text
        assert ops.get("/api/v1/nodes/b/volumes/x").status_code == 200

        # a request that claims to come from a, without the cluster's key: refused, and nothing changes
        forged = {"x-openvsan-forwarded": f"node=a;role=admin;token=ops;t={time.time():.3f};sig={'0' * 64}"}
        r = httpx.delete(f"{b.api_url}/api/v1/volumes/x", params={"force": True}, headers=forged)
        assert r.status_code == 401 and "wrong signature" in r.json()["detail"], r.text
        assert ops.get("/api/v1/nodes/b/volumes/x").status_code == 200
        assert "wrong signature" in b.log_tail()

        r = ops.delete("/api/v1/nodes/b/volumes/x", params={"force": True})
        assert r.status_code == 200, r.text
        assert ops.get("/api/v1/nodes/b/volumes/x").status_code == 404
        r = ops.get("/api/v1/nodes/c/node")
        assert r.status_code == 404 and "members: a, b" in r.json()["detail"], r.text

        # the console's cluster page on a: both members, b's health asked of b, the replicated volume
        console = httpx.Client(base_url=a.api_url, timeout=60)
        assert console.post("/login", data={"token": viewer_token}).status_code == 303
        page = console.get("/cluster")
        assert page.status_code == 200, page.text
        b_health = ops.get("/api/v1/nodes/b/health").json()["status"]
        assert re.search(rf'data-member="b"[^>]*>.*?badge {b_health}', page.text, re.DOTALL), page.text
        assert 'data-member="a"' in page.text and 'data-volume="v1"' in page.text

        # b down: a says so, with b's address
        b.kill()
        r = ops.get("/api/v1/nodes/b/node")
        assert r.status_code == 502 and b.api_url in r.json()["detail"], r.text
        deadline = time.monotonic() + 20
        while {m["name"]: m["up"] for m in ops.get("/api/v1/nodes").json()}["b"]:
            assert time.monotonic() < deadline, "b still up in the cluster's store 20 s after it was killed"
            time.sleep(0.5)
        assert re.search(r'data-member="b" class="down"', console.get("/cluster").text)
