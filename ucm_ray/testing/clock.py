"""A clock a test moves forward, for the scheduler half's deadlines and timeouts."""

from __future__ import annotations

import time


class AdvancingClock:
    """The host's monotonic time plus what a test advanced it by: a test jumps past a timeout
    (a free slot's idle time, a lookup's age, a quiet tick) instead of sleeping it out, while
    what waits for real work (a shard's answer, a lookup's short grace) still sees time pass.

    ``freeze()`` stops the host's time from counting: from then on only ``advance`` moves it,
    so a test whose outcome depends on how long steps take (the slot supply's ticks) gets the
    same answer on a fast box and on a loaded CI machine. Only for the in-process store, whose
    answers are in at once: a wait for a real shard would never see its deadline pass."""

    def __init__(self) -> None:
        self._ahead_s = 0.0
        self._frozen_at: float | None = None

    def __call__(self) -> float:
        if self._frozen_at is not None:
            return self._frozen_at + self._ahead_s
        return time.monotonic() + self._ahead_s

    def advance(self, seconds: float) -> None:
        self._ahead_s += seconds

    def freeze(self) -> None:
        """Stop following the host's time (see the class docstring)."""
        if self._frozen_at is None:
            self._frozen_at = time.monotonic()
