"""Parity kernels (openvsan.pool.parity) against the byte-by-byte reference, for every backend usable here.

The ISA-L backend runs the same tests where libisal is installed (Debian libisal2; .ci/run installs it) and
the GPU (CuPy) backend where there is a CUDA GPU; each is skipped elsewhere with the reason. On a GPU machine:
`python -m pytest tests/unit/test_parity.py -k gpu`.
"""

from __future__ import annotations

import itertools
import mmap
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openvsan.pool.parity import Parity, available, backend, gf, gf_inv, gf_mul, gf_pow2, reference_pq, reference_xor
from openvsan.pool.parity.cpu import NumpyParity
from openvsan.pool.parity.gpu import unavailable_reason
from openvsan.pool.parity.isal import unavailable_reason as isal_unavailable_reason

GPU_WHY = unavailable_reason()
ISAL_WHY = isal_unavailable_reason()

BACKENDS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("isal", id="isal", marks=pytest.mark.skipif(ISAL_WHY is not None, reason=str(ISAL_WHY))),
    pytest.param("cupy", id="gpu-cupy", marks=pytest.mark.skipif(GPU_WHY is not None, reason=str(GPU_WHY))),
]

# lengths: empty, one byte, odd multiples of 8, non-multiples of 8, a tile and a bit
LENGTHS = [0, 1, 7, 8, 9, 24, 40, 63, 100, 257]

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=BACKENDS)
def par(request: pytest.FixtureRequest) -> Parity:
    return backend(request.param)


def chunks(rng: random.Random, n: int, length: int) -> list[bytes]:
    return [rng.randbytes(length) for _ in range(n)]


# -- GF(2^8) ----------------------------------------------------------------------------------------------------


def test_gf_tables_are_the_md_field() -> None:
    assert gf.EXP[0] == 1 and gf.EXP[1] == 2
    assert gf.EXP[8] == 0x1D  # x^8 = x^4 + x^3 + x^2 + 1 under 0x11d
    assert sorted(gf.EXP[:255]) == list(range(1, 256))  # g = 2 generates the whole multiplicative group
    assert all(gf.LOG[gf.EXP[i]] == i for i in range(255))
    assert gf_mul(0x80, 2) == 0x1D


def test_gf_mul_laws() -> None:
    rng = random.Random(5)
    for a in range(256):
        assert gf_mul(a, 0) == 0 and gf_mul(0, a) == 0
        assert gf_mul(a, 1) == a
        if a:
            assert gf_mul(a, gf_inv(a)) == 1
            assert gf.gf_div(gf_mul(a, 77), a) == 77
    for _ in range(2000):
        a, b, c = rng.randrange(256), rng.randrange(256), rng.randrange(256)
        assert gf_mul(a, b) == gf_mul(b, a)
        assert gf_mul(a, gf_mul(b, c)) == gf_mul(gf_mul(a, b), c)
        assert gf_mul(a, b ^ c) == gf_mul(a, b) ^ gf_mul(a, c)
    with pytest.raises(ZeroDivisionError):
        gf_inv(0)


def test_gf_mul_matches_carryless_multiply() -> None:
    def slow(a: int, b: int) -> int:  # shift-and-add with reduction, independent of the log tables
        r = 0
        while b:
            if b & 1:
                r ^= a
            a <<= 1
            if a & 0x100:
                a ^= 0x11D
            b >>= 1
        return r

    for a in range(256):
        for b in range(0, 256, 7):
            assert gf_mul(a, b) == slow(a, b)


def test_gf_pow2_and_tables() -> None:
    assert gf_pow2(0) == 1 and gf_pow2(255) == 1 and gf_pow2(1) == 2
    assert gf_mul(gf_pow2(-3), gf_pow2(3)) == 1
    assert gf.mul_table(0x53) == bytes(gf_mul(0x53, x) for x in range(256))


def test_two_data_coefficients_solve_the_syndromes() -> None:
    rng = random.Random(9)
    for x, y in [(0, 1), (0, 7), (3, 4), (2, 200)]:
        a_, b_ = gf.raid6_two_data_coefficients(x, y)
        for _ in range(50):
            dx, dy = rng.randrange(256), rng.randrange(256)
            p = dx ^ dy
            q = gf_mul(gf_pow2(x), dx) ^ gf_mul(gf_pow2(y), dy)
            assert gf_mul(a_, p) ^ gf_mul(b_, q) == dx


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_recovery_rows_rebuild_every_loss(n: int) -> None:
    """The one-pass rows (what the ISA-L backend feeds ec_encode_data), checked in pure Python."""
    rng = random.Random(n)
    data = chunks(rng, n, 24)
    p, q = reference_pq(data)
    members = [*data, p, q]
    for lost in itertools.chain.from_iterable(itertools.combinations(range(n + 2), k) for k in (1, 2)):
        missing = [i for i in lost if i < n]
        if not missing:
            continue
        sources, rows = gf.raid6_recovery_rows(n, missing, n not in lost, n + 1 not in lost)
        assert not set(sources) & set(lost)
        for x, row in zip(missing, rows, strict=True):
            rebuilt = bytearray(24)
            for s_, c in zip(sources, row, strict=True):
                for j, byte in enumerate(members[s_]):
                    rebuilt[j] ^= gf_mul(c, byte)
            assert bytes(rebuilt) == data[x], (lost, x)
    with pytest.raises(ValueError):
        gf.raid6_recovery_rows(4, [0, 1], True, False)
    with pytest.raises(ValueError):
        gf.raid6_recovery_rows(4, [0, 1, 2], True, True)


def test_reference_by_hand() -> None:
    assert reference_pq([b"\x01", b"\x01"]) == (b"\x00", b"\x03")  # Q = 1 + 2*1
    assert reference_pq([b"\x00", b"\x80"]) == (b"\x80", b"\x1d")  # 2 * 0x80 wraps through 0x11d
    assert reference_pq([b"\x00", b"\x00", b"\x01"]) == (b"\x01", b"\x04")
    assert reference_xor([b"\x0f\xf0", b"\xff\x00"]) == b"\xf0\xf0"


# -- encode -------------------------------------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(2, 16), length=st.sampled_from(LENGTHS), seed=st.integers(0, 2**32))
def test_xor_and_pq_match_reference(par: Parity, n: int, length: int, seed: int) -> None:
    data = chunks(random.Random(seed), n, length)
    p, q = par.pq(data)
    assert (p, q) == reference_pq(data)
    assert par.xor(data) == p
    assert type(p) is bytes and type(q) is bytes


@SETTINGS
@given(n=st.integers(1, 16), length=st.sampled_from(LENGTHS), seed=st.integers(0, 2**32), at=st.integers(0, 7))
def test_encode_into_writes_what_xor_and_pq_return(par: Parity, n: int, length: int, seed: int, at: int) -> None:
    """Into writable memory of any kind (a RAM member's mapping, offset anywhere), nothing outside it touched."""
    data = chunks(random.Random(seed), n, length)
    p, q = reference_pq(data)
    mem = bytearray(b"\xa5" * (2 * length + 16))
    view = memoryview(mem)
    out_p, out_q = view[at:at + length], view[at + length + 3:at + 2 * length + 3]
    par.encode_into(data, [out_p])
    assert bytes(out_p) == p
    out_p[:] = bytes(length)
    par.encode_into(data, [out_p, out_q])
    assert (bytes(out_p), bytes(out_q)) == (p, q)
    assert mem[:at] == b"\xa5" * at and mem[at + length:at + length + 3] == b"\xa5" * 3
    assert mem[at + 2 * length + 3:] == b"\xa5" * (len(mem) - at - 2 * length - 3)


@SETTINGS
@given(n=st.integers(1, 16), blocks=st.integers(1, 12), seed=st.integers(0, 2**32), shift=st.sampled_from([0, 0, 8, 32]),
       data_writable=st.booleans())
def test_encode_into_members_memory_aligned_or_not(par: Parity, n: int, blocks: int, seed: int, shift: int,
                                                   data_writable: bool) -> None:
    """Chunks that all lie in page-aligned memory at multiples of 512 bytes, as RAM members' chunks do (ISA-L
    takes those to its RAID 6 kernel, pq_gen), give what the reference gives; so do the same chunks shifted off
    that alignment, and read-only data (ISA-L's general encoder)."""
    length = 512 * blocks
    rng = random.Random(seed)
    data = chunks(rng, n, length)
    mem = mmap.mmap(-1, (n + 2) * (length + 4096) + 4096)
    view = memoryview(mem)
    slots = [view[i * (length + 4096) + shift:i * (length + 4096) + shift + length] for i in range(n + 2)]
    for slot, d in zip(slots, data, strict=False):
        slot[:] = d
    src = slots[:n] if data_writable else data
    par.encode_into(src, slots[n:])
    assert (bytes(slots[n]), bytes(slots[n + 1])) == reference_pq(data)
    par.encode_into(src, slots[n:n + 1])
    assert bytes(slots[n]) == reference_xor(data)
    assert [bytes(x) for x in slots[:n]] == data


@SETTINGS
@given(members=st.integers(2, 8), nparity=st.sampled_from([1, 2]), rows=st.integers(1, 6), seed=st.integers(0, 2**32),
       aligned=st.booleans())
def test_encode_stripes_into_equals_encode_into_per_stripe(par: Parity, members: int, nparity: int, rows: int,
                                                           seed: int, aligned: bool) -> None:
    """Stripes laid out in one buffer per member, as a request's rows are (a rotating parity, ranges on 512-byte
    bounds or off them), get the parity encode_into gives each one; the data is left as it was. In page-aligned
    memory ISA-L takes its RAID kernels with each buffer's address taken once."""
    rng = random.Random(seed)
    size = 4096 * rows
    shift = 0 if aligned else 24
    mem = mmap.mmap(-1, members * (size + 4096))
    spans = [memoryview(mem)[i * (size + 4096) + shift:i * (size + 4096) + shift + size] for i in range(members)]
    for sp in spans:
        sp[:] = rng.randbytes(size)
    k = members - nparity
    stripes = []
    for r in range(rows):
        parity = [(members - 1 - r + j) % members for j in range(nparity)]
        data = [m for m in range(members) if m not in parity]
        start = r * 4096 + rng.choice([0, 512, 1024])
        length = rng.choice([512, 1024, 2048, 4096 - (start % 4096)])
        stripes.append((data, parity, start, length))
    before = [bytes(sp) for sp in spans]
    if k < 1:
        return
    par.encode_stripes_into(spans, stripes)
    for data, parity, start, length in stripes:
        chunks = [before[i][start:start + length] for i in data]
        want = reference_pq(chunks) if nparity == 2 else (reference_xor(chunks),)
        assert tuple(bytes(spans[j][start:start + length]) for j in parity) == tuple(want)
        assert all(bytes(spans[i][start:start + length]) == before[i][start:start + length] for i in data)


def test_encode_stripes_into_refuses_a_stripe_outside_its_buffers(par: Parity) -> None:
    mem = mmap.mmap(-1, 3 * 8192)
    spans = [memoryview(mem)[i * 8192:(i + 1) * 8192] for i in range(3)]
    with pytest.raises(ValueError, match="outside"):
        par.encode_stripes_into(spans, [((0, 1), (2,), 4096, 8192)])
    with pytest.raises(ValueError, match="outside"):
        par.encode_stripes_into([b"\0" * 512, b"\0" * 512, bytearray(256)], [((0, 1), (2,), 0, 512)])


def test_encode_into_errors(par: Parity) -> None:
    out = memoryview(bytearray(3))
    with pytest.raises(ValueError, match="no data"):
        par.encode_into([], [out])
    with pytest.raises(ValueError, match="not 2 writable bytes"):
        par.encode_into([b"ab", b"cd"], [out])
    with pytest.raises(ValueError, match="read-only"):
        par.encode_into([b"abc", b"def"], [b"xyz"])
    with pytest.raises(ValueError, match="3 output chunks: 1 .P. or 2 .P and Q."):
        par.encode_into([b"abc"], [out, out, out])


@SETTINGS
@given(
    n=st.integers(1, 16), length=st.integers(0, 300), tile=st.sampled_from([1, 8, 13, 64]), seed=st.integers(0, 2**32)
)
def test_numpy_tiling_matches_reference(n: int, length: int, tile: int, seed: int) -> None:
    """Small tiles make short chunks cross tile edges, so the tiled loops are checked against the reference."""
    data = chunks(random.Random(seed), n, length)
    par = NumpyParity(tile=tile)
    assert par.pq(data) == reference_pq(data)
    assert par.xor(data) == reference_xor(data)


def test_large_chunks_sampled_against_reference(par: Parity) -> None:
    """1 MiB + 5 bytes (many default tiles and a ragged end): the kernels are per byte column, so sampled columns
    must equal the reference over those columns."""
    rng = random.Random(1)
    n, length = 6, (1 << 20) + 5
    data = [os.urandom(length) for _ in range(n)]
    p, q = par.pq(data)
    assert par.xor(data) == p
    for j in [0, 1, 4095, 32767, 32768, 65536, length - 1, *rng.sample(range(length), 40)]:
        rp, rq = reference_pq([d[j : j + 1] for d in data])
        assert (p[j : j + 1], q[j : j + 1]) == (rp, rq), j


def test_buffer_kinds(par: Parity) -> None:
    rng = random.Random(2)
    data = chunks(rng, 4, 100)
    big = bytearray(rng.randbytes(1000))
    mixed = [data[0], bytearray(data[1]), memoryview(data[2]), memoryview(big)[333:433]]
    want = reference_pq([data[0], data[1], data[2], bytes(big[333:433])])
    assert par.pq(mixed) == want
    assert par.xor(mixed) == want[0]


def test_single_chunk(par: Parity) -> None:
    assert par.pq([b"abc"]) == (b"abc", b"abc")
    assert par.xor([b"abc"]) == b"abc"


def test_encode_errors(par: Parity) -> None:
    with pytest.raises(ValueError, match="no data"):
        par.pq([])
    with pytest.raises(ValueError, match="no data"):
        par.xor([])
    with pytest.raises(ValueError, match="differ in length"):
        par.pq([b"ab", b"abc"])
    with pytest.raises(ValueError, match="differ in length"):
        par.xor([b"ab", b"abc"])
    with pytest.raises(ValueError, match="at most 255"):
        par.pq([b"a"] * 256)


# -- recover --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("length", [1, 9, 64, 100])
def test_recover_every_loss_of_up_to_two(par: Parity, n: int, length: int) -> None:
    rng = random.Random(n * 1000 + length)
    data = chunks(rng, n, length)
    p, q = reference_pq(data)
    members: list[bytes | None] = [*data, p, q]
    for lost in itertools.chain.from_iterable(itertools.combinations(range(n + 2), k) for k in (0, 1, 2)):
        have = [None if i in lost else m for i, m in enumerate(members)]
        got = par.recover(have[:n], have[n], have[n + 1])
        assert got == data, f"lost {lost}"
        assert all(type(b) is bytes for b in got)


@SETTINGS
@given(n=st.integers(2, 16), length=st.sampled_from(LENGTHS), seed=st.integers(0, 2**32), data_=st.data())
def test_recover_random_two_data(par: Parity, n: int, length: int, seed: int, data_: st.DataObject) -> None:
    data = chunks(random.Random(seed), n, length)
    p, q = par.pq(data)
    x, y = data_.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
    have: list[bytes | None] = list(data)
    have[x] = have[y] = None
    assert par.recover(have, p, q) == data
    have = list(data)
    have[x] = None
    assert par.recover(have, None, q) == data  # one data chunk and P lost: from Q alone


def test_recover_large(par: Parity) -> None:
    n, length = 8, 300_001  # several tiles, a ragged end
    data = [os.urandom(length) for _ in range(n)]
    p, q = par.pq(data)
    have: list[bytes | None] = list(data)
    have[2] = have[7] = None
    assert par.recover(have, p, q) == data
    have = list(data)
    have[5] = None
    assert par.recover(have, None, q) == data


@pytest.mark.parametrize("n", [1, 2, 4])
def test_recover_three_lost_is_an_error(par: Parity, n: int) -> None:
    data = chunks(random.Random(3), n, 16)
    p, q = reference_pq(data)
    members: list[bytes | None] = [*data, p, q]
    for lost in itertools.combinations(range(n + 2), 3):
        have = [None if i in lost else m for i, m in enumerate(members)]
        with pytest.raises(ValueError, match="at most two"):
            par.recover(have[:n], have[n], have[n + 1])


def test_recover_errors(par: Parity) -> None:
    with pytest.raises(ValueError, match="differ in length"):
        par.recover([b"ab", None], b"abc", b"ab")
    with pytest.raises(ValueError):
        par.recover([], b"a", b"a")


def test_recover_returns_given_chunks_unchanged(par: Parity) -> None:
    data = [b"\x01" * 8, bytearray(b"\x02" * 8), memoryview(b"\x03" * 8)]
    p, q = reference_pq(data)
    got = par.recover([data[0], None, data[2]], p, q)
    assert got == [b"\x01" * 8, b"\x02" * 8, b"\x03" * 8]


# -- read-modify-write ----------------------------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 16), length=st.sampled_from(LENGTHS), seed=st.integers(0, 2**32), data_=st.data())
def test_pq_update_equals_recompute(par: Parity, n: int, length: int, seed: int, data_: st.DataObject) -> None:
    rng = random.Random(seed)
    data = chunks(rng, n, length)
    p, q = par.pq(data)
    index = data_.draw(st.integers(0, n - 1))
    new = rng.randbytes(length)
    p2, q2 = par.pq_update(index, data[index], new, p, q)
    data[index] = new
    assert (p2, q2) == reference_pq(data)
    p3, q3 = par.pq_update(index, new, new, p2, None)  # RAID 5 form: no Q in, none out
    assert (p3, q3) == (p2, None)


@SETTINGS
@given(n=st.integers(1, 16), length=st.sampled_from([*LENGTHS, 4096, 4100, 65536]), seed=st.integers(0, 2**32),
       data_=st.data())
def test_update_into_writes_pq_update_over_p_and_q(par: Parity, n: int, length: int, seed: int,
                                                   data_: st.DataObject) -> None:
    """update_into leaves in P's and Q's own memory what pq_update returns (ISA-L takes P and Q as sources and
    outputs of one call: lengths under its vector width go to its portable code, the rest to its kernels), for
    RAID 6 and for RAID 5 (no Q); old and new are left as they were."""
    rng = random.Random(seed)
    data = chunks(rng, n, length)
    p, q = par.pq(data)
    index = data_.draw(st.integers(0, n - 1))
    old, new = bytearray(data[index]), rng.randbytes(length)
    want_p, want_q = par.pq_update(index, old, new, p, q)
    pm, qm = bytearray(p), bytearray(q)
    par.update_into(index, memoryview(old), new, memoryview(pm), memoryview(qm))
    assert (bytes(pm), bytes(qm)) == (bytes(want_p), bytes(want_q or b""))
    assert old == data[index]
    p5 = bytearray(p)
    par.update_into(index, old, memoryview(new), p5, None)
    assert bytes(p5) == bytes(want_p)
    data[index] = new
    assert (bytes(pm), bytes(qm)) == reference_pq(data)


def test_pq_update_every_index_large(par: Parity) -> None:
    """Every index uses a different multiplier (doublings for small ones, a table for the rest)."""
    n, length = 16, 70_003
    data = [os.urandom(length) for _ in range(n)]
    p, q = par.pq(data)
    for index in range(n):
        new = os.urandom(length)
        p, q2 = par.pq_update(index, data[index], bytearray(new), memoryview(p), q)
        assert q2 is not None
        q = q2
        data[index] = new
    assert (p, q) == par.pq(data)
    assert p == par.xor(data)


def test_pq_update_errors(par: Parity) -> None:
    with pytest.raises(ValueError, match="differ in length"):
        par.pq_update(0, b"ab", b"abc", b"ab", b"ab")
    with pytest.raises(ValueError, match="index"):
        par.pq_update(-1, b"a", b"b", b"c", b"d")
    with pytest.raises(ValueError, match="index"):
        par.pq_update(255, b"a", b"b", b"c", b"d")


# -- backend choice -----------------------------------------------------------------------------------------------


def test_backend_names() -> None:
    assert backend("numpy").name == "numpy"
    assert isinstance(backend("numpy"), Parity)
    auto = backend()
    assert auto is backend("auto")
    assert auto.name == ("cupy" if GPU_WHY is None else "numpy" if ISAL_WHY else "isal")
    with pytest.raises(ValueError, match="unknown parity backend 'raid9'"):
        backend("raid9")


def test_available_says_why() -> None:
    avail = available()
    assert avail["numpy"] is None
    assert avail["isal"] == ISAL_WHY
    if ISAL_WHY is not None:
        assert "libisal2" in ISAL_WHY
    if GPU_WHY is None:
        assert avail["cupy"] is None
    else:
        assert "no CUDA GPU" in str(avail["cupy"])
        with pytest.raises(ValueError, match="no CUDA GPU"):
            backend("cupy")


def test_gpu_backend_present_or_skip_reason_visible() -> None:
    """Fails on a machine that has a GPU and CuPy yet cannot use them; elsewhere reports why it skips."""
    if GPU_WHY is not None:
        pytest.skip(GPU_WHY)
    assert backend("cupy").name == "cupy"


def test_isal_missing_library_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from openvsan.pool.parity import isal

    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(isal.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(isal.ctypes, "CDLL", no_library)
    with pytest.raises(ValueError, match=r"'isal' is unavailable: libisal.so.2: .*apt-get install libisal2"):
        isal._library.__wrapped__()


def test_threads_share_a_backend(par: Parity) -> None:
    """The pool may run parity in worker threads: one backend object, concurrent calls, no crossed scratch."""
    from concurrent.futures import ThreadPoolExecutor

    def work(seed: int) -> bool:
        rng = random.Random(seed)
        length = rng.choice([4096, 65536 + 3, 300_000])
        data = [rng.randbytes(length) for _ in range(5)]
        ok = True
        for _ in range(5):
            p, q = par.pq(data)
            have: list[bytes | None] = list(data)
            have[1] = have[3] = None
            ok &= par.recover(have, p, q) == data
            ok &= (p[:64], q[:64]) == reference_pq([d[:64] for d in data])
        return ok

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(8)))
