"""malloc.py: with keep_large_buffers(), a 1 MiB buffer made and dropped over and over is served from the heap
again (its pages stay mapped); with glibc's defaults each one is faulted in anew. Measured by the minor page
faults of a child process (the settings are per process, and this one's must stay as they are)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r'''
import json, resource, sys
from openvsan.malloc import keep_large_buffers
applied = keep_large_buffers() if sys.argv[1] == "tuned" else False
def churn(rounds):
    for _ in range(rounds):
        # what a target does with a queue depth of 1 MiB writes: each arrives as 128 KiB pieces (H2CData),
        # joined into one buffer; then all of them are done
        burst = []
        for _ in range(8):
            chunks = [bytes(128 << 10) for _ in range(8)]
            burst.append(b"".join(chunks))
            del chunks
        del burst
churn(8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(32)
print(json.dumps({"applied": applied, "faults_per_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 256}))
'''


def run(mode: str, **env: str) -> dict[str, float]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "OPENVSAN_MALLOC"}
    r = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True,
                       env={**e, **env}, timeout=60)
    out: dict[str, float] = json.loads(r.stdout)
    return out


def test_large_buffers_are_used_again() -> None:
    tuned, default = run("tuned"), run("default")
    assert tuned["applied"] is True
    # a fresh 1 MiB is 256 pages (and its pieces more); kept on the heap, next to none fault again
    assert default["faults_per_mib"] > 200, default
    assert tuned["faults_per_mib"] < 10, tuned


def test_the_administrators_choice_stands() -> None:
    assert run("tuned", MALLOC_MMAP_THRESHOLD_="131072")["applied"] is False
    assert run("tuned", OPENVSAN_MALLOC="default")["applied"] is False
