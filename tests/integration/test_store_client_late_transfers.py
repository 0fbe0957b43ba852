"""``StoreClient.get`` / ``put`` whose NIXL transfer timed out while its shard was stalled.

NIXL cannot cancel a read or write in flight: released, it still lands once the shard runs again
(tests/integration/test_nixl_late_reads.py). The connector's worker fences such reads and
reports such writes uncertain; these tests hold the store's own client API to the same: after
``get`` returns, nothing lands in the caller's tensors (not even over a replica's bytes read into
them); a shard stalled for good makes ``get`` fail rather than return tensors that may still
change; a timed-out ``put`` leaves its slots to no other writer while its write may land.

A real fleet on this node, reached through NIXL (``transport="nixl"``, no host staging: the
read lands in the caller's tensor itself, as on a host with RDMA). This process's NIXL agent runs
UCX over TCP only (``UCX_TLS=tcp``): with ``cma`` UCX would read a stopped shard's memory without
it, and a read would never stall.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import ray
import torch

from tests.support.polling import until
from tests.support.store_helpers import key
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.transport.base import LateReadError, PoolKey
from ucm_ray.transport.nixl import shutdown_client_agent

NBYTES = 1 << 20
POOL_BYTES = 16 << 20
TIMEOUT_S = 1.0
RESUME_S = 1.6
"""When a stalled shard runs again, from the call's start: past its transfer's timeout (the call
gave up on it), within the ``transfer_timeout_s`` more a call waits for a late read."""
SETTLE_S = 0.5
"""How long a late transfer is given to land once its shard runs again (it takes milliseconds)."""


@pytest.fixture(scope="module")
def tcp_only() -> Iterator[None]:
    """This process's NIXL client agent, made afresh with UCX over TCP only (and again after)."""
    shutdown_client_agent()
    before = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"
    try:
        yield
    finally:
        shutdown_client_agent()
        if before is None:
            del os.environ["UCX_TLS"]
        else:
            os.environ["UCX_TLS"] = before


class Stalled:
    """A shard's process, stopped with SIGSTOP (a long pause, a swapped-out host) and resumed."""

    def __init__(self, cfg, pool: PoolKey) -> None:
        self.pid = ray.get(ray.get_actor(pool[0], namespace=cfg.ray_namespace).stats.remote(), timeout=30)["pid"]

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        assert until(lambda: psutil.Process(self.pid).status() == psutil.STATUS_STOPPED, 10.0), "never stopped"

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


def _fleet(fleet, replication: int):
    return fleet(num_shards=replication, replication=replication, transport="nixl", nixl_stage_through_host="off",
                 pool_bytes=POOL_BYTES, transfer_timeout_s=TIMEOUT_S, lookup_timeout_s=TIMEOUT_S)


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("replication", [1, 2])
def test_after_get_returns_a_timed_out_read_lands_nowhere_in_the_callers_tensor(fleet, tcp_only, replication):
    """The key's first owner stalls; ``get`` times out reading it, and the shard runs again
    ``RESUME_S`` after the call began. Once ``get`` returned (a miss, or with a replica the
    replica's bytes), the caller writes its tensor: nothing changes it afterwards. Before:
    ``get`` returned at the timeout (with a replica, after reading the replica into the same
    tensor) and the stalled shard's read landed in the tensor later, over what the caller had
    put there."""
    cfg = _fleet(fleet, replication)
    client = StoreClient(cfg)
    data, buf = _random(NBYTES, seed=7), torch.zeros(NBYTES, dtype=torch.uint8)
    client.register_local(data)
    client.register_local(buf)
    k = key(0, "late-get")
    stalled = None
    try:
        assert client.put([k], [data]) == [True]  # NIXL's connections to every owner are up
        assert client.get([k], [buf]) == [True] and torch.equal(buf, data)
        stalled = Stalled(cfg, client.owners([k])[0][0])
        buf.zero_()
        stalled.stop()
        resume = threading.Timer(RESUME_S, stalled.resume)
        resume.start()
        got = client.get([k], [buf])
        returned = buf.clone()
        buf.fill_(0x5A)  # the caller uses its tensor again
        resume.join()
        time.sleep(SETTLE_S)
        assert bool((buf == 0x5A).all()), "the timed-out read landed in the caller's tensor after get returned"
        assert got == [replication > 1]
        if replication > 1:
            assert torch.equal(returned, data), "the replica's bytes were not read"
    finally:
        if stalled is not None:
            stalled.resume()
        client.close()


def test_a_get_whose_read_is_still_in_flight_a_timeout_later_raises(fleet, tcp_only):
    """A shard stalled for good: ``get`` waits ``transfer_timeout_s`` past its read's timeout,
    then raises ``LateReadError`` rather than return a tensor the read may still write. Before:
    it returned a miss at the timeout, the read still in flight into the caller's tensor."""
    cfg = _fleet(fleet, 1)
    client = StoreClient(cfg)
    data, buf = _random(NBYTES, seed=8), torch.zeros(NBYTES, dtype=torch.uint8)
    client.register_local(data)
    client.register_local(buf)
    k = key(0, "stalled-get")
    stalled = None
    try:
        assert client.put([k], [data]) == [True]
        stalled = Stalled(cfg, client.owners([k])[0][0])
        stalled.stop()
        started = time.monotonic()
        with pytest.raises(LateReadError, match="still in flight"):
            client.get([k], [buf])
        assert time.monotonic() - started >= 2 * TIMEOUT_S * 0.9
        stalled.resume()
        assert until(lambda: torch.equal(buf, data), 30.0), "the late read never landed: it was not in flight"
    finally:
        if stalled is not None:
            stalled.resume()
        client.close()


def test_a_put_whose_write_timed_out_leaves_its_slots_to_no_other_writer(fleet, tcp_only, monkeypatch):
    """The shard stalls right after granting ``put`` its slots, so the write times out. Once the
    shard runs again another writer asks for every slot of the pool: it gets none of those (they
    stay reserved, then quarantined by the shard, as the connector's uncertain saves' are), and
    the late write lands there. Before: ``put`` freed them, and the next writer was handed
    slots the late write could still land in."""
    cfg = _fleet(fleet, 1)
    client, other = StoreClient(cfg), StoreClient(cfg)
    data = _random(3 * NBYTES, seed=9)
    client.register_local(data)
    views = [data[i * NBYTES:(i + 1) * NBYTES] for i in range(3)]
    (pool,) = client.owners([key(0, "warm")])[0]
    stalled = Stalled(cfg, pool)
    granted: list[int] = []
    reserve = client._reserve

    def reserve_then_stall(*args):
        placed = reserve(*args)
        granted.extend(offset for _, _, _, offset in placed)
        stalled.stop()
        return placed

    try:
        assert client.put([key(0, "warm")], views[:1]) == [True]  # NIXL's connection is up
        monkeypatch.setattr(client, "_reserve", reserve_then_stall)
        assert client.put([key(i, "late-put") for i in range(2)], views[1:]) == [False, False]
        assert len(granted) == 2
        stalled.resume()
        time.sleep(SETTLE_S)  # what put sent the shard while it was stopped is answered first
        grant = other.reserve(pool, NBYTES, POOL_BYTES // NBYTES).result()
        assert grant is not None
        assert not set(granted) & set(grant.offsets), \
            "a timed-out write's slots were handed to another writer while the write could still land"
    finally:
        stalled.resume()
        client.close()
        other.close()


def test_closing_a_client_frees_no_staging_slab_a_timed_out_read_may_still_land_in(fleet, tcp_only):
    """Staged reads (``nixl_stage_through_host``: ``on``; ``auto`` for host memory on a host
    without RDMA): ``get`` times out reading a stalled shard, its slab is quarantined, then the
    client is closed while the shard is still stopped. This process then allocates host memory
    of the slab's size, filled with 0x5A, until it is handed the slab's address (at most 128
    tensors); once the shard runs again, none of it changes. Before: ``close`` dropped the
    quarantined slab with the rest, the allocator handed its memory to a new tensor, and the
    late read landed there."""
    cfg = fleet(num_shards=1, transport="nixl", nixl_stage_through_host="on", pool_bytes=POOL_BYTES,
                transfer_timeout_s=TIMEOUT_S, lookup_timeout_s=TIMEOUT_S)
    client = StoreClient(cfg)
    data, buf = _random(NBYTES, seed=10), torch.zeros(NBYTES, dtype=torch.uint8)
    k = key(0, "closed-staged")
    stalled = None
    try:
        assert client.put([k], [data]) == [True]
        stalled = Stalled(cfg, client.owners([k])[0][0])
        stalled.stop()
        logging.disable(logging.WARNING)  # pytest keeps log records: their exceptions' frames hold the slab
        try:
            assert client.get([k], [buf]) == [False]
        finally:
            logging.disable(logging.NOTSET)
        staging = client.connections.staging
        assert staging is not None and staging.quarantined == 1
        (slab,) = staging.slab_addresses
    finally:
        client.close()
    try:
        gc.collect()  # a slab and its transfer refer to each other
        after: list[torch.Tensor] = []
        while len(after) < 128 and not any(t.data_ptr() <= slab < t.data_ptr() + NBYTES for t in after):
            after.append(torch.full((NBYTES,), 0x5A, dtype=torch.uint8))
        stalled.resume()
        time.sleep(SETTLE_S)
        assert all(bool((t == 0x5A).all()) for t in after), \
            "a timed-out read landed in memory that close freed and this process allocated again"
    finally:
        stalled.resume()
