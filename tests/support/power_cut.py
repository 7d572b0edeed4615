"""A device that loses power: FaultDevice with a volatile cache whose crash writes back `survive` of what it
held (blocks chosen by `rng`), for the power-cut tests of the thin volume group and the compression layer."""

from __future__ import annotations

import random

from openvsan.block import FaultDevice
from openvsan.block.device import BlockDevice


class PowerCut(FaultDevice):
    """crash_after_writes cuts the power with `survive` of the cache written back, blocks chosen by `rng`."""

    def __init__(self, inner: BlockDevice, survive: float, rng: random.Random) -> None:
        super().__init__(inner, volatile_cache=True)
        self.survive, self.rng = survive, rng

    def crash(self, *, survive: float | None = None, rng: random.Random | None = None) -> None:
        super().crash(survive=self.survive if survive is None else survive, rng=rng or self.rng)
