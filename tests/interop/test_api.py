"""The REST API of a real `vsan serve` (issue 15), over HTTP with httpx: a volume's lifecycle through the API
seen by real initiators (nbdinfo, iscsi-readcapacity16), conflicts (409, 412), bad specs (422 with the line
the CLI prints), tokens (401, 403; the first one printed once in the log), and /metrics checked by promtool."""

from __future__ import annotations

import json
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from vsan_harness import TEST_INITIATOR, VSAN, VsanServer, require_tools, run

pytestmark = pytest.mark.interop

MiB = 1 << 20


def cli(server: VsanServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VSAN), *args, "--data-dir", str(server.data_dir)], capture_output=True, text=True,
                          timeout=60, check=False)


def nbd_size(server: VsanServer, export: str) -> int:
    return int(run(["nbdinfo", "--size", server.nbd_url(export)]).stdout.strip())


@pytest.fixture
def api(vsan: Callable[..., VsanServer]) -> tuple[VsanServer, httpx.Client]:
    require_tools("nbdinfo", "iscsi-readcapacity16")
    server = vsan(nbd=True)
    base = server.wait_api()
    client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {server.first_api_token()}"}, timeout=60)
    return server, client


def test_a_volume_made_resized_exported_and_deleted_through_the_api_is_what_initiators_see(
        api: tuple[VsanServer, httpx.Client]) -> None:
    server, c = api
    node = c.get("/api/v1/node")
    assert node.status_code == 200 and node.json()["name"] == "test-node"
    rev = int(node.headers["etag"].strip('"'))

    r = c.put("/api/v1/volumes/v1", json={"size": "32MiB"}, headers={"If-Match": f'"{rev}"'})
    assert r.status_code == 201, r.text
    assert r.headers["location"] == "/api/v1/volumes/v1" and r.json()["volume"]["size"] == 32 * MiB
    rev1 = int(r.headers["etag"].strip('"'))
    assert rev1 > rev and r.json()["revision"] == rev1

    r = c.post("/api/v1/exports", json={"protocol": "nbd", "name": "v1", "volume": "v1"})
    assert r.status_code == 201, r.text
    changes = [e for e in c.get("/api/v1/events").json() if e["kind"] == "change"]
    assert [e["object"] for e in changes][-2:] == ["volume v1", "export v1"], changes
    r = c.post("/api/v1/exports", json={"protocol": "iscsi", "name": server.iqn, "volume": "v1", "lun": 1})
    assert r.status_code == 201, r.text
    assert nbd_size(server, "v1") == 32 * MiB
    cap = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, "-s", server.url(1)]).stdout
    assert int(cap.strip()) == 32 * MiB
    devices = {d["name"]: d for d in c.get("/api/v1/devices").json()}
    assert devices["v1"]["used_by"] == "volume v1" and devices["v1"]["size"] == 32 * MiB
    listed = {(e["protocol"], e["name"]) for e in c.get("/api/v1/exports").json()}
    assert {("nbd", "v1"), ("iscsi", server.iqn), ("nbd", "disk0")} <= listed

    # a change made against an old revision is refused, and changes nothing
    r = c.put("/api/v1/volumes/v1", json={"size": "48MiB"}, headers={"If-Match": f'"{rev}"'})
    assert r.status_code == 412 and r.headers["content-type"] == "application/problem+json", r.text
    assert nbd_size(server, "v1") == 32 * MiB
    now = int(c.get("/api/v1/volumes/v1").headers["etag"].strip('"'))
    r = c.put("/api/v1/volumes/v1", json={"size": "48MiB"}, headers={"If-Match": f'"{now}"'})
    assert r.status_code == 200, r.text
    assert nbd_size(server, "v1") == 48 * MiB
    assert c.get("/api/v1/volumes/v1").json()["size"] == 48 * MiB

    # exported: not deleted without force (409), then deleted with its exports
    r = c.delete("/api/v1/volumes/v1")
    assert r.status_code == 409 and "is exported" in r.json()["detail"]
    r = c.delete("/api/v1/volumes/v1", params={"force": "true"})
    assert r.status_code == 200, r.text
    assert c.get("/api/v1/volumes/v1").status_code == 404
    gone = subprocess.run(["nbdinfo", "--size", server.nbd_url("v1")], capture_output=True, text=True, timeout=30,
                          check=False)
    assert gone.returncode != 0
    assert nbd_size(server, "disk0") == 64 * MiB     # the volume that was there all along, untouched


def test_bad_specs_get_422_with_the_line_the_cli_prints(api: tuple[VsanServer, httpx.Client]) -> None:
    server, c = api
    r = c.put("/api/v1/volumes/v2", json={"size": "12XB"})
    assert r.status_code == 422
    p = r.json()
    assert p["status"] == 422 and p["instance"] == "/api/v1/volumes/v2"
    assert "'12XB' is not a size" in p["detail"]
    # a refusal the node makes: the API's detail is the line `vsan volume create` prints
    r = c.put("/api/v1/volumes/v2", json={"size": "8MiB", "pool": "nope"})
    assert r.status_code in (409, 422), r.text
    printed = cli(server, "volume", "create", "v2", "--size", "8MiB", "--pool", "nope")
    assert printed.returncode != 0
    assert printed.stderr.strip() == f"vsan: {r.json()['detail']}", (printed.stderr, r.json())
    r = c.put("/api/v1/volumes/v2", json={"sise": "12MiB"})
    assert r.status_code == 422 and 'did you mean "size"' in r.json()["detail"]
    r = c.put("/api/v1/volumes/disk0", json={"pool": "nope"})
    assert r.status_code == 409
    assert c.get("/api/v1/volumes").status_code == 200
    assert [v["name"] for v in c.get("/api/v1/volumes").json()] == ["disk0"]


def test_tokens_roles_and_refusals(api: tuple[VsanServer, httpx.Client]) -> None:
    server, c = api
    made = cli(server, "token", "create", "watcher", "--role", "read-only")
    assert made.returncode == 0, made.stderr
    reader = httpx.Client(base_url=c.base_url, headers={"Authorization": f"Bearer {made.stdout.strip()}"})
    assert reader.get("/api/v1/volumes").status_code == 200
    assert reader.get("/api/v1/tokens/self").json()["role"] == "read-only"
    r = reader.put("/api/v1/volumes/v3", json={"size": "8MiB"})
    assert r.status_code == 403
    assert c.get("/api/v1/volumes/v3").status_code == 404      # nothing was made
    anon = httpx.Client(base_url=c.base_url)
    assert anon.get("/healthz").status_code == 200
    r = anon.get("/api/v1/volumes")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    listed = cli(server, "token", "list", "--json")
    assert {t["name"] for t in json.loads(listed.stdout)} == {"initial", "watcher"}
    assert "vsan_" not in listed.stdout and "digest" not in listed.stdout
    assert cli(server, "token", "revoke", "watcher").returncode == 0
    assert reader.get("/api/v1/volumes").status_code == 401
    assert "authentication failed from 127.0.0.1" in server.log_text()


def test_metrics_pass_promtool(api: tuple[VsanServer, httpx.Client]) -> None:
    require_tools("promtool")
    _, c = api
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'openvsan_volume_size_bytes{volume="disk0"} 6.7108864e+07' in r.text
    check = subprocess.run(["promtool", "check", "metrics"], input=r.text, capture_output=True, text=True,
                           timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr


def scrape(c: httpx.Client) -> dict[str, float]:
    """The samples of /metrics, by name and labels as written."""
    out = {}
    for line in c.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_counters_match_a_known_workload(api: tuple[VsanServer, httpx.Client]) -> None:
    """fio issues exactly N writes then N reads over NBD: the volume's counters and histograms grow by exactly
    that; `vsan bench` for a while: within 1 % (and the requests it had in flight) of the ops it reports."""
    require_tools("fio")
    server, c = api
    before = scrape(c)
    n = 3000
    for rw in ("randwrite", "randread"):
        run(["fio", "--name=m", "--ioengine=nbd", f"--uri={server.nbd_url('disk0')}", f"--rw={rw}", "--bs=4k",
             "--iodepth=8", f"--number_ios={n}", "--size=16M", "--time_based=0", "--output-format=terse"],
            timeout=120)
    after = scrape(c)
    v = '{volume="disk0"}'

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew(f"openvsan_volume_write_ops_total{v}") == n
    assert grew(f"openvsan_volume_write_bytes_total{v}") == n * 4096
    assert grew(f"openvsan_volume_read_ops_total{v}") == n
    assert grew(f"openvsan_volume_read_bytes_total{v}") == n * 4096
    assert grew(f"openvsan_volume_read_latency_seconds_count{v}") == n
    assert grew(f"openvsan_volume_write_latency_seconds_count{v}") == n
    assert after['openvsan_volume_write_latency_seconds_bucket{le="+Inf",volume="disk0"}'] == \
        after[f"openvsan_volume_write_latency_seconds_count{v}"]
    assert 0 < grew(f"openvsan_volume_read_latency_seconds_sum{v}") < n * 0.01

    before = after
    out = run([str(VSAN), "bench", server.nbd_url("disk0"), "--rw", "randread", "--qd", "16", "--duration", "2",
               "--warmup", "0", "--json"], timeout=120).stdout
    done = json.loads(out)["runs"][0]["total"]["ops"]
    counted = scrape(c)[f"openvsan_volume_read_ops_total{v}"] - before[f"openvsan_volume_read_ops_total{v}"]
    assert done <= counted <= done * 1.01 + 16, (done, counted)


def test_the_cli_on_a_remote_node_is_the_cli_on_a_local_one(api: tuple[VsanServer, httpx.Client],
                                                            tmp_path: Path) -> None:
    """`vsan --node URL` sends the same commands over the REST API: the same answers, the same one-line
    refusals, the roles enforced; `config apply` sends the file's contents."""
    server, c = api
    token_file = tmp_path / "token"
    token_file.write_text(server.first_api_token() + "\n")
    url = str(c.base_url)

    def remote(*args: str, token: Path = token_file) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(VSAN), "--node", url, "--token-file", str(token), *args], capture_output=True,
                              text=True, timeout=60, check=False)

    made = remote("volume", "create", "r1", "--size", "16MiB")
    assert made.returncode == 0, made.stderr
    assert "+ volume r1" in made.stdout
    over_api = json.loads(remote("volume", "show", "r1", "--json").stdout)
    local = json.loads(cli(server, "volume", "show", "r1", "--json").stdout)
    for key in ("name", "size", "uuid", "exports"):
        assert over_api[key] == local[key]
    assert nbd_size_after_export(server, remote) == 16 * MiB
    # a refusal: the same line and exit code as the local CLI
    a, b = remote("volume", "create", "r1", "--size", "8MiB"), cli(server, "volume", "create", "r1", "--size", "8MiB")
    assert (a.returncode, a.stderr) == (b.returncode, b.stderr) and "exists" in a.stderr
    # a read-only token reads, and is refused a change
    ro = tmp_path / "ro"
    ro.write_text(cli(server, "token", "create", "ro", "--role", "read-only").stdout)
    assert remote("volume", "list", token=ro).returncode == 0
    refused = remote("volume", "delete", "r1", "--force", token=ro)
    assert refused.returncode != 0 and "read-only" in refused.stderr
    bad = tmp_path / "bad"
    bad.write_text("vsan_00000000_" + "x" * 43)
    assert "not valid" in remote("volume", "list", token=bad).stderr
    # the whole desired state from a file here: the one the node started with (r1 and its export go)
    applied = remote("config", "apply", str(server.config))
    assert applied.returncode == 0, applied.stderr
    assert "- volume r1" in applied.stdout
    assert c.get("/api/v1/volumes/r1").status_code == 404


def test_the_local_cli_goes_through_the_api(api: tuple[VsanServer, httpx.Client]) -> None:
    """The node tells its local CLI where its API is, with a token made at start (api-local.json, 0600, in no
    token list): `vsan` commands then work with the control socket out of the way; a file left by a node that
    is gone is ignored; the node removes the file when it stops."""
    server, _ = api
    local = server.data_dir / "api-local.json"
    assert local.stat().st_mode & 0o777 == 0o600
    doc = json.loads(local.read_text())
    assert doc["url"] == f"http://127.0.0.1:{server.api_port}" and doc["pid"] == server.proc.pid  # type: ignore[union-attr]
    listed = json.loads(cli(server, "token", "list", "--json").stdout)
    assert [t["name"] for t in listed] == ["initial"]
    sock, aside = server.data_dir / "control.sock", server.data_dir / "control.sock.aside"
    sock.rename(aside)
    try:
        made = cli(server, "volume", "create", "l1", "--size", "8MiB")
        assert made.returncode == 0 and "+ volume l1" in made.stdout, made.stderr
        refused = cli(server, "volume", "create", "l1", "--size", "8MiB")
        assert refused.returncode == 2 and "exists" in refused.stderr, refused.stderr
        # the file of a node that is gone: ignored (here: the control socket, which is away)
        local.write_text(json.dumps({**doc, "pid": 2 ** 22 + 1, "token": "vsan_00000000_" + "x" * 43}))
        gone = cli(server, "volume", "list")
        assert gone.returncode == 1 and "no vsan serve is running" in gone.stderr, gone.stderr
    finally:
        aside.rename(sock)
    assert "l1" in cli(server, "volume", "list").stdout
    local.write_text(json.dumps(doc))
    server.stop()
    assert not local.exists()


def nbd_size_after_export(server: VsanServer, remote: Callable[..., subprocess.CompletedProcess[str]]) -> int:
    out = remote("export", "add", "nbd", "r1", "--volume", "r1")
    assert out.returncode == 0, out.stderr
    return nbd_size(server, "r1")


def test_sessions_show_who_is_connected_from_where(api: tuple[VsanServer, httpx.Client]) -> None:
    """An iSCSI initiator and an NBD client connected now are listed, with their names and addresses."""
    require_tools("iscsi-perf")
    server, c = api
    perf = subprocess.Popen(["iscsi-perf", "-i", TEST_INITIATOR, "-t", "6", server.url()], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    bench = subprocess.Popen([str(VSAN), "bench", server.nbd_url("disk0"), "--rw", "randread", "--duration", "6",
                              "--warmup", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        while True:
            rows = c.get("/api/v1/sessions").json()
            iscsi = [r for r in rows if r["protocol"] == "iscsi" and r["state"] == "logged in"]
            nbd = [r for r in rows if r["protocol"] == "nbd" and r["state"] == "transmission"]
            if iscsi and nbd or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert iscsi and iscsi[0]["initiator"] == TEST_INITIATOR and iscsi[0]["target"] == server.iqn, rows
        assert iscsi[0]["peer"].startswith("127.0.0.1:")
        assert nbd and nbd[0]["export"] == "disk0" and nbd[0]["tls"] is False, rows
        printed = cli(server, "sessions")
        assert printed.returncode == 0 and TEST_INITIATOR in printed.stdout and "disk0" in printed.stdout
    finally:
        perf.wait(60)
        bench.wait(60)


def test_the_api_over_https_with_the_given_certificate(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    """[api] tls: HTTPS with the configured certificate; a client that trusts its CA gets in (httpx and
    `vsan --node https://... --ca`), a plain-HTTP request gets nothing; the health report warns of the
    certificate's end."""
    require_tools("openssl")
    from tls_pki import make_pki

    pki = make_pki(tmp_path / "pki")
    server = vsan(start=False)
    listen = f'listen = "127.0.0.1:{server.api_port}"\n'
    server.config.write_text(server.config.read_text().replace(listen, listen + (
        f'tls = {{ cert = "{pki.server / "server-cert.pem"}", key = "{pki.server / "server-key.pem"}" }}\n')))
    server.start()
    base = f"https://127.0.0.1:{server.api_port}"
    trust = ssl.create_default_context(cafile=str(pki.ca))
    deadline = time.monotonic() + 30
    while True:
        try:
            assert httpx.get(f"{base}/healthz", verify=trust, timeout=5).status_code == 200
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    token = server.first_api_token()
    r = httpx.get(f"{base}/api/v1/node", verify=trust, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.json()["name"] == "test-node"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{server.api_port}/healthz", timeout=5)
    with pytest.raises(httpx.TransportError):      # a client that does not trust the CA refuses the server
        httpx.get(f"{base}/healthz", timeout=5)
    # the local CLI reaches the API over HTTPS, trusting the node's own certificate (not through the socket)
    sock = server.data_dir / "control.sock"
    sock.rename(sock.with_name("control.sock.aside"))
    try:
        listed = cli(server, "volume", "list", "--json")
        assert listed.returncode == 0 and json.loads(listed.stdout)[0]["name"] == "disk0", listed.stderr
    finally:
        sock.with_name("control.sock.aside").rename(sock)
    out = subprocess.run([str(VSAN), "--node", base, "--token", token, "--ca", str(pki.ca), "health", "--json"],
                         capture_output=True, text=True, timeout=60, check=False)
    # the test CA's certificates live a few days: the health report says so (a warning: exit 1)
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert report["status"] == "warning" and report["findings"][0]["code"] == "cert-expiring", report


def test_a_scrape_of_a_node_with_100_volumes(vsan: Callable[..., VsanServer]) -> None:
    """100 volumes (carved from one device): every one is in /metrics, promtool passes, and the scrape's
    time is printed (issue 15 asks for 50 ms or less; this 2-core machine's figure is in docs/benchmarks.md,
    not asserted)."""
    require_tools("promtool")
    server = vsan("ram", "256MiB", carve="1MiB", carved=[(f"v{i:02d}", "1MiB", True) for i in range(99)])
    c = httpx.Client(base_url=server.wait_api(), headers={"Authorization": f"Bearer {server.first_api_token()}"},
                     timeout=60)
    c.get("/metrics")
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        text = c.get("/metrics").text
        times.append(time.perf_counter() - t0)
    assert text.count("openvsan_volume_size_bytes{") == 100
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60,
                           check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    times.sort()
    print(f"/metrics of 100 volumes: median {times[4] * 1000:.1f} ms, best {times[0] * 1000:.1f} ms, worst "
          f"{times[-1] * 1000:.1f} ms ({len(text)} bytes)")


POOL_CONFIG = """
[node]
name = "pool-node"

[[devices]]
name = "m0"
type = "ram"
size = "16MiB"

[[devices]]
name = "m1"
type = "ram"
size = "16MiB"

[[devices]]
name = "s0"
type = "ram"
size = "16MiB"

[[pools]]
name = "p0"
level = "raid1"
members = ["m0", "m1"]

[[volumes]]
name = "pv"
pool = "p0"

[iscsi]
portals = ["127.0.0.1:{port}"]

[[iscsi.targets]]
iqn = "{iqn}"
luns = [{{ lun = 0, volume = "pv" }}]

[nbd]
portals = ["127.0.0.1:{nbd_port}"]

[[nbd.exports]]
name = "pv"
volume = "pv"

[api]
listen = "127.0.0.1:{api_port}"
"""


def test_a_pool_through_the_api_scrub_fail_spare_rebuild(vsan: Callable[..., VsanServer]) -> None:
    """Pools as resources: state and members, a scrub's report, a member failed, a spare added and rebuilt
    onto while an NBD client reads what was written before; a read-only token sees and changes nothing; an
    unknown pool is a 404 with the CLI's line."""
    require_tools("nbdcopy")
    server = vsan(start=False)
    server.config.write_text(POOL_CONFIG.format(port=server.port, iqn=server.iqn, nbd_port=server.nbd_port,
                                                api_port=server.api_port))
    server.start()
    c = httpx.Client(base_url=server.wait_api(), headers={"Authorization": f"Bearer {server.first_api_token()}"},
                     timeout=120)
    data = bytes(range(256)) * (4 * MiB // 256)
    run(["nbdcopy", "-", server.nbd_url("pv")], input=data)
    p = c.get("/api/v1/pools/p0").json()
    assert p["state"] == "optimal" and [m["device"] for m in p["members"]] == ["m0", "m1"], p
    r = c.get("/api/v1/pools/p9")
    assert r.status_code == 404 and "no pool" in r.json()["detail"] and "p0" in r.json()["detail"], r.text
    scrub = c.post("/api/v1/pools/p0/scrub", json={"repair": False})
    assert scrub.status_code == 200 and scrub.json()["mismatches"] == 0, scrub.text
    r = c.post("/api/v1/pools/p0/scrub", json={"repiar": False})
    assert r.status_code == 422 and "repiar" in r.json()["detail"]

    ro = cli(server, "token", "create", "viewer", "--role", "read-only").stdout.strip()
    r = httpx.post(f"{c.base_url}/api/v1/pools/p0/members/1/fail", headers={"Authorization": f"Bearer {ro}"})
    assert r.status_code == 403 and "read-only" in r.json()["detail"]
    assert c.get("/api/v1/pools/p0").json()["state"] == "optimal"

    r = c.post("/api/v1/pools/p0/members/m1/fail")
    assert r.status_code == 200, r.text
    assert c.get("/api/v1/pools/p0").json()["state"] == "degraded"
    r = c.post("/api/v1/pools/p0/spares", json={"device": "s0"})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while (st := c.get("/api/v1/pools/p0").json())["state"] != "optimal":
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    assert [m["device"] for m in st["members"]] == ["m0", "s0"], st
    out = subprocess.run(["nbdcopy", server.nbd_url("pv"), "-"], capture_output=True, timeout=60, check=True).stdout
    assert out[:len(data)] == data
    health = {f["code"] for f in c.get("/api/v1/health").json()["findings"]}
    assert not any(code.startswith("pool-") for code in health), health
