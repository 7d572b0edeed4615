"""The replication path: a primary's connection to a peer's replica, and the replica's saved fence floor.

The primary reaches each peer's replica of a volume as an NVMe namespace over NVMe/TCP (our initiator),
authenticated both ways with DH-HMAC-CHAP keys derived from the cluster's secret (`replication_keys`),
and takes it for its epoch before the first write: Reservation Register with key = epoch, then Reservation
Acquire, Write Exclusive, preempting whichever key holds it now (the previous primary's epoch). The
replica's EpochFence (fence.py) refuses a key below its floor, so a primary of an old epoch cannot take it.

`FloorFile` keeps a replica's floor in its data dir, written whole to a new file, synced and renamed
(and the directory synced) before the acquisition that raised it is answered.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from pathlib import Path

from openvsan.durable import replace_file
from openvsan.initiator.nvme_tcp import NvmeCommandError, NvmeOptions, NvmeTcpInitiator
from openvsan.protocol.nvme.auth import Secret
from openvsan.protocol.nvme.host_commands import parse_reservation_report
from openvsan.protocol.nvme.reservations import WRITE_EXCLUSIVE

REPLICA_NQN_PREFIX = "nqn.2026-11.org.openvsan:replica:"
NODE_NQN_PREFIX = "nqn.2026-11.org.openvsan:node:"
ACQUIRE, PREEMPT = 0, 1
REGISTER, REPLACE = 0, 2
CONFLICT = 0x83            # Base 2.0 Figure 102: Reservation Conflict (SCT 0)


def replication_keys(cluster_secret: bytes) -> tuple[Secret, Secret]:
    """The replication path's DH-HMAC-CHAP keys, (host's, controller's), derived from the cluster's secret
    (cluster/membership.py): every node of the cluster has them, so the primary proves it is one to the
    replica, and the replica that it is one to the primary (NVMe Base 2.0 §8.13, bidirectional)."""
    host = hmac.new(cluster_secret, b"openvsan replication host", hashlib.sha256).digest()
    ctrl = hmac.new(cluster_secret, b"openvsan replication controller", hashlib.sha256).digest()
    return Secret(host), Secret(ctrl)


def replica_nqn(volume: str) -> str:
    return REPLICA_NQN_PREFIX + volume


def node_nqn(node: str) -> str:
    return NODE_NQN_PREFIX + node


class PeerFenced(Exception):
    """The peer's replica is held by a newer epoch than ours (or refused ours as older than its floor)."""


async def take_replica(dev: NvmeTcpInitiator, epoch: int) -> None:
    """Make `epoch` the holder of the peer's replica (register, then acquire or preempt the holder)."""
    try:
        try:
            await dev.reservation_register(epoch)
        except NvmeCommandError as e:
            if e.status & 0xFF != CONFLICT:
                raise
            # registered already under another key (an earlier epoch of ours): replace it
            await dev.reservation_register(epoch, action=REPLACE, iekey=True)
        held = parse_reservation_report(await dev.reservation_report()).holder_key
        if held == epoch:
            return
        if held is None:
            await dev.reservation_acquire(epoch, WRITE_EXCLUSIVE)
        else:
            await dev.reservation_acquire(epoch, WRITE_EXCLUSIVE, action=PREEMPT, prkey=held)
    except NvmeCommandError as e:
        if e.status & 0xFF == CONFLICT:
            raise PeerFenced(f"{dev.url}: its replica refused epoch {epoch} (a newer epoch holds it)") from None
        raise


async def connect_peer(host: str, port: int, volume: str, me: str, epoch: int, *,
                       opts: NvmeOptions | None = None) -> NvmeTcpInitiator:
    """Our initiator to `volume`'s replica on a peer, taken for `epoch`."""
    o = opts or NvmeOptions()
    o.hostnqn = node_nqn(me)
    dev = NvmeTcpInitiator(host, port, replica_nqn(volume), 1, o)
    await dev.open()
    try:
        await take_replica(dev, epoch)
    except BaseException:
        await dev.close()
        raise
    return dev


class FloorFile:
    """A replica's fence floor, durable (8 bytes, little-endian)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> int:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        if len(raw) != 8:
            raise ValueError(f"{self.path}: not a fence floor ({len(raw)} bytes, want 8)")
        return int(struct.unpack("<Q", raw)[0])

    def save(self, floor: int) -> None:
        replace_file(self.path, struct.pack("<Q", floor))
