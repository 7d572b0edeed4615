"""Placing a node's volumes on worker processes (node/workers.py): what goes together, balance, each worker's
share of the desired state, and the cpu list syntax."""

from __future__ import annotations

from typing import Any

import pytest

from openvsan.node.config import parse_config
from openvsan.node.render import config_document
from openvsan.node.workers import parse_cpus, part, pinned, place, worker_count


def config(volumes: int = 4, **extra: Any) -> Any:
    doc: dict[str, Any] = {
        "node": {"name": "n", "max_connections": 1000, "max_unauthenticated": 101,
                 "max_unauthenticated_per_source": 50},
        "devices": [{"name": f"d{i}", "type": "ram", "size": "1MiB"} for i in range(volumes)]
        + [{"name": "spare", "type": "ram", "size": "1MiB"}],
        "volumes": [{"name": f"v{i}", "device": f"d{i}"} for i in range(volumes)],
        "iscsi": {"portals": ["127.0.0.1:3260"], "targets": [
            # t01 exports v0 and v1 together: they must share a worker
            {"iqn": "iqn.2026-12.org.x:t01", "luns": [{"lun": 0, "volume": "v0"}, {"lun": 1, "volume": "v1"}]},
            {"iqn": "iqn.2026-12.org.x:t2", "luns": [{"lun": 0, "volume": "v2"}]}]},
        "nvme": {"portals": ["127.0.0.1:4420"], "subsystems": [
            {"nqn": "nqn.2026-12.org.x:s3", "namespaces": [{"nsid": 1, "volume": "v3"}]}]},
        "nbd": {"portals": ["127.0.0.1:10809"], "exports": [{"name": "e1", "volume": "v1"}]},
    }
    doc.update(extra)
    return parse_config(doc)


def test_volumes_a_target_exports_together_share_a_worker_and_groups_are_balanced() -> None:
    cfg = config()
    p = place(cfg, 2)
    assert p.volumes["v0"] == p.volumes["v1"] == p.targets["iqn.2026-12.org.x:t01"] == p.nbd["e1"]
    # the pair (2 volumes) on one worker, the two single volumes on the other
    assert p.volumes["v2"] == p.volumes["v3"] != p.volumes["v0"]
    assert p.targets["iqn.2026-12.org.x:t2"] == p.volumes["v2"] and p.subsystems["nqn.2026-12.org.x:s3"] == p.volumes["v3"]
    assert place(cfg, 2) == p                     # the same config, the same placement
    four = place(cfg, 4)
    assert len({four.volumes[v] for v in ("v0", "v2", "v3")}) == 3 and four.volumes["v1"] == four.volumes["v0"]
    one = place(cfg, 1)
    assert set(one.volumes.values()) == {0}


def test_each_worker_gets_its_volumes_devices_exports_and_a_share_of_the_caps() -> None:
    cfg = config()
    p = place(cfg, 2)
    parts = [part(cfg, p, i) for i in range(2)]
    assert sorted(v.name for x in parts for v in x.volumes) == ["v0", "v1", "v2", "v3"]
    for x in parts:
        used = {v.device for v in x.volumes}
        assert {d.name for d in x.devices} - {"spare"} == used
        assert all(p.targets[t.iqn] == parts.index(x) for t in x.targets)
        assert x.nvme is not None and x.nvme.portals == cfg.nvme.portals   # every worker answers discovery
        assert x.node.max_connections == 500
    # the node's caps split so that the workers' shares add up to them (101 = 51 + 50)
    assert [x.node.max_unauthenticated for x in parts] == [51, 50]
    assert [x.node.max_unauthenticated_per_source for x in parts] == [25, 25]
    tiny = config(node={"name": "n", "max_unauthenticated_per_source": 1})
    assert [part(tiny, place(tiny, 3), i).node.max_unauthenticated_per_source for i in range(3)] == [1, 1, 1]
    # a device no volume or pool uses stays with worker 0
    assert "spare" in {d.name for d in parts[0].devices} and "spare" not in {d.name for d in parts[1].devices}
    assert sum(len(x.nbd_exports) for x in parts) == 1


def test_in_a_cluster_worker_0_serves_the_replicated_volumes_and_holds_the_membership() -> None:
    doc = {"id": "c1", "etcd": ["127.0.0.1:2379"], "replication": "127.0.0.1:7000"}
    cluster = config(cluster=doc, volumes=4)
    assert pinned(cluster, 2) == set()                              # nothing replicated: nothing pinned
    replicated = parse_config({
        "node": {"name": "n"}, "cluster": doc,
        "devices": [{"name": f"d{i}", "type": "ram", "size": "1MiB"} for i in range(3)],
        "volumes": [{"name": "r", "device": "d0", "replicas": 2, "nodes": ["n", "m"]},
                    {"name": "a", "device": "d1"}, {"name": "b", "device": "d2"}],
        "iscsi": {"portals": ["127.0.0.1:3260"], "targets": [
            {"iqn": "iqn.2026-12.org.x:rb", "luns": [{"lun": 0, "volume": "r"}, {"lun": 1, "volume": "b"}]},
            {"iqn": "iqn.2026-12.org.x:a", "luns": [{"lun": 0, "volume": "a"}]}]}})
    assert pinned(replicated, 1) == set() and pinned(replicated, 2) == {"r", "b"}
    p = place(replicated, 2)
    assert (p.volumes["r"], p.volumes["b"], p.volumes["a"]) == (0, 0, 1)
    assert part(replicated, p, 0).cluster is not None and part(replicated, p, 1).cluster is None


def test_cpu_lists() -> None:
    assert parse_cpus("0") == [0]
    assert parse_cpus("0,2,4-6") == [0, 2, 4, 5, 6]
    assert parse_cpus(" 3-3 , 1,1") == [3, 1]
    for bad in ("", "a", "3-1", "-1", "1-x"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_workers_in_the_config_are_checked_and_kept() -> None:

    cfg = config(node={"name": "n", "workers": 4, "worker_cpus": [0, 1]})
    assert cfg.node.workers == 4 and cfg.node.worker_cpus == (0, 1)
    assert parse_config(config_document(cfg)).node == cfg.node
    with pytest.raises(ValueError, match="1 to 256 worker processes"):
        config(node={"name": "n", "workers": 0})
    for bad in ("many", 2.0, True):
        with pytest.raises(ValueError, match='expected "auto" or an integer'):
            config(node={"name": "n", "workers": bad})


def test_workers_default_to_one_per_core_the_node_may_use() -> None:
    """The issue's default: one worker per core; `taskset -c 0 vsan serve` (one core) is one process."""
    cfg = config(node={"name": "n"})
    assert cfg.node.workers == "auto"
    assert parse_config(config_document(cfg)).node.workers == "auto"
    assert worker_count("auto", [0, 1, 2, 3]) == 4
    assert worker_count("auto", [5]) == 1
    assert worker_count("auto", [0, 0, 1]) == 2
    assert worker_count("auto", list(range(1000))) == 256
    assert worker_count(3, [0]) == 3 and worker_count(1, [0, 1]) == 1


def test_a_new_supervisor_waits_until_the_workers_of_the_old_one_are_gone(tmp_path: Any) -> None:
    import asyncio
    import os

    from openvsan.node.workers import hold_workers_lock, wait_for_old_workers

    old = hold_workers_lock(tmp_path)          # a worker of the supervisor that was killed, still draining

    async def go() -> None:
        waiting = asyncio.ensure_future(wait_for_old_workers(tmp_path))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        os.close(old)                          # it exits: its lock goes
        await asyncio.wait_for(waiting, 5)
        hold_workers_lock(tmp_path)            # the new workers take it again, side by side

    asyncio.run(go())


def test_a_move_takes_a_group_with_what_exports_it_and_a_join_moves_the_fewer_volumes() -> None:
    from openvsan.node.workers import joins, moved, place_again

    cfg = config()
    p = place(cfg, 2)
    pair, single = p.volumes["v0"], p.volumes["v2"]
    m = moved(p, cfg, {"v0", "v1"}, single)
    assert m.volumes == {"v0": single, "v1": single, "v2": single, "v3": single}
    assert m.targets["iqn.2026-12.org.x:t01"] == m.nbd["e1"] == single
    assert m.targets["iqn.2026-12.org.x:t2"] == p.targets["iqn.2026-12.org.x:t2"]
    # v2 joins t01 (v0 and v1): the worker with two of the three volumes keeps them, v2's group goes there
    doc_targets = [{"iqn": "iqn.2026-12.org.x:t01", "luns": [{"lun": 0, "volume": "v0"}, {"lun": 1, "volume": "v1"},
                                                             {"lun": 2, "volume": "v2"}]}]
    joined = config(iscsi={"portals": ["127.0.0.1:3260"], "targets": doc_targets})
    with pytest.raises(ValueError, match="move them to one worker first"):
        place_again(joined, p)
    assert joins(joined, cfg, p) == [("v2", pair)]
    after = moved(p, cfg, {"v2"}, pair)
    assert place_again(joined, after).volumes["v2"] == pair
    assert joins(cfg, cfg, p) == []               # nothing joins: nothing moves


def test_balance_moves_the_group_that_evens_the_workers_out_most() -> None:
    from openvsan.node.workers import GroupLoad, plan_balance

    def plan(busy: dict[int, float], groups: list[tuple[str, int, float]]) -> list[tuple[str, int]]:
        return [(g.volumes[0], to) for g, to in plan_balance(busy, [GroupLoad([v], w, x) for v, w, x in groups])]

    # three busy volumes on worker 0, an idle one on worker 1: the one that evens them out best goes
    assert plan({0: 1.0, 1: 0.0}, [("a", 0, 0.5), ("b", 0, 0.3), ("c", 0, 0.2), ("d", 1, 0.0)]) == [("a", 1)]
    assert plan({0: 1.0, 1: 0.0}, [("a", 0, 0.7), ("b", 0, 0.2), ("c", 0, 0.1)]) == [("a", 1)]
    assert plan({0: 1.0, 1: 0.0}, [("a", 0, 0.8), ("b", 0, 0.1), ("c", 0, 0.1)]) == [("a", 1)]
    assert plan({0: 1.0, 1: 0.0}, [("a", 0, 0.95), ("b", 0, 0.05)]) == []   # b gains too little, a nothing
    # close enough: nothing moves (a move pauses I/O; it must be worth it)
    assert plan({0: 0.5, 1: 0.3}, [("a", 0, 0.3), ("b", 0, 0.2), ("c", 1, 0.3)]) == []
    # one volume is the whole load: moving it only moves the problem
    assert plan({0: 0.9, 1: 0.0}, [("a", 0, 0.9)]) == []
    # four workers: the busiest gives to the idlest, again while it pays, each group once
    moves = plan({0: 1.0, 1: 0.9, 2: 0.0, 3: 0.1},
                 [("a", 0, 0.5), ("b", 0, 0.5), ("c", 1, 0.45), ("d", 1, 0.45), ("e", 3, 0.1)])
    assert moves[0] == ("a", 2) and ("c", 3) in moves or ("d", 3) in moves, moves
    assert len({v for v, _ in moves}) == len(moves)
    # idle volumes never move, whatever the gap
    assert plan({0: 0.8, 1: 0.0}, [("a", 0, 0.0), ("b", 0, 0.0)]) == []


def test_the_balance_interval_is_off_or_at_least_ten_seconds() -> None:
    assert config().node.worker_balance_interval == 0
    assert config(node={"name": "n", "worker_balance_interval": 30}).node.worker_balance_interval == 30
    with pytest.raises(ValueError, match="use 0 \\(off\\) or 10 to 86400 seconds"):
        config(node={"name": "n", "worker_balance_interval": 5})


def test_with_nbd_over_tls_worker_0_serves_every_nbd_export_and_what_goes_with_it(tmp_path: Any) -> None:
    from openvsan.node.workers import joins, moved, pinned, place_again

    for f in ("c.pem", "k.pem"):
        (tmp_path / f).write_text("x")
    tls = {"portals": ["127.0.0.1:10809"], "tls": {"cert": str(tmp_path / "c.pem"), "key": str(tmp_path / "k.pem")},
           "exports": [{"name": "e1", "volume": "v1"}, {"name": "e3", "volume": "v3"}]}
    cfg = config(nbd=tls)
    assert pinned(cfg, 1) == set() and pinned(config(), 2) == set()
    assert pinned(cfg, 2) == {"v0", "v1", "v3"}                  # v0: exported with v1 by t01
    p = place(cfg, 2)
    assert {v: p.volumes[v] for v in ("v0", "v1", "v3")} == {"v0": 0, "v1": 0, "v3": 0} and p.volumes["v2"] == 1
    # an NBD export added for v2 (on worker 1): v2 goes to worker 0 first
    more = config(nbd={**tls, "exports": [*tls["exports"], {"name": "e2", "volume": "v2"}]})
    with pytest.raises(ValueError, match="belong on worker 0 \\(NBD over TLS, or replicated\\)"):
        place_again(more, p)
    assert joins(more, cfg, p) == [("v2", 0)]
    assert place_again(more, moved(p, cfg, {"v2"}, 0)).volumes["v2"] == 0


def test_starttls_on_a_worker_that_runs_no_tls_hands_the_connection_over_unanswered() -> None:
    import struct

    from openvsan.protocol.nbd.connection import NbdServerConnection
    from openvsan.protocol.nbd.events import ExportInfo, Send
    from openvsan.protocol.routing import Elsewhere

    option = struct.pack(">QII", 0x49484156454F5054, 5, 0)        # NBD_OPT_STARTTLS
    for elsewhere, handed in ((None, False), (0, True)):
        conn = NbdServerConnection([ExportInfo("e", 1 << 20)], tls_offered=True, tls_elsewhere=elsewhere)
        events = conn.receive_data(struct.pack(">I", 3) + option)
        assert any(isinstance(e, Elsewhere) and e.worker == 0 for e in events) == handed
        sent = b"".join(bytes(b) for e in events if isinstance(e, Send) for b in e.data)
        assert (sent == b"") == handed                             # handed over: not acknowledged here
