"""How many inputs each fuzz test runs, and the running total (reported at the end of the session).

CI runs the default counts (together well over 100,000 inputs in a couple of minutes on 2 cores). The
`soak` variants take their count from FUZZ_INPUTS (per test, default 1,000,000). Every random loop runs
over fixed seeds, so a failure names the seed and input index that reproduce it.
"""

from __future__ import annotations

import os

SEEDS = (1, 2, 3, 0x5EED, 20261130)
TOTAL = {"inputs": 0}


def count(n: int = 1) -> None:
    TOTAL["inputs"] += n


def soak_inputs() -> int:
    return int(os.environ.get("FUZZ_INPUTS", "1000000"))


def hypothesis_examples(default: int) -> int:
    """Hypothesis examples per test: FUZZ_HYPOTHESIS_EXAMPLES overrides the CI default."""
    return int(os.environ.get("FUZZ_HYPOTHESIS_EXAMPLES", str(default)))
