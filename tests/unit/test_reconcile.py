"""node/reconcile.py plan(): for random pairs of valid configs that differ only in what may change while
serving, the plan carried out change by change on a model of the node (plain dicts, here) reaches the
desired state, in an order that never leaves an export without its volume, a volume without its device or a
LUN or namespace without its target or subsystem; every change's inverse undoes it (what Node.apply relies on
to roll back a failure half-way); what cannot change while serving is refused in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from config_strategies import configs, grow_only, universes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openvsan.node.config import parse_config
from openvsan.node.reconcile import Change, PlanRefused, plan, without_children
from openvsan.node.specs import NodeConfig


def examples(n: int) -> Any:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.data_too_large])

# model table per change kind; a LUN or namespace is keyed (parent, number)
TABLES = {"device": "devices", "volume": "volumes", "target": "targets", "lun": "luns", "subsystem": "subsystems",
          "namespace": "namespaces", "nbd export": "nbd"}


def model_of(cfg: NodeConfig) -> dict[str, dict[Any, Any]]:
    """What a node serving `cfg` holds, as the plan's changes see it: targets and subsystems without their
    children, which are objects of their own."""
    return {
        "devices": {d.name: d for d in cfg.devices},
        "volumes": {v.name: v for v in cfg.volumes},
        "targets": {t.iqn: without_children(t, "luns") for t in cfg.targets},
        "luns": {(t.iqn, str(x.lun)): x for t in cfg.targets for x in t.luns},
        "subsystems": {s.nqn: without_children(s, "namespaces") for s in cfg.subsystems},
        "namespaces": {(s.nqn, str(x.nsid)): x for s in cfg.subsystems for x in s.namespaces},
        "nbd": {e.name: e for e in cfg.nbd_exports},
    }


class Unsafe(AssertionError):
    """A change the node could not carry out at this point of the plan."""


def users_of_volume(m: dict[str, dict[Any, Any]], name: str) -> list[str]:
    return ([f"LUN {k}" for k, x in m["luns"].items() if x.volume == name]
            + [f"namespace {k}" for k, x in m["namespaces"].items() if x.volume == name]
            + [f"NBD export {k}" for k, x in m["nbd"].items() if x.volume == name])


def apply(m: dict[str, dict[Any, Any]], c: Change, pools: set[str]) -> None:
    """Carry out one change on the model, checking that the node could do it now."""
    table = m[TABLES[c.kind]]
    key: Any = (c.parent, c.key) if c.kind in ("lun", "namespace") else c.key
    if c.op == "add":
        if key in table:
            raise Unsafe(f"{c}: already there")
        spec = c.new
        if c.kind == "volume" and not (spec.device in m["devices"] or spec.pool in pools):
            raise Unsafe(f"{c}: its device {spec.device} is not there")
        if c.kind in ("lun", "namespace", "nbd export") and spec.volume not in m["volumes"]:
            raise Unsafe(f"{c}: its volume {spec.volume} is not there")
        if c.kind == "lun" and c.parent not in m["targets"]:
            raise Unsafe(f"{c}: its target is not there")
        if c.kind == "namespace" and c.parent not in m["subsystems"]:
            raise Unsafe(f"{c}: its subsystem is not there")
        if c.kind in ("target", "subsystem") and getattr(spec, "luns", ()) + getattr(spec, "namespaces", ()):
            raise Unsafe(f"{c}: a parent is added without its children, which are changes of their own")
        if c.kind == "lun" and c.key != str(spec.lun) or c.kind == "namespace" and c.key != str(spec.nsid):
            raise Unsafe(f"{c}: key and number differ")
        table[key] = spec
        return
    if key not in table:
        raise Unsafe(f"{c}: not there")
    if table[key] != c.old:
        raise Unsafe(f"{c}: what it changes is not what is there ({table[key]} != {c.old})")
    if c.op == "remove":
        if c.kind == "device" and any(v.device == c.key for v in m["volumes"].values()):
            raise Unsafe(f"{c}: a volume still lives on it")
        if c.kind == "volume" and users_of_volume(m, c.key):
            raise Unsafe(f"{c}: still exported as {users_of_volume(m, c.key)}")
        if c.kind == "target" and any(p == c.key for p, _ in m["luns"]):
            raise Unsafe(f"{c}: it still has LUNs")
        if c.kind == "subsystem" and any(p == c.key for p, _ in m["namespaces"]):
            raise Unsafe(f"{c}: it still has namespaces")
        del table[key]
        return
    if c.op == "resize" and c.kind != "device" or c.op == "update" and c.kind not in ("volume", "target", "subsystem"):
        raise Unsafe(f"{c}: the node has no {c.op} of a {c.kind}")
    if c.op == "update" and c.kind == "volume" and (c.new.device, c.new.pool) != (c.old.device, c.old.pool):
        raise Unsafe(f"{c}: moves a volume")
    table[key] = c.new


def copy_model(m: dict[str, dict[Any, Any]]) -> dict[str, dict[Any, Any]]:
    return {k: dict(v) for k, v in m.items()}


pairs = universes().flatmap(lambda u: st.tuples(configs(u), configs(u))).map(lambda ab: (ab[0], grow_only(*ab)))


@examples(100)
@given(pairs)
def test_plan_reaches_desired_state_in_a_safe_order(pair: tuple[NodeConfig, NodeConfig]) -> None:
    actual, desired = pair
    changes = plan(actual, desired)
    pools = {p.name for p in actual.pools}
    m = model_of(actual)
    for c in changes:
        apply(m, c, pools)
    assert m == model_of(desired)
    # and no change is there for nothing
    assert len({(c.op, c.kind, c.parent, c.key) for c in changes}) == len(changes)
    assert all(c.old != c.new for c in changes)
    assert all((c.new.size or 0) >= (c.old.size or 0) for c in changes if c.op == "resize"), "a device shrinks"


@examples(50)
@given(pairs)
def test_inverse_of_every_change_undoes_it(pair: tuple[NodeConfig, NodeConfig]) -> None:
    actual, desired = pair
    pools = {p.name for p in actual.pools}
    m = model_of(actual)
    done = []
    for c in plan(actual, desired):
        before = copy_model(m)
        apply(m, c, pools)
        after = copy_model(m)
        undo = c.inverse()
        assert undo.inverse() == c
        apply(m, undo, pools)
        assert m == before, f"the inverse of {c} did not undo it"
        apply(m, c, pools)
        assert m == after
        done.append(c)
    # a failure after the last change: Node.apply undoes all of them, last first, back to actual
    for c in reversed(done):
        apply(m, c.inverse(), pools)
    assert m == model_of(actual)


@examples(50)
@given(pairs, st.data())
def test_undo_from_any_point_returns_to_actual(pair: tuple[NodeConfig, NodeConfig], data: st.DataObject) -> None:
    actual, desired = pair
    changes = plan(actual, desired)
    failed_at = data.draw(st.integers(0, len(changes)))
    pools = {p.name for p in actual.pools}
    m = model_of(actual)
    for c in changes[:failed_at]:
        apply(m, c, pools)
    for c in reversed(changes[:failed_at]):
        apply(m, c.inverse(), pools)
    assert m == model_of(actual)


@examples(50)
@given(universes().flatmap(configs))
def test_plan_of_no_difference_is_empty(cfg: NodeConfig) -> None:
    assert plan(cfg, cfg) == []
    assert plan(cfg, dataclasses.replace(cfg, source=Path("/elsewhere.toml"))) == []


@examples(30)
@given(pairs)
def test_changes_print_one_line(pair: tuple[NodeConfig, NodeConfig]) -> None:
    for c in plan(*pair):
        text = str(c)
        assert text and "\n" not in text and text[0] in "+-~"
        assert c.key in text


# ---- what cannot change while serving


def base() -> dict[str, Any]:
    return {
        "node": {"name": "n1"},
        "devices": [{"name": "ram0", "type": "ram", "size": "1MiB"},
                    {"name": "ram1", "type": "ram", "size": "1MiB"},
                    {"name": "f0", "type": "file", "path": "/srv/vsan-test/f0.img", "size": "1MiB"},
                    {"name": "m0", "type": "ram", "size": "1MiB"}, {"name": "m1", "type": "ram", "size": "1MiB"}],
        "pools": [{"name": "pool0", "level": "raid1", "members": ["m0", "m1"]}],
        "volumes": [{"name": "disk0", "device": "ram0"}, {"name": "disk1", "device": "f0"}],
        "iscsi": {"targets": [{"iqn": "iqn.2026-11.org.openvsan:disk0", "portals": ["127.0.0.1:3260"],
                               "luns": [{"lun": 0, "volume": "disk0"}]}]},
        "nvme": {"portals": ["127.0.0.1:4420"],
                 "subsystems": [{"nqn": "nqn.2026-11.org.openvsan:disk0", "namespaces": [{"nsid": 1,
                                                                                           "volume": "disk0"}]}]},
        "nbd": {"portals": ["127.0.0.1:10809"], "exports": [{"name": "disk0", "volume": "disk0"}]},
    }


def _dev(d: dict[str, Any], name: str) -> dict[str, Any]:
    return next(x for x in d["devices"] if x["name"] == name)


def _vol(d: dict[str, Any], name: str) -> dict[str, Any]:
    return next(x for x in d["volumes"] if x["name"] == name)


REFUSALS = {
    "node name": (lambda d: d["node"].update(name="n2"), "[node] name"),
    "node limits": (lambda d: d["node"].update(max_connections=10, max_unauthenticated=5,
                                               max_unauthenticated_per_source=5),
                    "[node] max_connections, max_unauthenticated, max_unauthenticated_per_source"),
    "node poll": (lambda d: d["node"].update(poll_us=0), "[node] poll_us"),
    "pool level": (lambda d: d["pools"][0].update(level="raid0"), "[[pools]]"),
    "pool removed": (lambda d: (d.pop("pools"),), "[[pools]]"),
    "pool added": (lambda d: (d["pools"].pop(), d.update(pools=[{"name": "p1", "level": "raid1",
                                                                "members": ["m0", "m1"]}])), "[[pools]]"),
    "device type": (lambda d: _dev(d, "ram0").update(type="null"), "device ram0: only its size"),
    "device path": (lambda d: _dev(d, "f0").update(path="/srv/vsan-test/other.img"), "device f0: only its size"),
    "device block size": (lambda d: _dev(d, "ram0").update(block_size=4096), "device ram0: only its size"),
    "device backing": (lambda d: _dev(d, "ram0").update(backing="/dev/shm/vsan-test-ram0"),
                       "device ram0: only its size"),
    "device direct": (lambda d: _dev(d, "f0").update(direct=True), "device f0: only its size"),
    "device shrinks": (lambda d: _dev(d, "ram0").update(size="512KiB"), "device ram0: 512.0 KiB is smaller than its 1.0 MiB"),
    "volume moves device": (lambda d: _vol(d, "disk1").update(device="ram1"), "volume disk1: it cannot move"),
    "volume moves to pool": (lambda d: (_vol(d, "disk1").pop("device"), _vol(d, "disk1").update(pool="pool0")),
                             "volume disk1: it cannot move"),
    "nbd tls": (lambda d: d["nbd"].update(tls={"cert": "/etc/vsan/c.pem", "key": "/etc/vsan/k.pem"}),
                "[nbd] tls"),
    "nvme portals": (lambda d: d["nvme"].update(portals=["127.0.0.1:4421"]), "[nvme] portals"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_refused_while_serving(what: str) -> None:
    change, words = REFUSALS[what]
    actual = parse_config(base())
    d = base()
    change(d)
    if what == "nbd tls":
        d["nbd"]["exports"][0]["tls"] = "off"
    desired = parse_config(d)
    assert desired != actual
    with pytest.raises(PlanRefused) as e:
        plan(actual, desired)
    text = str(e.value)
    assert "\n" not in text and text.startswith(words), text
    # and the other way round too, except where only one direction is a mistake (growing is fine)
    if what != "device shrinks":
        with pytest.raises(PlanRefused):
            plan(desired, actual)


def test_growing_a_device_is_a_resize() -> None:
    actual = parse_config(base())
    d = base()
    _dev(d, "ram0")["size"] = "2MiB"
    changes = plan(actual, parse_config(d))
    assert [(c.op, c.kind, c.key) for c in changes] == [("resize", "device", "ram0")]
    assert str(changes[0]) == "~ device ram0: 1.0 MiB -> 2.0 MiB"


def test_what_may_change_is_not_refused() -> None:
    """Everything but the fixed parts at once: volumes, their qos and read_only, devices, every export."""
    actual = parse_config(base())
    d = base()
    d["devices"].append({"name": "ram9", "type": "ram", "size": "4MiB"})
    d["devices"] = [x for x in d["devices"] if x["name"] != "ram1"]
    d["volumes"].append({"name": "disk9", "device": "ram9", "qos": {"iops_limit": 100}})
    d["volumes"].append({"name": "big", "pool": "pool0"})
    _vol(d, "disk0").update(read_only=True, qos={"bps_limit": "10MB"})
    d["iscsi"]["targets"][0]["luns"].append({"lun": 1, "volume": "disk9"})
    d["iscsi"]["targets"][0].update(chap={"user": "alice", "secret": "twelve+chars"})
    d["nvme"]["subsystems"][0]["allow_unauthenticated"] = True     # disk9 is behind CHAP on iSCSI
    d["iscsi"]["targets"].append({"iqn": "iqn.2026-11.org.openvsan:big", "portals": ["127.0.0.1:3261"],
                                  "luns": [{"lun": 0, "volume": "big"}]})
    d["nvme"]["subsystems"][0]["namespaces"] = [{"nsid": 2, "volume": "disk9"}]
    d["nvme"]["subsystems"][0]["portals"] = ["127.0.0.1:4422"]
    d["nbd"]["exports"] = [{"name": "disk9", "volume": "disk9", "read_only": True, "allow_unauthenticated": True}]
    desired = parse_config(d)
    changes = plan(actual, desired)
    pools = {"pool0"}
    m = model_of(actual)
    for c in changes:
        apply(m, c, pools)
    assert m == model_of(desired)
    kinds = {(c.op, c.kind) for c in changes}
    assert {("add", "device"), ("remove", "device"), ("add", "volume"), ("update", "volume"), ("add", "lun"),
            ("update", "target"), ("add", "target"), ("remove", "namespace"), ("add", "namespace"),
            ("update", "subsystem"), ("remove", "nbd export"), ("add", "nbd export")} <= kinds
    # a volume that loses no export and no device keeps its place: an update, not a remove and an add
    assert not any(c.kind == "volume" and c.key == "disk0" and c.op != "update" for c in changes)


def test_model_catches_an_unsafe_order() -> None:
    """The model applier is a real check: a plan put in the wrong order fails it."""
    actual = parse_config(base())
    d = base()
    d["devices"].append({"name": "ram9", "type": "ram", "size": "4MiB"})
    d["volumes"].append({"name": "disk9", "device": "ram9"})
    d["nbd"]["exports"].append({"name": "disk9", "volume": "disk9"})
    changes = plan(actual, parse_config(d))
    assert [c.kind for c in changes] == ["device", "volume", "nbd export"]
    with pytest.raises(Unsafe):
        m = model_of(actual)
        for c in reversed(changes):
            apply(m, c, set())
