"""[cluster] and replicated volumes in the config: what is refused (one line each), what round-trips through
the store's objects, what a running node refuses to change."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from openvsan.node.config import ConfigError, parse_config
from openvsan.node.reconcile import PlanRefused, plan
from openvsan.node.store import config_from_objects, config_objects

BASE: dict[str, Any] = {
    "node": {"name": "a"},
    "cluster": {"id": "c1", "etcd": ["10.0.0.1:2379", "http://10.0.0.2:2379"], "replication": "10.0.1.1:4430"},
    "devices": [{"name": "d0", "type": "ram", "size": "1MiB"}],
    "volumes": [{"name": "v1", "device": "d0", "replicas": 2, "nodes": ["a", "b"]}],
    "iscsi": {"portals": ["127.0.0.1:3260"],
              "targets": [{"iqn": "iqn.2026-11.org.openvsan:v1", "luns": [{"lun": 0, "volume": "v1"}]}]},
}


def doc(**patch: Any) -> dict[str, Any]:
    d = copy.deepcopy(BASE)
    for k, v in patch.items():
        if v is None:
            d.pop(k)
        else:
            d[k] = v
    return d


def volume(**patch: Any) -> dict[str, Any]:
    d = doc()
    d["volumes"][0].update(patch)
    return d


def error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_replicated_volume_on_a_cluster_node() -> None:
    c = parse_config(doc())
    assert c.cluster is not None and c.cluster.id == "c1" and c.cluster.lease_ttl == 5
    assert str(c.cluster.replication) == "10.0.1.1:4430"
    (v,) = c.volumes
    assert v.replicated and v.nodes == ("a", "b")


@pytest.mark.parametrize(("data", "want"), [
    (doc(cluster=None), "volumes[0].replicas: a replicated volume needs the node in a cluster"),
    (volume(nodes=["b", "c"]), 'volumes[0].nodes: this node ("a") is not one of b, c'),
    (volume(nodes=["a"]), "replicas = 2 needs that many node names"),
    (volume(replicas=4, nodes=["a", "b", "c", "d"]), "use 1 (not replicated), 2 or 3"),
    (volume(replicas=1), "names nodes a, b but the volume has replicas = 1"),
    (volume(nodes=["a", "a"]), '"a" is listed twice'),
    (doc(cluster={"id": "c1", "etcd": [], "replication": "10.0.1.1:4430"}), "list at least one etcd member"),
    (doc(cluster={"id": "c1", "etcd": ["http://x:1/v3"], "replication": "10.0.1.1:4430"}),
     "an etcd client URL is host:port"),
    (doc(cluster={"id": "c1", "etcd": ["x:1"]}), "cluster.replication: missing"),
    (doc(cluster={**BASE["cluster"], "lease_ttl": 1}), "use 2 to 60 seconds"),
    (doc(cluster={**BASE["cluster"], "replication": "127.0.0.1:3260"}),
     "is already an iSCSI portal"),
])
def test_refused(data: dict[str, Any], want: str) -> None:
    assert want in error(data)


def test_cluster_and_replicas_round_trip_through_the_store() -> None:
    c = parse_config(doc())
    back = config_from_objects(config_objects(c), {}, lambda *_: "")
    assert back.cluster == c.cluster and back.volumes == c.volumes


def test_a_running_node_does_not_change_its_cluster_or_replicas() -> None:
    c = parse_config(doc())
    with pytest.raises(PlanRefused, match=r"\[cluster\]"):
        plan(c, parse_config(doc(cluster={**BASE["cluster"], "lease_ttl": 9})))
    with pytest.raises(PlanRefused, match="replicas and nodes change only"):
        plan(c, parse_config(volume(replicas=3, nodes=["a", "b", "c"])))


def test_a_replicated_volume_is_not_added_while_serving() -> None:
    base = doc()
    base["volumes"] = []
    base["iscsi"]["targets"][0]["luns"] = []
    base["iscsi"]["targets"] = []
    with pytest.raises(PlanRefused, match="served at their next restart"):
        plan(parse_config(base), parse_config(doc()))


def test_the_readme_cluster_examples_are_valid() -> None:
    from pathlib import Path

    from openvsan.node.config import load_config

    here = Path(__file__).parents[2] / "examples" / "cluster"
    a, b = (load_config(here / f"node-{n}.toml") for n in ("a", "b"))
    assert a.cluster is not None and b.cluster is not None and len(a.cluster.etcd) == 3
    assert (a.cluster.id, a.cluster.etcd) == (b.cluster.id, b.cluster.etcd)
    assert a.volumes[0].nodes == b.volumes[0].nodes == ("a", "b")
    assert a.targets[0].iqn == b.targets[0].iqn and a.subsystems[0].nqn == b.subsystems[0].nqn
    assert a.cluster.replication != b.cluster.replication
