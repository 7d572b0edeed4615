# replicated.sh -- helpers of the replicated-volume guest scripts (busybox sh), prepended after common.sh by
# tests/interop/test_guest_replicated.py. The two paths lead to two replica nodes; the host kills or cuts the
# primary while fio runs, and reads the failover stall from what fio_failover prints.

path_monitor() {  # $1 = a command printing one line of path states; a line "@@PATHS <uptime> ..." per change
    last=""
    while [ ! -e /tmp/monitor.stop ]; do
        now=$($1 2>/dev/null | tr '\n' ' ')
        [ "$now" != "$last" ] && echo "@@PATHS $(cut -d' ' -f1 /proc/uptime) $now"
        last=$now
        sleep 0.5
    done
}

fio_failover() {  # random writes verified as they go, each completion in a latency log; then the stalls
    # the file laid out first: fio's clock (its log's times) then starts with the marker the host waits on
    fio --name=failover --filename=/mnt/fio.dat --size=32M --create_only=1 > /tmp/fio.layout 2>&1 ||
        { cat /tmp/fio.layout; fail "fio layout"; }
    T0=$(cut -d' ' -f1 /proc/uptime)
    echo "@@FIO_RUNNING uptime=$T0 date=$(date +%T)"
    fio --name=failover --filename=/mnt/fio.dat --size=32M --rw=randwrite --bsrange=4k-64k --direct=1 \
        --ioengine=libaio --iodepth=8 --time_based --runtime="$FIO_SECS" --verify=crc32c --verify_backlog=64 \
        --verify_fatal=1 --do_verify=1 --write_lat_log=/tmp/fo --log_avg_msec=0 \
        --log_alternate_epoch=1 --log_alternate_epoch_clock_id=1 > /tmp/fio.out 2>&1
    rc=$?
    echo "@@FIO_DONE uptime=$(cut -d' ' -f1 /proc/uptime)"
    grep -E 'err=|write: IOPS|read: IOPS| lat \((u|m)sec\): min' /tmp/fio.out
    [ "$rc" = 0 ] || { cat /tmp/fio.out; fail "fio exit $rc"; }
    grep -q 'err= 0' /tmp/fio.out || { cat /tmp/fio.out; fail "fio reported an error"; }
    grep -qi 'verify.*fail\|bad magic\|crc32c.*mismatch' /tmp/fio.out && { cat /tmp/fio.out; fail "fio verify"; }
    LOG=/tmp/fo_lat.1.log
    [ -s "$LOG" ] || fail "fio wrote no latency log"
    # fio 3.x log lines: completion time (ms of CLOCK_MONOTONIC, the clock of /proc/uptime: printed as ms
    # after @@FIO_RUNNING), latency (ns), direction (0 read, 1 write), size. A stall is a gap between one
    # completion and the next: nothing completed while no path served.
    sort -t, -k1,1n "$LOG" | awk -F', *' -v min="${GAP_MS:-300}" -v t0="$T0" '
        { $1 -= t0 * 1000 }
        NR > 1 && $1 - prev >= min { printf "@@GAP %d %d %d\n", prev, $1, $1 - prev }
        { prev = $1; if ($3 == 1 && $2 > maxw) maxw = $2; n++ }
        END { printf "@@FIO_LOG completions=%d last_ms=%d max_write_lat_ms=%d\n", n, prev, maxw / 1000000 }'
    echo "@@FIO_OK write $(grep -E '^ +write: IOPS' /tmp/fio.out | grep -o 'IOPS=[^,]*, BW=[^ ]*')"
}
