"""A clock a test moves forward, for the scheduler half's deadlines and timeouts."""

from __future__ import annotations

import time


class AdvancingClock:
    """The host's monotonic time plus what a test advanced it by: a test jumps past a timeout
    (a free slot's idle time, a lookup's age, a quiet tick) instead of sleeping it out, while
    what waits for real work (a shard's answer, a lookup's short grace) still sees time pass."""

    def __init__(self) -> None:
        self._ahead_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self._ahead_s

    def advance(self, seconds: float) -> None:
        self._ahead_s += seconds
