"""The shape of `vsan bench --json`'s document (openvsan/bench/report.py), checked by the unit tier on
simulated time and by the integration tier through the CLI."""

from __future__ import annotations

from typing import Any

SIDE = {"ops": int, "bytes": int, "iops": float, "mbps": float,
        "latency_us": {k: float for k in ("mean", "min", "p50", "p90", "p99", "p99.9", "max")}}
RUN = {
    "target": str, "round": int, "elapsed_s": float,
    "job": {"name": str, "pattern": str, "bs": int, "write_pct": int, "threads": int, "qd": int, "rw": str},
    "device": {"block_size": int, "num_blocks": int},
    "read": SIDE, "write": SIDE, "total": SIDE,
    "cpu": {"bench_pct": float, "target_pct": (float, type(None))},
    "errors": {"io": int, "verify": int, "first": list},
    "timeseries": list, "histogram_us": list,
}
DOC = {"schema_version": int, "tool": str, "version": str, "started": str, "host": {"hostname": str, "python": str},
       "options": dict, "runs": list, "compare": (list, type(None))}
POINT = {"t": float, "iops": float, "mbps": float, "lat_mean_us": float, "lat_p99_us": float, "lat_max_us": float}


def conforms(value: Any, schema: Any, where: str = "$") -> None:
    if isinstance(schema, dict):
        assert isinstance(value, dict), where
        assert set(value) == set(schema), f"{where}: keys {sorted(value)} != {sorted(schema)}"
        for k, sub in schema.items():
            conforms(value[k], sub, f"{where}.{k}")
    elif schema is float:
        assert isinstance(value, (int, float)) and not isinstance(value, bool), where
    else:
        assert isinstance(value, schema), f"{where}: {type(value).__name__}"
