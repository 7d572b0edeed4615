"""CPU time from /proc (openvsan/procstat.py): a process tree counts its live descendants, as `vsan bench
--target-pid` needs for a `vsan serve` whose data path runs in worker processes."""

from __future__ import annotations

import subprocess
import sys
import time

from openvsan.procstat import children, cpu_seconds, tree_cpu_seconds

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\nprint('done', flush=True)\ntime.sleep(30)"


def test_a_tree_counts_the_cpu_of_its_grandchildren() -> None:
    # a shell whose child burns 0.4 s of CPU, then sleeps: the shell's own time is ~0
    shell = subprocess.Popen(["sh", "-c", f"{sys.executable} -c \"$0\"; :", BURN], stdout=subprocess.PIPE, text=True)
    try:
        assert shell.stdout is not None and shell.stdout.readline().strip() == "done"
        kids = children(shell.pid)
        assert len(kids) == 1
        own = cpu_seconds(shell.pid)
        tree = tree_cpu_seconds(shell.pid)
        assert tree is not None and own < 0.2 and tree - own >= 0.35, (own, tree)
    finally:
        shell.kill()
        shell.wait()
        time.sleep(0.05)
    assert tree_cpu_seconds(shell.pid) is None   # gone (reaped)


def test_a_process_without_children_is_its_own_time() -> None:
    import os

    me = os.getpid()
    a = cpu_seconds(me)
    t = tree_cpu_seconds(me)
    assert t is not None and t >= a and not [p for p in children(me) if p == me]
