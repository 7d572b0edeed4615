#!/usr/bin/env python3
"""Serve RAM namespaces over NVMe/TCP with NvmeTcpServer alone (no node, no config, no store): for
measuring the NVMe/TCP target by itself and for poking at it by hand. The tests use `vsan serve`.

    nvme_serve.py --port 4420 --nqn nqn.2026-11.org.openvsan:disk0 --size 256MiB [--block-size 512]
                  [--namespaces 1] [--allow-host NQN ...] [--ready-file PATH]

SIGTERM/SIGINT: stop accepting, drain, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from openvsan.block import RamDevice
from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
from openvsan.frontend.nvme_tcp import NvmeTcpServer
from openvsan.volume import Volume

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def size_of(text: str) -> int:
    for suffix, mult in UNITS.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * mult
    return int(text)


async def main(args: argparse.Namespace) -> None:
    nss = []
    for i in range(args.namespaces):
        dev = RamDevice(size_of(args.size) // args.block_size, args.block_size)
        nss.append(NvmeNamespaceConfig(i + 1, Volume(dev, name=f"ram{i}", uuid=uuid.uuid5(uuid.NAMESPACE_URL, f"{args.nqn}/{i}"))))
    sub = NvmeSubsystemConfig(args.nqn, nss, [(args.host, args.port)], allowed_hosts=args.allow_host or None,
                              serial="openvsan-test")
    server = NvmeTcpServer([sub])
    await server.start()
    if args.ready_file:
        Path(args.ready_file).write_text(str(os.getpid()))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4420)
    p.add_argument("--nqn", default="nqn.2026-11.org.openvsan:disk0")
    p.add_argument("--size", default="256MiB")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--namespaces", type=int, default=1)
    p.add_argument("--allow-host", action="append")
    p.add_argument("--ready-file")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args()
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)-5s %(name)s: %(message)s")
    if a.loop == "uvloop":
        import uvloop

        uvloop.run(main(a))
    else:
        asyncio.run(main(a))
