"""What a protocol layer raises when the name a peer asked for (an NBD export, ...) is served by another
worker process of this node: the frontend hands the connection over (frontend/handoff.py)."""

from __future__ import annotations


class Elsewhere(Exception):
    """What a connection asks for is served by another worker process of this node."""

    def __init__(self, worker: int, what: str) -> None:
        super().__init__(f"{what} is served by worker {worker}")
        self.worker = worker
        self.what = what
