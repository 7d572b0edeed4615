#!/usr/bin/env python3
"""What a QoS layer whose limits are not reached costs on the fast path (issue 11: at most 5 % at 4K QD32).

Two volumes over RAM disks of the same size: A is the RamDevice alone, B has a QosLayer over it with limits far
above any rate reached here (total and read, IOPS and bytes: the four buckets a read takes from). N readers
(the queue depth) each send 4 KiB reads the way a frontend does, read_now first and read() when that declines,
and yield to the loop after each, as a reply's send would. Rounds are pairs, A then B or B then A by
turns; the median of the pairs' ratios B / A is printed, with the cost of one read_now call in a tight loop.

    .venv/bin/python bench/qos_overhead.py [--readers 32] [--seconds 0.5] [--rounds 20] [--block 4096] [--uvloop]

In-process: no server, no sockets. The figure is the layer's cost against the least a command can cost in
Python; a real `vsan serve` adds the protocol's work per command, so its ratio is closer to 1 (docs/benchmarks.md
has the A/B with an initiator)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from openvsan.block.ram import RamDevice
from openvsan.volume import Volume
from openvsan.volume.qos import QosLayer, QosLimits

SIZE = 256 << 20
FAR_ABOVE = QosLimits(iops_limit=1e9, bps_limit=1e15, read_iops_limit=1e9, read_bps_limit=1e15)


def volumes(block: int) -> tuple[Volume, Volume]:
    a = Volume(RamDevice(SIZE // 512, 512, name="a"), name="plain")
    b = Volume(QosLayer(RamDevice(SIZE // 512, 512, name="b"), FAR_ABOVE), name="qos")
    return a, b


async def round_of(vol: Volume, readers: int, seconds: float, blocks: int) -> float:
    """Reads per second with `readers` concurrent readers."""
    end = time.perf_counter() + seconds
    counts = [0] * readers
    span = vol.num_blocks - blocks

    async def reader(i: int) -> None:
        rng = random.Random(i)
        n = 0
        read_now, read = vol.read_now, vol.read
        while time.perf_counter() < end:
            lba = rng.randrange(span)
            if read_now(lba, blocks) is None:
                await read(lba, blocks)
            n += 1
            await asyncio.sleep(0)
        counts[i] = n

    t0 = time.perf_counter()
    await asyncio.gather(*(reader(i) for i in range(readers)))
    return sum(counts) / (time.perf_counter() - t0)


def call_cost(vol: Volume, blocks: int, calls: int = 300_000) -> float:
    """Nanoseconds per read_now call, in a tight loop."""
    read_now, lbas = vol.read_now, [random.randrange(vol.num_blocks - blocks) for _ in range(1024)]
    t0 = time.perf_counter()
    for i in range(calls):
        read_now(lbas[i & 1023], blocks)
    return (time.perf_counter() - t0) / calls * 1e9


async def main(args: argparse.Namespace) -> dict[str, float]:
    blocks = args.block // 512
    a, b = volumes(args.block)
    for vol in (a, b):                         # touch every page once, so neither pays first faults
        await vol.write(0, bytes(SIZE))
        await round_of(vol, args.readers, 0.3, blocks)
    # each round is a pair, A then B or B then A by turns; the ratio of each pair, then their median, so
    # that a neighbour's load that comes and goes touches both halves of a pair alike
    rates: dict[str, list[float]] = {"plain": [], "qos": []}
    ratios, ns_ratios = [], []
    ns: dict[str, list[float]] = {"plain": [], "qos": []}
    for r in range(args.rounds):
        pair = {}
        for vol in ((a, b) if r % 2 == 0 else (b, a)):
            pair[vol.name] = await round_of(vol, args.readers, args.seconds, blocks)
            rates[vol.name].append(pair[vol.name])
        ratios.append(pair["qos"] / pair["plain"])
        cost = {vol.name: call_cost(vol, blocks, 50_000) for vol in ((a, b) if r % 2 == 0 else (b, a))}
        for k, v in cost.items():
            ns[k].append(v)
        ns_ratios.append(cost["qos"] - cost["plain"])
    stats = b.stack.stats()                    # type: ignore[attr-defined]
    assert stats["throttled"] == 0, "the limits were reached: raise FAR_ABOVE"
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"readers": args.readers, "block": args.block, "rounds": args.rounds,
            "plain_iops": statistics.median(rates["plain"]), "qos_iops": statistics.median(rates["qos"]),
            "ratio": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
            "plain_read_now_ns": statistics.median(ns["plain"]), "qos_read_now_ns": statistics.median(ns["qos"]),
            "added_ns": statistics.median(ns_ratios)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--readers", type=int, default=32)
    p.add_argument("--seconds", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--uvloop", action="store_true", help="run on uvloop, as `vsan serve` does when installed")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.uvloop:
        import uvloop
        uvloop.install()
    out = asyncio.run(main(args))
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.block} B reads, {args.readers} readers, {args.rounds} rounds of {args.seconds:g} s each (A/B):")
        print(f"  plain RamDevice   {out['plain_iops']:>12,.0f} reads/s   read_now {out['plain_read_now_ns']:6.0f} ns")
        print(f"  QoS over it       {out['qos_iops']:>12,.0f} reads/s   read_now {out['qos_read_now_ns']:6.0f} ns")
        print(f"  ratio QoS / plain {out['ratio']:.3f} (median of {args.rounds} pairs; quartiles "
              f"{out['ratio_q1']:.3f}-{out['ratio_q3']:.3f}), {(1 - out['ratio']) * 100:+.1f} % cost; "
              f"read_now {out['added_ns']:+.0f} ns")
