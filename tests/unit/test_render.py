"""node/render.py: a NodeConfig as its config document, which node/config.py parses back to the same config
(the live node edits desired state this way, so every field must survive the round trip)."""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from pathlib import Path

import pytest
from config_strategies import node_configs
from hypothesis import HealthCheck, given, settings

from openvsan.node.config import load_config, parse_config
from openvsan.node.render import config_document
from openvsan.node.specs import NodeConfig

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))


def round_trip(cfg: NodeConfig) -> NodeConfig:
    doc = config_document(cfg)
    kept = copy.deepcopy(doc)
    back = parse_config(doc)
    assert doc == kept, "parse_config changed the document it read"
    return back


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_round_trip(path: Path) -> None:
    cfg = load_config(path, data_dir=Path("/var/lib/openvsan-test"))
    assert round_trip(cfg) == cfg


def test_examples_are_there() -> None:
    assert {p.name for p in EXAMPLES} >= {"single-node.toml", "raid5.toml"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(node_configs)
def test_random_configs_round_trip(cfg: NodeConfig) -> None:
    back = round_trip(cfg)
    # field by field first, so a failure names the part that did not come back
    for f in dataclasses.fields(NodeConfig):
        assert getattr(back, f.name) == getattr(cfg, f.name), f.name
    assert back == cfg
    assert config_document(back) == config_document(cfg)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(node_configs)
def test_random_documents_hold_only_toml_values(cfg: NodeConfig) -> None:
    """Only what TOML can hold: tables, arrays, strings, integers, floats and booleans (no None, no Path)."""

    def check(v: object) -> None:
        if isinstance(v, dict):
            for x in v.values():
                check(x)
        elif isinstance(v, list):
            for x in v:
                check(x)
        else:
            assert isinstance(v, str | int | float | bool), repr(v)

    check(config_document(cfg))


def test_example_file_text_equals_its_document(tmp_path: Path) -> None:
    """The example read from its TOML text and from its rendered document are the same config."""
    path = EXAMPLES[0]
    with path.open("rb") as f:
        raw = tomllib.load(f)
    data_dir = Path("/var/lib/openvsan-test")
    assert parse_config(raw, base_dir=path.parent, data_dir=data_dir) == parse_config(
        config_document(load_config(path, data_dir=data_dir)), data_dir=data_dir)
