"""The node's log format, for people: `2026-11-30 04:50:00 INFO  node: serving ...`."""

from __future__ import annotations

import logging
import sys
from typing import TextIO


class HumanFormatter(logging.Formatter):
    def __init__(self, tag: str = "") -> None:
        # tag: which worker process of the node wrote the line (`w1`), where there are several
        super().__init__(f"%(asctime)s %(levelname)-5s {tag + ' ' if tag else ''}%(short)s: %(message)s",
                         datefmt="%Y-%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        # openvsan.frontend.iscsi -> target.iscsi: the package name on every line is noise
        record.short = record.name.removeprefix("openvsan.")
        return super().format(record)


def setup_logging(level: str | int = "info", stream: TextIO | None = None, *, tag: str = "") -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(HumanFormatter(tag))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # the etcd client's gRPC says at debug level, with a traceback, that each call it cancels at shutdown was
    # cancelled: its warnings and errors still show, not that
    logging.getLogger("grpc").setLevel(max(logging.INFO, root.level))
