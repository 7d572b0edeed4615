#!/usr/bin/env python3
"""Which typed-spec library for the node's desired state (issue 11): pydantic v2 or msgspec, by parse cost and by
the quality of their errors, beside today's hand-written parser (openvsan.node.config.parse_config).

Parse cost, median of N, for examples/single-node.toml and a generated config (2,000 devices and volumes, 1,000
LUNs, 500 NBD exports): today's parse_config (field and cross-object checks together), each library's field-level
parse alone, and with our cross-object checks (bench/spec_models/common.py) after it, which is what a conversion
would run. Also: the import time of each library and spec module (a `vsan` CLI call pays it), and the parse of
one control-socket request, a volume.create body, from a dict and from its JSON bytes.

Error quality: for bad inputs (one change each to the example), what today's parser says, what each library
says raw, and what our mapping to `<path>: <what is wrong>; <mend>` makes of it.

    .venv/bin/python bench/spec_parse_bench.py [--runs 7] [--only cost|errors]
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
sys.path.insert(0, str(HERE))

import msgspec
import pydantic
from spec_models import common
from spec_models import msgspec_specs as M
from spec_models import pydantic_specs as P

from openvsan.node.config import ConfigError, parse_config
from openvsan.node.values import check_object_name, parse_size

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
    env_path = f"{REPO / 'src'}:{HERE}"

    def once(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([py, "-c", f"import sys; sys.path[:0] = {env_path.split(':')!r}; {code}"], check=True)
        return time.perf_counter() - t0
    base = statistics.median(once("pass") for _ in range(runs))
    return (statistics.median(once(stmt) for _ in range(runs)) - base) * 1e3


def pyd(doc: dict[str, Any]) -> Any:
    return P.parse(doc)


def pyd_cross(doc: dict[str, Any]) -> Any:
    cfg = P.parse(doc)
    common.cross_check(cfg)
    return cfg


def msg(doc: dict[str, Any]) -> Any:
    return M.parse(doc)


def msg_cross(doc: dict[str, Any]) -> Any:
    cfg = M.parse(doc)
    common.cross_check(cfg)
    return cfg


def today_volume_create(args: dict[str, Any]) -> None:
    """What node/live.py checks of a volume.create body before it re-parses the whole document."""
    check_object_name(args["name"])
    parse_size(args["size"])
    if args.get("backing", "ram") not in ("ram", "file"):
        raise ValueError(args["backing"])


def cost(runs: int) -> None:
    small = tomllib.loads(EXAMPLE.read_text())
    big = generated()
    n_luns = sum(len(t["luns"]) for t in big["iscsi"]["targets"])
    print(f"# parse cost, median of {runs} (small: {EXAMPLE.name}; big: {len(big['volumes'])} volumes, {n_luns} LUNs, "
          f"{len(big['nbd']['exports'])} NBD exports)")
    print(f"{'parser':44} {'small (us)':>11} {'big (ms)':>10}")
    rows: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("today: parse_config (field + cross checks)", parse_config),
        (f"pydantic {pydantic.VERSION}: field checks", pyd),
        (f"pydantic {pydantic.VERSION}: + our cross checks", pyd_cross),
        (f"msgspec {msgspec.__version__}: field checks", msg),
        (f"msgspec {msgspec.__version__}: + our cross checks", msg_cross),
    ]
    for name, fn in rows:
        s = median_s(lambda fn=fn: fn(small), runs, inner=200) * 1e6
        b = median_s(lambda fn=fn: fn(big), runs) * 1e3
        print(f"{name:44} {s:11.1f} {b:10.1f}")

    body = {"name": "live1", "size": "256MiB", "backing": "ram"}
    raw = msgspec.json.encode(body)
    print("\n# one control-socket request: a volume.create body (us, median)")
    inner = 20000
    for name, fn in (
            ("today: live.py's argument checks", lambda: today_volume_create(body)),
            ("pydantic: VolumeCreate.model_validate(dict)", lambda: P.VolumeCreate.model_validate(body)),
            ("pydantic: VolumeCreate.model_validate_json(bytes)", lambda: P.VolumeCreate.model_validate_json(raw)),
            ("msgspec: convert(dict)", lambda: msgspec.convert(body, M.VolumeCreate, dec_hook=M.dec_hook)),
            ("msgspec: json Decoder.decode(bytes)", lambda: M.parse_volume_create_json(raw))):
        print(f"{name:52} {median_s(fn, runs, inner=inner) * 1e6:8.2f}")
    t = median_s(lambda: parse_config(small), runs, inner=200) * 1e6
    print(f"{'(today live.py then re-parses the whole doc: small)':52} {t:8.1f}")

    print("\n# import time (ms, fresh interpreter, median of 5, less an empty one)")
    for name, stmt in (("openvsan.node.config (today)", "import openvsan.node.config"),
                       ("pydantic", "import pydantic"),
                       ("msgspec", "import msgspec"),
                       ("spec_models.pydantic_specs (library + 25 models)", "import spec_models.pydantic_specs"),
                       ("spec_models.msgspec_specs (library + 25 structs)", "import spec_models.msgspec_specs"),
                       ("fastapi (if installed)", ("import importlib.util as u; u.find_spec('fastapi') and "
                                                   "__import__('fastapi')"))):
        print(f"{name:52} {import_ms(stmt, 5):8.1f}")


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


def _today(doc: dict[str, Any]) -> str:
    try:
        parse_config(doc)
    except ConfigError as e:
        return str(e)
    return "(accepted)"


def _pydantic(doc: dict[str, Any]) -> tuple[str, str]:
    try:
        pyd_cross(doc)
    except pydantic.ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        raw = f"{'.'.join(map(str, first['loc']))}: {first['msg']}" + (f" (+{len(errs) - 1} more)" if len(errs) > 1
                                                                        else "")
        return raw, P.one_line(e, doc)
    except common.CrossError as e:
        return "(passed: ours)", str(e)
    return "(accepted)", "(accepted)"


def _msgspec(doc: dict[str, Any]) -> tuple[str, str]:
    try:
        msg_cross(doc)
    except msgspec.ValidationError as e:
        return str(e), M.one_line(e, doc)
    except common.CrossError as e:
        return "(passed: ours)", str(e)
    return "(accepted)", "(accepted)"


def errors() -> None:
    base = tomllib.loads(EXAMPLE.read_text())
    same_p = same_m = 0
    for what, mutate in BAD:
        doc = copy.deepcopy(base)
        mutate(doc)
        today = _today(doc)
        p_raw, p_ours = _pydantic(doc)
        m_raw, m_ours = _msgspec(doc)
        same_p += p_ours == today
        same_m += m_ours == today
        print(f"## {what}")
        print(f"  today          {today}")
        print(f"  pydantic raw   {p_raw}")
        print(f"  pydantic ours  {p_ours}{'   [= today]' if p_ours == today else ''}")
        print(f"  msgspec raw    {m_raw}")
        print(f"  msgspec ours   {m_ours}{'   [= today]' if m_ours == today else ''}")
    print(f"\nmapped line identical to today's: pydantic {same_p}/{len(BAD)}, msgspec {same_m}/{len(BAD)}")


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
