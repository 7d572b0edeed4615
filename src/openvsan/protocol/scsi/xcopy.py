"""EXTENDED COPY (LID1) and RECEIVE COPY RESULTS (SPC-4 6.4, 6.22): not yet; the table stays empty."""

from __future__ import annotations

from typing import Any

HANDLERS: dict[tuple[int, int | None], Any] = {}
DATA_OUT: dict[int, Any] = {}
