"""A worker process of `vsan serve --workers 2` killed with SIGKILL under I/O (node/workers.py): the
supervisor starts it again and its volume comes back; the other worker's sessions never notice.

Two writer clients (tests/support/history_client.py, our initiators with their reconnect), one per volume,
each on its own worker: v0 over iSCSI, v1 over NVMe/TCP, then the other way round. The worker serving one
of them is killed mid-run. Afterwards: the other client saw no failed write and its connection was never
made again; the killed worker's client reconnected, its writes were acknowledged again after the restart,
and every acknowledged write of both is in the volume files (tests/support/history.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from history import check, load
from worker_node import BS, WorkerNode

pytestmark = pytest.mark.interop

CLIENT = Path(__file__).parents[1] / "support" / "history_client.py"
LOGIN = {"iscsi": r"normal session tsih=\d+ for \S+ on {name}", "nvme": r"connected to {name} \(controller"}


def _acks(path: Path) -> int:
    return path.read_text().count('"ev":"ack"') if path.exists() else 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("killed", "protocols"), [("v1", ("iscsi", "nvme")), ("v0", ("nvme", "iscsi"))])
def test_a_killed_worker_comes_back_and_the_other_does_not_notice(tmp_path: Path, killed: str,
                                                                  protocols: tuple[str, str]) -> None:
    node = WorkerNode(tmp_path / "node").start()
    clients: dict[str, subprocess.Popen[str]] = {}
    hist = {v: tmp_path / f"{v}.jsonl" for v in node.volumes}
    survivor = next(v for v in node.volumes if v != killed)
    proto = dict(zip(node.volumes, protocols, strict=True))
    try:
        for v in node.volumes:
            clients[v] = subprocess.Popen(
                [sys.executable, str(CLIENT), "--log", str(hist[v]), "--count", "4096", node.url(proto[v], v)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert clients[v].stdout is not None
            line = clients[v].stdout.readline()
            assert "@@WRITING" in line, line + clients[v].stdout.read()
        time.sleep(1.5)
        victim = node.owner(killed)
        other = node.owner(survivor)
        assert victim["worker"] != other["worker"]
        logins_before = _logins(node, proto[survivor], survivor)
        assert logins_before >= 1, node.log_text()[-3000:]
        killed_logins = _logins(node, proto[killed], killed)
        acks_before = _acks(hist[killed])
        os.kill(int(victim["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        t0 = time.monotonic()
        while True:   # the supervisor restarts it, and the client's writes are acknowledged again
            row = node.owner(killed)
            if row["restarts"] == 1 and row["serving"] and _acks(hist[killed]) > acks_before + 50:
                break
            assert time.monotonic() - t0 < 60, f"{killed}: not back within 60 s: {row}\n{node.log_text()[-3000:]}"
            time.sleep(0.2)
        assert node.owner(survivor)["pid"] == other["pid"]   # the other worker was not restarted
        time.sleep(1.0)
        done = {}
        for v, c in clients.items():
            c.send_signal(signal.SIGTERM)
            out, _ = c.communicate(timeout=120)
            assert c.returncode == 0, out
            done[v] = re.search(r"@@DONE acked=(\d+) failed=(\d+)", out)
            assert done[v], out
        log = node.log_text()
        assert re.search(rf"worker {victim['worker']} \(pid {victim['pid']}\) killed by SIGKILL", log), log[-3000:]
        assert _logins(node, proto[survivor], survivor) == logins_before, f"{survivor}'s client connected again: it noticed the other worker"
        assert _logins(node, proto[killed], killed) > killed_logins, f"{killed}'s client did not connect again"
        assert int(done[survivor].group(2)) == 0, f"{survivor}'s client saw failed writes: {done[survivor].group(0)}"
    finally:
        for c in clients.values():
            if c.poll() is None:
                c.kill()
        rc = node.stop()
    assert rc == 0, node.log_text()[-3000:]
    for v in node.volumes:
        image = node.image(v).read_bytes()
        report = check(load(hist[v]), lambda lba, img=image: img[lba * BS:(lba + 1) * BS])
        assert report.ok, f"{v}: {report}"
        assert report.acked > 100, f"{v}: too few writes acknowledged for the test to mean anything: {report}"
    print(f"killed the worker of {killed} ({proto[killed]}); {survivor} ({proto[survivor]}) undisturbed; "
          f"no acknowledged write lost")


def _logins(node: WorkerNode, proto: str, v: str) -> int:
    return len(re.findall(LOGIN[proto].format(name=re.escape(_name(proto, v))), node.log_text()))


def _name(proto: str, v: str) -> str:
    from worker_node import iqn, nqn

    return iqn(v) if proto == "iscsi" else nqn(v)


@pytest.mark.timeout(180)
def test_a_killed_supervisor_takes_its_workers_with_it_and_a_new_one_waits_for_them(tmp_path: Path) -> None:
    """SIGKILL of `vsan serve` itself: its workers get SIGTERM (PR_SET_PDEATHSIG) and drain; a `vsan serve`
    started at once on the same data dir waits until they are gone before it opens the devices, then
    serves what the first one acknowledged."""
    import asyncio

    from openvsan.initiator import open_url

    node = WorkerNode(tmp_path / "node").start()
    old = [int(r["pid"]) for r in node.workers_report()]  # type: ignore[call-overload]

    async def write(v: str) -> None:
        dev = await open_url(node.url("nvme", v))
        try:
            await dev.write(7, f"before the kill {v}".encode().ljust(BS, b"."), fua=True)
        finally:
            await dev.close()

    async def read(v: str) -> bytes:
        dev = await open_url(node.url("iscsi", v))
        try:
            return bytes(await dev.read(7, 1))
        finally:
            await dev.close()

    for v in node.volumes:
        asyncio.run(write(v))
    assert node.proc is not None
    node.proc.kill()
    node.proc.wait()
    node.proc = None
    node.start()      # at once: the old workers may still be draining
    try:
        for pid in old:
            assert not _alive(pid), f"worker {pid} of the killed vsan serve still runs"
        for v in node.volumes:
            assert asyncio.run(read(v)) == f"before the kill {v}".encode().ljust(BS, b".")
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by whoever inherited it, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.timeout(180)
def test_a_ram_volume_keeps_its_blocks_when_its_worker_is_killed(tmp_path: Path) -> None:
    """A RAM device's memory is made and kept by the supervisor (node/workers.py memfds): a worker killed
    with SIGKILL and started again serves what was written before, as a file device would."""
    import asyncio

    from openvsan.initiator import open_url

    node = WorkerNode(tmp_path / "node", backing="ram").start()
    blocks = {v: f"in the memory of {v}".encode().ljust(BS, b".") for v in node.volumes}

    async def write(v: str) -> None:
        dev = await open_url(node.url("nvme", v))
        try:
            await dev.write(11, blocks[v], fua=True)
        finally:
            await dev.close()

    async def read(v: str) -> bytes:
        dev = await open_url(node.url("nbd", v))
        try:
            return bytes(await dev.read(11, 1))
        finally:
            await dev.close()

    try:
        for v in node.volumes:
            asyncio.run(write(v))
        victim = node.owner("v1")
        os.kill(int(victim["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        deadline = time.monotonic() + 60
        while not (node.owner("v1")["serving"] and node.owner("v1")["restarts"] == 1):
            assert time.monotonic() < deadline, node.log_text()[-3000:]
            time.sleep(0.2)
        for v in node.volumes:
            assert asyncio.run(read(v)) == blocks[v], v
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]
