"""Pool connections that fail as real pools do, for the connector's fault tests (the harness's
``pool_connections``)."""

from __future__ import annotations

import time
from typing import ClassVar

from ucm_ray.transport.base import Transfer, TransferError
from ucm_ray.transport.pools import PoolConnections


class BrokenPosts(PoolConnections):
    """Every copy raises something nobody listed (a bug on the copy thread)."""

    def post(self, by_pool, *, write):
        raise ZeroDivisionError("a bug nobody listed")


class Hung(Transfer):
    """What a read from a pool that never answers does: time out. Each wait's timeout is
    appended to ``waited`` (what the worker gave the pool, whatever the host's load)."""

    def __init__(self, waited: list[float]) -> None:
        self._waited = waited

    def done(self) -> bool:
        return False

    def wait(self, timeout_s: float | None = None) -> None:
        self._waited.append(timeout_s or 0.0)
        time.sleep(timeout_s or 0.0)
        raise TransferError("the pool never answered")


class HungLoads(PoolConnections):
    """Saves land; every load hangs until its timeout. ``waited``: the timeout of every wait for
    a hung load, in order (a class of its own per test: ``hung_loads``)."""

    waited: ClassVar[list[float]]

    def post(self, by_pool, *, write):
        if write:
            return super().post(by_pool, write=write)
        return [(pool, Hung(self.waited)) for pool in by_pool], set()


def hung_loads() -> type[HungLoads]:
    """``HungLoads`` with a ``waited`` list of its own (the harness makes the instances)."""
    return type("HungLoads", (HungLoads,), {"waited": []})
