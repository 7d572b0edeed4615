"""LUKS2 through the Linux kernel's dm-crypt, both ways (issue 16), in the QEMU guest (cryptsetup and dm-crypt
are in the multipath guest build, tests/support/guest_lab.py MULTIPATH_GUEST):

1. openvsan serves an encrypted volume; QEMU (qemu-img over iSCSI) writes 4 MiB of random data into it;
2. a plain openvsan node then exports the volume's backing file as it is (LUN 0) and a blank file (LUN 1);
   in the guest, `cryptsetup open` of LUN 0 with the volume's key file gives back exactly what QEMU wrote
   (and a wrong key file opens nothing); `cryptsetup luksFormat` of LUN 1, then data written through
   dm-crypt;
3. openvsan serves that file as an encrypted volume with the guest's key file: it reads what dm-crypt
   wrote (nbdcopy).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from guest_lab import MULTIPATH_GUEST, MULTIPATH_VMDIR
from test_guest_kernel import ISCSI_NODE, run_guest
from vsan_harness import VsanServer, require_tools, run

pytestmark = [pytest.mark.interop, pytest.mark.slow]

MiB = 1 << 20


def _octal(data: bytes) -> str:
    return "".join(f"\\{b:03o}" for b in data)


def guest_script(key1: bytes, key2: bytes, sha: str) -> str:
    return r"""
fail() { echo "@@FAIL $*"; exit 1; }
modprobe -a iscsi_tcp sd_mod crc32c_generic dm_mod dm_crypt xts ecb af_alg algif_skcipher || fail modprobe
mkdir -p /run/lock/iscsi /run/cryptsetup
iscsid || fail iscsid
""" + ISCSI_NODE.lstrip("\n") + r"""iscsiadm -m node -T "$IQN" -p $PORTAL --login || fail login
disk() { for b in /sys/class/iscsi_session/session*/device/target*/*:$1/block/*; do [ -b "/dev/${b##*/}" ] && echo /dev/${b##*/}; done; }
for i in $(seq 100); do [ -n "$(disk 0)" ] && [ -n "$(disk 1)" ] && break; sleep 0.1; done
D0=$(disk 0); D1=$(disk 1)
[ -b "$D0" ] && [ -b "$D1" ] || fail "the two LUNs did not appear"
printf '""" + _octal(key1) + r"""' > /tmp/k1
printf '""" + _octal(key2) + r"""' > /tmp/k2
cryptsetup open --test-passphrase --key-file /tmp/k2 $D0 && fail "a wrong key file opened openvsan's container"
cryptsetup open --type luks2 --key-file /tmp/k1 $D0 ours || fail "cryptsetup open of openvsan's container"
GOT=$(head -c 4194304 /dev/mapper/ours | sha256sum | cut -d' ' -f1)
cryptsetup close ours
[ "$GOT" = """ + f'"{sha}"' + r""" ] || fail "dm-crypt read $GOT, not what QEMU wrote through openvsan"
echo "@@OURS_OPENED_OK"
cryptsetup luksFormat --type luks2 --batch-mode --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --sector-size 4096 \
    --key-file /tmp/k2 $D1 || fail luksFormat
cryptsetup open --type luks2 --key-file /tmp/k2 $D1 theirs || fail "cryptsetup open of its own container"
dd if=/dev/urandom of=/tmp/d bs=1M count=4 2>/dev/null || fail "random data"
dd if=/tmp/d of=/dev/mapper/theirs bs=1M oflag=direct 2>/dev/null || fail "write through dm-crypt"
sync
cryptsetup close theirs || fail "cryptsetup close"
echo "@@THEIRS $(sha256sum /tmp/d | cut -d' ' -f1)"
iscsiadm -m node -T "$IQN" -p $PORTAL --logout || fail logout
echo "@@PASS"
"""


def config(server: VsanServer, volumes: str, luns: str, nbd: str = "") -> str:
    return f"""
[node]
name = "crypt-guest"
{volumes}
[iscsi]
portals = ["127.0.0.1:{server.port}"]

[[iscsi.targets]]
iqn = "{server.iqn}"
luns = [{luns}]

[nbd]
portals = ["127.0.0.1:{server.nbd_port}"]
{nbd}
[api]
listen = "127.0.0.1:{server.api_port}"
"""


@pytest.mark.timeout(1500)
def test_dm_crypt_reads_openvsans_luks2_and_openvsan_reads_dm_crypts(vsan: Callable[..., VsanServer],
                                                                     tmp_path: Path) -> None:
    require_tools("qemu-img", "nbdcopy")
    key1, key2 = os.urandom(48), os.urandom(48)
    k1, k2 = tmp_path / "k1", tmp_path / "k2"
    k1.write_bytes(key1)
    k2.write_bytes(key2)
    ours, theirs, data = tmp_path / "ours.img", tmp_path / "theirs.img", tmp_path / "data.raw"
    data.write_bytes(os.urandom(4 * MiB))

    # 1. QEMU writes into an encrypted openvsan volume over iSCSI
    a = vsan(start=False)
    a.config.write_text(config(a, f"""
[[devices]]
name = "d0"
type = "file"
path = "{ours}"
size = "64MiB"

[[volumes]]
name = "sec"
device = "d0"
encryption = {{ key_file = "{k1}" }}
""", '{ lun = 0, volume = "sec" }'))
    a.start()
    run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", str(data), a.url(0)])
    a.stop()

    # 2. a plain node exports the backing file as it is, and a blank one: the guest's dm-crypt does the rest
    theirs.write_bytes(b"")
    os.truncate(theirs, 64 * MiB)
    b = vsan(start=False)
    b.config.write_text(config(b, f"""
[[devices]]
name = "raw"
type = "file"
path = "{ours}"

[[devices]]
name = "blank"
type = "file"
path = "{theirs}"

[[volumes]]
name = "raw"
device = "raw"

[[volumes]]
name = "blank"
device = "blank"
""", '{ lun = 0, volume = "raw" }, { lun = 1, volume = "blank" }'))
    script = tmp_path / "crypt.sh"
    script.write_text(guest_script(key1, key2, hashlib.sha256(data.read_bytes()).hexdigest()))
    text = run_guest(b, tmp_path, GUEST_SCRIPT=str(script), VMDIR=str(MULTIPATH_VMDIR), **MULTIPATH_GUEST)
    assert "@@OURS_OPENED_OK" in text
    m = re.search(r"@@THEIRS ([0-9a-f]{64})", text)
    assert m, text[-3000:]

    # 3. openvsan serves the container dm-crypt wrote, with the guest's key file
    c = vsan(start=False)
    c.config.write_text(config(c, f"""
[[devices]]
name = "d1"
type = "file"
path = "{theirs}"

[[volumes]]
name = "imp"
device = "d1"
encryption = {{ key_file = "{k2}" }}
""", '{ lun = 0, volume = "imp" }', nbd='\n[[nbd.exports]]\nname = "imp"\nvolume = "imp"\n'))
    c.start()
    back = subprocess.run(["nbdcopy", c.nbd_url("imp"), "-"], capture_output=True, timeout=120, check=True).stdout
    assert hashlib.sha256(back[:4 * MiB]).hexdigest() == m.group(1)
    c.stop()
