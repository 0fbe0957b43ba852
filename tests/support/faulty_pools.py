"""Pool connections that fail as real pools do, for the connector's fault tests (the harness's
``pool_connections``)."""

from __future__ import annotations

import time

from ucm_ray.transport.base import Transfer, TransferError
from ucm_ray.transport.pools import PoolConnections


class BrokenPosts(PoolConnections):
    """Every copy raises something nobody listed (a bug on the copy thread)."""

    def post(self, by_pool, *, write):
        raise ZeroDivisionError("a bug nobody listed")


class Hung(Transfer):
    """What a read from a pool that never answers does: time out."""

    def done(self) -> bool:
        return False

    def wait(self, timeout_s: float | None = None) -> None:
        time.sleep(timeout_s or 0.0)
        raise TransferError("the pool never answered")


class HungLoads(PoolConnections):
    """Saves land; every load hangs until its timeout."""

    def post(self, by_pool, *, write):
        if write:
            return super().post(by_pool, write=write)
        return [(pool, Hung()) for pool in by_pool], set()
