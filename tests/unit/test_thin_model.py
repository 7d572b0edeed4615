"""A model of a volume group (volume/thin), driven by hypothesis: random writes (any size, across clusters),
fast-path writes, unmaps, write_zeroes, flushes, snapshots, clones, rollbacks, deletes, resizes, checkpoints,
and reopening (after a close, or from the journal). After every step each volume reads as the model says,
and the sharing of clusters is the model's: every mapped cluster of the model has a token (a new one when
a write lands in a cluster that was unmapped or shared, as copy-on-write makes one), and the group's mapping
must be that token structure exactly (token <-> physical cluster one to one), so `used` is the number of
tokens and each volume's `mapped` the number of its own.

THIN_MODEL_EXAMPLES (default 50) and THIN_MODEL_STEPS (default 50) run more."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from openvsan.block import RamDevice
from openvsan.volume.thin import GroupError, VolumeGroup
from openvsan.volume.thin import state as thin_state

BS = 512
CS = 4096
CB = CS // BS
MAX_CLUSTERS = 24          # of one volume
MAX_VOLUMES = 8            # volumes and snapshots: the device never runs out of clusters
NAMES = [f"v{i}" for i in range(12)]


def payload(tag: int, lba: int, blocks: int) -> bytes:
    return b"".join((tag.to_bytes(4, "little") + (lba + i).to_bytes(4, "little")) * (BS // 8)
                    for i in range(blocks))


def pages_of(v: Any) -> list[int]:
    """Mapped entries per page of a volume's mapping, counted from the mapping."""
    m = list(v.map)
    return [sum(1 for p in m[i:i + thin_state.PAGE] if p) for i in range(0, len(m), thin_state.PAGE)]


@dataclass
class Model:
    blocks: int
    thin: bool
    snapshot: bool
    data: bytearray
    tokens: list[int | None] = field(default_factory=list)   # per virtual cluster


class ThinModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # pages of 4 mapping entries (not 1024): volumes here span many, most of them empty
        self.saved_pages = thin_state.SHIFT, thin_state.PAGE
        thin_state.SHIFT, thin_state.PAGE = 2, 4
        self.loop = asyncio.new_event_loop()
        self.dev = RamDevice(4 << 20 >> 9, BS)
        self.group = self.run(VolumeGroup.format(self.dev, cluster_size=CS, metadata_size=200 << 10))
        self.group.commit_interval = 1e9
        self.model: dict[str, Model] = {}
        self.tag = 0
        self.token = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        thin_state.SHIFT, thin_state.PAGE = self.saved_pages
        self.run(self.dev.close())
        self.loop.close()

    # ---- the model's copy-on-write

    def refs(self, token: int) -> int:
        return sum(m.tokens.count(token) for m in self.model.values())

    def new_token(self) -> int:
        self.token += 1
        return self.token

    def touch(self, m: Model, vc: int, zero: bool) -> None:
        """A write (or zeros) into virtual cluster vc of m: unmapped or shared, it gets a cluster of its own."""
        t = m.tokens[vc]
        if t is None:
            if not zero or not m.thin:
                m.tokens[vc] = self.new_token()
        elif self.refs(t) > 1:
            m.tokens[vc] = self.new_token()

    def write_model(self, m: Model, lba: int, blocks: int, raw: bytes | None) -> None:
        for vc in range(lba // CB, -(-(lba + blocks) // CB)):
            self.touch(m, vc, raw is None)
        m.data[lba * BS:(lba + blocks) * BS] = raw if raw is not None else bytes(blocks * BS)

    def unmap_model(self, m: Model, lba: int, blocks: int) -> None:
        end = lba + blocks
        first = -(-lba // CB)
        last = len(m.tokens) if end >= m.blocks else end // CB
        if not m.thin or first >= last:
            self.write_model(m, lba, blocks, None)
            return
        if lba < first * CB:
            self.write_model(m, lba, first * CB - lba, None)
        for vc in range(first, last):
            m.tokens[vc] = None
        m.data[first * CB * BS:min(end, last * CB) * BS] = bytes((min(end, last * CB) - first * CB) * BS)
        if end > last * CB:
            self.write_model(m, last * CB, end - last * CB, None)

    # ---- rules

    @initialize(first=st.integers(1, MAX_CLUSTERS), second=st.integers(1, MAX_CLUSTERS), cut=st.integers(0, CB - 1))
    def two_volumes(self, first: int, second: int, cut: int) -> None:
        for name, clusters, thin in (("v0", first, True), ("v1", second, False)):
            blocks = max(1, clusters * CB - cut)
            self.run(self.group.create(name, blocks * BS, thin=thin))
            tokens = [None] * clusters if thin else [self.new_token() for _ in range(clusters)]
            self.model[name] = Model(blocks, thin, False, bytearray(blocks * BS), tokens)

    def writable(self) -> list[str]:
        return sorted(n for n, m in self.model.items() if not m.snapshot)

    def range_of(self, data: st.DataObject, m: Model) -> tuple[int, int]:
        lba = data.draw(st.integers(0, m.blocks - 1), label="lba")
        blocks = data.draw(st.integers(1, min(3 * CB, m.blocks - lba)), label="blocks")
        return lba, blocks

    @precondition(lambda self: len(self.model) < MAX_VOLUMES)
    @rule(data=st.data(), clusters=st.integers(1, MAX_CLUSTERS), cut=st.integers(0, CB - 1), thin=st.booleans())
    def create(self, data: st.DataObject, clusters: int, cut: int, thin: bool) -> None:
        name = data.draw(st.sampled_from([n for n in NAMES if n not in self.model]), label="name")
        blocks = max(1, clusters * CB - cut)
        self.run(self.group.create(name, blocks * BS, thin=thin))
        m = Model(blocks, thin, False, bytearray(blocks * BS), [None] * clusters)
        if not thin:
            m.tokens = [self.new_token() for _ in range(clusters)]
        self.model[name] = m

    @precondition(lambda self: any(not m.snapshot for m in self.model.values()))
    @rule(data=st.data(), fua=st.booleans())
    def write(self, data: st.DataObject, fua: bool) -> None:
        name = data.draw(st.sampled_from(self.writable()), label="volume")
        m = self.model[name]
        lba, blocks = self.range_of(data, m)
        self.tag += 1
        raw = payload(self.tag, lba, blocks)
        self.run(self.group.volume(name).write(lba, raw, fua=fua))
        self.write_model(m, lba, blocks, raw)

    @precondition(lambda self: any(not m.snapshot for m in self.model.values()))
    @rule(data=st.data())
    def write_now(self, data: st.DataObject) -> None:
        """The fast path, or the normal one where it declines."""
        name = data.draw(st.sampled_from(self.writable()), label="volume")
        m = self.model[name]
        lba = data.draw(st.integers(0, m.blocks - 1), label="lba")
        blocks = data.draw(st.integers(1, min(CB - lba % CB, m.blocks - lba)), label="blocks")
        self.tag += 1
        raw = payload(self.tag, lba, blocks)
        lv = self.group.volume(name)
        if not lv.write_now(lba, raw):
            self.run(lv.write(lba, raw))
        self.write_model(m, lba, blocks, raw)

    @precondition(lambda self: any(not m.snapshot for m in self.model.values()))
    @rule(data=st.data(), zeroes=st.booleans())
    def unmap(self, data: st.DataObject, zeroes: bool) -> None:
        name = data.draw(st.sampled_from(self.writable()), label="volume")
        m = self.model[name]
        lba, blocks = self.range_of(data, m)
        if data.draw(st.booleans(), label="to the end"):
            blocks = m.blocks - lba
        lv = self.group.volume(name)
        self.run(lv.write_zeroes(lba, blocks) if zeroes else lv.unmap(lba, blocks))
        self.unmap_model(m, lba, blocks)

    @rule()
    def flush(self) -> None:
        self.run(self.group.commit())

    @rule()
    def checkpoint(self) -> None:
        self.run(self.group.checkpoint())

    @precondition(lambda self: self.model and len(self.model) < MAX_VOLUMES)
    @rule(data=st.data(), clone=st.booleans())
    def snapshot_or_clone(self, data: st.DataObject, clone: bool) -> None:
        origin = data.draw(st.sampled_from(sorted(self.model)), label="origin")
        name = data.draw(st.sampled_from([n for n in NAMES if n not in self.model]), label="name")
        o = self.model[origin]
        if clone:
            self.run(self.group.clone(origin, name))
        else:
            self.run(self.group.snapshot(origin, name))
        self.model[name] = Model(o.blocks, True if clone else o.thin, not clone, bytearray(o.data), list(o.tokens))

    @precondition(lambda self: len(self.model) >= 2 and any(not m.snapshot for m in self.model.values()))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.writable()), label="volume")
        to = data.draw(st.sampled_from(sorted(n for n in self.model if n != name)), label="to")
        self.run(self.group.rollback(name, to))
        m, s = self.model[name], self.model[to]
        m.blocks, m.data, m.tokens = s.blocks, bytearray(s.data), list(s.tokens)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)), label="volume")
        self.run(self.group.delete(name))
        del self.model[name]

    @precondition(lambda self: any(not m.snapshot for m in self.model.values()))
    @rule(data=st.data(), clusters=st.integers(1, MAX_CLUSTERS), cut=st.integers(0, CB - 1), force=st.booleans())
    def resize(self, data: st.DataObject, clusters: int, cut: int, force: bool) -> None:
        name = data.draw(st.sampled_from(self.writable()), label="volume")
        m = self.model[name]
        blocks = max(1, clusters * CB - cut)
        n = -(-blocks // CB)
        shrink = blocks < m.blocks and not force
        if shrink and (any(t is not None for t in m.tokens[n:]) or blocks % CB and m.tokens[n - 1] is not None):
            with pytest.raises(GroupError):
                self.run(self.group.resize(name, blocks * BS))
            return
        self.run(self.group.resize(name, blocks * BS, force=force))
        if blocks > m.blocks and m.blocks % CB:
            self.write_model(m, m.blocks, -(-m.blocks // CB) * CB - m.blocks, None)
        if n <= len(m.tokens):
            m.tokens = m.tokens[:n]
        else:
            grow = n - len(m.tokens)
            m.tokens += [None] * grow if m.thin else [self.new_token() for _ in range(grow)]
        m.data = (m.data + bytes(max(0, blocks * BS - len(m.data))))[:blocks * BS]
        m.blocks = blocks

    @rule(close=st.booleans())
    def reopen(self, close: bool) -> None:
        """Closed cleanly, or opened again from what the last commit left (the journal replayed)."""
        if close:
            self.run(self.group.close())
        else:
            self.run(self.group.commit())
        self.group = self.run(VolumeGroup.open(self.dev))
        self.group.commit_interval = 1e9

    # ---- what must hold after every step

    @invariant()
    def reads_match(self) -> None:
        g = self.group
        assert g.names() == sorted(self.model)
        for name, m in self.model.items():
            lv = g.volume(name)
            assert lv.num_blocks == m.blocks and lv.thin == m.thin and lv.read_only == m.snapshot, name
            assert bytes(self.run(lv.read(0, m.blocks))) == bytes(m.data), name
            for lba in range(0, m.blocks, 5 * CB + 3):     # the fast path, here and there
                n = min(CB - lba % CB, m.blocks - lba)
                got = lv.read_now(lba, n)
                assert got is None or bytes(got) == bytes(m.data[lba * BS:(lba + n) * BS]), (name, lba)

    @invariant()
    def sharing_matches(self) -> None:
        g = self.group
        to_p: dict[int, int] = {}
        counts = [0] * (g.clusters + 1)       # clusters are numbered from 1
        for name, m in self.model.items():
            v = g.vols[g.by_name[name]]
            assert len(v.map) == len(m.tokens), name
            for vc, (t, p) in enumerate(zip(m.tokens, v.map, strict=True)):
                assert (t is None) == (p == 0), (name, vc)
                if t is not None:
                    assert to_p.setdefault(t, p) == p, (name, vc)
                    counts[p] += 1
            assert v.mapped == sum(t is not None for t in m.tokens), name
            assert list(v.pages) == pages_of(v), name
            assert g.info(name)["mapped"] == v.mapped * CS
        assert len(set(to_p.values())) == len(to_p)          # one cluster per token
        assert g.used == len(to_p) == g.space()["used"] // CS
        assert list(g.ref) == counts


TestThinModel = ThinModel.TestCase
TestThinModel.settings = settings(
    max_examples=int(os.environ.get("THIN_MODEL_EXAMPLES", "50")),
    stateful_step_count=int(os.environ.get("THIN_MODEL_STEPS", "50")),
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
