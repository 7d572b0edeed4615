"""Named profiles, the seed suites and the explicit --rw/--bs/--threads/--qd/--mix options."""

from __future__ import annotations

import pytest

from openvsan.bench.profiles import PROFILES, SUITES, Job, ProfileError, custom_job, parse_size, resolve

KiB, MiB = 1 << 10, 1 << 20


def test_every_seed_profile_exists() -> None:
    want = {"4k-randread": ("rand", 4 * KiB, 0), "4k-randwrite": ("rand", 4 * KiB, 100),
            "4k-70-30": ("rand", 4 * KiB, 30), "4k-90-10": ("rand", 4 * KiB, 10), "4k-50-50": ("rand", 4 * KiB, 50),
            "64k-randread": ("rand", 64 * KiB, 0), "64k-randwrite": ("rand", 64 * KiB, 100),
            "1m-seqread": ("seq", MiB, 0), "1m-seqwrite": ("seq", MiB, 100),
            "2m-seqread": ("seq", 2 * MiB, 0), "2m-seqwrite": ("seq", 2 * MiB, 100)}
    assert set(PROFILES) == set(want)
    for name, (pattern, bs, w) in want.items():
        j = PROFILES[name]
        assert (j.pattern, j.bs, j.write_pct) == (pattern, bs, w), name


def test_storagereview_suite_pairs() -> None:
    got = [(j.rw, j.bs, j.threads, j.qd) for j in SUITES["storagereview"]]
    assert got == [("randread", 4 * KiB, 16, 32), ("randwrite", 4 * KiB, 8, 4), ("randread", 64 * KiB, 4, 32),
                   ("randwrite", 64 * KiB, 4, 1), ("read", MiB, 2, 8), ("write", MiB, 1, 8)]


def test_diskspd_suite_sweeps_write_percentages() -> None:
    assert [j.write_pct for j in SUITES["diskspd"]] == [0, 30, 50, 70, 100]
    assert {j.bs for j in SUITES["diskspd"]} == {4 * KiB} and {j.pattern for j in SUITES["diskspd"]} == {"rand"}


def test_explicit_options() -> None:
    (j,) = resolve(None, rw="randrw", bs="16k", threads=3, qd=7, mix=70)
    assert (j.pattern, j.bs, j.threads, j.qd, j.write_pct, j.rw) == ("rand", 16 * KiB, 3, 7, 30, "randrw")
    (j,) = resolve("4k-randread", threads=2, qd=64)
    assert (j.threads, j.qd, j.bs) == (2, 64, 4 * KiB)
    (j,) = resolve("4k-randread", bs="8k")
    assert j.bs == 8 * KiB and j.rw == "randread"
    assert len(resolve("storagereview", qd=2)) == 6 and {j.qd for j in resolve("storagereview", qd=2)} == {2}
    assert custom_job("write", "1m").pattern == "seq"


@pytest.mark.parametrize("bad", [lambda: resolve("nope"), lambda: resolve(None, rw="sideways"),
                                 lambda: resolve(None, rw="randread", mix=50), lambda: resolve(None, bs="3x"),
                                 lambda: resolve("diskspd", rw="randread"), lambda: Job("x", bs=1000),
                                 lambda: Job("x", write_pct=101), lambda: Job("x", qd=0)])
def test_bad_options_are_profile_errors(bad: object) -> None:
    with pytest.raises(ProfileError):
        bad()  # type: ignore[operator]


def test_sizes() -> None:
    assert [parse_size(s) for s in ("4k", "64K", "1m", "1MiB", "2g", "4096")] == [4096, 65536, MiB, MiB, 2 << 30, 4096]


def test_one_target_s_load_is_spread_over_the_cores_by_default() -> None:
    from openvsan.bench.profiles import PROFILES, spread

    qd32 = PROFILES["4k-randread"]
    assert (qd32.threads, qd32.qd) == (1, 32)
    assert (spread(qd32, 1).threads, spread(qd32, 1).qd) == (1, 32)       # one core: as it is
    assert (spread(qd32, 2).threads, spread(qd32, 2).qd) == (2, 16)       # the same 32 in flight, two processes
    assert (spread(qd32, 16).threads, spread(qd32, 16).qd) == (8, 4)      # at most 8, at least 4 each
    qd1 = resolve(None, rw="randread", qd=1)[0]
    assert spread(qd1, 8) == qd1                                           # nothing to share
    odd = resolve(None, rw="randread", qd=12)[0]
    assert (spread(odd, 8).threads, spread(odd, 8).qd) == (3, 4)          # shared evenly or not at all
    two = resolve(None, rw="randread", qd=8, threads=2)[0]
    assert spread(two, 8) == two                                           # --threads given: kept
