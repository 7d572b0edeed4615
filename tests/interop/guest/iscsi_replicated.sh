# iscsi_replicated.sh -- open-iscsi logs in to one replicated volume through both replica nodes (PORTAL_A,
# PORTAL_B: ip:port; the same IQN on each), dm-multipath (prio alua, group_by_prio, hwhandler "1 alua") makes
# one map of two path groups: the primary's path active/optimized (prio 50), the secondary's standby (a
# "ghost" path, prio 1). ext4 on it; fio_failover while the host kills the primary, restarts it, kills the
# other. Needs IQN, FIO_SECS; common.sh and replicated.sh first.
modprobe -a iscsi_tcp sd_mod ext4 crc32c_generic scsi_dh_alua dm_mod dm_multipath dm_round_robin || fail modprobe
mkdir -p /run/lock/iscsi /etc/multipath
# A dead node's session fails at once (its TCP connection closes); a cut one is found by a NOP-Out every 2 s
# with 2 s to answer. Its commands go back to dm-multipath 2 s later (replacement_timeout, default 120 s).
sed -i -e 's/^node.session.timeo.replacement_timeout = .*/node.session.timeo.replacement_timeout = 2/' \
       -e 's/^node.conn\[0\].timeo.noop_out_interval = .*/node.conn[0].timeo.noop_out_interval = 2/' \
       -e 's/^node.conn\[0\].timeo.noop_out_timeout = .*/node.conn[0].timeo.noop_out_timeout = 2/' \
       /etc/iscsi/iscsid.conf
iscsid || fail iscsid
for P in "$PORTAL_A" "$PORTAL_B"; do
    iscsiadm -m discovery -t sendtargets -p "$P" > /tmp/disc || fail "discovery $P"
    cat /tmp/disc
    grep -q "^$P,[0-9]* $IQN\$" /tmp/disc || fail "SendTargets of $P does not list $P for $IQN"
done
iscsiadm -m node -T "$IQN" -p "$PORTAL_A" --login || fail "login $PORTAL_A"
iscsiadm -m node -T "$IQN" -p "$PORTAL_B" --login || fail "login $PORTAL_B"
wait_count 2 '/sys/class/iscsi_session/session*/device/target*/*/block/*' || fail "want 2 SCSI disks"
iscsiadm -m session
for d in /sys/block/sd*; do
    echo "@@ALUA ${d##*/} access_state=$(cat $d/device/access_state 2>/dev/null) \
preferred=$(cat $d/device/preferred_path 2>/dev/null) wwid=$(cat $d/device/wwid 2>/dev/null)"
done
cat > /etc/multipath.conf <<'CONF'
defaults {
    user_friendly_names yes
    find_multipaths no
    # no udev in this guest: the WWID from sysfs (VPD page 83h)
    uid_attribute ""
    polling_interval 1
    enable_foreign "^$"
}
blacklist {
    device {
        vendor ".*"
        product ".*"
    }
}
blacklist_exceptions {
    device {
        vendor "OPENVSAN"
        product "VIRTUAL-DISK"
    }
}
devices {
    device {
        vendor "OPENVSAN"
        product "VIRTUAL-DISK"
        path_grouping_policy group_by_prio
        prio alua
        hardware_handler "1 alua"
        failback immediate
        no_path_retry 60
        # multipathd writes this as the iSCSI session's recovery_tmo (its default, 5 s, would override
        # replacement_timeout): a dead node's commands go back to dm-multipath 2 s after its connection fails
        fast_io_fail_tmo 2
        path_checker tur
        path_selector "round-robin 0"
        rr_min_io_rq 1
    }
}
CONF
mkdir -p /run/udev/data
for d in /sys/block/sd*; do echo "I:$(cut -d. -f1 /proc/uptime)000000" > "/run/udev/data/b$(cat "$d/dev")"; done
multipathd -d -v3 > /tmp/multipathd.log 2>&1 &   # in the foreground: its log (checker, prio) is ours
for i in $(seq 50); do multipathd show daemon 2>/dev/null | grep -q running && break; sleep 0.1; done
multipath -v2 > /tmp/multipath.out 2>&1
cat /tmp/multipath.out
for i in $(seq 100); do dmsetup ls --target multipath 2>/dev/null | grep -q . && break; sleep 0.1; done
MAP=$(dmsetup ls --target multipath | awk 'NR==1{print $1}')
[ -n "$MAP" ] || fail "no multipath map"
[ "$(dmsetup ls --target multipath | grep -c .)" = 1 ] || fail "more than one multipath map: not one identity"
multipath -ll "$MAP" | tee /tmp/mp.before
grep -q 'hwhandler=.1 alua' /tmp/mp.before || fail "no alua hardware handler"
# two path groups: the primary's (ALUA active/optimized: prio 50) active, the standby one (prio 1) enabled
grep -qE "prio=50 status=(active|enabled)" /tmp/mp.before || fail "no path group of prio 50 (active/optimized)"
grep -qE 'prio=1 status=enabled' /tmp/mp.before || fail "no enabled path group of prio 1 (standby)"
grep -qE 'sd[a-z]+ .*active ready' /tmp/mp.before || fail "the primary's path is not active ready"
grep -qE 'sd[a-z]+ .*ghost' /tmp/mp.before || fail "the secondary's path is not a ghost (standby) path"
echo "@@MPATH_PRIMARY_AND_STANDBY $MAP"
DEV=/dev/mapper/$MAP
[ -b "$DEV" ] || DEV=/dev/dm-$(dmsetup info -c --noheadings -o minor "$MAP" | tr -d ' ')
[ -b "$DEV" ] || fail "no block device for $MAP"
fs_prepare "$DEV"
paths() {
    multipathd show paths raw format "%d %t %T %p" | tr ' ' ':' | sort
    for d in /sys/block/sd*; do echo "${d##*/}=$(cat $d/device/access_state 2>/dev/null)"; done
}
path_monitor paths &
fio_failover
touch /tmp/monitor.stop
multipath -ll "$MAP" | tee /tmp/mp.after
grep -qE 'prio=50 status=active' /tmp/mp.after || fail "no active/optimized path group after the failovers"
echo "@@MPATH_FOLLOWED"
dmesg | grep -iE 'alua|multipath|device-mapper|connection.*error|session recovery' | tail -40
grep -E 'sd[a-z]+: (tur checker|prio = |.*state = )|switch|failback|reinstat|fail path|remaining active' \
    /tmp/multipathd.log | grep -v 'checker timeout' | tail -80
fs_check "$DEV"
echo "@@PASS"
