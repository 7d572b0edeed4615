"""Declared lengths against what each protocol's phase allows, fed to the sans-IO readers in pieces.

A header that declares more than the phase allows is refused from the header alone: the reader answers
(raises, or returns its terminating event) on the piece that completes the header, and holds no more than
one header plus one PDU of the phase's limit at any point. Lengths within the limit are read whole.
Issue 10, "Bounded memory for every peer before it authenticates".
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import uuid
from typing import Any

import budget
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openvsan.block import Capabilities
from openvsan.block.ram import RamDevice
from openvsan.frontend.config import IscsiTargetConfig
from openvsan.frontend.iscsi import OUR_MRDSL, Connection, IscsiServer
from openvsan.protocol.iscsi.framing import (
    HARD_MAX_AHS,
    HARD_MAX_DSL,
    LOGIN_MAX_DSL,
    FramingError,
    LengthError,
    PduReader,
    digest,
)
from openvsan.protocol.nbd import Close, ExportInfo, NbdServerConnection, Send
from openvsan.protocol.nbd.connection import MAX_OPTION_DATA
from openvsan.protocol.nbd.wire import IHAVEOPT, OPTION
from openvsan.protocol.nvme_tcp.pdu import CH, Fes, PduType
from openvsan.protocol.nvme_tcp.queue import CapsuleCommand, DataReceived, Established, TcpQueue, Terminated
from openvsan.protocol.scsi import Lun, ScsiTarget
from openvsan.volume import Volume

MIB = 1 << 20
# every length class is a case of its own; hypothesis varies how the header and data are cut
FUZZ = settings(max_examples=budget.hypothesis_examples(4), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def length_classes(limit: int, hard: int) -> list[int]:
    """Every length class the brief names: 0, small, the limit, one past it, 8 KiB, 64 KiB, 1 MiB,
    16 MiB - 4 and the format's maximum."""
    return sorted({x for x in (0, 1, 100, limit - 1, limit, limit + 1, 8192, 65536, MIB, 16 * MIB - 4, hard)
                   if 0 <= x <= hard})


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    at = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(at) if b > a]


# --- iSCSI (RFC 7143 §11.2, §13.12) -----------------------------------------------------------------------
def iscsi_header(dsl: int, ahs_words: int = 0, *, login: bool = True) -> bytes:
    b = bytearray(48)
    b[0], b[1] = (0x43, 0x81) if login else (0x01, 0x80)   # Login Request (T, CSG 0 NSG 1) / SCSI Command
    b[4] = ahs_words
    b[5:8] = dsl.to_bytes(3, "big")
    struct.pack_into(">I", b, 16, 0x1234)
    return bytes(b) + bytes(4 * ahs_words)


# (max_dsl, max_ahs) of each phase: login, full feature phase at what we declare, a smaller negotiation
ISCSI_PHASES = [(LOGIN_MAX_DSL, 0), (OUR_MRDSL, HARD_MAX_AHS), (512, HARD_MAX_AHS), (8192, 64)]
ISCSI_CASES = [(phase, dsl, ahs) for phase in ISCSI_PHASES for dsl in length_classes(phase[0], HARD_MAX_DSL)
               for ahs in sorted({0, 1, phase[1] // 4, phase[1] // 4 + 1, 255} & set(range(256)))]


@pytest.mark.parametrize("case", ISCSI_CASES)
@FUZZ
@given(st.booleans(), st.lists(st.integers(0, 1 << 20), max_size=6), st.integers(1, 70000))
def test_iscsi_refused_from_the_header(case: tuple[tuple[int, int], int, int], hd: bool, cuts: list[int],
                                       step: int) -> None:
    (max_dsl, max_ahs), dsl, ahs_words = case
    r = PduReader()
    r.max_dsl, r.max_ahs, r.header_digest = max_dsl, max_ahs, hd
    header = iscsi_header(dsl, ahs_words)
    wire_header = header + (digest(header) if hd else b"")
    over = dsl > max_dsl or 4 * ahs_words > max_ahs
    limit = len(wire_header) + max_dsl + 3
    # the lengths are judged once the BHS is in (with header digests: once its digest has been checked)
    judged_at = len(wire_header) if hd else 48
    got = []
    fed = 0
    for p in pieces(wire_header, cuts):
        fed += len(p)
        if over and fed >= judged_at:
            with pytest.raises(LengthError) as e:
                r.receive_data(p)
            assert e.value.bhs == header[:48]
            assert r.buffered == 0          # nothing of the refused PDU is held
            budget.count()
            return
        got += r.receive_data(p)
        assert r.buffered <= len(wire_header)
    assert not over
    # within the limits: the data is read, and never more than header + limit is held
    data = bytes(range(256)) * (dsl // 256) + bytes(dsl % 256)
    body = data + bytes(-dsl & 3)
    step = max(step, len(body) // 64)
    for pos in range(0, len(body), step):
        got += r.receive_data(body[pos:pos + step])
        assert r.buffered <= limit
    assert len(got) == 1 and bytes(got[0].data) == data and len(got[0].ahs) == 4 * ahs_words
    budget.count()


@pytest.mark.parametrize("dsl", [LOGIN_MAX_DSL + 1, 65536, MIB, 16 * MIB - 4, HARD_MAX_DSL])
def test_iscsi_refused_with_the_data_in_the_same_receive(dsl: int) -> None:
    """The header and the first 256 KiB of data in one receive (what uvloop hands up): refused at once,
    and nothing kept, whether the reader held bytes from before or not."""
    for held in (b"", iscsi_header(0)[:20]):
        r = PduReader()
        r.max_dsl, r.max_ahs = LOGIN_MAX_DSL, 0
        ok = iscsi_header(0)
        if held:
            assert r.receive_data(ok[:20]) == []
            stream = ok[20:] + iscsi_header(dsl) + bytes(256 * 1024)
        else:
            stream = ok + iscsi_header(dsl) + bytes(256 * 1024)
        with pytest.raises(LengthError):
            r.receive_data(stream)
        assert r.buffered == 0


def test_iscsi_bad_header_digest_is_not_taken_for_a_length() -> None:
    """§7.8: with header digests, a header that fails its digest is a digest error, not a length error."""
    r = PduReader()
    r.max_dsl, r.header_digest = 8192, True
    h = iscsi_header(16 * MIB - 4, login=False)
    with pytest.raises(FramingError) as e:
        r.receive_data(h + b"\0\0\0\0")
    assert not isinstance(e.value, LengthError)


def test_iscsi_default_reader_takes_the_format_maximum() -> None:
    r = PduReader()
    assert r.receive_data(iscsi_header(HARD_MAX_DSL, 255)) == []
    assert r.buffered == 48 + 1020


# --- iSCSI target: the answer on the wire --------------------------------------------------------------------
class Wire:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.eof = False

    def writelines(self, parts: list[Any]) -> None:
        for p in parts:
            self.out += p

    def write(self, data: Any) -> None:
        self.out += data

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    @property
    def ended(self) -> bool:
        """Closed, or half-closed by a refusal that lingers (the target sends nothing more either way)."""
        return self.closed or self.eof

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


IQN = "iqn.2026-11.org.openvsan:limits"


def iscsi_connection() -> tuple[Connection, Wire]:
    unit = Lun(Volume(RamDevice(64, 512), name="d", uuid=uuid.UUID(int=1), serial="s"))
    srv = IscsiServer([IscsiTargetConfig(IQN, ScsiTarget(IQN, {0: unit}), [("127.0.0.1", 3260)])])
    c = Connection(srv, ("127.0.0.1", 3260))
    w = Wire()
    c.connection_made(w)  # type: ignore[arg-type]
    return c, w


@pytest.mark.parametrize("dsl", [LOGIN_MAX_DSL + 1, 65536, 16 * MIB - 4, HARD_MAX_DSL])
def test_iscsi_login_header_beyond_8k_gets_a_login_reject(dsl: int) -> None:
    """RFC 7143 §13.12 (8192 until negotiated), §11.13.5: a Login Response, class 2 (initiator error), and
    the connection closes; the answer leaves after the 48 header bytes alone."""
    async def go() -> None:
        c, w = iscsi_connection()
        hdr = bytearray(iscsi_header(dsl))
        hdr[8:14] = b"\x40\0\0\0\0\x07"
        struct.pack_into(">I", hdr, 24, 77)          # CmdSN
        c.data_received(bytes(hdr))
        assert w.ended and len(w.out) == 48
        c.data_received(bytes(256 * 1024))      # what the peer still sends is dropped, not held or parsed
        assert len(w.out) == 48 and c.reader.buffered == 0
        rsp = bytes(w.out)
        assert rsp[0] == 0x23 and rsp[36:38] == b"\x02\x00"
        assert rsp[8:14] == hdr[8:14] and struct.unpack_from(">I", rsp, 16)[0] == 0x1234
        assert struct.unpack_from(">I", rsp, 28)[0] == 77     # ExpCmdSN
        assert c.reader.buffered == 0
        c.connection_lost(None)
    asyncio.run(go())


def test_iscsi_login_phase_refuses_an_ahs_and_other_opcodes_long() -> None:
    async def go() -> None:
        c, w = iscsi_connection()
        c.data_received(iscsi_header(0, 1))
        assert w.ended and bytes(w.out)[36:38] == b"\x02\x00"
        c2, w2 = iscsi_connection()
        c2.data_received(iscsi_header(MIB, login=False))
        assert w2.ended and bytes(w2.out)[36:38] == b"\x02\x0b"   # §11.13.5: invalid during login
        for x in (c, c2):
            x.connection_lost(None)
    asyncio.run(go())


def test_iscsi_full_feature_header_beyond_mrdsl_gets_a_reject() -> None:
    """After login: beyond the MaxRecvDataSegmentLength we declared, a Reject (§11.17.1 Protocol Error)
    carrying the header, then the connection closes (ERL 0). The fast lane sends it the same way."""
    from openvsan.protocol.iscsi.login import LoginState

    for lane in (True, False):
        async def go(lane: bool = lane) -> None:
            c, w = iscsi_connection()
            t = c.server.targets[IQN]
            st_ = LoginState(isid=b"\x40\0\0\0\0\1", initiator_name="iqn.x:y", target_name=IQN, target=t, cmdsn=1)
            c.server.admit(c, st_)
            c.login = None
            c.reader.max_dsl = OUR_MRDSL
            c._lane = lane
            hdr = iscsi_header(OUR_MRDSL + 4, login=False)
            c.data_received(hdr + bytes(1000))
            out = bytes(w.out)
            assert w.ended and out[0] == 0x3F and out[2] == 0x04 and out[48:96] == hdr
            assert c.reader.buffered == 0
            c.connection_lost(None)
        asyncio.run(go())


# --- NVMe/TCP (NVMe/TCP 1.0 §3.6.1, §3.6.2) -------------------------------------------------------------------
def nvme_icreq() -> bytes:
    return CH.pack(PduType.IC_REQ, 0, 128, 0, 128) + bytes(120)


def nvme_header(ptype: int, plen: int) -> bytes:
    hlen = 72 if ptype == PduType.CAPSULE_CMD else 24 if ptype != PduType.IC_REQ else 128
    pdo = hlen if plen > hlen else 0
    return CH.pack(ptype, 0, hlen, pdo, plen & 0xFFFFFFFF)


IN_CAPSULE, MAXH2C = 8192, 131072
NVME_TYPES = [PduType.IC_REQ, PduType.CAPSULE_CMD, PduType.H2C_DATA]


def nvme_limit(ptype: int, ready: bool) -> int | None:
    """The largest PLEN the phase takes for the type, or None when the type itself is refused."""
    if not ready:
        return 128 if ptype == PduType.IC_REQ else None
    if ptype == PduType.CAPSULE_CMD:
        return 72 + IN_CAPSULE
    if ptype == PduType.H2C_DATA:
        return 24 + MAXH2C
    return None  # a second ICReq: read (128 bytes), then refused


NVME_CASES = [(t, ready, plen) for t in NVME_TYPES for ready in (False, True)
              for plen in sorted({0, 8, 24, 72, 127, 128, 129, 72 + IN_CAPSULE, 73 + IN_CAPSULE, 24 + MAXH2C,
                                  25 + MAXH2C, 8192, 65536, MIB, 16 * MIB - 4, 0xFFFFFFFF})]


@pytest.mark.parametrize("case", NVME_CASES)
@FUZZ
@given(st.lists(st.integers(0, 16), max_size=4))
def test_nvme_refused_from_the_common_header(case: tuple[int, bool, int], cuts: list[int]) -> None:
    ptype, ready, plen = case
    q = TcpQueue(in_capsule=IN_CAPSULE, maxh2cdata=MAXH2C)
    if ready:
        (ev,) = q.receive_data(nvme_icreq())
        assert isinstance(ev, Established)
        q.reader.max_capsule_data = IN_CAPSULE
    hdr = nvme_header(ptype, plen)
    limit = nvme_limit(ptype, ready)
    hlen = hdr[2]
    refused = limit is None or plen > limit or plen < hlen
    if ptype == PduType.IC_REQ and ready and plen == 128:
        refused = False    # read whole, then refused as a second ICReq (128 bytes held at most)
    for i, p in enumerate(pieces(hdr, cuts)):
        evs = q.receive_data(p)
        if i < len(pieces(hdr, cuts)) - 1:
            assert evs == [] and q.reader.buffered < 8
    if refused:
        (ev,) = evs
        assert isinstance(ev, Terminated) and ev.response[0] == PduType.C2H_TERM_REQ
        fes = int.from_bytes(ev.response[8:10], "little")
        if limit is None and ptype != PduType.IC_REQ:
            assert fes == Fes.PDU_SEQUENCE_ERROR          # §3.3: nothing but ICReq before ICReq
        else:
            assert fes in (Fes.INVALID_PDU_HEADER_FIELD, Fes.DATA_TRANSFER_LIMIT_EXCEEDED)
        assert q.receive_data(bytes(1000)) == []
        budget.count()
        return
    assert evs == []
    # within the limits: the rest is taken, never more than one PDU of the limit held
    body = bytes(plen - 8)
    evs = []
    for pos in range(0, len(body), 4096):
        evs += q.receive_data(body[pos:pos + 4096])
        assert q.reader.buffered <= (limit or 128)
    assert len(evs) <= 1 and all(isinstance(e, (CapsuleCommand, DataReceived, Established, Terminated)) for e in evs)
    budget.count()


def test_nvme_capsule_before_icreq_is_refused_from_its_8_bytes() -> None:
    q = TcpQueue()
    (ev,) = q.receive_data(nvme_header(PduType.CAPSULE_CMD, 72 + 8192))
    assert isinstance(ev, Terminated) and int.from_bytes(ev.response[8:10], "little") == Fes.PDU_SEQUENCE_ERROR
    assert ev.response[24:32] == nvme_header(PduType.CAPSULE_CMD, 72 + 8192)


# --- NBD (proto.md "Option haggling") -----------------------------------------------------------------------
NBD_CASES = sorted({0, 1, 100, MAX_OPTION_DATA - 1, MAX_OPTION_DATA, MAX_OPTION_DATA + 1, 8192, 65536 + 1, MIB,
                    16 * MIB - 4, 0xFFFFFFFF})


@pytest.mark.parametrize("length", NBD_CASES)
@FUZZ
@given(st.lists(st.integers(0, 20), max_size=4), st.integers(1, 70000))
def test_nbd_option_length_refused_from_its_header(length: int, cuts: list[int], step: int) -> None:
    c = NbdServerConnection([ExportInfo("e", 1 << 20)])
    c.greeting()
    assert c.receive_data(struct.pack(">I", 1)) == []          # NBD_FLAG_C_FIXED_NEWSTYLE
    opt = OPTION.pack(IHAVEOPT, 0x7FFF, length)               # an option nobody knows
    hdr_pieces = pieces(opt, cuts)
    for i, p in enumerate(hdr_pieces):
        evs = c.receive_data(p)
        if i < len(hdr_pieces) - 1:
            assert evs == []
    if length > MAX_OPTION_DATA:
        assert len(evs) == 1 and isinstance(evs[0], Close)
        assert c.receive_data(bytes(1000)) == []
        assert len(c._acc) == 0
        budget.count()
        return
    data = bytes(length)
    evs = list(evs)
    step = max(step, len(data) // 64)
    for pos in range(0, len(data), step):
        evs += c.receive_data(data[pos:pos + step])
        assert len(c._acc) <= MAX_OPTION_DATA
    assert evs and isinstance(evs[-1], Send)    # NBD_REP_ERR_UNSUP, and haggling goes on
    budget.count()


# --- the receive budget after login: write data at the device -------------------------------------------------
class Gated:
    """RAM whose writes wait for a gate (a slow disk), with no SyncWrite: every write becomes a Task."""

    def __init__(self, inner: RamDevice) -> None:
        self.inner = inner
        self.block_size, self.num_blocks = inner.block_size, inner.num_blocks
        self.capabilities = Capabilities()   # no fast path
        self.gate = asyncio.Event()

    async def write(self, lba: int, data: Any, *, fua: bool = False) -> None:
        await self.gate.wait()
        await self.inner.write(lba, data, fua=fua)

    def __getattr__(self, name: str) -> Any:
        if name in ("read_now", "write_now"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class CountingWire(Wire):
    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.pauses = self.resumes = 0

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False
        self.resumes += 1


def write10_pdu(itt: int, cmdsn: int, lba: int, data: bytes) -> bytes:
    b = bytearray(48)
    b[0], b[1] = 0x01, 0x80 | 0x20                      # SCSI Command, F, W
    b[5:8] = len(data).to_bytes(3, "big")
    struct.pack_into(">III", b, 16, itt, len(data), cmdsn)
    b[32:42] = struct.pack(">BBIBHB", 0x2A, 0, lba, 0, len(data) // 512, 0)
    return bytes(b) + data


def test_iscsi_reading_pauses_while_write_data_waits_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past RUNNING_WRITE_BUDGET of write data at the device, reading pauses; it resumes once half drained."""
    from openvsan.frontend import portals
    from openvsan.protocol.iscsi.login import LoginState

    monkeypatch.setattr(portals, "RUNNING_WRITE_BUDGET", 64 * 1024)

    async def go() -> None:
        dev = Gated(RamDevice(1024, 512))
        unit = Lun(Volume(dev, name="d", uuid=uuid.UUID(int=1), serial="s"))  # type: ignore[arg-type]
        t = IscsiTargetConfig(IQN, ScsiTarget(IQN, {0: unit}), [("127.0.0.1", 3260)])
        srv = IscsiServer([t])
        c = Connection(srv, ("127.0.0.1", 3260))
        w = CountingWire()
        c.connection_made(w)  # type: ignore[arg-type]
        st_ = LoginState(isid=b"\x40\0\0\0\0\1", initiator_name="iqn.x:y", target_name=IQN, target=t, cmdsn=1)
        srv.admit(c, st_)
        c.login = None
        c.reader.max_dsl = OUR_MRDSL
        c._lane = True
        for i in range(3):
            c.data_received(write10_pdu(i + 1, i + 1, i * 64, bytes([i]) * 32768))
            await asyncio.sleep(0)
            assert w.paused == (i == 2), i          # 96 KiB at the device > 64 KiB: paused
        assert w.pauses == 1
        dev.gate.set()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not w.paused and w.resumes == 1 and c._running_bytes == 0
        assert bytes(await dev.inner.read(128, 64)) == bytes([2]) * 32768
        c.connection_lost(None)
    asyncio.run(go())


def test_nvme_reading_pauses_while_write_data_waits_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same budget on an NVMe/TCP I/O queue: in-capsule writes waiting on a slow device pause reading."""
    from openvsan.frontend import nvme_tcp, portals
    from openvsan.frontend.config import NvmeNamespaceConfig, NvmeSubsystemConfig
    from openvsan.protocol.nvme import host_commands as HC
    from openvsan.protocol.nvme_tcp import host_pdus as H

    monkeypatch.setattr(portals, "RUNNING_WRITE_BUDGET", 16 * 1024)
    nqn, host = "nqn.2026-11.org.openvsan:limits", "nqn.2026-11.org.openvsan:host"

    def capsule(sqe: bytes, data: bytes = b"") -> bytes:
        return b"".join(bytes(p) for p in H.capsule_cmd(sqe, data, hdgst=False, ddgst=False))

    async def go() -> None:
        dev = Gated(RamDevice(1024, 512))
        ns = NvmeNamespaceConfig(1, Volume(dev, name="d", uuid=uuid.UUID(int=2)))  # type: ignore[arg-type]
        srv = nvme_tcp.NvmeTcpServer([NvmeSubsystemConfig(nqn, [ns], [("127.0.0.1", 4420)])])
        hostid = bytes(range(16))
        conns = []
        for qid in (0, 1):
            c = nvme_tcp.Connection(srv, ("127.0.0.1", 4420))
            w = CountingWire()
            c.connection_made(w)  # type: ignore[arg-type]
            c.data_received(H.icreq(hdgst=False, ddgst=False))
            cntlid = conns[0][0].ctrl.cntlid if conns else 0xFFFF
            c.data_received(capsule(HC.connect(1, qid, 32, 30000 if qid == 0 else 0),
                                    HC.connect_data(hostid, cntlid, nqn, host)))
            for _ in range(5):
                await asyncio.sleep(0)
            assert c.ctrl is not None, bytes(w.out).hex()
            if qid == 0:   # NVMe 2.0 §3.5.1: CC.EN before an I/O queue may connect
                c.data_received(capsule(HC.property_set(2, HC.PROP_CC, HC.CC_EN | HC.CC_IO_QUEUE_ENTRY_SIZES)))
                await asyncio.sleep(0)
                assert c.ctrl.ready
            conns.append((c, w))
        c, w = conns[1]
        for i in range(3):
            c.data_received(capsule(HC.write(10 + i, 1, i * 16, 16, 8192, fua=False, in_capsule=True),
                                    bytes([i + 1]) * 8192))
            await asyncio.sleep(0)
            assert w.paused == (i == 2), i          # 24 KiB at the device > 16 KiB: paused
        dev.gate.set()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not w.paused and w.resumes == 1 and c._running_bytes == 0
        assert bytes(await dev.inner.read(32, 16)) == bytes([3]) * 8192
        for x, _ in reversed(conns):
            x.connection_lost(None)
    asyncio.run(go())
