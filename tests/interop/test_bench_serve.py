"""`vsan bench` against a real `vsan serve` over iSCSI, NVMe/TCP and NBD, and on a local file: the table,
--json, --report, --compare, several worker processes, and --verify catching a block corrupted behind the
target's back. Each run is 1-2 s; the module stays under a minute."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vsan_harness import REPO, VSAN, VsanServer, free_port, make_device

pytestmark = pytest.mark.interop

NQN = "nqn.2026-11.org.openvsan:disk0"
SIZE = 64 << 20
# written for the well-known ports; VsanServer.write_example moves them to free ones
CONFIG = """
[node]
name = "bench-node"

[[devices]]
name = "file0"
type = "file"
path = {path}
size = "64MiB"
block_size = 512

[[volumes]]
name = "disk0"
device = "file0"

[iscsi]
portals = ["127.0.0.1:3260"]

[[iscsi.targets]]
iqn = "iqn.2026-11.org.openvsan:disk0"
luns = [{{ lun = 0, volume = "disk0" }}]

[nvme]
portals = ["127.0.0.1:4420"]

[[nvme.subsystems]]
nqn = "nqn.2026-11.org.openvsan:disk0"
namespaces = [{{ nsid = 1, volume = "disk0" }}]

[nbd]
portals = ["127.0.0.1:10809"]

[[nbd.exports]]
name = "disk0"
volume = "disk0"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VsanServer]:
    work = tmp_path_factory.mktemp("bench")
    s = VsanServer(work, free_port(), make_device("file", work, "64MiB"))
    s.write_example(CONFIG.format(path=json.dumps(str(work / "file0.img"))))
    s.start()
    try:
        yield s
    finally:
        s.cleanup()


def urls(s: VsanServer) -> dict[str, str]:
    return {"iscsi": s.url(), "nvme": f"nvme+tcp://127.0.0.1:{s.nvme_port}/{NQN}/1", "nbd": s.nbd_url()}


def bench(*args: str | Path, ok: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([str(VSAN), "bench", *map(str, args)], check=False, capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
    if ok:
        assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def bench_json(*args: str | Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(bench(*args, "--json").stdout)
    assert doc["schema_version"] == 1
    return doc


@pytest.mark.parametrize("proto", ["iscsi", "nvme", "nbd"])
def test_each_protocol(server: VsanServer, proto: str) -> None:
    assert server.proc is not None
    doc = bench_json(urls(server)[proto], "-p", "4k-70-30", "--qd", "8", "-d", "1.5", "--warmup", "0.3",
                     "--target-pid", str(server.proc.pid))
    (run,) = doc["runs"]
    assert run["device"] == {"block_size": 512, "num_blocks": SIZE // 512}
    assert run["read"]["ops"] > 100 and run["write"]["ops"] > 30, run["total"]
    assert run["errors"] == {"io": 0, "verify": 0, "first": []}
    assert run["cpu"]["target_pct"] is not None and run["cpu"]["target_pct"] > 1
    assert run["timeseries"] and run["total"]["latency_us"]["p99"] > 0


def test_table_threads_and_verify_over_nvme(server: VsanServer) -> None:
    p = bench(urls(server)["nvme"], "--rw", "randrw", "--mix", "50", "-t", "2", "-q", "4", "-d", "1",
              "--warmup", "0", "--verify", "--precondition", "--size", "8m")
    for word in ("IOPS", "p99.9", "read", "write", "total", "nvme+tcp://"):
        assert word in p.stdout, p.stdout


def test_verify_catches_corruption_behind_the_target(server: VsanServer) -> None:
    iscsi = urls(server)["iscsi"]
    bench(iscsi, "--rw", "write", "--bs", "64k", "--qd", "4", "-d", "0.5", "--warmup", "0", "--verify",
          "--precondition", "--size", "1m")
    img = server.workdir / "file0.img"
    lba = 1234
    with open(img, "r+b") as f:  # flip one bit of one stored block; vsan serve reads the same file
        f.seek(lba * 512 + 300)
        b = f.read(1)
        f.seek(lba * 512 + 300)
        f.write(bytes([b[0] ^ 0x10]))
    for url in (iscsi, urls(server)["nbd"]):
        p = bench(url, "--rw", "read", "--bs", "64k", "--qd", "4", "-d", "0.5", "--warmup", "0", "--verify",
                  "--size", "1m", "--json", ok=False)
        assert p.returncode == 1, p.stderr
        (run,) = json.loads(p.stdout)["runs"]
        assert run["errors"]["verify"] >= 1
        assert run["errors"]["first"][0]["lba"] == lba and run["errors"]["first"][0]["kind"] == "corrupt"
    # repair it, so the other tests see a clean disk
    bench(iscsi, "--rw", "write", "--bs", "64k", "-d", "0.2", "--warmup", "0", "--precondition", "--size", "1m")


def test_local_file_report_and_compare(server: VsanServer, tmp_path: Path) -> None:
    img = tmp_path / "local.img"
    out = tmp_path / "report"
    p = bench(img, "--size", "16m", "-p", "4k-randread", "--qd", "4", "-d", "1.2", "--warmup", "0.2",
              "--report", out)
    assert "4k-randread" in p.stdout and "report:" in p.stdout
    names = sorted(f.name for f in out.iterdir())
    assert "index.html" in names and "results.json" in names
    pngs = [n for n in names if n.endswith(".png")]
    assert len(pngs) == 3 and all((out / n).read_bytes()[:4] == b"\x89PNG" for n in pngs)
    assert "<img" in (out / "index.html").read_text()

    doc = bench_json("--compare", img, urls(server)["nbd"], "--rw", "randread", "--qd", "4", "-d", "0.6",
                     "--warmup", "0", "--rounds", "2")
    assert len(doc["runs"]) == 4
    assert [r["target"] for r in doc["runs"]][:2] == [str(img), urls(server)["nbd"]]  # interleaved
    (cmp,) = doc["compare"]
    assert cmp["baseline"] == str(img)
    ratios = {row["target"]: row["ratio"]["iops"] for row in cmp["targets"]}
    assert ratios[str(img)] == 1.0 and ratios[urls(server)["nbd"]] > 0
    assert os.path.getsize(img) == 16 << 20
