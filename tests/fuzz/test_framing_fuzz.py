"""PduReader against random and mutated byte streams (RFC 7143 §11.2 framing, §13.1 digests).

Two properties: (1) whatever the bytes, receive_data returns PDUs or raises FramingError, nothing else;
(2) for a stream of well-formed PDUs cut into arbitrary chunks, it returns exactly the PDUs an independent
model of the framing sees (same BHS, AHS, data, digest verdict), however the stream was cut.
"""

from __future__ import annotations

import random

import budget
import pdus
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openvsan.protocol.iscsi.framing import FramingError, LengthError, PduReader, digest, frame

Expected = tuple[bytes, bytes, bytes, bool]


def cut(stream: bytes, rng: random.Random) -> list[bytes]:
    """Split a stream the way TCP might: single bytes, odd sizes, whole PDUs, everything at once."""
    style = rng.randrange(4)
    if style == 0:
        return [stream]
    if style == 1:
        return [stream[i:i + 1] for i in range(len(stream))] if len(stream) < 400 else [stream]
    out, pos = [], 0
    while pos < len(stream):
        n = rng.choice((1, 2, 3, 47, 48, 49, 52, rng.randrange(1, 200))) if style == 2 else rng.randrange(1, 9000)
        out.append(stream[pos:pos + n])
        pos += n
    return out


def feed(reader: PduReader, chunks: list[bytes]) -> tuple[list[Expected], FramingError | None]:
    got: list[Expected] = []
    views = []
    try:
        for c in chunks:
            for p in reader.receive_data(c):
                views.append(p)
                got.append((bytes(p.bhs), bytes(p.ahs), bytes(p.data), p.digest_ok))
    except FramingError as e:
        return got, e
    # PDUs handed out earlier must not change when later data arrives (they are views into received bytes)
    assert [(bytes(p.bhs), bytes(p.ahs), bytes(p.data), p.digest_ok) for p in views] == got
    return got, None


def random_pdu(rng: random.Random, *, hd: bool, dd: bool, corrupt_data_digest: bool = False,
               data_out: bool = False) -> tuple[bytes, Expected]:
    """One well-formed PDU with random fields (a SCSI Data-Out's opcode where `data_out`), and what the reader
    must return for it."""
    bhs = bytearray(rng.randbytes(pdus.BHS_LEN))
    if data_out:
        bhs[0] = (bhs[0] & 0xC0) | 0x05
    ahs = rng.randbytes(4 * rng.choice((0, 0, 0, 1, 2, rng.randrange(256))))
    n = rng.choice((0, 0, 1, 2, 3, 4, 5, 48, 511, 512, 8192, rng.randrange(20000)))
    data = rng.randbytes(n)
    bhs[4] = len(ahs) // 4
    bhs[5:8] = n.to_bytes(3, "big")
    header = bytes(bhs) + ahs
    wire = header + (pdus.crc(header) if hd else b"")
    ok = True
    if n:
        padded = pdus.pad(data)
        d = pdus.crc(padded) if dd else b""
        if dd and corrupt_data_digest:
            d = bytes((d[0] ^ 0x01,)) + d[1:]
            ok = False
        wire += padded + d
    return wire, (bytes(bhs), ahs, data, ok)


PLACED = [0]   # Data-Out payloads a placing reader put where its `place` said (the shortcut was taken)


def reader(hd: bool, dd: bool, place: random.Random | None = None) -> PduReader:
    """A reader; with `place`, one that places straddling Data-Outs (framing.PduReader.place) into memory of
    its own most of the time and declines the rest (then it joins, as without)."""
    r = PduReader()
    r.header_digest, r.data_digest = hd, dd
    if place is not None:
        rng = place

        def placer(bhs: memoryview, dsl: int) -> memoryview | None:
            if rng.random() < 0.2:
                return None
            PLACED[0] += 1
            return memoryview(bytearray(dsl))
        r.place = placer
    return r


@pytest.mark.parametrize("seed", budget.SEEDS)
def test_well_formed_streams_frame_exactly(seed: int) -> None:
    rng = random.Random(seed)
    for i in range(1000):
        hd, dd = rng.random() < 0.5, rng.random() < 0.5
        place = random.Random(rng.random()) if rng.random() < 0.5 else None   # the Data-Out shortcut: same PDUs
        stream, want = b"", []
        for _ in range(rng.randrange(1, 6)):
            wire, exp = random_pdu(rng, hd=hd, dd=dd, corrupt_data_digest=rng.random() < 0.1,
                                   data_out=place is not None and rng.random() < 0.5)
            stream += wire
            want.append(exp)
        tail = rng.randbytes(rng.randrange(pdus.BHS_LEN)) if rng.random() < 0.3 else b""
        got, err = feed(reader(hd, dd, place), cut(stream + tail, rng))
        assert err is None, f"seed {seed} input {i}: {err}"
        assert got == want, f"seed {seed} input {i}"
        budget.count()
    assert PLACED[0], "no Data-Out was ever placed: the shortcut went untested"


@pytest.mark.parametrize("seed", budget.SEEDS)
def test_header_digest_error_is_fatal(seed: int) -> None:
    """§7.8: a header digest error at ERL 0 drops the connection. PDUs that arrived in earlier
    receive_data calls were delivered; those in the same call as the bad header are dropped with it (the
    session ends at ERL 0 anyway, so nothing was acknowledged for them)."""
    rng = random.Random(seed)
    for i in range(400):
        good, exp = random_pdu(rng, hd=True, dd=False)
        bad, _ = random_pdu(rng, hd=True, dd=False)
        bad = bytearray(bad)
        where = rng.randrange(pdus.BHS_LEN + bad[4] * 4 + 4)
        if 4 <= where < 8:
            where = 0  # keep the lengths, so the error is the digest and not a framing shift
        bad[where] ^= 1 << rng.randrange(8)
        got, err = feed(reader(True, False), cut(good + bytes(bad), rng))
        assert isinstance(err, FramingError), f"seed {seed} input {i}"
        assert got in ([], [exp]), f"seed {seed} input {i}"
        budget.count()


def check_any_stream(chunks: list[bytes], hd: bool, dd: bool) -> None:
    """Arbitrary bytes: PDUs or FramingError only, and the same verdict however the stream is cut."""
    whole, whole_err = feed(reader(hd, dd), [b"".join(chunks)])
    parts, parts_err = feed(reader(hd, dd), chunks)
    assert parts == whole
    assert (whole_err is None) == (parts_err is None)
    placed, placed_err = feed(reader(hd, dd, random.Random(len(chunks))), chunks)   # the Data-Out shortcut
    assert placed == parts
    assert (placed_err is None) == (parts_err is None)


@pytest.mark.parametrize("seed", budget.SEEDS)
def test_random_and_mutated_streams(seed: int) -> None:
    rng = random.Random(seed)
    templates = [
        pdus.login_request({"InitiatorName": "iqn.x", "TargetName": "iqn.y"}),
        pdus.scsi_command(pdus.write10(0, 8), itt=1, cmdsn=1, edtl=4096, write=True, data=bytes(4096)),
        pdus.scsi_command(pdus.read10(0, 8), itt=2, cmdsn=2, edtl=4096, read=True),
        pdus.data_out(bytes(1000), itt=1, offset=4096),
        pdus.nop_out(itt=3, cmdsn=3, data=b"ping"),
        pdus.text_request({"SendTargets": "All"}, itt=4, cmdsn=4),
        pdus.logout_request(itt=5, cmdsn=5),
        pdus.task_mgmt(1, itt=6, cmdsn=6, rtt=1),
        pdus.snack(itt=7),
    ]
    for i in range(5000):
        hd, dd = rng.random() < 0.3, rng.random() < 0.3
        if rng.random() < 0.2:
            stream = rng.randbytes(rng.randrange(2000))
        else:
            stream = b"".join(pdus.mutate(rng.choice(templates), rng) for _ in range(rng.randrange(1, 5)))
        try:
            check_any_stream(cut(stream, rng), hd, dd)
        except AssertionError as e:
            raise AssertionError(f"seed {seed} input {i}: {e}") from e
        budget.count()


@settings(max_examples=budget.hypothesis_examples(400), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=300), max_size=8), st.booleans(), st.booleans())
def test_hypothesis_arbitrary_chunks(chunks: list[bytes], hd: bool, dd: bool) -> None:
    check_any_stream(chunks, hd, dd)
    budget.count()


@settings(max_examples=budget.hypothesis_examples(300), deadline=None)
@given(st.binary(min_size=48, max_size=48), st.binary(max_size=3000), st.booleans(), st.booleans(),
       st.integers(min_value=1, max_value=97))
def test_hypothesis_frame_roundtrip(bhs: bytes, data: bytes, hd: bool, dd: bool, step: int) -> None:
    """What frame() sends, PduReader reads back unchanged (our target speaks its own dialect correctly)."""
    b = bytearray(bhs)
    b[4] = 0
    b[5:8] = len(data).to_bytes(3, "big")
    wire = b"".join(bytes(p) for p in frame(bytes(b), data, header_digest=hd, data_digest=dd))
    r = reader(hd, dd)
    got = []
    for i in range(0, len(wire), step):
        got += r.receive_data(wire[i:i + step])
    assert [(bytes(p.bhs), bytes(p.data), p.digest_ok) for p in got] == [(bytes(b), data, True)]
    budget.count()


@settings(max_examples=budget.hypothesis_examples(300), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from((0, 1, 48, 512, 8191, 8192, 8193, 20000)), st.integers(0, 3)),
                min_size=1, max_size=5),
       st.sampled_from(((8192, 0), (8192, 1020), (512, 4), (262144, 1020))), st.booleans(),
       st.integers(1, 9000), st.integers(0, 2**32 - 1))
def test_hypothesis_phase_limits(shape: list[tuple[int, int]], limits: tuple[int, int], hd: bool, step: int,
                                 seed: int) -> None:
    """With the phase's limits set (max_dsl, max_ahs): the PDUs up to the first one declaring more come out
    (those of the receive that refuses are dropped with the connection, like a header digest error), the
    refusal is a LengthError, and after every call the reader holds at most one PDU of the limits' size."""
    max_dsl, max_ahs = limits
    rng = random.Random(seed)
    stream, want, refused = b"", [], False
    for dsl, ahs_words in shape:
        bhs = bytearray(rng.randbytes(pdus.BHS_LEN))
        bhs[4] = ahs_words
        bhs[5:8] = dsl.to_bytes(3, "big")
        header = bytes(bhs) + bytes(4 * ahs_words)
        data = rng.randbytes(dsl)
        stream += header + (pdus.crc(header) if hd else b"") + pdus.pad(data)
        if not refused:
            if dsl > max_dsl or 4 * ahs_words > max_ahs:
                refused = True
            else:
                want.append((bytes(bhs), bytes(4 * ahs_words), data))
    r = reader(hd, False)
    r.max_dsl, r.max_ahs = max_dsl, max_ahs
    most = pdus.BHS_LEN + max_ahs + 4 + max_dsl + 3
    got: list[tuple[bytes, bytes, bytes]] = []
    err: FramingError | None = None
    step = max(step, len(stream) // 2000)
    for pos in range(0, len(stream), step):
        try:
            got += [(bytes(p.bhs), bytes(p.ahs), bytes(p.data)) for p in r.receive_data(stream[pos:pos + step])]
        except FramingError as e:
            err = e
            break
        assert r.buffered <= most
    assert isinstance(err, LengthError) == refused and (err is None) == (not refused)
    assert got == want[:len(got)] and (refused or got == want)
    if err is not None:
        assert r.buffered == 0
    budget.count()


def test_digest_matches_rfc_example() -> None:
    """RFC 7143 Appendix B.4: 32 bytes of zeros → CRC32C aa 36 91 8a, sent least significant byte first."""
    assert digest(bytes(32)) == bytes.fromhex("aa36918a")
    assert digest(b"\xff" * 32) == bytes.fromhex("43aba862")


def test_sixteen_mib_announced_then_trickled() -> None:
    """The largest DataSegmentLength the format allows: the reader waits for all of it, and a byte at a
    time until then costs nothing (no re-join of what it holds per call)."""
    r = PduReader()
    bhs = bytearray(pdus.scsi_command(pdus.write10(0, 1), itt=1, cmdsn=1, edtl=512, write=True))
    n = (1 << 24) - 1
    bhs[5:8] = n.to_bytes(3, "big")
    assert r.receive_data(bytes(bhs)) == []
    chunk = bytes(1 << 16)
    sent = 0
    while sent + len(chunk) < n:
        assert r.receive_data(chunk) == []
        sent += len(chunk)
    for _ in range(100):
        assert r.receive_data(b"\0") == []
        sent += 1
    rest = n - sent + pdus.pad(bytes(n))[n:].__len__()
    got = r.receive_data(bytes(rest))
    assert len(got) == 1 and len(got[0].data) == n
    budget.count()


@pytest.mark.soak
def test_soak_mutated_streams() -> None:
    rng = random.Random(budget.soak_inputs())
    templates = [pdus.scsi_command(pdus.write10(0, 1), itt=1, cmdsn=1, edtl=512, write=True, data=bytes(512)),
                 pdus.login_request({"InitiatorName": "iqn.x"}), pdus.nop_out(itt=1, cmdsn=1)]
    for i in range(budget.soak_inputs()):
        hd, dd = rng.random() < 0.3, rng.random() < 0.3
        stream = b"".join(pdus.mutate(rng.choice(templates), rng) for _ in range(rng.randrange(1, 5)))
        try:
            check_any_stream(cut(stream, rng), hd, dd)
        except AssertionError as e:
            raise AssertionError(f"input {i}: {e}") from e
        budget.count()
