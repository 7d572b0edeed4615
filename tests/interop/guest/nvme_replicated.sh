# nvme_replicated.sh -- the Linux NVMe/TCP host connects to one replicated volume through both replica nodes
# (NVME_A_ADDR, NVME_B_ADDR on NVME_PORT; the same NQN on each); native multipath gives one namespace device
# with two controllers: the primary's path ANA optimized, the secondary's inaccessible. ext4 on it;
# fio_failover while the host cuts the primary's link, lets it back, kills the other. Needs NQN, FIO_SECS;
# common.sh and replicated.sh first.
modprobe -a nvme_tcp ext4 crc32c_generic || fail modprobe
[ "$(cat /sys/module/nvme_core/parameters/multipath)" = Y ] || fail "nvme_core multipath is off"
# a cut path must fail fast: keep-alive 2 s finds it, then a reconnect every second for two minutes
for A in "$NVME_A_ADDR" "$NVME_B_ADDR"; do
    nvme connect -t tcp -a "$A" -s "$NVME_PORT" -n "$NQN" --keep-alive-tmo=2 --reconnect-delay=1 \
        --ctrl-loss-tmo=120 || fail "nvme connect $A"
done
wait_count 2 '/sys/class/nvme-subsystem/nvme-subsys*/nvme[0-9]*' || fail "want 2 controllers in one subsystem"
[ "$(ls -d /sys/class/nvme-subsystem/nvme-subsys* | wc -l)" = 1 ] || fail "want one subsystem: not one identity"
SUBSYS=$(ls -d /sys/class/nvme-subsystem/nvme-subsys* | head -1)
wait_count 1 "$SUBSYS/nvme*n1" || fail "no multipath namespace"
NS=$(ls -d $SUBSYS/nvme*n1 | head -1); DEV=/dev/${NS##*/}
wait_count 2 '/sys/block/nvme*c*n1' || fail "want 2 path devices under $DEV"
nvme list-subsys | tee /tmp/subsys.before
for p in /sys/block/nvme*c*n1; do echo "@@ANA ${p##*/} $(cat $p/ana_state)"; done
[ "$(cat /sys/block/nvme*c*n1/ana_state | grep -c '^optimized$')" = 1 ] || fail "want one optimized path"
[ "$(cat /sys/block/nvme*c*n1/ana_state | grep -c '^inaccessible$')" = 1 ] || fail "want one inaccessible path"
echo "@@NVME_OPTIMIZED_AND_INACCESSIBLE $DEV"
fs_prepare "$DEV"
paths() {
    for c in /sys/class/nvme/nvme*; do echo "${c##*/}:$(cat $c/address | tr ',' ' ' | cut -d' ' -f1):$(cat $c/state)"; done
    for p in /sys/block/nvme*c*n1; do echo "${p##*/}=$(cat $p/ana_state)"; done
}
path_monitor paths &
fio_failover
touch /tmp/monitor.stop
nvme list-subsys | tee /tmp/subsys.after
for p in /sys/block/nvme*c*n1; do echo "@@ANA ${p##*/} $(cat $p/ana_state)"; done
live_optimized() {  # the path devices whose controller is live and whose ANA state is optimized
    for p in /sys/block/nvme*c*n1; do
        c=$(echo "${p##*/}" | sed 's/^nvme[0-9]*c\([0-9]*\)n[0-9]*$/nvme\1/')
        [ "$(cat /sys/class/nvme/$c/state)" = live ] && [ "$(cat $p/ana_state)" = optimized ] && echo "${p##*/}"
    done
}
[ "$(live_optimized | grep -c .)" = 1 ] || fail "want one live optimized path after the failovers"
echo "@@NVME_FOLLOWED"
dmesg | grep -iE 'nvme' | tail -40
fs_check "$DEV"
echo "@@PASS"
