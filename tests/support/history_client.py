"""A writer client for fault tests, run as its own process (inside a Lab namespace, where the test process
cannot reach): writers (history.py) over one volume's paths, each event appended to --log as it happens,
until SIGTERM; then the writes in flight finish and it exits 0.

    python history_client.py --log H.jsonl --writers 2 --extent 8 --first 0 --count 16384 URL [URL...]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from history import Recorder, Writer, stripe

from openvsan.initiator import open_url


async def main(a: argparse.Namespace) -> int:
    dev = await open_url(a.urls, no_path_retry=a.no_path_retry) if len(a.urls) > 1 else await open_url(a.urls[0])
    rec = Recorder(dev.block_size, log=a.log, meta={"urls": a.urls}, keep=False)   # the log is the history
    writers = [Writer(dev, rec, i, ext, concurrency=a.concurrency, seed=i)
               for i, ext in enumerate(stripe(a.first, a.count, writers=a.writers, blocks=a.extent))]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    tasks = [asyncio.create_task(w.run()) for w in writers]
    print("@@WRITING", flush=True)
    await stop.wait()
    for w in writers:
        w.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), a.no_path_retry + 30)
    rec.close()
    await dev.close()
    print(f"@@DONE acked={sum(w.acked for w in writers)} failed={sum(w.failed for w in writers)}", flush=True)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("urls", nargs="+")
    p.add_argument("--log", required=True)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--extent", type=int, default=8)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int, default=8192)
    p.add_argument("--no-path-retry", type=float, default=60.0)
    sys.exit(asyncio.run(main(p.parse_args())))
