"""Moving a volume between the worker processes of `vsan serve --workers 2` while it serves
(`vsan workers move`, node/workers.py Supervisor.move): the worker that serves it suspends its NBD
connections and iSCSI sessions (reading stops, what they started finishes), closes the volume and hands
each connection over with its protocol state (and the LU's: reservations, unit attentions); the other worker
opens the volume and the connections go on there. The clients (our NBD and iSCSI initiators, fio's nbd
engine checking every block it wrote, QEMU's iSCSI initiator) see a pause, never an error nor a new login,
and nothing written is lost, on file and on RAM devices (the supervisor hands the RAM device's memory
over)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vsan_harness import VSAN, require_tools
from worker_node import BS, WorkerNode

from openvsan.initiator import open_url

pytestmark = pytest.mark.interop

MOVES = 6


def move(node: WorkerNode, volume: str, to: int, ok: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(VSAN), "workers", "move", volume, "--to", str(to), "--data-dir", str(node.data_dir)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert (out.returncode == 0) == ok, out
    return out


def other(node: WorkerNode, volume: str) -> int:
    return 1 - int(node.owner(volume)["worker"])  # type: ignore[call-overload]


@pytest.fixture(params=["file", "ram"])
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[WorkerNode]:
    n = WorkerNode(tmp_path / "node", backing=request.param, size_mib=64).start()
    try:
        yield n
    finally:
        rc = n.stop()
        assert rc == 0, n.log_text()[-3000:]


def test_nbd_clients_go_on_while_their_volume_moves_between_workers(node: WorkerNode) -> None:
    """Four connections write (4 KiB, and 128 KiB payloads that a RAM volume receives in place) and read back
    their own blocks without pause while v0 moves back and forth (an NBD client has no way to recover from
    a lost connection: any would fail it)."""
    clients_through_moves(node, "nbd", 4, 256, 4)
    log = node.log_text()
    assert len(re.findall(r"NBD export v0 \(67108864 bytes[^)]*\): moved here with its volume", log)) == 4 * MOVES, \
        log[-3000:]
    assert "Traceback" not in log and "could not" not in log, log[-3000:]
    if node.backing == "file":   # and the file holds what a new connection read back
        image = node.image("v0").read_bytes()
        assert image.count(b"nbd client 0 write") >= 1


def test_fio_checks_every_block_while_its_volume_moves(node: WorkerNode) -> None:
    """fio's nbd engine (libnbd) writes at queue depth 16 and reads each batch back (crc32c) while v0 moves."""
    require_tools("fio")
    out = node.workdir / "fio.json"
    fio = subprocess.Popen(
        ["fio", "--name=moving", "--ioengine=nbd", f"--uri={node.url('nbd', 'v0')}", "--rw=randwrite", "--bs=4k",
         "--iodepth=16", "--size=32M", "--time_based", "--runtime=10", "--verify=crc32c", "--verify_backlog=256",
         "--verify_fatal=1", "--verify_state_save=0", "--output-format=json", f"--output={out}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    moves = 0
    try:
        time.sleep(1.0)
        while fio.poll() is None and moves < MOVES:
            moves += "1 connection(s) went with it" in move(node, "v0", other(node, "v0")).stdout
            time.sleep(0.5)
        text, _ = fio.communicate(timeout=60)
    finally:
        if fio.poll() is None:
            fio.kill()
    assert fio.returncode == 0, text
    job = json.loads(out.read_text())["jobs"][0]
    assert job["error"] == 0, job
    assert job["write"]["total_ios"] > 1000 and job["read"]["total_ios"] > 1000, job   # written and checked
    assert moves >= 4, f"fio ended after {moves} moves"
    log = node.log_text()
    assert len(re.findall(r"NBD export v0 \(67108864 bytes[^)]*\): moved here with its volume", log)) == moves, log
    assert "Traceback" not in log and "could not" not in log, log[-3000:]


def test_clients_read_back_every_write_while_a_compressed_volume_moves(tmp_path: Path) -> None:
    """The same on compressed volumes (volume/compress.py), whose small writes wait in the layer's write cache:
    the worker that gives the volume up closes it, which writes the cache to the device before the other
    worker opens it. Our NBD clients read back what they wrote last (fio's check would not see such a loss: an
    older block fio wrote at the same offset passes its crc32c check too)."""
    node = WorkerNode(tmp_path / "node", backing="ram", size_mib=64, compression="lz4").start()
    try:
        clients_through_moves(node, "nbd", 4, 256, 4)
        squeeze = json.loads(subprocess.run([str(VSAN), "volume", "show", "v0", "--json", "--data-dir",
                                             str(node.data_dir)], capture_output=True, text=True, timeout=60,
                                            check=True).stdout)["compress_stats"]
        assert squeeze["chunks"] > 0 and squeeze["cache_size"] > 0, squeeze
    finally:
        rc = node.stop()
        assert rc == 0, node.log_text()[-3000:]


def test_a_worker_killed_after_a_move_comes_back_serving_the_moved_volume(tmp_path: Path) -> None:
    node = WorkerNode(tmp_path / "node", backing="ram").start()
    try:
        to = other(node, "v0")
        move(node, "v0", to)
        block = b"written after the move".ljust(BS, b"!")

        async def write() -> None:
            dev = await open_url(node.url("nbd", "v0"))
            try:
                await dev.write(3, block, fua=True)
            finally:
                await dev.close()

        asyncio.run(write())
        victim = node.owner("v0")
        assert victim["worker"] == to
        os.kill(int(victim["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        deadline = time.monotonic() + 60
        while not (node.owner("v0")["restarts"] == 1 and node.owner("v0")["serving"]):
            assert time.monotonic() < deadline, node.log_text()[-3000:]
            time.sleep(0.1)
        assert node.owner("v0")["worker"] == to          # it came back where v0 was moved to, with v0

        async def read() -> bytes:
            dev = await open_url(node.url("nbd", "v0"))
            try:
                return bytes(await dev.read(3, 1))
            finally:
                await dev.close()

        assert asyncio.run(read()) == block            # the RAM device's memory went with it, and stayed
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]


def test_what_cannot_move_is_refused_with_one_line_and_nothing_changes(tmp_path: Path) -> None:
    node = WorkerNode(tmp_path / "node").start()
    try:
        where = {v: node.owner(v)["worker"] for v in node.volumes}
        bad = move(node, "nope", 0, ok=False)
        assert bad.returncode == 2 and bad.stderr.strip() == "vsan: no volume named 'nope' on this node", bad
        bad = move(node, "v0", 7, ok=False)
        assert "no worker 7: this node has workers 0 to 1" in bad.stderr, bad
        same = move(node, "v0", int(where["v0"]))  # type: ignore[call-overload]
        assert f"volume v0 is on worker {where['v0']} already" in same.stdout, same
        assert {v: node.owner(v)["worker"] for v in node.volumes} == where
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]


def clients_through_moves(node: WorkerNode, proto: str, clients: int, big: int, went: int) -> list[int]:
    """`clients` connections of `proto` to v0 write (8 blocks, and every third write `big` blocks: past what
    goes with the command, so R2T and Data-Out or H2CData) and read back while v0 moves MOVES times, each
    move taking `went` connections along; then a new connection reads what each wrote last. Returns how many
    times each client connected again (0: its session or controller moved whole)."""
    last: dict[int, bytes] = {}

    async def go() -> list[int]:
        devs = [await open_url(node.url(proto, "v0")) for _ in range(clients)]
        stop = asyncio.Event()
        done = [0] * len(devs)

        async def client(k: int) -> None:
            dev = devs[k]
            i = 0
            while not stop.is_set():
                blocks = 8 if i % 3 else big
                lba = k * 30000 + (i % 16) * 1024
                data = f"{proto} client {k} write {i}".encode().ljust(blocks * BS, bytes([k + 1]))
                await dev.write(lba, data, fua=i % 5 == 0)
                assert bytes(await dev.read(lba, blocks)) == data, (k, i)
                last[lba] = data
                i += 1
                done[k] = i

        tasks = [asyncio.create_task(client(k)) for k in range(len(devs))]
        for _ in range(MOVES):
            before = list(done)
            while min(d - b for d, b in zip(done, before, strict=True)) < 10:
                await asyncio.sleep(0.02)
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            to = await asyncio.to_thread(other, node, "v0")
            out = (await asyncio.to_thread(move, node, "v0", to)).stdout
            assert re.fullmatch(rf"volume v0 moved from worker \d to worker \d; {went} connection\(s\) went with it "
                                r"\(\d+ ms\)\n", out), out
        stop.set()
        await asyncio.gather(*tasks)
        again = [getattr(d, "reconnects", 0) for d in devs]   # an NBD client never connects again
        for d in devs:
            await d.close()
        dev = await open_url(node.url(proto, "v0"))
        try:
            for lba, data in last.items():
                assert bytes(await dev.read(lba, len(data) // BS)) == data, lba
        finally:
            await dev.close()
        return again

    return asyncio.run(go())


def test_iscsi_sessions_go_on_while_their_volume_moves_between_workers(node: WorkerNode) -> None:
    """Three sessions write (small writes with their data immediate, 512 KiB ones through R2T and Data-Out)
    and read back, without a new login, while v0 moves back and forth."""
    assert clients_through_moves(node, "iscsi", 3, 1024, 3) == [0, 0, 0]   # never logged in again
    log = node.log_text()
    assert len(re.findall(r"normal session tsih=\d+ for \S+ on \S+:v0: moved here with its volume", log)) == 3 * MOVES
    assert "Traceback" not in log and "could not" not in log, log[-3000:]


def test_nvme_controllers_go_on_while_their_volume_moves_between_workers(node: WorkerNode) -> None:
    """Two controllers (an admin and an I/O queue each: four connections) write, small writes in the capsule
    and 256 KiB ones through R2T and H2CData, and read back, with no new association, while v0 moves."""
    assert clients_through_moves(node, "nvme", 2, 512, 4) == [0, 0]      # never connected again
    log = node.log_text()
    assert len(re.findall(r"admin queue of controller \d+ of \S+:v0 for \S+: moved here with its subsystem",
                          log)) == 2 * MOVES, log[-3000:]
    assert "Traceback" not in log and "could not" not in log, log[-3000:]


def test_new_connections_while_a_volume_moves_are_never_refused(tmp_path: Path) -> None:
    """New iSCSI logins, NVMe/TCP associations and NBD connections to v0, one after the other on each
    protocol, while v0 moves back and forth as fast as `vsan workers move` goes: every one is served (a name
    is never unknown to the node during a move: the worker it leaves and the one it comes to send such a
    connection to the latter, which holds it until it serves the volume)."""
    node = WorkerNode(tmp_path / "node", backing="ram", size_mib=16).start()
    opened = {p: 0 for p in ("iscsi", "nvme", "nbd")}
    try:
        async def go() -> None:
            stop = asyncio.Event()

            async def connect_again_and_again(proto: str) -> None:
                while not stop.is_set():
                    dev = await open_url(node.url(proto, "v0"))
                    try:
                        assert len(bytes(await dev.read(opened[proto] % 64, 1))) == BS
                    finally:
                        await dev.close()
                    opened[proto] += 1

            tasks = [asyncio.create_task(connect_again_and_again(p)) for p in opened]
            for _ in range(2 * MOVES):
                to = await asyncio.to_thread(other, node, "v0")
                await asyncio.to_thread(move, node, "v0", to)
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            stop.set()
            await asyncio.gather(*tasks)

        asyncio.run(go())
        assert min(opened.values()) >= 2 * MOVES, opened
        log = node.log_text()
        # (a connection its client is ending, its logout or NBD_CMD_DISC under way, may be closed rather than
        # moved: "could not be suspended"; its client has what it asked for, as the checks above say)
        assert "Traceback" not in log, log[-3000:]
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]


def test_qemu_writes_through_moves_and_every_block_is_there(tmp_path: Path) -> None:
    """QEMU's iSCSI initiator (libiscsi) writes a pattern over the whole volume, 16 at a time, again and again
    while v0 moves; it sees no error, and reading the volume back finds the pattern everywhere."""
    require_tools("qemu-img", "qemu-io")
    node = WorkerNode(tmp_path / "node", backing="ram", size_mib=64).start()
    try:
        url = node.url("iscsi", "v0")
        bench = subprocess.Popen(["qemu-img", "bench", "-w", "--pattern=90", "-c", "300000", "-d", "16", "-s", "4096",
                                  "-f", "raw", url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        moves = 0
        try:
            time.sleep(0.5)
            while bench.poll() is None and moves < MOVES:
                out = move(node, "v0", other(node, "v0")).stdout
                moves += "1 connection(s) went with it" in out
                time.sleep(0.3)
            text, _ = bench.communicate(timeout=120)
        finally:
            if bench.poll() is None:
                bench.kill()
        assert bench.returncode == 0 and "Run completed" in text, text
        assert moves >= 3, f"only {moves} moves while qemu-img bench ran"
        check = subprocess.run(["qemu-io", "-f", "raw", "-c", "read -P 90 0 64M", url], capture_output=True,
                               text=True, timeout=120, check=False)
        assert check.returncode == 0 and "Pattern verification failed" not in check.stdout + check.stderr, check
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]


def pr_out(action: int, key: int, sark: int, rtype: int = 0) -> tuple[bytes, bytes]:
    """PERSISTENT RESERVE OUT (SPC-4 6.16): the CDB and its 24-byte parameter list."""
    cdb = struct.pack(">BBB2xIB", 0x5F, action, rtype, 24, 0)
    return cdb, struct.pack(">QQ8x", key, sark)


def test_a_reservation_and_its_sessions_move_with_the_volume(tmp_path: Path) -> None:
    """A Write Exclusive reservation taken before the move holds after it: the holder still writes, another
    initiator port (another NVMe host) still gets RESERVATION CONFLICT, and READ RESERVATION (Reservation
    Report) answers the same; over iSCSI and over NVMe/TCP."""
    node = WorkerNode(tmp_path / "node").start()
    try:
        async def go() -> None:
            holder = await open_url(node.url("iscsi", "v0"))
            other_port = await open_url(node.url("iscsi", "v0"))
            try:
                for dev in (holder, other_port):
                    key = 0xABC if dev is holder else 0xDEF
                    cdb, params = pr_out(0x00, 0, key)                       # REGISTER
                    assert (await dev.execute(cdb, data=params)).status == 0  # type: ignore[attr-defined]
                cdb, params = pr_out(0x01, 0xABC, 0, rtype=0x01)             # RESERVE, Write Exclusive
                assert (await holder.execute(cdb, data=params)).status == 0  # type: ignore[attr-defined]
                read_reservation = struct.pack(">BB5xHx", 0x5E, 0x01, 64)
                before = bytes((await holder.execute(read_reservation, read_len=64)).data)  # type: ignore[attr-defined]
                await asyncio.to_thread(move, node, "v0", await asyncio.to_thread(other, node, "v0"))
                after = bytes((await holder.execute(read_reservation, read_len=64)).data)  # type: ignore[attr-defined]
                assert after == before and after[8:16] == (0xABC).to_bytes(8, "big") and after[21] & 0x0F == 1
                await holder.write(0, b"holder".ljust(BS, b"."))
                write10 = struct.pack(">BBIBHB", 0x2A, 0, 1, 0, 1, 0)
                refused = await other_port.execute(write10, data=bytes(BS))  # type: ignore[attr-defined]
                assert refused.status == 0x18                               # RESERVATION CONFLICT
                assert holder.reconnects == other_port.reconnects == 0  # type: ignore[attr-defined]
            finally:
                await holder.close()
                await other_port.close()

        asyncio.run(go())

        async def nvme() -> None:
            """The same over NVMe/TCP: a Write Exclusive reservation of another host moves with the subsystem."""
            holder = await open_url(node.url("nvme", "v0") + "?hostnqn=nqn.2026-12.org.openvsan.test:holder")
            other_host = await open_url(node.url("nvme", "v0") + "?hostnqn=nqn.2026-12.org.openvsan.test:other")
            try:
                await holder.reservation_register(0xABC)  # type: ignore[attr-defined]
                await holder.reservation_acquire(0xABC, 1)  # type: ignore[attr-defined]   # Write Exclusive
                before = await holder.reservation_report()  # type: ignore[attr-defined]
                await asyncio.to_thread(move, node, "v0", await asyncio.to_thread(other, node, "v0"))
                assert await holder.reservation_report() == before  # type: ignore[attr-defined]
                await holder.write(2, b"nvme holder".ljust(BS, b"."))
                with pytest.raises(Exception, match="SCT 0x0 SC 0x83"):   # Reservation Conflict
                    await other_host.write(2, bytes(BS))
                assert holder.reconnects == other_host.reconnects == 0  # type: ignore[attr-defined]
            finally:
                await holder.close()
                await other_host.close()

        asyncio.run(nvme())
        assert "Traceback" not in node.log_text()
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]


def busy_pair(node: WorkerNode) -> list[str]:
    """The volumes that share v0's worker at start (three volumes on two workers: two of them)."""
    w = node.owner("v0")["worker"]
    pair = [v for v in node.volumes if node.owner(v)["worker"] == w]
    assert len(pair) == 2, {v: node.owner(v)["worker"] for v in node.volumes}
    return pair


@contextlib.contextmanager
def fio_reads(node: WorkerNode, volumes: list[str], seconds: int) -> Iterator[list[subprocess.Popen[str]]]:
    """fio on each of `volumes` (NBD, 4K random 70/30 at QD16, every write read back and checked) for
    `seconds`; killed if still running when the block ends."""
    require_tools("fio")
    fios = [subprocess.Popen(["fio", f"--name={v}", "--ioengine=nbd", f"--uri={node.url('nbd', v)}", "--rw=randrw",
                              "--rwmixread=70", "--bs=4k", "--iodepth=16", "--size=32M", "--time_based",
                              f"--runtime={seconds}", "--verify=crc32c", "--verify_backlog=256", "--verify_fatal=1",
                              "--verify_state_save=0"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for v in volumes]
    try:
        yield fios
    finally:
        for f in fios:
            if f.poll() is None:
                f.kill()


def finished_clean(fios: list[subprocess.Popen[str]]) -> None:
    texts = [f.communicate(timeout=60)[0] for f in fios]
    assert all(f.returncode == 0 for f in fios), texts


def test_balance_moves_a_busy_volume_to_the_idle_worker(tmp_path: Path) -> None:
    """Two volumes driven hard on one worker, the other idle: `vsan workers balance` sees it (each worker's
    core, each volume's share) and moves one of them, under I/O, to the idle worker."""
    node = WorkerNode(tmp_path / "node", backing="ram", volumes=("v0", "v1", "v2"), size_mib=64).start()
    try:
        pair = busy_pair(node)
        src = int(node.owner(pair[0])["worker"])  # type: ignore[call-overload]
        with fio_reads(node, pair, 12) as fios:
            time.sleep(2)
            out = subprocess.run([str(VSAN), "workers", "balance", "--json", "--data-dir", str(node.data_dir)],
                                 capture_output=True, text=True, timeout=120, check=True)
            got = json.loads(out.stdout)
            finished_clean(fios)
        assert got["workers"][str(src)] > 0.25, got                         # the busy worker was seen busy
        loads = {g["volumes"][0]: g["load"] for g in got["groups"]}
        assert all(loads[v] > 0.05 for v in pair) and loads[next(v for v in node.volumes if v not in pair)] < 0.05, got
        assert len(got["plan"]) == 1 and got["plan"][0]["volumes"][0] in pair, got
        assert len(got["moved"]) == 1 and got["moved"][0]["connections"] == 1, got
        assert len({node.owner(v)["worker"] for v in pair}) == 2           # now one on each worker
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]


def test_volumes_balance_themselves_when_asked_to(tmp_path: Path) -> None:
    """[node] worker_balance_interval: the supervisor does the same by itself."""
    node = WorkerNode(tmp_path / "node", backing="ram", volumes=("v0", "v1", "v2"), size_mib=64,
                      node_extra=("worker_balance_interval = 10",)).start()
    try:
        assert "volumes are balanced over the workers by load every 10 s" in node.log_text()
        pair = busy_pair(node)
        with fio_reads(node, pair, 25) as fios:
            deadline = time.monotonic() + 40
            while len({node.owner(v)["worker"] for v in pair}) < 2:
                assert time.monotonic() < deadline, node.log_text()[-3000:]
                time.sleep(0.5)
            finished_clean(fios)
        assert re.search(r"balance: volume v\d moved from worker \d to worker \d", node.log_text())
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]
