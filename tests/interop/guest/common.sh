# common.sh -- helpers of the multipath guest scripts (busybox sh), prepended to each of them by
# tests/interop/test_guest_multipath.py. The host waits on the @@ markers: after @@FIO_RUNNING it cuts a path
# while fio writes and verifies; fio must then finish with no error, the payload written before the cut must
# read back, and the filesystem must check clean.
t() { echo "@@T $1 uptime=$(cut -d' ' -f1 /proc/uptime)"; }
fail() { echo "@@FAIL $*"; dmesg | tail -40; exit 1; }

wait_count() {  # $1 = how many, $2 = glob: wait until the glob names that many existing paths
    for i in $(seq 150); do
        n=0; for f in $2; do [ -e "$f" ] && n=$((n + 1)); done
        [ "$n" -ge "$1" ] && return 0
        sleep 0.1
    done; return 1
}

fs_prepare() {  # $1 = device: mkfs, mount on /mnt, an 8 MiB payload whose checksum fs_check verifies
    mkfs.ext4 -q -F "$1" || fail "mkfs $1"
    mount "$1" /mnt || fail "mount $1"
    dd if=/dev/urandom of=/mnt/payload bs=1M count=8 2>/dev/null || fail "payload write"
    sync
    PAYLOAD_SUM=$(sha256sum /mnt/payload | cut -d' ' -f1)
    t "fs_ready dev=$1"
}

fio_across_cut() {  # random writes, each batch read back and verified as it goes (verify_backlog)
    echo "@@FIO_RUNNING"
    fio --name=cut --filename=/mnt/fio.dat --size=32M --rw=randwrite --bsrange=4k-64k --direct=1 \
        --ioengine=libaio --iodepth=8 --time_based --runtime="$FIO_SECS" --verify=crc32c --verify_backlog=64 \
        --verify_fatal=1 --do_verify=1 > /tmp/fio.out 2>&1
    rc=$?
    grep -E 'err=|write: IOPS|read: IOPS| lat \((u|m)sec\): min' /tmp/fio.out
    [ "$rc" = 0 ] || { cat /tmp/fio.out; fail "fio exit $rc"; }
    grep -q 'err= 0' /tmp/fio.out || { cat /tmp/fio.out; fail "fio reported an error"; }
    grep -qi 'verify.*fail\|bad magic\|crc32c.*mismatch' /tmp/fio.out && { cat /tmp/fio.out; fail "fio verify"; }
    # the write side: its longest latency is the stall of the failover
    echo "@@FIO_OK write $(grep -E '^ +write: IOPS' /tmp/fio.out | grep -o 'IOPS=[^,]*, BW=[^ ]*')"
    echo "@@FIO_WRITE_LAT $(awk '/^ +write: IOPS/{w=1} w && /^ +lat \((u|m)sec\): min/{sub(/^ +/, ""); print; exit}' /tmp/fio.out)"
}

fs_check() {  # $1 = device: the payload reads back from the device (not the page cache), then fsck -n
    umount /mnt || fail umount
    echo 3 > /proc/sys/vm/drop_caches
    mount "$1" /mnt || fail "remount $1"
    S=$(sha256sum /mnt/payload | cut -d' ' -f1)
    [ "$S" = "$PAYLOAD_SUM" ] || fail "payload checksum $S, wrote $PAYLOAD_SUM"
    echo "@@PAYLOAD_OK $S"
    umount /mnt || fail umount2
    e2fsck -fn "$1" > /tmp/fsck.out 2>&1 || { cat /tmp/fsck.out; fail "fsck -n $1"; }
    echo "@@FSCK_CLEAN $(tail -1 /tmp/fsck.out)"
}
