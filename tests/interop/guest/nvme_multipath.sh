# nvme_multipath.sh -- the Linux NVMe/TCP host connects to one subsystem through two portals (NVME_A_ADDR,
# NVME_B_ADDR on NVME_PORT); native multipath (nvme_core multipath=Y) gives one namespace device with two
# controllers under it, ext4 on it; a path is cut during fio (after @@FIO_RUNNING): I/O moves to the other
# controller. Needs NQN, FIO_SECS; common.sh first.
modprobe -a nvme_tcp ext4 crc32c_generic || fail modprobe
[ "$(cat /sys/module/nvme_core/parameters/multipath)" = Y ] || fail "nvme_core multipath is off"
# a cut path must fail fast: keep-alive 3 s finds it, then a reconnect every 2 s for a minute
for A in "$NVME_A_ADDR" "$NVME_B_ADDR"; do
    nvme connect -t tcp -a "$A" -s "$NVME_PORT" -n "$NQN" --keep-alive-tmo=3 --reconnect-delay=2 \
        --ctrl-loss-tmo=60 || fail "nvme connect $A"
done
wait_count 2 '/sys/class/nvme-subsystem/nvme-subsys*/nvme[0-9]*' || fail "want 2 controllers in one subsystem"
SUBSYS=$(ls -d /sys/class/nvme-subsystem/nvme-subsys* | head -1)
[ "$(ls -d /sys/class/nvme-subsystem/nvme-subsys* | wc -l)" = 1 ] || fail "want one subsystem"
wait_count 1 "$SUBSYS/nvme*n1" || fail "no multipath namespace"
NS=$(ls -d $SUBSYS/nvme*n1 | head -1); DEV=/dev/${NS##*/}
wait_count 2 '/sys/block/nvme*c*n1' || fail "want 2 path devices under $DEV"
echo round-robin > "$SUBSYS/iopolicy" || fail "iopolicy"
nvme list-subsys | tee /tmp/subsys.before
[ "$(grep -c ' live' /tmp/subsys.before)" = 2 ] || fail "want 2 live paths"
for p in /sys/block/nvme*c*n1; do echo "@@ANA ${p##*/} $(cat $p/ana_state)"; done
echo "@@NVME_TWO_PATHS $DEV iopolicy=$(cat $SUBSYS/iopolicy)"
fs_prepare "$DEV"
fio_across_cut
nvme list-subsys | tee /tmp/subsys.after
[ "$(grep -c ' live' /tmp/subsys.after)" = 1 ] || fail "want 1 live path after the cut"
echo "@@NVME_PATH_FAILED $(grep -vE ' live|^ *$' /tmp/subsys.after | grep -E 'tcp' | head -1 | sed 's/^ *//')"
fs_check "$DEV"
echo "@@PASS"
