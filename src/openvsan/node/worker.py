"""One worker process of `vsan serve --workers N` (node/workers.py starts it: `python -m openvsan.node.worker`).

Reads its assignment from stdin (a pickle from the supervisor, its parent: the whole stored state, the
placement, its index and core, the inbox descriptors it inherited), pins itself to its core, and serves its
part of the node as a Node in worker mode. Prints "ready" on stdout once it listens; SIGTERM drains and
stops it like a single-process node."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import sys
from pathlib import Path

log = logging.getLogger("openvsan.node.worker")


def main() -> None:
    args = pickle.load(sys.stdin.buffer)
    index: int = args["index"]
    from openvsan.node.logs import setup_logging

    setup_logging(args["log_level"], tag=f"w{index}")
    cpu = args["cpu"]
    if cpu is not None:
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError as e:
            log.warning("worker %d: cannot pin to cpu %d: %s; running unpinned", index, cpu, e)
    from openvsan.frontend.handoff import Exchange
    from openvsan.node.node import Node, NodeError, os_error_line, run
    from openvsan.node.workers import WorkerRole, hold_workers_lock, part

    hold_workers_lock(Path(args["data_dir"]))
    state = args["state"]
    placement = args["placement"]
    role = WorkerRole(index, state.config, placement)
    role.exchange = Exchange(index, list(args["send"]), args["inbox"])
    role.memfds = dict(args.get("memfds") or {})
    mine = dataclasses.replace(state, config=part(state.config, placement, index))

    node = Node(mine, Path(args["data_dir"]), worker=role)

    def ready() -> None:
        # the supervisor tells the other workers the sizes of what this one serves (NBD_OPT_INFO)
        sys.stdout.write(f"ready {json.dumps(node.geometry())}\n")
        sys.stdout.flush()

    def failed(why: str) -> None:
        # the line the supervisor ends `vsan serve` with, as one process would (cli/main.py serve)
        log.error("worker %d: %s", index, why)
        sys.stdout.write(f"failed {json.dumps(why)}\n")
        sys.stdout.flush()
        sys.exit(1)

    try:
        run(node, started=ready)
    except NodeError as e:
        failed(str(e))
    except OSError as e:
        failed(os_error_line(e))


if __name__ == "__main__":
    main()
