#!/usr/bin/env python3
"""Run a target command for a harness that starts and stops it by itself, and record how it ended.

    run_target.py --log LOG -- .venv/bin/vsan serve --config CFG --data-dir DIR

libiscsi-suite.py and run-guest-test.sh start the target themselves and stop it with SIGTERM to its
process group, without looking at how it exited. This wrapper sits in that process group, appends the
target's output to LOG, and then one line saying how it ended:

    @@EXIT rc=0 after SIGTERM            a clean stop
    @@EXIT rc=-11 without SIGTERM        it died on its own: a crash

so a test can assert afterwards that the target never crashed. SIGHUP restarts the target (SIGTERM, then a
fresh start with the same command), for tests of initiators that must ride through a restart. With
--fresh-data-dir BASE, each run of the wrapper gets a new empty data dir under BASE (the `{data}`
placeholder in the command), so nothing (a persistent reservation, say) carries over from one run to
the next.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # if the wrapper alone is killed, the target must not outlive it holding the port
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--fresh-data-dir", metavar="BASE")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.fresh_data_dir:
        os.makedirs(args.fresh_data_dir, exist_ok=True)
        data = tempfile.mkdtemp(prefix="data-", dir=args.fresh_data_dir)
        cmd = [c.replace("{data}", data) for c in cmd]
    terminated = restarting = False
    child: subprocess.Popen[bytes]

    def on_term(signum: int, frame: object) -> None:
        nonlocal terminated
        terminated = True
        # the target has a process group of its own, so it hears this only from us, exactly once
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    def on_hup(signum: int, frame: object) -> None:
        # a test restarts the target under a connected initiator: SIGTERM it, then start it again
        nonlocal restarting
        restarting = True
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)

    with open(args.log, "ab", buffering=0) as log:
        log.write(f"@@WRAPPER pid={os.getpid()}\n".encode())
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        signal.signal(signal.SIGHUP, on_hup)
        while True:
            log.write(f"@@START {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
            child = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 (no threads here)
            )
            while True:
                with contextlib.suppress(InterruptedError):
                    rc = child.wait()
                    break
            how = "after SIGTERM" if terminated or restarting else "without SIGTERM"
            log.write(f"@@EXIT rc={rc} {how} {time.strftime('%H:%M:%S')}\n".encode())
            if not restarting or terminated:
                break
            restarting = False
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
