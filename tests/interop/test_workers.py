"""`vsan serve --workers 2` (node/workers.py): two worker processes share every portal (SO_REUSEPORT), each
serving one of two volumes; a connection the kernel gives to the worker that does not serve what it names
is handed to the one that does, with its socket and what it said so far (frontend/handoff.py).

Each test connects many times per protocol (iSCSI, NVMe/TCP, NBD), so both workers accept connections for
both volumes; the node's debug log must show hand-offs for every protocol, and every connection must
reach its own volume (what one wrote, another reads back, over another protocol). Discovery answered by
either worker lists the whole node (libiscsi's iscsi-ls, nbdinfo --list, our NVMe discovery)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vsan_harness import require_tools
from worker_node import BS, WorkerNode, iqn, nqn

from openvsan.initiator import open_url
from openvsan.initiator.nvme_tcp import discover as nvme_discover

pytestmark = pytest.mark.interop

ROUNDS = 10          # connections per protocol and volume: all on one worker has odds of 2^-20
PROTOCOLS = ("iscsi", "nvme", "nbd")
KIND = {"iscsi": "iSCSI target", "nvme": "NVMe subsystem", "nbd": "NBD export"}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[WorkerNode]:
    n = WorkerNode(tmp_path / "node").start()
    try:
        yield n
    finally:
        rc = n.stop()
        assert rc == 0, n.log_text()[-3000:]


def block(proto: str, v: str, i: int) -> bytes:
    return f"{proto}:{v}:{i}:".encode().ljust(BS, b"\xa5")


def test_each_connection_reaches_its_volume_whichever_worker_accepts_it(node: WorkerNode) -> None:
    owners = {v: node.owner(v)["worker"] for v in node.volumes}
    assert sorted(owners.values()) == [0, 1], owners   # one volume per worker

    async def go() -> None:
        for i in range(ROUNDS):
            for proto in PROTOCOLS:
                for v in node.volumes:
                    dev = await open_url(node.url(proto, v))
                    try:
                        lba = PROTOCOLS.index(proto) * ROUNDS + i
                        await dev.write(lba, block(proto, v, i), fua=True)
                        assert bytes(await dev.read(lba, 1)) == block(proto, v, i)
                    finally:
                        await dev.close()
        # every block, read back over another protocol (a new connection, maybe on the other worker)
        for v in node.volumes:
            for k, proto in enumerate(PROTOCOLS):
                other = PROTOCOLS[(k + 1) % len(PROTOCOLS)]
                dev = await open_url(node.url(other, v))
                try:
                    data = bytes(await dev.read(k * ROUNDS, ROUNDS))
                finally:
                    await dev.close()
                for i in range(ROUNDS):
                    assert data[i * BS:(i + 1) * BS] == block(proto, v, i), (proto, v, i)

    asyncio.run(go())
    log = node.log_text()
    for proto in PROTOCOLS:
        handed = re.findall(rf"w(\d) frontend: [^\n]*: {KIND[proto]} (\S+) is served by worker (\d): handed to", log)
        assert handed, f"no {proto} connection was handed over in {2 * ROUNDS} connections:\n{log[-3000:]}"
        for at, name, to in handed:
            v = name.rsplit(":", 1)[-1]
            assert int(to) == owners[v] != int(at), (at, name, to)
    assert "answers differently" not in log and "Traceback" not in log, log[-3000:]
    # the volumes' files hold what was written: each worker wrote its own volume only
    for v in node.volumes:
        image = node.image(v).read_bytes()
        assert image[:BS] == block("iscsi", v, 0)


def test_discovery_lists_the_whole_node_on_every_worker(node: WorkerNode) -> None:
    require_tools("iscsi-ls", "nbdinfo")
    port = node.ports
    for _ in range(8):   # connections spread over both workers: each must list what both serve
        out = subprocess.run(["iscsi-ls", f"iscsi://127.0.0.1:{port['iscsi']}"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        assert all(f"Target:{iqn(v)} Portal:127.0.0.1:{port['iscsi']},1" in out for v in node.volumes), out
        out = subprocess.run(["nbdinfo", "--list", f"nbd://127.0.0.1:{port['nbd']}"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        for v in node.volumes:
            # the size of an export the other worker serves is known here (the supervisor told it)
            assert re.search(rf'export="{v}":\n(?:\t.*\n)*?\texport-size: {node.size_mib << 20} ', out), out
        found = asyncio.run(nvme_discover(f"nvme+tcp://127.0.0.1:{port['nvme']}"))
        assert sorted(name for name, _ in found) == sorted(nqn(v) for v in node.volumes), found
    assert "Traceback" not in node.log_text()


def test_vsan_workers_shows_each_worker_on_its_core(node: WorkerNode) -> None:
    rows = node.workers_report()
    assert [r["worker"] for r in rows] == [0, 1]
    for r in rows:
        assert r["serving"] is True and r["restarts"] == 0 and isinstance(r["pid"], int)
        assert r["cpu"] is not None    # pinned by default: worker i on the i-th usable core
        assert len(r["volumes"]) == 1  # type: ignore[arg-type]
        v = r["volumes"][0]  # type: ignore[index]
        assert r["targets"] == [iqn(v)] and r["subsystems"] == [nqn(v)] and r["nbd_exports"] == [v]
    # the live commands answer for the whole node: each volume with the worker that serves it
    listed = json.loads(vsan(node, "volume", "list", "--json").stdout)
    assert {v["name"]: v["worker"] for v in listed} == {r["volumes"][0]: r["worker"] for r in rows}  # type: ignore[index]
    assert all(v["size"] == node.size_mib << 20 for v in listed), listed


def vsan(node: WorkerNode, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(Path(__file__).parents[2] / ".venv" / "bin" / "vsan"), *args, "--data-dir",
                          str(node.data_dir)], capture_output=True, text=True, timeout=120, check=False)
    assert (out.returncode == 0) == ok, out
    return out


def test_changes_while_serving_reach_every_worker(node: WorkerNode) -> None:
    """vsan volume / export / qos go through the supervisor to the worker that serves the volume; the other
    worker learns the new target, subsystem and export (discovery, hand-off); a worker restarted after the
    change serves the changed state; a target that gathers volumes of two workers moves them to one first."""
    require_tools("iscsi-ls", "nbdinfo")
    port = node.ports
    vsan(node, "volume", "create", "v2", "--size", "4MiB", "--backing", "ram")
    vsan(node, "export", "add", "iscsi", iqn("v2"), "--volume", "v2", "--portal", f"127.0.0.1:{port['iscsi']}")
    vsan(node, "export", "add", "nvme", nqn("v2"), "--volume", "v2", "--portal", f"127.0.0.1:{port['nvme']}")
    vsan(node, "export", "add", "nbd", "v2", "--volume", "v2", "--portal", f"127.0.0.1:{port['nbd']}")
    owner = node.owner("v2")
    assert owner["targets"] == [iqn("v0"), iqn("v2")] or owner["targets"] == [iqn("v1"), iqn("v2")], owner

    async def roundtrip(proto: str, i: int) -> None:
        dev = await open_url(node.url(proto, "v2"))
        try:
            await dev.write(i, block(proto, "v2", i), fua=True)
            assert bytes(await dev.read(i, 1)) == block(proto, "v2", i)
        finally:
            await dev.close()

    for i in range(ROUNDS):
        for proto in PROTOCOLS:
            asyncio.run(roundtrip(proto, PROTOCOLS.index(proto) * ROUNDS + i))
        out = subprocess.run(["iscsi-ls", f"iscsi://127.0.0.1:{port['iscsi']}"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        assert f"Target:{iqn('v2')} " in out, out
        names = sorted(n for n, _ in asyncio.run(nvme_discover(f"nvme+tcp://127.0.0.1:{port['nvme']}")))
        assert names == sorted(nqn(v) for v in ("v0", "v1", "v2")), names
    vsan(node, "volume", "resize", "v2", "--size", "6MiB")
    vsan(node, "qos", "set", "v2", "--iops-limit", "5000")
    shown = json.loads(vsan(node, "volume", "show", "v2", "--json").stdout)
    assert shown["worker"] == owner["worker"] and shown["size"] == 6 << 20 and shown["qos"]["iops_limit"] == 5000
    for _ in range(6):   # the size every worker answers NBD_OPT_INFO with is the new one
        out = subprocess.run(["nbdinfo", "--size", f"nbd://127.0.0.1:{port['nbd']}/v2"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        assert out.strip() == str(6 << 20), out
    # one target for v0 and v1, which two workers serve: v1 (with what exports it) moves to v0's worker first
    v0_worker = node.owner("v0")["worker"]
    vsan(node, "export", "add", "iscsi", iqn("v0"), "--volume", "v1", "--lun", "1")
    assert node.owner("v1")["worker"] == v0_worker and iqn("v0") in node.owner("v1")["targets"]
    assert re.search(r"volume v1 moved from worker \d to worker \d, to be exported with the others", node.log_text())

    async def both_luns() -> None:
        for lun in (0, 1):
            dev = await open_url(node.url("iscsi", "v0").rsplit("/", 1)[0] + f"/{lun}")
            try:
                await dev.write(40, block("iscsi", f"lun{lun}", 0), fua=True)
                assert bytes(await dev.read(40, 1)) == block("iscsi", f"lun{lun}", 0)
            finally:
                await dev.close()

    asyncio.run(both_luns())
    vsan(node, "export", "remove", "iscsi", iqn("v0"), "--lun", "1")
    # the worker of v2, killed: it comes back with v2 as it is now
    os.kill(int(owner["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    deadline = time.monotonic() + 60
    while not (node.owner("v2")["serving"] and node.owner("v2")["restarts"] == 1):
        assert time.monotonic() < deadline, node.log_text()[-3000:]
        time.sleep(0.2)
    asyncio.run(roundtrip("nbd", 0))
    out = subprocess.run(["nbdinfo", "--size", f"nbd://127.0.0.1:{port['nbd']}/v2"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    assert out.strip() == str(6 << 20), out
    # gone again, from every worker's discovery
    for what in (("nbd", "v2"), ("iscsi", iqn("v2")), ("nvme", nqn("v2"))):
        vsan(node, "export", "remove", *what)
    vsan(node, "volume", "delete", "v2")
    for _ in range(6):
        out = subprocess.run(["iscsi-ls", f"iscsi://127.0.0.1:{port['iscsi']}"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        assert "v2" not in out, out
        out = subprocess.run(["nbdinfo", "--list", f"nbd://127.0.0.1:{port['nbd']}"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        assert 'export="v2"' not in out, out
    assert "Traceback" not in node.log_text()


def test_pool_commands_reach_the_worker_of_the_pool(tmp_path: Path) -> None:
    """`vsan pool list|status|scrub` on a node with workers: answered by the worker that serves the pool."""
    from vsan_harness import VSAN, free_port

    port = free_port()
    members = "".join(f'[[devices]]\nname = "m{i}"\ntype = "ram"\nsize = "8MiB"\n' for i in range(3))
    cfg = tmp_path / "pool.toml"
    cfg.write_text(f'[node]\nname = "wp"\nworkers = 2\n{members}[[devices]]\nname = "r"\ntype = "ram"\n'
                   'size = "8MiB"\n[[pools]]\nname = "pool0"\nlevel = "raid5"\nmembers = ["m0", "m1", "m2"]\n'
                   '[[volumes]]\nname = "plain"\ndevice = "r"\n[[volumes]]\nname = "pv"\npool = "pool0"\n'
                   f'[nbd]\nportals = ["127.0.0.1:{port}"]\n[[nbd.exports]]\nname = "pv"\nvolume = "pv"\n')
    data, log = tmp_path / "data", tmp_path / "vsan.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(VSAN), "serve", "--config", str(cfg), "--data-dir", str(data)], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "serving with 2 worker processes" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)

        def run(*args: str) -> str:
            out = subprocess.run([str(VSAN), *args, "--data-dir", str(data)], capture_output=True, text=True,
                                 timeout=60, check=False)
            assert out.returncode == 0, out
            return out.stdout

        pools = json.loads(run("pool", "list", "--json"))
        assert [(p["name"], p["state"]) for p in pools] == [("pool0", "optimal")], pools
        assert "m1" in run("pool", "status", "pool0")
        assert "0 inconsistent" in run("pool", "scrub", "pool0")
        assert "Traceback" not in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]


def test_nbd_over_tls_runs_in_worker_0_and_connections_go_there_at_starttls(tmp_path: Path) -> None:
    """[nbd] tls with two workers: worker 0 serves every NBD export (and what is exported with them); a TLS
    client the kernel gives to worker 1 is handed over at NBD_OPT_STARTTLS, before the TLS handshake, and
    its session runs in worker 0. Such a volume does not move off worker 0."""
    require_tools("nbdinfo", "nbdcopy")
    from tls_pki import make_pki

    pki = make_pki(tmp_path / "pki")
    d = pki.server
    tls = (f'tls = {{ cert = "{d / "server-cert.pem"}", key = "{d / "server-key.pem"}", ca = "{d / "ca-cert.pem"}", '
           "verify_client = true }")
    node = WorkerNode(tmp_path / "node", volumes=("v0", "v1", "v2"), nbd_extra=(tls,))
    text = node.config.read_text()
    for v in node.volumes:    # the LUNs and namespaces beside exports that check certificates: open on purpose
        text = text.replace(f'luns = [{{ lun = 0, volume = "{v}" }}]',
                            f'luns = [{{ lun = 0, volume = "{v}" }}]\nallow_unauthenticated = true')
        text = text.replace(f'namespaces = [{{ nsid = 1, volume = "{v}" }}]',
                            f'namespaces = [{{ nsid = 1, volume = "{v}" }}]\nallow_unauthenticated = true')
    node.config.write_text(text)
    node.start()
    try:
        assert all(node.owner(v)["worker"] == 0 for v in node.volumes), node.workers_report()
        src = tmp_path / "src.img"
        src.write_bytes(os.urandom(1 << 20))
        port = node.ports["nbd"]
        for i in range(ROUNDS):      # connections land on either worker
            v = node.volumes[i % 3]
            url = f"nbds://127.0.0.1:{port}/{v}?tls-certificates={pki.client}"
            for args in (["--flush", str(src), url], [url, str(tmp_path / "back.img")]):
                done = subprocess.run(["nbdcopy", *args], check=False, timeout=60, capture_output=True,
                                      text=True)
                assert done.returncode == 0, (i, v, done.stderr, node.log_text()[-3000:])
            back = tmp_path / "back.img"
            assert back.read_bytes()[:1 << 20] == src.read_bytes(), (i, v)
        log = node.log_text()
        assert re.search(r"w1 frontend: [^\n]*: NBD over TLS is served by worker 0: handed to worker 0", log), log[-3000:]
        assert "NBD TLS" in log and "Traceback" not in log
        refused = vsan(node, "workers", "move", "v0", "--to", "1", ok=False)
        assert "stays on worker 0: with NBD over TLS worker 0 serves every NBD export" in refused.stderr, refused
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]
