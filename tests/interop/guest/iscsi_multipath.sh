# iscsi_multipath.sh -- open-iscsi logs in to one target through two portals (PORTAL_A, PORTAL_B: ip:port),
# dm-multipath (prio alua, group_by_prio) makes one map of the two paths, ext4 on it; a path is cut during
# fio (by the host, after @@FIO_RUNNING): I/O moves to the other path. Needs IQN, FIO_SECS; common.sh first.
modprobe -a iscsi_tcp sd_mod ext4 crc32c_generic scsi_dh_alua dm_mod dm_multipath dm_round_robin || fail modprobe
mkdir -p /run/lock/iscsi /etc/multipath
# A dead path must fail fast: a NOP-Out every 2 s with 2 s to answer finds it; the session's commands then go
# back to dm-multipath 5 s later (replacement_timeout, default 120 s), which retries them on the live path.
sed -i -e 's/^node.session.timeo.replacement_timeout = .*/node.session.timeo.replacement_timeout = 5/' \
       -e 's/^node.conn\[0\].timeo.noop_out_interval = .*/node.conn[0].timeo.noop_out_interval = 2/' \
       -e 's/^node.conn\[0\].timeo.noop_out_timeout = .*/node.conn[0].timeo.noop_out_timeout = 2/' \
       /etc/iscsi/iscsid.conf
iscsid || fail iscsid
iscsiadm -m discovery -t sendtargets -p "$PORTAL_A" > /tmp/disc || fail discovery
cat /tmp/disc
grep -q "^$PORTAL_A,[0-9]* $IQN\$" /tmp/disc || fail "SendTargets does not list $PORTAL_A for $IQN"
grep -q "^$PORTAL_B,[0-9]* $IQN\$" /tmp/disc || fail "SendTargets does not list $PORTAL_B for $IQN"
iscsiadm -m node -T "$IQN" -p "$PORTAL_A" --login || fail "login $PORTAL_A"
iscsiadm -m node -T "$IQN" -p "$PORTAL_B" --login || fail "login $PORTAL_B"
wait_count 2 '/sys/class/iscsi_session/session*/device/target*/*/block/*' || fail "want 2 SCSI disks"
iscsiadm -m session
t iscsi_two_sessions
cat > /etc/multipath.conf <<'CONF'
defaults {
    user_friendly_names yes
    find_multipaths no
    # no udev in this guest: the WWID from sysfs (VPD page 83h)
    uid_attribute ""
    polling_interval 2
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
        no_path_retry 12
        path_checker tur
        path_selector "round-robin 0"
        rr_min_io_rq 1
    }
}
CONF
# No udevd in this guest: multipath only takes devices that udev has initialized, which libudev tells by an
# entry in the udev database; give each path disk one (its WWID comes from sysfs, uid_attribute "").
mkdir -p /run/udev/data
for d in /sys/block/sd*; do echo "I:$(cut -d. -f1 /proc/uptime)000000" > "/run/udev/data/b$(cat "$d/dev")"; done
multipathd -s > /tmp/multipathd.log 2>&1 || { cat /tmp/multipathd.log; fail multipathd; }
multipath -v2 > /tmp/multipath.out 2>&1
cat /tmp/multipath.out
for i in $(seq 100); do dmsetup ls --target multipath 2>/dev/null | grep -q . && break; sleep 0.1; done
MAP=$(dmsetup ls --target multipath | awk 'NR==1{print $1}')
[ -n "$MAP" ] || fail "no multipath map"
[ "$(dmsetup ls --target multipath | grep -c .)" = 1 ] || fail "more than one multipath map"
multipath -ll "$MAP" | tee /tmp/mp.before
[ "$(grep -cE '[0-9]+:[0-9]+:[0-9]+:[0-9]+ sd[a-z]+ .*active ready' /tmp/mp.before)" = 2 ] || {
    cat /tmp/multipathd.log; multipath -v4 2>&1 | grep -v "^ *$" | grep -iE "sd[ab]|skip|udev|init|blacklist" | head -60; fail "want 2 active ready paths"; }
grep -q 'hwhandler=.1 alua' /tmp/mp.before || fail "no alua hardware handler"
grep -q 'prio=50' /tmp/mp.before || fail "no ALUA priority 50 (active/optimized)"
echo "@@MPATH_TWO_PATHS $MAP"
DEV=/dev/mapper/$MAP
[ -b "$DEV" ] || DEV=/dev/dm-$(dmsetup info -c --noheadings -o minor "$MAP" | tr -d ' ')   # no udev: no link
[ -b "$DEV" ] || fail "no block device for $MAP"
fs_prepare "$DEV"
fio_across_cut
multipath -ll "$MAP" | tee /tmp/mp.after
grep -qE 'failed (faulty|ghost|i/o pending|shaky)|failed.*running' /tmp/mp.after || fail "no path reported failed"
grep -qE 'active ready +running' /tmp/mp.after || fail "no path left active"
echo "@@MPATH_PATH_FAILED"
fs_check "$DEV"
echo "@@PASS"
