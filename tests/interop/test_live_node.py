"""A live node (issue 11): volumes and exports created, resized and removed on a running `vsan serve` with
the `vsan volume|export|config apply` commands, seen at once by real initiators (libiscsi tools, qemu-io,
nbdinfo, our NVMe/TCP initiator), while fio keeps writing and verifying another volume undisturbed."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from vsan_harness import IQN, REPO, TEST_INITIATOR, VSAN, VsanServer, qemu_io, require_tools, run

pytestmark = pytest.mark.interop

EXAMPLE = REPO / "examples" / "single-node.toml"
NQN = "nqn.2026-11.org.openvsan:live1"
MiB = 1 << 20


def vsan_cli(server: VsanServer, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([str(VSAN), *args, "--data-dir", str(server.data_dir)], capture_output=True, text=True,
                       timeout=120, check=False)
    if check and p.returncode != 0:
        pytest.fail(f"vsan {' '.join(args)}: exit {p.returncode}\n{p.stdout}{p.stderr}", pytrace=False)
    return p


def capacity(server: VsanServer, lun: int) -> int:
    out = run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, "-s", server.url(lun)]).stdout
    return int(out.strip())


def nbd_size(server: VsanServer, export: str) -> int:
    return int(run(["nbdinfo", "--size", server.nbd_url(export)]).stdout.strip())


def nvme_size(server: VsanServer, nsid: int = 1) -> int:
    out = run([str(VSAN), "initiator", "identify", f"nvme+tcp://127.0.0.1:{server.nvme_port}/{NQN}/{nsid}"]).stdout
    m = re.search(r"(\d+) blocks of (\d+) bytes", out)
    assert m, out
    return int(m.group(1)) * int(m.group(2))


def example(vsan: Callable[..., VsanServer]) -> VsanServer:
    server = vsan(start=False)
    server.write_example(EXAMPLE.read_text())  # 3260, 4420 and 10809 moved to free ports
    server.start()
    return server


def start_fio(server: VsanServer, workdir: Path, seconds: int) -> subprocess.Popen[str]:
    """fio over NBD on disk0: random writes, each batch of 256 read back and checked (crc32c) while writing,
    for `seconds`: the I/O of the volume the changes must not disturb."""
    require_tools("fio")
    return subprocess.Popen(
        ["fio", "--name=undisturbed", "--ioengine=nbd", f"--uri={server.nbd_url('disk0')}", "--rw=randwrite",
         "--bs=4k", "--iodepth=8", "--size=64M", "--time_based", f"--runtime={seconds}", "--verify=crc32c",
         "--verify_backlog=256", "--verify_fatal=1", "--verify_state_save=0", "--output-format=json", f"--output={workdir / 'fio.json'}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_create_export_resize_unexport_delete_while_serving(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    require_tools("iscsi-readcapacity16", "iscsi-ls", "nbdinfo", "qemu-io")
    server = example(vsan)
    fio = start_fio(server, tmp_path, 25)
    try:
        out = vsan_cli(server, "volume", "create", "live1", "--size", "256MiB", "--backing", "ram").stdout
        assert "+ volume live1" in out and "+ device live1" in out, out
        out = vsan_cli(server, "export", "add", "iscsi", IQN, "--volume", "live1", "--lun", "1").stdout
        assert f"+ LUN 1 of {IQN} (volume live1)" in out, out
        assert capacity(server, 1) == 256 * MiB
        qemu_io(server.url(1), "write -P 0x5a 0 1M", "write -P 0xa5 255M 1M")

        out = vsan_cli(server, "volume", "resize", "live1", "--size", "512MiB").stdout
        assert "~ device live1: 256.0 MiB -> 512.0 MiB" in out, out
        assert capacity(server, 1) == 512 * MiB       # a new login, no restart
        qemu_io(server.url(1), "read -P 0x5a 0 1M", "read -P 0xa5 255M 1M", "read -P 0 256M 1M",
                "write -P 0x77 511M 1M", "read -P 0x77 511M 1M")

        out = vsan_cli(server, "export", "add", "nvme", NQN, "--volume", "live1").stdout
        assert f"+ subsystem {NQN}" in out and f"+ namespace 1 of {NQN} (volume live1)" in out, out
        assert nvme_size(server) == 512 * MiB
        vsan_cli(server, "export", "add", "nbd", "live1", "--volume", "live1")
        assert nbd_size(server, "live1") == 512 * MiB
        qemu_io(server.nbd_url("live1"), "read -P 0x5a 0 1M")

        vsan_cli(server, "volume", "resize", "live1", "--size", "768MiB")
        assert (capacity(server, 1), nvme_size(server), nbd_size(server, "live1")) == (768 * MiB,) * 3

        listed = json.loads(vsan_cli(server, "export", "list", "--json").stdout)
        assert {(e["protocol"], e["name"], e["volume"]) for e in listed} >= {
            ("iscsi", IQN, "live1"), ("nvme", NQN, "live1"), ("nbd", "live1", "live1"), ("iscsi", IQN, "disk0")}
        shown = json.loads(vsan_cli(server, "volume", "show", "live1", "--json").stdout)
        assert shown["size"] == 768 * MiB and shown["stack"] == ["RamDevice"] and len(shown["exports"]) == 3

        vsan_cli(server, "export", "remove", "iscsi", IQN, "--lun", "1")
        luns = run(["iscsi-ls", "-i", TEST_INITIATOR, "-s", server.portal_url()]).stdout
        assert re.search(r"^Lun:0\s", luns, re.MULTILINE) and not re.search(r"^Lun:1\s", luns, re.MULTILINE), luns

        refused = vsan_cli(server, "volume", "delete", "live1", check=False)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert "is exported" in refused.stderr and "--force" in refused.stderr, refused.stderr
        assert nbd_size(server, "live1") == 768 * MiB   # refused: nothing changed
        out = vsan_cli(server, "volume", "delete", "live1", "--force").stdout
        assert "- nbd export live1" in out and f"- subsystem {NQN}" in out and "- volume live1" in out, out
        gone = subprocess.run(["nbdinfo", "--size", server.nbd_url("live1")], capture_output=True, text=True,
                              timeout=30, check=False)
        assert gone.returncode != 0
        assert capacity(server, 0) == 1 << 30           # disk0 untouched
    finally:
        out, _ = fio.communicate(timeout=120)
    assert fio.returncode == 0, out
    text = (tmp_path / "fio.json").read_text()
    job = json.loads(text[text.index("{"):])["jobs"][0]
    assert job["error"] == 0 and job["write"]["io_bytes"] > 0 and job["read"]["io_bytes"] > 0, job


def test_bad_requests_get_one_line_and_change_nothing(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    server = example(vsan)
    before = vsan_cli(server, "volume", "list", "--json").stdout
    bad = [
        (["volume", "create", "no/slash", "--size", "1MiB"], "name: 'no/slash' is not a usable name"),
        (["volume", "create", "odd", "--size", "1000"], "512-byte blocks"),
        (["volume", "create", "disk0", "--size", "1MiB"], "volume disk0 exists"),
        (["volume", "create", "huge", "--size", "1MiB", "--backing", "tape"], "backing: \"tape\" is not a backing"),
        (["volume", "resize", "disk0", "--size", "512MiB"], "does not shrink"),
        (["volume", "resize", "nope", "--size", "1GiB"], "no volume named 'nope'"),
        (["export", "add", "iscsi", IQN, "--volume", "nope"], "no volume named 'nope'"),
        (["export", "add", "iscsi", IQN, "--volume", "disk0", "--lun", "1"], "already a LUN of this target"),
        (["export", "add", "iscsi", "not-an-iqn", "--volume", "disk0"], "iqn"),
        (["export", "add", "nbd", "disk0", "--volume", "disk0"], "NBD export disk0 exists"),
        (["export", "remove", "iscsi", IQN, "--lun", "7"], "has no LUN 7"),
        (["qos", "set", "disk0", "--read-iops-limit", "100", "--read-iops-burst", "10"], "below read_iops_limit"),
        (["qos", "set", "disk0", "--frobnicate", "1"], "not a QoS knob"),
    ]
    for args, words in bad:
        p = vsan_cli(server, *args, check=False)
        assert p.returncode == 2, (args, p.returncode, p.stdout, p.stderr)
        assert p.stderr.startswith("vsan: ") and p.stderr.count("\n") == 1, (args, p.stderr)
        assert words in p.stderr, (args, p.stderr)
    broken = tmp_path / "broken.toml"
    broken.write_text(EXAMPLE.read_text().replace('device = "ram0"', 'device = "ram9"'))
    p = vsan_cli(server, "config", "apply", str(broken), check=False)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "ram9" in p.stderr, p.stderr
    # a request the CLI would never send, straight to the control socket
    from openvsan.node.control import ControlError, call

    for cmd, args, words in (
            ("volume.create", {"name": 5}, "name: expected a string, found 5"),
            ("volume.create", {"name": "v", "size": "1MiB", "read_only": "false"}, "read_only: expected true or false"),
            ("volume.create", {"name": "v", "szie": "1MiB"}, 'szie: unknown key; did you mean "size"?'),
            ("export.add", {"protocol": "fc", "name": "x", "volume": "disk0"}, '"fc" is not a protocol'),
            ("export.add", {"protocol": "nbd", "name": "x", "volume": "disk0", "portals": ["nowhere"]}, "portals[0]"),
            ("volume.delete", {}, "name: missing"),
            ("qos.set", {"volume": "disk0", "limits": "fast"}, 'limits: expected a table, found "fast"')):
        with pytest.raises(ControlError) as e:
            call(server.data_dir, cmd, **args)
        assert "\n" not in str(e.value) and words in str(e.value), (cmd, args, str(e.value))
    assert vsan_cli(server, "volume", "list", "--json").stdout == before
    assert capacity(server, 0) == 1 << 30


def test_config_apply_prints_the_plan_and_applies_it(vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    server = example(vsan)
    grown = server.config.read_text() + (
        '\n[[devices]]\nname = "ram1"\ntype = "ram"\nsize = "128MiB"\n'
        '\n[[volumes]]\nname = "disk1"\ndevice = "ram1"\nqos = { write_iops_limit = 5000 }\n')
    grown = grown.replace('luns = [{ lun = 0, volume = "disk0" }]',
                          'luns = [{ lun = 0, volume = "disk0" }, { lun = 2, volume = "disk1" }]')
    new = tmp_path / "grown.toml"
    new.write_text(grown)
    dry = vsan_cli(server, "config", "apply", str(new), "--dry-run").stdout
    assert "+ volume disk1" in dry and f"+ LUN 2 of {IQN} (volume disk1)" in dry and "dry run" in dry, dry
    assert subprocess.run(["iscsi-readcapacity16", "-i", TEST_INITIATOR, "-s", server.url(2)], capture_output=True,
                          timeout=30, check=False).returncode != 0
    out = vsan_cli(server, "config", "apply", str(new)).stdout
    assert out.startswith("plan: ") and "+ LUN 2" in out, out
    assert capacity(server, 2) == 128 * MiB
    shown = json.loads(vsan_cli(server, "volume", "show", "disk1", "--json").stdout)
    assert shown["stack"] == ["QosLayer", "RamDevice"] and shown["qos"] == {"write_iops_limit": 5000}, shown
    assert "nothing to change" in vsan_cli(server, "config", "apply", str(new)).stdout
    back = vsan_cli(server, "config", "apply", str(server.config)).stdout
    assert "- LUN 2" in back and "- volume disk1" in back and "- device ram1" in back, back


def test_live_changes_survive_a_restart_from_the_data_dir(vsan: Callable[..., VsanServer]) -> None:
    """`vsan serve --data-dir D` with no --config serves the stored desired state, live changes included, with
    the same identities (an initiator must see the same disk); --config FILE makes the file the state again."""
    server = example(vsan)
    vsan_cli(server, "volume", "create", "live1", "--size", "64MiB", "--backing", "file")
    vsan_cli(server, "export", "add", "iscsi", IQN, "--volume", "live1", "--lun", "3")
    qemu_io(server.url(3), "write -P 0x3c 1M 1M")
    before = json.loads(vsan_cli(server, "volume", "show", "live1", "--json").stdout)
    assert before["layers"] == [] and (server.data_dir / "volumes" / "live1.img").is_file()
    server.stop()
    with_config = server.command
    server.command = lambda: [c for c in with_config() if c not in ("--config", str(server.config))]  # type: ignore[method-assign]
    server.start()
    after = json.loads(vsan_cli(server, "volume", "show", "live1", "--json").stdout)
    assert (after["uuid"], after["naa"], after["serial"], after["size"]) == (
        before["uuid"], before["naa"], before["serial"], 64 * MiB)
    qemu_io(server.url(3), "read -P 0x3c 1M 1M")
    server.stop()
    server.command = with_config  # type: ignore[method-assign]
    server.start()   # the file again: live1 is not in it
    assert "live1" not in vsan_cli(server, "volume", "list", "--json").stdout
