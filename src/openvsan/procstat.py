"""CPU time of processes, from /proc (proc(5)): what `vsan bench --target-pid` reports for a target and what
the supervisor of `vsan serve --workers N` samples to balance its workers."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["children", "cpu_seconds", "tree_cpu_seconds"]


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of every thread of a process so far (/proc/PID/stat utime, stime; fields 14
    and 15). OSError when it is gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The live children of a process (/proc/PID/task/TID/children of each of its threads)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for t in tasks:
        try:
            out += [int(x) for x in (t / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU time of a process and of all its live descendants (a `vsan serve` and its worker processes), or
    None when the process is gone. A descendant that ends between two samples takes its time with it: sample
    a tree whose processes live through the measurement."""
    try:
        total = cpu_seconds(pid)
    except OSError:
        return None
    todo, seen = children(pid), {pid}
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            total += cpu_seconds(p)
        except OSError:
            continue
        todo += children(p)
    return total
