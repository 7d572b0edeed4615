"""The bench worker's --rate on the real clock: half a second at 400 requests/s gets about 200."""

from __future__ import annotations

from openvsan.bench.engine import Plan
from openvsan.bench.profiles import custom_job
from openvsan.bench.runner import run_in_process
from openvsan.block import RamDevice


def test_rate_limits_requests() -> None:
    plan = Plan("ram", custom_job("randread", "4k", qd=8), duration=0.5, rate=400)
    res = run_in_process(RamDevice(2048), plan).result
    assert 160 <= res.read.count <= 220, res.read.count
