"""Pool connections that fail as real pools do, for the connector's fault tests (the harness's
``pool_connections``)."""

from __future__ import annotations

import time
from typing import ClassVar

from ucm_ray.testing.clock import AdvancingClock
from ucm_ray.transport.base import Transfer, TransferError
from ucm_ray.transport.pools import PoolConnections


class BrokenPosts(PoolConnections):
    """Every copy raises something nobody listed (a bug on the copy thread)."""

    def post(self, by_pool, *, write):
        raise ZeroDivisionError("a bug nobody listed")


class Hung(Transfer):
    """What a read from a pool that never answers does: time out, the whole timeout it was given
    going by on the worker's ``clock`` (advanced, not slept: a frozen worker clock then moves only
    here, so the step's deadline passes when the pool used it up, however slow the host is).
    Each wait's timeout is appended to ``waited`` (what the worker gave the pool)."""

    def __init__(self, waited: list[float], clock: AdvancingClock) -> None:
        self._waited = waited
        self._clock = clock

    def done(self) -> bool:
        return False

    def wait(self, timeout_s: float | None = None) -> None:
        self._waited.append(timeout_s or 0.0)
        self._clock.advance(timeout_s or 0.0)
        raise TransferError("the pool never answered")


class HungLoads(PoolConnections):
    """Saves land; every load hangs until its timeout. ``waited``: the timeout of every wait for
    a hung load, in order; ``clock``: the worker's; ``late_s``: how late (host time) each load is
    posted, as a copy thread that a loaded host leaves without a core (``hung_loads``)."""

    waited: ClassVar[list[float]]
    clock: ClassVar[AdvancingClock]
    late_s: ClassVar[float]

    def post(self, by_pool, *, write):
        if write:
            return super().post(by_pool, write=write)
        time.sleep(self.late_s)
        return [(pool, Hung(self.waited, self.clock)) for pool in by_pool], set()


def hung_loads(clock: AdvancingClock, *, late_s: float = 0.0) -> type[HungLoads]:
    """``HungLoads`` with a ``waited`` list of its own (the harness makes the instances) on the
    worker clock ``clock`` (give the same to ``make_engine(worker_clock=...)``)."""
    return type("HungLoads", (HungLoads,), {"waited": [], "clock": clock, "late_s": late_s})
