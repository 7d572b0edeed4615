"""EtcdStateStore on a real 3-member etcd cluster, each member in its own network namespace: the store keeps
working while one member is killed or cut off, a watch survives the loss of its member, and a lease expires
when its holder's namespace is cut off for longer than its TTL.

Clients are StoreAgents (tests/support/etcd_cluster.py): an EtcdStateStore in a child process inside a client
namespace (c1, c2), with all three endpoints, e1 first. The cluster is shared by the module; after each test
every cut is healed and every member is running and healthy again.

The watch decision: a watch survives (it resumes on another member from the revision after its last event,
no event lost or repeated); it raises StoreUnavailable only when no member answers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from etcd_cluster import AgentError, EtcdCluster, StoreAgent
from netns import Lab, require_lab_tools

from openvsan.cluster.etcd_process import ETCD_PACKAGE, EtcdMissing

MEMBERS = ["e1", "e2", "e3"]
TIMEOUT = 5.0  # the agents' per-request timeout: the store's own default, which outlasts an election (2 s did not, once, on a loaded CI machine)


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, EtcdCluster]]:
    require_lab_tools()
    with Lab([*MEMBERS, "c1", "c2"]) as lab:
        try:
            cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), MEMBERS, lab=lab)
        except EtcdMissing:
            pytest.fail(f"missing etcd: apt-get install {ETCD_PACKAGE} (or run `sudo bash .ci/run`)", pytrace=False)
        with cluster:
            yield lab, cluster


@pytest.fixture
def lab(net: tuple[Lab, EtcdCluster]) -> Iterator[Lab]:
    yield net[0]
    net[0].heal_all()
    cluster = net[1]
    for name, m in cluster.members.items():
        if m.proc is None or m.proc.poll() is not None:
            cluster.restart(name, wait=False)
    cluster.wait_healthy()


@pytest.fixture
def cluster(net: tuple[Lab, EtcdCluster], lab: Lab) -> EtcdCluster:
    return net[1]


@pytest.fixture
def agents(lab: Lab, cluster: EtcdCluster, request: pytest.FixtureRequest) -> Iterator[list[StoreAgent]]:
    """c1's and c2's stores, each under a prefix of this test's own."""
    prefix = f"/{request.node.name}"
    made = [StoreAgent(lab, c, cluster.endpoints, prefix=prefix, timeout=TIMEOUT) for c in ("c1", "c2")]
    yield made
    for a in made:
        a.close()


def cut_off(lab: Lab, name: str, *, from_clients: bool) -> None:
    for other in lab.names:
        if other != name and (from_clients or other in MEMBERS):
            lab.cut(name, other)


def settle(cluster: EtcdCluster, cut: str) -> None:
    """Until the members other than `cut` have a leader again (an election if `cut` led): a write caught in
    an election may or may not be applied, and says so; these tests are about what comes after."""
    time.sleep(1.0)  # two election timeouts: `cut` and its peers know the link is gone
    cluster.wait_healthy([n for n in MEMBERS if n != cut])


def put_get_cas(a: StoreAgent, key: str) -> None:
    r1 = a.call("put", key=key, value={"n": 1})
    assert a.call("get", key=key) == {"value": {"n": 1}, "revision": r1}
    r2 = a.call("put", key=key, value={"n": 2}, expect=r1)
    with pytest.raises(AgentError) as ei:
        a.call("put", key=key, value={"n": 3}, expect=r1)  # stale: the CAS still refuses it
    assert ei.value.kind == "Conflict"
    assert a.call("get", key=key) == {"value": {"n": 2}, "revision": r2}


def test_store_keeps_working_when_first_member_is_killed(cluster: EtcdCluster, agents: list[StoreAgent]) -> None:
    a = agents[0]
    put_get_cas(a, "/before")
    assert a.call("endpoint") == cluster.endpoint("e1")
    cluster.kill("e1")  # it may be the leader: the others elect one meanwhile, the store waits for that
    # the first call after the kill still finds c1's channel to e1 "up" (it has not read the FIN yet): a read
    # moves on by itself; a write would say it may or may not have been applied, as a write that was in
    # flight when its member died must
    assert a.call("get", key="/before")["value"] == {"n": 2}
    put_get_cas(a, "/after")
    assert a.call("endpoint") != cluster.endpoint("e1")
    assert a.call("get", key="/before")["value"] == {"n": 2}


def test_store_keeps_working_when_first_member_is_cut_off(
    lab: Lab, cluster: EtcdCluster, agents: list[StoreAgent]
) -> None:
    a = agents[0]
    put_get_cas(a, "/before")
    assert a.call("endpoint") == cluster.endpoint("e1")
    # 1. e1 cut from its peers only: it still answers c1, but "no leader" (etcd's require-leader
    # metadata), and nothing is applied, so even writes move to another member without an error
    cut_off(lab, "e1", from_clients=False)
    settle(cluster, "e1")  # e1 knows it has no leader
    put_get_cas(a, "/peers-cut")
    assert a.call("endpoint") != cluster.endpoint("e1")
    lab.heal_all()
    cluster.wait_healthy(["e1"])

    # 2. e1 cut from everyone, c1 included, while c1's channel to it is up: a write sent into the cut times
    # out and may or may not have been applied, so it says so; the next calls go to the others
    b = StoreAgent(lab, "c1", cluster.endpoints, prefix="/silent", timeout=TIMEOUT)
    try:
        r1 = b.call("put", key="/k", value={"n": 1})
        assert b.call("endpoint") == cluster.endpoint("e1")
        cut_off(lab, "e1", from_clients=True)
        with pytest.raises(AgentError) as ei:
            b.call("put", key="/k", value={"n": 2})
        assert ei.value.kind == "StoreUnavailable" and "may or may not have been applied" in ei.value.message
        # read back: e1 could reach nobody, so it was not applied
        assert b.call("get", key="/k") == {"value": {"n": 1}, "revision": r1}
        put_get_cas(b, "/all-cut")
        assert b.call("endpoint") != cluster.endpoint("e1")
    finally:
        b.close()


def test_watch_survives_member_loss(
    lab: Lab, cluster: EtcdCluster, agents: list[StoreAgent], request: pytest.FixtureRequest
) -> None:
    watcher, writer = agents
    start = writer.call("revision") + 1
    wid = watcher.call("watch", prefix="/w/", start_revision=start)
    writes = []

    def write_and_see(w: StoreAgent, key: str, within: float) -> None:
        rev = w.call("put", key=key, value={"k": key})
        writes.append(rev)
        (ev,) = watcher.events(wid, 1, timeout=within)
        assert "error" not in ev, ev
        assert (ev["key"], ev["revision"]) == (key, rev)

    def writer_avoiding(name: str) -> StoreAgent:
        """A writer that never uses `name`: its writes must not be the ones that hit the cut."""
        others = [cluster.endpoint(n) for n in MEMBERS if n != name]
        return StoreAgent(lab, "c2", others, prefix=f"/{request.node.name}", timeout=TIMEOUT)

    write_and_see(writer, "/w/1", 5)
    assert watcher.call("endpoint") == cluster.endpoint("e1")
    cluster.kill("e1")  # the stream breaks at once
    # the writer is on e1 too: its first write after the kill may go out on the channel it has not yet seen
    # close, and must then say it may or may not have been applied (test_store_keeps_working_when_first_
    # member_is_killed): this test is about the watch, so this write goes to the others once they have a leader
    w1 = writer_avoiding("e1")
    try:
        settle(cluster, "e1")
        write_and_see(w1, "/w/2", 10)
    finally:
        w1.close()
    cluster.restart("e1")
    # the watch is on e2 or e3 now; cut that one from its peers: etcd cancels a require-leader watch on a
    # member without a leader, and the watch moves on
    on = next(n for n in MEMBERS if cluster.endpoint(n) == watcher.call("endpoint"))
    w2 = writer_avoiding(on)
    try:
        cut_off(lab, on, from_clients=False)
        settle(cluster, on)
        write_and_see(w2, "/w/3", 10)
        lab.heal_all()
        cluster.wait_healthy()
    finally:
        w2.close()
    # cut the member it is on now from everyone: only gRPC keepalive finds the silent connection dead
    on = next(n for n in MEMBERS if cluster.endpoint(n) == watcher.call("endpoint"))
    w3 = writer_avoiding(on)
    try:
        cut_off(lab, on, from_clients=True)
        settle(cluster, on)
        write_and_see(w3, "/w/4", 20)
    finally:
        w3.close()
    # nothing lost, nothing repeated: a watch from the start replays exactly these
    lab.heal_all()
    again = watcher.call("watch", prefix="/w/", start_revision=start)
    assert [e["revision"] for e in watcher.events(again, 4)] == writes
    with pytest.raises(TimeoutError):
        watcher.events(wid, 1, timeout=0.5)  # and the surviving watch has nothing more


def test_lease_expires_when_holder_is_isolated(lab: Lab, agents: list[StoreAgent]) -> None:
    holder, observer = agents
    ttl = 2
    lease = holder.call("grant", ttl=ttl)
    holder.call("put", key="/leader", value={"node": "c1"}, expect=0, lease=lease)
    rev = observer.call("revision")
    wid = observer.call("watch", prefix="/leader", start_revision=rev + 1)
    assert holder.call("refresh", lease=lease) >= ttl
    refreshed = time.monotonic()
    lab.isolate("c1")
    with pytest.raises(AgentError) as ei:
        holder.call("refresh", lease=lease)
    assert ei.value.kind == "StoreUnavailable"
    (ev,) = observer.events(wid, 1, timeout=ttl + 5)
    gone = time.monotonic() - refreshed
    assert ev.get("kind") == "delete" and ev["key"] == "/leader", ev
    assert gone >= ttl - 0.5, f"the key went {gone:.1f}s after the last renewal, before its {ttl}s TTL"
    assert observer.call("get", key="/leader") is None
    lab.rejoin("c1")
    with pytest.raises(AgentError) as ei:
        holder.call("refresh", lease=lease)
    assert ei.value.kind == "LeaseExpired"
