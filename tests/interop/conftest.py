"""Interop tests: a real `vsan serve` and real initiators (libiscsi, QEMU, a Linux kernel in a guest)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from vsan_harness import VsanServer


@pytest.fixture
def server(vsan: Callable[..., VsanServer]) -> VsanServer:
    """The plain case: one 64 MiB RAM LUN, no auth, on a free port."""
    return vsan()
