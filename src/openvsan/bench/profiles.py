"""What to run: one `Job` (pattern, block size, threads × queue depth, read/write mix), named profiles and the
seed suites (issue 4: the StorageReview fio profiles and the DiskSpd write-percentage sweep)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

KiB = 1 << 10
MiB = 1 << 20

PATTERNS = ("rand", "seq")


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class Job:
    name: str
    pattern: str = "rand"         # rand | seq
    bs: int = 4 * KiB
    write_pct: int = 0            # 0: all reads, 100: all writes
    threads: int = 1              # worker processes, each with its own connection(s)
    qd: int = 1                   # requests each worker keeps in flight

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ProfileError(f"pattern {self.pattern!r}: want one of {', '.join(PATTERNS)}")
        if self.bs <= 0 or self.bs % 512:
            raise ProfileError(f"block size {self.bs}: want a positive multiple of 512")
        if not 0 <= self.write_pct <= 100:
            raise ProfileError(f"write mix {self.write_pct}: want 0..100 (% writes)")
        if not 1 <= self.threads <= 256 or not 1 <= self.qd <= 1024:
            raise ProfileError(f"threads {self.threads} / qd {self.qd}: want 1..256 / 1..1024")

    @property
    def rw(self) -> str:
        """fio's word for the pattern: randread, randwrite, randrw, read, write, rw."""
        kind = "read" if self.write_pct == 0 else "write" if self.write_pct == 100 else "rw"
        if self.pattern == "rand":
            return "rand" + kind
        return kind

    @property
    def writes(self) -> bool:
        return self.write_pct > 0

    def describe(self) -> str:
        mix = "" if self.write_pct in (0, 100) else f" {100 - self.write_pct}/{self.write_pct} r/w"
        return f"{format_bs(self.bs)} {self.rw}{mix}, {self.threads}T × QD{self.qd}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rw"] = self.rw
        return d


def _j(name: str, pattern: str, bs: int, write_pct: int, threads: int = 1, qd: int = 32) -> Job:
    return Job(name, pattern, bs, write_pct, threads, qd)


# The seeds' single-profile names (4k-70-30 = 70 % reads, 30 % writes, as fio's rwmixread=70).
PROFILES: dict[str, Job] = {j.name: j for j in (
    _j("4k-randread", "rand", 4 * KiB, 0),
    _j("4k-randwrite", "rand", 4 * KiB, 100),
    _j("4k-70-30", "rand", 4 * KiB, 30),
    _j("4k-90-10", "rand", 4 * KiB, 10),
    _j("4k-50-50", "rand", 4 * KiB, 50),
    _j("64k-randread", "rand", 64 * KiB, 0),
    _j("64k-randwrite", "rand", 64 * KiB, 100),
    _j("1m-seqread", "seq", MiB, 0, qd=8),
    _j("1m-seqwrite", "seq", MiB, 100, qd=8),
    _j("2m-seqread", "seq", 2 * MiB, 0, qd=8),
    _j("2m-seqwrite", "seq", 2 * MiB, 100, qd=8),
)}

# StorageReview's six fio profiles with their thread × queue-depth pairs; DiskSpd's 4K random sweep.
SUITES: dict[str, list[Job]] = {
    "storagereview": [
        _j("sr-4k-randread", "rand", 4 * KiB, 0, 16, 32),
        _j("sr-4k-randwrite", "rand", 4 * KiB, 100, 8, 4),
        _j("sr-64k-randread", "rand", 64 * KiB, 0, 4, 32),
        _j("sr-64k-randwrite", "rand", 64 * KiB, 100, 4, 1),
        _j("sr-1m-seqread", "seq", MiB, 0, 2, 8),
        _j("sr-1m-seqwrite", "seq", MiB, 100, 1, 8),
    ],
    "diskspd": [_j(f"diskspd-4k-w{w}", "rand", 4 * KiB, w, 1, 32) for w in (0, 30, 50, 70, 100)],
}

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """4k, 64K, 1m, 1MiB, 4096 → bytes (binary units, as fio reads them)."""
    m = _SIZE.match(text)
    if not m:
        raise ProfileError(f"size {text!r}: want e.g. 4k, 64k, 1m or a byte count")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def format_bs(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


_RW = {  # fio --rw word → (pattern, write_pct or None: take --mix)
    "randread": ("rand", 0), "randwrite": ("rand", 100), "randrw": ("rand", None),
    "read": ("seq", 0), "write": ("seq", 100), "rw": ("seq", None), "readwrite": ("seq", None),
    "seqread": ("seq", 0), "seqwrite": ("seq", 100),
}


def custom_job(rw: str, bs: str | int = "4k", threads: int = 1, qd: int = 1, mix: int | None = None) -> Job:
    """--rw --bs --threads --qd --mix; mix is the % of reads (fio's rwmixread), 70 means 70/30."""
    if rw not in _RW:
        raise ProfileError(f"--rw {rw!r}: want one of {', '.join(_RW)}")
    pattern, write_pct = _RW[rw]
    if write_pct is None:
        write_pct = 100 - (50 if mix is None else mix)
    elif mix is not None:
        raise ProfileError(f"--mix applies to randrw/rw, not {rw}")
    size = parse_size(bs) if isinstance(bs, str) else bs
    return Job(f"{format_bs(size).lower()}-{rw}", pattern, size, write_pct, threads, qd)


def resolve(profile: str | None, *, rw: str | None = None, bs: str | None = None, threads: int | None = None,
            qd: int | None = None, mix: int | None = None) -> list[Job]:
    """A profile name, a suite name, or the explicit options (which also override a profile's fields)."""
    if profile is None:
        return [custom_job(rw or "randread", bs or "4k", threads or 1, qd or 1, mix)]
    if profile in SUITES:
        if rw or bs or mix is not None:
            raise ProfileError(f"suite {profile!r} fixes its own patterns; drop --rw/--bs/--mix")
        jobs = SUITES[profile]
    elif profile in PROFILES:
        jobs = [PROFILES[profile]]
        if rw or bs or mix is not None:
            base = jobs[0]
            j = custom_job(rw or base.rw, bs or str(base.bs), base.threads, base.qd,
                           mix if mix is not None else (100 - base.write_pct if rw in ("randrw", "rw") else None))
            jobs = [j]
    else:
        known = ", ".join([*PROFILES, *SUITES])
        raise ProfileError(f"unknown profile {profile!r}: want one of {known}")
    return [replace(j, threads=threads or j.threads, qd=qd or j.qd) for j in jobs]


SPREAD_MAX = 8        # worker processes one job spreads over by default
SPREAD_QD = 4         # requests each of them keeps in flight, at least


def spread(job: Job, cores: int) -> Job:
    """A one-worker job over several processes, one per core this process may use (up to SPREAD_MAX), its
    queue depth shared out between them (SPREAD_QD at least each): the same requests in flight in all, and
    the client's work on several cores. The job as it is where there is one core, a queue too shallow to
    share, or a depth the workers cannot share evenly."""
    if job.threads != 1 or cores < 2:
        return job
    n = min(cores, SPREAD_MAX, job.qd // SPREAD_QD)
    while n > 1 and job.qd % n:
        n -= 1
    return replace(job, threads=n, qd=job.qd // n) if n > 1 else job
