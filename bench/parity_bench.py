#!/usr/bin/env python3
"""Parity kernels microbenchmark: GB/s per core of our RAID 5/6 backends (openvsan.pool.parity) beside ISA-L
through pyeclib (`isa_l_rs_vand`, k data + 2 parity: the same P and Q as Linux md), in one run. Issue 5;
results and commands in docs/benchmarks.md ("Parity kernels").

    .venv/bin/python bench/parity_bench.py [--cpu N] [--members 4,8] [--sizes 4k,16k,64k,256k,1m]
                                           [--seconds S] [--rounds R] [--json] [--out FILE] [--quick]

Operations, each over one stripe of `members` data chunks of `size` bytes:
  xor      RAID 5 P (ISA-L: k data + 1 parity)
  pq       RAID 6 P and Q (ISA-L: k data + 2 parity)
  recover2 two data chunks lost, rebuilt from the rest and P, Q (ISA-L: reconstruct of two data fragments)
GB/s = data bytes of the stripe (members x size, 10^9 bytes) / CPU seconds of this thread, so time the
scheduler gives to other work on a shared machine is not counted; wall-clock figures are in the JSON. Rounds are
interleaved (every case of every implementation once per round) and the median is reported.

pyeclib adds its own work around ISA-L's kernels: it splits the object into fragments with 80-byte headers
(a copy) on encode, and checks and strips them on reconstruct. That is what a Python program using ISA-L
pays, which is the comparison issue 5 asks for.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))  # run from a checkout without installing

from openvsan.pool.parity import available, backend

SCHEMA_VERSION = 1
PEER = "pyeclib-isal"  # ISA-L through pyeclib; our own "isal" backend calls ISA-L directly
OPS = ("xor", "pq", "recover2")
UNITS = {"k": 1024, "m": 1024 * 1024}


def parse_size(text: str) -> int:
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in UNITS:
        return int(t[:-1]) * UNITS[t[-1]]
    return int(t)


def size_name(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


class Case:
    """One stripe's data (random, made once) and the calls that time each operation on it."""

    def __init__(self, members: int, size: int) -> None:
        self.members = members
        self.size = size
        self.data = [os.urandom(size) for _ in range(members)]


Op = Callable[[], object]


def our_ops(name: str, case: Case) -> dict[str, Op]:
    par = backend(name)
    data = case.data
    p, q = par.pq(data)
    lost: list[bytes | None] = list(data)
    lost[0] = lost[1] = None  # the first two: the costliest pair for Horner's rule is no cheaper than any other
    if par.recover(lost, p, q) != data:
        raise SystemExit(f"{name}: recover2 returned wrong data; refusing to time a broken kernel")
    return {
        "xor": lambda: par.xor(data),
        "pq": lambda: par.pq(data),
        "recover2": lambda: par.recover(lost, p, q),
    }


def isal_driver(k: int, m: int) -> Any:
    from pyeclib.ec_iface import ECDriver  # type: ignore[import-not-found,import-untyped,unused-ignore]

    return ECDriver(k=k, m=m, ec_type="isa_l_rs_vand")


def isal_status() -> tuple[str | None, str]:
    """(None, what it is) when ISA-L runs through pyeclib here, else (why not, '')."""
    try:
        import pyeclib  # type: ignore[import-not-found,import-untyped,unused-ignore]  # noqa: F401
    except ImportError as e:
        return (
            f"pyeclib is not installed ({e}): `pip install -e .[parity-bench]` after "
            "`apt-get install liberasurecode-dev libisal-dev`"
        ), ""
    try:
        driver = isal_driver(4, 2)
        driver.encode(b"\x00" * 4096)
    except Exception as e:  # noqa: BLE001 - pyeclib raises its own ECDriverError family; any of them means no ISA-L
        return f"pyeclib cannot run isa_l_rs_vand ({type(e).__name__}: {e}): `apt-get install libisal2`", ""
    try:
        version = importlib.metadata.version("pyeclib")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return None, f"ISA-L through pyeclib {version}, isa_l_rs_vand"


def isal_ops(case: Case) -> dict[str, Op]:
    payload = b"".join(case.data)  # pyeclib splits one object into k fragments
    rs5 = isal_driver(case.members, 1)
    rs6 = isal_driver(case.members, 2)
    fragments = rs6.encode(payload)
    survivors = fragments[2:]
    if rs6.decode(survivors) != payload:
        raise SystemExit("ISA-L: decode of survivors returned wrong data")
    return {
        "xor": lambda: rs5.encode(payload),
        "pq": lambda: rs6.encode(payload),
        "recover2": lambda: rs6.reconstruct(survivors, [0, 1]),
    }


def measure(op: Op, nbytes: int, seconds: float) -> tuple[float, float, int]:
    """(GB/s per CPU second, GB/s wall, calls): calls until `seconds` of this thread's CPU time are spent."""
    op()  # warm: first-call allocations, table builds
    calls = 0
    c0, w0 = time.thread_time(), time.perf_counter()
    while True:
        op()
        calls += 1
        cpu = time.thread_time() - c0
        if cpu >= seconds:
            break
    wall = time.perf_counter() - w0
    return nbytes * calls / cpu / 1e9, nbytes * calls / wall / 1e9, calls


def run(args: argparse.Namespace) -> dict[str, Any]:
    impls = args.backends or [n for n, why in available().items() if why is None]
    isal_why, isal_what = isal_status()
    if isal_why is None:
        impls.append(PEER)
    else:
        print(f"ISA-L absent: {isal_why}", file=sys.stderr)
    cases = [Case(m, s) for m in args.members for s in args.sizes]
    ops: dict[tuple[str, int, int], dict[str, Op]] = {}
    for case in cases:
        for impl in impls:
            ops[(impl, case.members, case.size)] = isal_ops(case) if impl == PEER else our_ops(impl, case)
    samples: dict[tuple[str, str, int, int], list[tuple[float, float, int]]] = {}
    for _ in range(args.rounds):
        for case in cases:
            for op_name in OPS:
                for impl in impls:
                    key = (impl, op_name, case.members, case.size)
                    op = ops[(impl, case.members, case.size)][op_name]
                    samples.setdefault(key, []).append(measure(op, case.members * case.size, args.seconds))
    results = []
    for (impl, op_name, members, size), runs in samples.items():
        results.append(
            {
                "impl": impl,
                "op": op_name,
                "data_members": members,
                "chunk": size,
                "gbps": statistics.median(r[0] for r in runs),
                "gbps_wall": statistics.median(r[1] for r in runs),
                "calls": sum(r[2] for r in runs),
                "rounds": [round(r[0], 4) for r in runs],
            }
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "parity_bench",
        "host": {
            "hostname": socket.gethostname(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": sys.version.split()[0],
            "pinned_cpu": args.cpu,
        },
        "options": {
            "members": args.members,
            "sizes": args.sizes,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "quick": args.quick,
        },
        "isal": {"available": isal_why is None, "reason": isal_why, "via": isal_what or None},
        "results": results,
    }


def print_tables(doc: dict[str, Any]) -> None:
    """One Markdown table per data-member count: GB/s per core for each op and implementation, and ours / ISA-L."""
    res = doc["results"]
    impls = list(dict.fromkeys(r["impl"] for r in res))
    ours = [i for i in impls if i != PEER]
    by = {(r["impl"], r["op"], r["data_members"], r["chunk"]): r["gbps"] for r in res}
    for members in doc["options"]["members"]:
        header = ["chunk", "op", *[f"{i} GB/s" for i in impls]]
        if PEER in impls:
            header += [f"{i} / {PEER}" for i in ours]
        print(f"\n{members} data members, GB/s per core (data bytes / CPU s), median of {doc['options']['rounds']}")
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for size in doc["options"]["sizes"]:
            for op in OPS:
                row = [size_name(size), op, *[f"{by[(i, op, members, size)]:.2f}" for i in impls]]
                if PEER in impls:
                    row += [f"{by[(i, op, members, size)] / by[(PEER, op, members, size)]:.2f}" for i in ours]
                print("| " + " | ".join(row) + " |")
    if not doc["isal"]["available"]:
        print(f"\nISA-L absent: {doc['isal']['reason']}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", type=int, help="pin this process to one CPU (os.sched_setaffinity)")
    ap.add_argument("--members", help="data chunks per stripe, comma separated (default 4,8)")
    ap.add_argument("--sizes", help="chunk sizes (default 4k,16k,64k,256k,1m)")
    ap.add_argument("--seconds", type=float, help="CPU seconds per case per round (default 0.3)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds; the median is reported (default 3)")
    ap.add_argument("--backends", help="our backends to run, comma separated (default: every one usable here)")
    ap.add_argument("--json", action="store_true", help="print the JSON result instead of the tables")
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    ap.add_argument(
        "--quick", action="store_true", help="CI smoke: defaults of 4 members, 4k and 64k, 1 round of 0.02 s"
    )
    args = ap.parse_args(argv)
    defaults = ("4", "4k,64k", 0.02, 1) if args.quick else ("4,8", "4k,16k,64k,256k,1m", 0.3, 3)
    for option, default in zip(("members", "sizes", "seconds", "rounds"), defaults, strict=True):
        if getattr(args, option) is None:
            setattr(args, option, default)
    if args.seconds <= 0 or args.rounds < 1:
        ap.error("--seconds must be above 0 and --rounds at least 1")
    try:
        args.members = [int(x) for x in str(args.members).split(",")]
        args.sizes = [parse_size(x) for x in str(args.sizes).split(",")]
    except ValueError as e:
        ap.error(f"--members/--sizes: {e}")
    if any(m < 2 or m > 255 for m in args.members):
        ap.error("--members: each between 2 and 255")
    args.backends = args.backends.split(",") if args.backends else None
    for name in args.backends or []:
        try:
            backend(name)
        except ValueError as e:
            ap.error(str(e))
    if args.cpu is not None:
        try:
            os.sched_setaffinity(0, {args.cpu})
        except OSError as e:
            ap.error(f"--cpu {args.cpu}: {e}")
    doc = run(args)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_tables(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
