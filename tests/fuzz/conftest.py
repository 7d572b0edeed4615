"""Fuzz tests: put this folder on sys.path (for pdus, client, budget) and report how many inputs ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import budget


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if budget.TOTAL["inputs"]:
        terminalreporter.write_line(f"fuzz: {budget.TOTAL['inputs']} inputs fed to the iSCSI target code")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The soak variants run only when asked for: FUZZ_INPUTS=N in the environment or `-m soak`."""
    import os

    if "FUZZ_INPUTS" in os.environ or "soak" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="soak run: set FUZZ_INPUTS=N (inputs per soak test) to run it")
    here = Path(__file__).parent
    for item in items:
        if "soak" in item.keywords and here in item.path.parents:
            item.add_marker(skip)
