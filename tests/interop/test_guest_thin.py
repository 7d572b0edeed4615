"""A thin volume under a Linux kernel initiator (open-iscsi in the QEMU guest of test_guest_kernel.py):

- ext4 on a thin LUN: files written, one deleted, `fstrim` in the guest gives its clusters back to the volume
  group (what `vsan volume show` reports on the host);
- a snapshot taken on the host while the filesystem is mounted, exported read-only as LUN 1, found by a
  rescan in the guest and mounted there (ro,noload: a crash-consistent point, its journal not replayed),
  holds what was written before it while the origin keeps changing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from test_guest_kernel import ISCSI_NODE, guest_reached, run_guest
from vsan_harness import VSAN, VsanServer, run

pytestmark = [pytest.mark.interop, pytest.mark.slow]

MiB = 1 << 20

THIN_SCRIPT = r"""
fail() { echo "@@FAIL $*"; exit 1; }
modprobe -a iscsi_tcp sd_mod crc32c_generic ext4 || fail modprobe
mkdir -p /run/lock/iscsi
iscsid || fail iscsid
""" + ISCSI_NODE.lstrip("\n") + r"""iscsiadm -m node -T "$IQN" -p $PORTAL --login || fail login
disks() { for b in /sys/class/iscsi_session/session*/device/target*/*/block/*; do [ -b "/dev/${b##*/}" ] && echo ${b##*/}; done; }
for i in $(seq 100); do [ -n "$(disks)" ] && break; sleep 0.1; done
DEV=/dev/$(disks | head -1)
[ -b "$DEV" ] || fail "no iSCSI disk"
echo "@@DISCARD $(cat /sys/block/${DEV#/dev/}/queue/discard_max_bytes)"
mkfs.ext4 -q -E nodiscard $DEV || fail mkfs
mkdir -p /mnt/vol /mnt/snap
mount $DEV /mnt/vol || fail mount
dd if=/dev/urandom of=/mnt/vol/big bs=1M count=96 conv=fsync 2>/dev/null || fail "write big"
dd if=/dev/urandom of=/mnt/vol/keep bs=1M count=4 conv=fsync 2>/dev/null || fail "write keep"
sync
K1=$(sha256sum /mnt/vol/keep | cut -d' ' -f1)
echo "@@FILES_WRITTEN"
sleep 8
rm /mnt/vol/big
sync
fstrim -v /mnt/vol || fail fstrim
echo "@@TRIMMED"
sleep 8
echo "@@SNAPSHOT_NOW"
sleep 12
iscsiadm -m session --rescan || fail rescan
for i in $(seq 100); do [ "$(disks | wc -l)" -ge 2 ] && break; sleep 0.2; done
SNAP=/dev/$(disks | grep -v "^${DEV#/dev/}$" | head -1)
[ -b "$SNAP" ] || fail "the snapshot LUN did not appear: $(disks)"
mount -o ro,noload $SNAP /mnt/snap || fail "mount the snapshot"
[ "$(sha256sum /mnt/snap/keep | cut -d' ' -f1)" = "$K1" ] || fail "the snapshot does not hold keep"
dd if=/dev/urandom of=/mnt/vol/keep bs=1M count=4 conv=fsync 2>/dev/null || fail "overwrite keep"
dd if=/dev/urandom of=/mnt/vol/more bs=1M count=8 conv=fsync 2>/dev/null || fail "write more"
sync
echo 3 > /proc/sys/vm/drop_caches
[ "$(sha256sum /mnt/vol/keep | cut -d' ' -f1)" != "$K1" ] || fail "the origin did not change"
[ "$(sha256sum /mnt/snap/keep | cut -d' ' -f1)" = "$K1" ] || fail "the snapshot changed with its origin"
[ ! -e /mnt/snap/more ] || fail "a file written after the snapshot is in it"
echo "@@SNAPSHOT_OK $K1"
umount /mnt/snap || fail "umount snapshot"
umount /mnt/vol || fail umount
iscsiadm -m node -T "$IQN" -p $PORTAL --logout || fail logout
echo "@@PASS"
"""


@pytest.mark.timeout(1200)
def test_fstrim_returns_space_and_a_snapshot_mounts_read_only_in_the_guest(
        vsan: Callable[..., VsanServer], tmp_path: Path) -> None:
    server = vsan("file", "512MiB", carve="256MiB", start=False)
    script = tmp_path / "thin.sh"
    script.write_text(THIN_SCRIPT)
    seen: dict[str, int] = {}

    def cli(*args: str) -> str:
        return run([VSAN, *args, "--data-dir", server.data_dir], timeout=60).stdout

    def mapped() -> int:
        return int(json.loads(cli("volume", "show", "disk0", "--json"))["carved"]["mapped"])

    def host_side(guest_log: Path, target_log: Path) -> None:
        if not guest_reached(guest_log, "@@FILES_WRITTEN"):
            return
        seen["written"] = mapped()
        if not guest_reached(guest_log, "@@TRIMMED"):
            return
        seen["trimmed"] = mapped()
        if not guest_reached(guest_log, "@@SNAPSHOT_NOW"):
            return
        cli("snapshot", "create", "disk0", "snap1")
        cli("volume", "create", "snap1", "--device", "dev0", "--snapshot")
        cli("export", "add", "iscsi", server.iqn, "--volume", "snap1", "--lun", "1")

    text = run_guest(server, tmp_path, during=host_side, GUEST_SCRIPT=str(script))
    assert "@@SNAPSHOT_OK" in text
    print(f"thin volume mapped: {seen['written'] / MiB:.1f} MiB after the files, "
          f"{seen['trimmed'] / MiB:.1f} MiB after rm + fstrim")
    assert seen["written"] >= 100 * MiB
    assert seen["written"] - seen["trimmed"] >= 90 * MiB, seen
