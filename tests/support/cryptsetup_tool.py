"""The real cryptsetup (Debian cryptsetup-bin) for the LUKS2 tests: run it with a key file or key bytes on
stdin, and read the volume key it dumps."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def cryptsetup(*args: str, key: bytes | None = None, key_file: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    """`cryptsetup ARGS`, the passphrase from `key` (stdin) or `key_file`; fails loudly if it is not installed."""
    if shutil.which("cryptsetup") is None:
        pytest.fail("cryptsetup is not installed (Debian cryptsetup-bin; .ci/run installs it)", pytrace=False)
    extra = ["--key-file", "-"] if key is not None else ["--key-file", str(key_file)] if key_file is not None else []
    return subprocess.run(["cryptsetup", *args, *extra], input=key, capture_output=True, timeout=120, check=False)


def dumped_volume_key(image: Path, *, key: bytes | None = None, key_file: Path | None = None) -> bytes:
    """The volume key `cryptsetup luksDump --dump-volume-key` prints for `image`, opened with that passphrase."""
    r = cryptsetup("luksDump", "--dump-volume-key", "--batch-mode", str(image), key=key, key_file=key_file)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("MK dump:"))
    hexed = lines[at].partition(":")[2] + "".join(line for line in lines[at + 1:] if line.startswith("\t"))
    return bytes.fromhex("".join(hexed.split()))
