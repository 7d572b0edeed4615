#!/usr/bin/env python3
"""What reading the node's desired state costs (openvsan.node.config.parse_config over the typed specs of
node/specs.py), and what it says about bad input: run it in two checkouts to compare a change.

Parse cost, median of N, for examples/single-node.toml and a generated config (2,000 devices and volumes, 1,000
LUNs, 500 NBD exports; each live change parses the node's whole desired state again); the import time of
openvsan.node.config (a `vsan` CLI call pays it). Errors: the one line each of 17 bad inputs gets (one change
each to the example), to diff between checkouts.

The choice of pydantic over msgspec was measured with this script's earlier form and a model of the specs in
each library (bench/spec_parse_bench.py and bench/spec_models/ at a6a01da; docs/benchmarks.md).

    .venv/bin/python bench/config_parse_bench.py [--runs 7] [--only cost|errors]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))

from openvsan.node.config import ConfigError, parse_config

EXAMPLE = REPO / "examples" / "single-node.toml"


def generated(volumes: int = 2000, luns: int = 1000, nbd: int = 500, per_target: int = 100) -> dict[str, Any]:
    """A big node: one RAM device per volume, every tenth volume with QoS, LUNs in targets of `per_target`."""
    doc: dict[str, Any] = {"node": {"name": "big"}}
    doc["devices"] = [{"name": f"ram{i}", "type": "ram", "size": "1GiB", "block_size": 512} for i in range(volumes)]
    doc["volumes"] = [{"name": f"vol{i}", "device": f"ram{i}"} for i in range(volumes)]
    for v in doc["volumes"][::10]:
        v["qos"] = {"read_iops_limit": 1000, "read_iops_burst": 2000, "bps_limit": "100MB"}
    doc["iscsi"] = {"portals": ["127.0.0.1:3260"], "targets": [
        {"iqn": f"iqn.2026-11.org.openvsan:t{t}",
         "luns": [{"lun": j, "volume": f"vol{t * per_target + j}"} for j in range(min(per_target, luns - t * per_target))]}
        for t in range((luns + per_target - 1) // per_target)]}
    doc["nbd"] = {"portals": ["127.0.0.1:10809"],
                  "exports": [{"name": f"e{i}", "volume": f"vol{luns + i}"} for i in range(nbd)]}
    return doc


def median_s(fn: Callable[[], Any], runs: int, inner: int = 1) -> float:
    fn()  # warm: caches, lazy imports
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def import_ms(stmt: str, runs: int) -> float:
    """Wall time of a fresh interpreter that runs `stmt`, less one that runs nothing."""
    py = sys.executable
    env_path = f"{REPO / 'src'}"

    def once(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([py, "-c", f"import sys; sys.path[:0] = {env_path.split(':')!r}; {code}"], check=True)
        return time.perf_counter() - t0
    base = statistics.median(once("pass") for _ in range(runs))
    return (statistics.median(once(stmt) for _ in range(runs)) - base) * 1e3


def cost(runs: int) -> None:
    small = tomllib.loads(EXAMPLE.read_text())
    big = generated()
    n_luns = sum(len(t["luns"]) for t in big["iscsi"]["targets"])
    print(f"# parse_config, median of {runs} (small: {EXAMPLE.name}; big: {len(big['volumes'])} volumes, {n_luns} "
          f"LUNs, {len(big['nbd']['exports'])} NBD exports)")
    s = median_s(lambda: parse_config(small), runs, inner=200) * 1e6
    b = median_s(lambda: parse_config(big), runs) * 1e3
    print(f"small: {s:.1f} us   big: {b:.1f} ms")
    print(f"import openvsan.node.config: {import_ms('import openvsan.node.config', 5):.1f} ms (fresh interpreter, "
          "median of 5, less an empty one)")


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        d = doc
        for k in path[:-1]:
            d = d[k]
        if value is _DROP:
            del d[path[-1]]
        else:
            d[path[-1]] = value
    return mutate


_DROP = object()
T0 = ["iscsi", "targets", 0]
BAD: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("unknown key, a typo", _set(["volumes", 0, "read_onyl"], True)),
    ("wrong type (string for int)", _set(["devices", 0, "block_size"], "512")),
    ("bool for an int", _set(["node", "poll_us"], True)),
    ("bad size string", _set(["devices", 0, "size"], "1 GiBs")),
    ("negative QoS limit", _set(["volumes", 0, "qos"], {"read_iops_limit": -5})),
    ("burst below limit", _set(["volumes", 0, "qos"], {"read_iops_limit": 100, "read_iops_burst": 50})),
    ("bad enum (device type)", _set(["devices", 0, "type"], "rom")),
    ("key of another device type", _set(["devices", 0, "path"], "/tmp/x.img")),
    ("missing required key (iqn)", _set([*T0, "iqn"], _DROP)),
    ("extra key in a nested table", _set([*T0, "luns"], [{"lun": 0, "volume": "disk0", "lnu": 1}])),
    ("LUN out of range", _set([*T0, "luns"], [{"lun": 20000, "volume": "disk0"}])),
    ("bad portal (port)", _set(["iscsi", "portals"], ["127.0.0.1:99999"])),
    ("bad IQN (month 13)", _set([*T0, "iqn"], "iqn.2026-13.org.openvsan:disk0")),
    ("bad NQN", _set(["nvme", "subsystems", 0, "nqn"], "nqn.disk0")),
    ("bad enum (NBD tls)", _set(["nbd", "exports", 0, "tls"], "maybe")),
    ("a table where a list goes", _set(["volumes"], {"name": "disk0", "device": "ram0"})),
    ("unknown volume (cross-object)", _set([*T0, "luns"], [{"lun": 0, "volume": "disk9"}])),
]


def _line(doc: dict[str, Any]) -> str:
    try:
        parse_config(doc)
    except ConfigError as e:
        return str(e)
    return "(accepted)"


def errors() -> None:
    base = tomllib.loads(EXAMPLE.read_text())
    for what, mutate in BAD:
        doc = copy.deepcopy(base)
        mutate(doc)
        print(f"{what:32} {_line(doc)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--only", choices=("cost", "errors"))
    a = ap.parse_args()
    if a.only != "errors":
        cost(a.runs)
        print()
    if a.only != "cost":
        errors()


if __name__ == "__main__":
    main()
