"""The typed specs (node/specs.py): one declaration for the TOML file, the control socket, the store and the REST
API to come. A spec built in code passes the checks a config gets; a JSON body reads as the TOML text does; the
schema a REST API publishes comes from them; and no input, however wrong, gets past the one-line error."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from openvsan.node.config import ConfigError, parse_config
from openvsan.node.specs import (
    ConfigDocument,
    DeviceSpec,
    LunSpec,
    NodeConfig,
    NodeSettings,
    PoolSpec,
    TargetSpec,
    VolumeSpec,
)
from openvsan.node.values import Portal

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "single-node.toml"
DOC = tomllib.loads(EXAMPLE.read_text())
P = (Portal("127.0.0.1", 3260),)


@pytest.mark.parametrize("make, why", [
    (lambda: DeviceSpec("a b", "ram", 512), "not a usable name"),
    (lambda: DeviceSpec("a", "tape", 512), "unknown device type"),
    (lambda: DeviceSpec("a", "ram", 1000), "whole number of 512-byte blocks"),
    (lambda: DeviceSpec("a", "ram", None), "a ram device needs a size"),
    (lambda: DeviceSpec("a", "ram", "1GiB"), None),         # a size reads as in a config
    (lambda: PoolSpec("p", "raid5", ("a", "b")), "raid5 needs at least 3 members"),
    (lambda: VolumeSpec("v", "d", pool="p"), "names both device"),
    (lambda: TargetSpec("iqn.2026-11.org.x:t", (), P), "missing or empty"),
    (lambda: TargetSpec("iqn.2026-11.org.x:t", (LunSpec(0, "v"), LunSpec(0, "w")), P), "LUN 0 is already used"),
    (lambda: TargetSpec("iqn.2026-11.org.x:t", (LunSpec(16384, "v"),), P), "16384 is out of range"),
    (lambda: NodeSettings("n", max_connections=10), "it cannot be above max_connections = 10"),
    (lambda: NodeSettings("n", poll_us="50"), "Input should be a valid integer"),   # strict: no "50" -> 50
])
def test_a_spec_built_in_code_is_checked(make: Any, why: str | None) -> None:
    if why is None:
        assert make().size == 1 << 30
        return
    with pytest.raises(ValidationError, match=why):
        make()


def test_luns_sort_by_number_and_keep_the_written_place_in_errors() -> None:
    t = TargetSpec("iqn.2026-11.org.x:t", (LunSpec(5, "a"), LunSpec(2, "b")), P)
    assert [x.lun for x in t.luns] == [2, 5]
    doc = copy.deepcopy(DOC)
    doc["iscsi"]["targets"][0]["luns"] = [{"lun": 5, "volume": "disk0"}, {"lun": 2, "volume": "nope"}]
    with pytest.raises(ConfigError, match=r"^iscsi\.targets\[0\]\.luns\[1\]\.volume: unknown volume \"nope\""):
        parse_config(doc)


def test_a_json_body_reads_as_the_toml_text() -> None:
    """The control socket and a REST API get JSON: the same document, the same specs."""
    assert parse_config(json.loads(json.dumps(DOC))) == parse_config(DOC)
    doc = TypeAdapter(ConfigDocument).validate_json(json.dumps(DOC), context={"document": True})
    assert doc.iscsi is not None and doc.iscsi.targets[0].portals == (Portal("127.0.0.1", 3260),)


def test_the_schema_names_every_object_and_writes_portals_as_text() -> None:
    schema = TypeAdapter(ConfigDocument).json_schema()
    defs = schema["$defs"]
    for name in ("NodeSettings", "DeviceSpec", "PoolSpec", "VolumeSpec", "TargetSpec", "LunSpec", "ChapSpec",
                 "SubsystemSpec", "NamespaceSpec", "HostAuthSpec", "NbdExportSpec", "NbdTlsSpec"):
        assert name in defs, name
    assert defs["TargetSpec"]["properties"]["portals"]["items"]["type"] == "string"
    assert set(defs["TargetSpec"]["required"]) == {"iqn", "luns", "portals"}
    out = json.loads(TypeAdapter(NodeConfig).dump_json(parse_config(DOC)))
    assert out["targets"][0]["portals"] == ["127.0.0.1:3260"]


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*at, i))
    return out


SECRET = "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"
HOST = "nqn.2014-08.org.nvmexpress:uuid:0c9a1d3e-1234-4567-89ab-0123456789ab"
# every kind of table and value a config holds, valid as it stands
RICH: dict[str, Any] = {
    "node": {"name": "n1", "poll_us": 20, "max_connections": 100, "auth_delay_max": 1.5},
    "devices": [{"name": f"m{i}", "type": "ram", "size": "64MiB"} for i in range(4)]
    + [{"name": "f0", "type": "file", "path": "/tmp/f0.img", "size": 1 << 20, "direct": False},
       {"name": "n0", "type": "null", "size": "1GiB", "block_size": 4096}],
    "pools": [{"name": "p0", "level": "raid5", "members": ["m0", "m1", "m2"], "spares": ["m3"], "chunk": "64KiB",
               "rebuild_rate": "100MiB/s"}],
    "volumes": [{"name": "v0", "pool": "p0", "qos": {"read_iops_limit": 1000, "bps_limit": "100MB"}},
                {"name": "v1", "device": "f0", "read_only": True}, {"name": "v2", "device": "n0"}],
    "iscsi": {"portals": ["127.0.0.1:3260"], "advertised_portals": ["192.0.2.1:3260"], "targets": [
        {"iqn": "iqn.2026-11.org.x:t0", "luns": [{"lun": 0, "volume": "v0"}, {"lun": 3, "volume": "v1"}],
         "allowed_initiators": ["iqn.2026-11.org.x:i0"], "chap": {"user": "u", "secret": "twelve+chars"},
         "mutual_chap": {"user": "t", "secret": "other+secret"}, "alias": "a", "portal_group_tag": 2}]},
    "nvme": {"portals": ["127.0.0.1:4420"], "subsystems": [
        {"nqn": "nqn.2026-11.org.x:s0", "namespaces": [{"nsid": 1, "volume": "v2"}], "serial": "SN",
         "model": "M", "allowed_hosts": [HOST], "hosts": [{"nqn": HOST, "dhchap_secret": SECRET}],
         "dhchap_hashes": ["sha256"], "dhchap_dhgroups": ["null", "ffdhe2048"]}]},
    "nbd": {"portals": ["127.0.0.1:10809"], "tls": {"cert": "c.pem", "key": "k.pem", "ca": "ca.pem",
                                                    "verify_client": True},
            "exports": [{"name": "e0", "volume": "v1", "read_only": True, "description": "d"}]},
}
PATHS = [p for p in _paths(RICH) if p]
KEY_PATH = re.compile(r"^[a-z_]+(\[\d+\]|\.[a-z_]+)*(: | )")   # the line starts by naming the key


def test_the_rich_document_is_valid() -> None:
    cfg = parse_config(copy.deepcopy(RICH))
    assert cfg.volume("v0").qos == {"read_iops_limit": 1000, "bps_limit": 100_000_000}
    assert cfg.nbd_exports[0].tls == "require" and cfg.pools[0].rebuild_rate == 100 << 20
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                 st.text(max_size=12), st.lists(st.integers(), max_size=3), st.just({}),
                 st.dictionaries(st.sampled_from(["name", "x", "volume", "lun", "type"]), st.integers(), max_size=2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(PATHS), JUNK, st.booleans()), min_size=1, max_size=3))
def test_any_wrong_value_gets_one_line(edits: list[tuple[tuple[Any, ...], Any, bool]]) -> None:
    """Values replaced with junk, or keys dropped: the document parses, or ConfigError says one line naming a
    key path; never a pydantic dump or another exception."""
    doc = copy.deepcopy(RICH)
    for path, junk, drop in edits:
        parent: Any = doc
        try:
            for seg in path[:-1]:
                parent = parent[seg]
            if drop and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = junk
        except (KeyError, IndexError, TypeError):
            continue
    try:
        parse_config(doc)
    except ConfigError as e:
        line = str(e)
        assert "\n" not in line and KEY_PATH.match(line) and "validation error" not in line, line
        assert "pydantic" not in line and "Input should" not in line, line


@pytest.mark.parametrize("kw, why", [
    ({"compression": "lz4"}, "compression is for a thin volume carved"),
    ({"compression": "lz4", "size": "1GiB", "thin": False}, "compression is for a thin volume carved"),
    ({"compression": "lz4", "size": 1000 * 1024}, "multiple of its 64 KiB chunks, e.g. 1.0 MiB"),
    ({"compression": "brotli", "size": "1GiB"}, 'use "lz4", "zstd" or "zstd:LEVEL"'),
    ({"compression": "zstd:40", "size": "1GiB"}, "a zstd level is 1 to 19"),
    ({"compression": "lz4", "size": "1GiB", "encryption": {"key_file": "/k"}}, "add allow_discards = true"),
    ({"compression": "lz4", "size": "1GiB", "compression_chunk": "8KiB"}, "8.0 KiB: use one of 16.0 KiB"),
    ({"size": "1GiB", "compression_chunk": "16KiB"}, "compression_chunk is for a compressed volume"),
    ({"compression": "lz4", "size": 48 << 10, "compression_chunk": "32KiB"}, "multiple of its 32 KiB chunks"),
    ({"size": "1GiB", "compression_frame": "4KiB"}, "compression_frame is for a compressed volume"),
    ({"size": "1GiB", "compression_cache": "64MiB"}, "compression_cache is for a compressed volume"),
    ({"compression": "lz4", "size": "1GiB", "compression_frame": "6KiB"}, "frame size 6144: use 0"),
    ({"compression": "lz4", "size": "1GiB", "compression_chunk": "16KiB", "compression_frame": "16KiB"},
     "4 KiB, 8 KiB (smaller than the 16 KiB chunk)"),
    ({"size": "1GiB", "replicas": 2, "nodes": ("a", "b"), "encryption": {"prompt": True}},
     "give its encryption a key_file or key_command"),
])
def test_compressed_volumes_are_checked(kw: dict[str, Any], why: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(why)):
        VolumeSpec("v", "d", **kw)


def test_replicated_volumes_and_served_snapshots_take_encryption_and_compression() -> None:
    """Each replica node keeps the layers in its own stack; a snapshot of such a volume is read through the
    same layers (read-only)."""
    crypt = {"key_file": "/k", "allow_discards": True}
    v = VolumeSpec("v", "d", size="1GiB", compression="lz4", encryption=crypt, replicas=2, nodes=("a", "b"))
    assert [x["type"] for x in v.layers] == ["crypt", "compress"]
    s = VolumeSpec("s", "d", snapshot=True, read_only=True, compression="lz4", encryption=crypt)
    assert [x["type"] for x in s.layers] == ["crypt", "compress"] and s.carved_size is None


def test_a_compressed_volumes_chunk_is_in_its_layer_and_its_carved_size() -> None:
    from openvsan.volume.compress import backing_size

    v = VolumeSpec("v", "d", size="1GiB", compression="lz4", compression_chunk="16KiB")
    assert v.layers == [{"type": "compress", "algorithm": "lz4", "chunk_size": 16 << 10}]
    assert v.carved_size == backing_size(1 << 30, 16 << 10) > backing_size(1 << 30)   # a slot is chunk + 4 KiB
    assert VolumeSpec("v", "d", size=48 << 10, compression="lz4", compression_chunk="16KiB").chunk_bytes == 16 << 10
    # its frames: in the layer when given, 0 (one stream per chunk) included
    for written, want in (("4KiB", 4096), (0, 0), ("0", 0)):
        v = VolumeSpec("v", "d", size="1GiB", compression="lz4", compression_frame=written)
        assert v.layers == [{"type": "compress", "algorithm": "lz4", "frame_size": want}], written
    # its write cache: in the layer when given, 0 (none) included
    for written, want in (("64MiB", 64 << 20), (0, 0)):
        v = VolumeSpec("v", "d", size="1GiB", compression="lz4", compression_cache=written)
        assert v.layers == [{"type": "compress", "algorithm": "lz4", "cache_size": want}], written


def test_a_compressed_volume_sits_above_its_encryption_and_takes_two_slots_per_chunk() -> None:
    from openvsan.volume.compress import backing_size
    from openvsan.volume.luks2 import DATA_OFFSET

    v = VolumeSpec("v", "d", size="1GiB", compression="zstd:5",
                   encryption={"key_file": "/k", "allow_discards": True})
    assert [x["type"] for x in v.layers] == ["crypt", "compress"]
    assert v.layers[1] == {"type": "compress", "algorithm": "zstd:5"}
    assert v.carved_size == backing_size(1 << 30) + DATA_OFFSET
    assert VolumeSpec("w", "d", size="1GiB").carved_size == 1 << 30
