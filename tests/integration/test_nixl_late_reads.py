"""NIXL reads that time out while their shard is stalled, with real NIXL between Ray actors.

A shard whose process is stopped (SIGSTOP: a long pause, a swapped-out host) does not answer a
read over UCX's TCP transport (its progress thread is stopped with it), so the read stays in
flight. What NIXL 1.5.1 does when such a request is released: ``releaseXferReq`` ->
``nixlUcxBackendReqH::release`` -> ``ucp_request_cancel``, which cancels nothing for an RMA
operation (UCX cancels receives only), then ``ucp_request_free``: the release succeeds, raises
nothing, and the read still lands once the shard runs again. These tests pin that fact and the
guards it calls for: a timed-out read stays over-or-not (``done``) until it really is; a staged
read's slab is quarantined until then; an unstaged read's KV blocks are fenced off.

The stalled shard's actor runs UCX with ``UCX_TLS=tcp``: on one host UCX would pick ``cma``
(process_vm_readv), which reads a stopped process's memory without it and lands in the post.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from tests.support.nixl_pool_actor import pool_actor_class
from tests.support.polling import until
from tests.support.small_ray import own_or_session_ray
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.types import Location
from ucm_ray.transport.base import CopyOp, LateReadError, Ranges, TransferError
from ucm_ray.transport.nixl import NixlPoolTransport, shutdown_client_agent
from ucm_ray.transport.nixl.client import client_agent
from ucm_ray.transport.nixl.staging import HostStaging
from ucm_ray.transport.pools import PoolConnections
from ucm_ray.vllm.metadata import BlockLoads, LoadJob, UcmRayConnectorMetadata
from ucm_ray.vllm.worker import WorkerPart

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

POOL = 4 << 20
NBYTES = 1 << 20
TIMEOUT_S = 1.0
LANDS_S = 30.0
"""How long a late read is given to land once its shard runs again (it takes milliseconds)."""


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def cluster():
    with own_or_session_ray() as ray:
        yield ray
    shutdown_client_agent()


class Shard:
    """A pool actor filled with ``seed``'s bytes; ``tcp``: reached over UCX's TCP transport only."""

    def __init__(self, ray, shard_id: str, seed: int, *, tcp: bool) -> None:
        options = {"runtime_env": {"env_vars": {"UCX_TLS": "tcp"}}} if tcp else {}
        self.ray = ray
        self.actor = pool_actor_class().options(**options).remote(POOL)
        self.desc = ray.get(self.actor.descriptor.remote(shard_id, 1), timeout=120)
        self.pid = ray.get(self.actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)
        ray.get(self.actor.fill.remote(0, POOL, seed), timeout=60)
        self.bytes = _random(POOL, seed)
        self.stopped = False

    def pool(self, offset: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.ray.get(self.actor.read.remote(offset, nbytes), timeout=60)),
                                dtype=torch.uint8)

    def stop(self) -> None:
        """Stopped once this returns (a signal is delivered asynchronously: a read posted right
        after ``kill`` could still be served)."""
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True
        assert until(lambda: psutil.Process(self.pid).status() == psutil.STATUS_STOPPED, 10.0), "never stopped"

    def resume(self) -> None:
        if self.stopped:
            os.kill(self.pid, signal.SIGCONT)
            self.stopped = False

    def close(self) -> None:
        self.resume()
        try:
            self.ray.get(self.actor.close.remote(), timeout=60)
        except Exception:  # noqa: BLE001 -- gone already
            pass
        self.ray.kill(self.actor)
        if os.path.exists(self.desc.shm_path):
            os.unlink(self.desc.shm_path)


@pytest.fixture
def stalled(cluster) -> Iterator[Shard]:
    shard = Shard(cluster, "stalled", seed=1, tcp=True)
    yield shard
    shard.close()


@pytest.fixture
def healthy(cluster) -> Iterator[Shard]:
    shard = Shard(cluster, "healthy", seed=2, tcp=False)
    yield shard
    shard.close()



def _connected(transport: NixlPoolTransport, buf: torch.Tensor) -> None:
    """One read that lands: UCX's connection to the shard is up before it stops."""
    transport.read(Ranges.of([CopyOp(0, buf[:4096])])).wait(60)


def test_nixl_releasing_an_in_flight_read_does_not_cancel_it(stalled):
    """The fact the guards rest on: a read released while NIXL reports it ``PROC`` raises
    nothing on release, and its bytes land once the shard runs again."""
    transport = NixlPoolTransport(stalled.desc)
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    transport.register_local(dst)
    agent = client_agent().agent
    try:
        _connected(transport, dst)
        dst.zero_()
        stalled.stop()
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs([(dst.data_ptr(), NBYTES, 0)], "DRAM"),
                                       agent.get_xfer_descs([(stalled.desc.pool_base_addr, NBYTES, 0)], "DRAM"),
                                       transport._remote)
        assert agent.transfer(handle) == "PROC"
        time.sleep(TIMEOUT_S)
        assert agent.check_xfer_state(handle) == "PROC", "the stalled shard answered"
        handle.release()  # no exception: NIXL took the release as a cancel
        assert not bool(dst.any())
        stalled.resume()
        assert until(lambda: torch.equal(dst, stalled.bytes[:NBYTES]), LANDS_S), "the released read never landed"
    finally:
        stalled.resume()
        transport.close()


def test_a_timed_out_read_is_not_done_until_its_bytes_can_no_longer_land(stalled):
    """``wait`` fails at its timeout, but ``done`` stays False while the request is in flight
    (before: its handles were released and it said done, with its bytes still to land)."""
    transport = NixlPoolTransport(stalled.desc)
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    transport.register_local(dst)
    try:
        _connected(transport, dst)
        dst.zero_()
        stalled.stop()
        transfer = transport.read(Ranges.of([CopyOp(0, dst)]))
        with pytest.raises(TransferError, match="timed out"):
            transfer.wait(TIMEOUT_S)
        assert not transfer.done(), "a timed-out read said done while its bytes could still land"
        assert transfer.late(), "a timed-out read in flight is not marked late"
        stalled.resume()
        assert until(transfer.done, LANDS_S), "the late read never finished"
        assert torch.equal(dst, stalled.bytes[:NBYTES])
        assert not transfer.late()
        with pytest.raises(TransferError, match="timed out"):  # still a failure: its step gave up on it
            transfer.wait(0.0)
    finally:
        stalled.resume()
        transport.close()


def test_a_timed_out_read_stays_late_after_its_transport_is_closed(stalled):
    """A read times out on a stalled shard, then its transport is closed while the shard is still
    stopped, as ``PoolConnections.sync`` closes a pool's when the membership drops it (Ray saw its
    actor die; a partitioned node): ``late`` turns False at once, yet the read lands once the
    shard runs again. The fence (``Copier.fence_late_reads``), ``StoreClient.get``'s wait and
    a quarantined staging slab's ``reclaim`` all trust ``late``. Now the transport keeps its
    remote agent until its last transfer is over (NIXL 1.5.1 reported a request of a removed
    remote agent over while UCX still landed it: review67, stop 67; this test was its strict
    xfail)."""
    transport = NixlPoolTransport(stalled.desc)
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    transport.register_local(dst)
    try:
        _connected(transport, dst)
        dst.zero_()
        stalled.stop()
        transfer = transport.read(Ranges.of([CopyOp(0, dst)]))
        with pytest.raises(TransferError, match="timed out"):
            transfer.wait(TIMEOUT_S)
        assert transfer.late()
        transport.close()
        late_after_close = transfer.late()
        stalled.resume()
        assert until(lambda: torch.equal(dst, stalled.bytes[:NBYTES]), LANDS_S), "the read never landed"
        assert late_after_close, "late was False after the transport closed, and the read landed after"
        assert until(lambda: not transfer.late(), LANDS_S), "the landed read never read as over"
    finally:
        stalled.resume()
        transport.close()


def test_a_staged_read_that_timed_out_keeps_its_slab_until_it_can_no_longer_land(stalled, healthy):
    """A staged read from the stalled shard times out; a read from a healthy shard of the same
    size comes next and lands in a slab; the stalled shard runs again; the second read is
    scattered. Before: the first read's slab was given back at the timeout, the second read
    took it, and the stalled shard's late bytes overwrote the healthy shard's in it: the
    second read scattered another shard's bytes into its destination."""
    staging = HostStaging("on", rdma=[])
    late, fine = NixlPoolTransport(stalled.desc, staging=staging), NixlPoolTransport(healthy.desc, staging=staging)
    first, second = torch.zeros(NBYTES, dtype=torch.uint8), torch.zeros(NBYTES, dtype=torch.uint8)
    for transport in (late, fine):
        for buf in (first, second):
            transport.register_local(buf)
    try:
        _connected(late, first)
        _connected(fine, second)
        first.zero_()
        second.zero_()
        stalled.stop()
        timed_out = late.read(Ranges.of([CopyOp(0, first)]))
        with pytest.raises(TransferError, match="timed out"):
            timed_out.wait(TIMEOUT_S)
        assert staging.quarantined == 1, "the timed-out read's slab is not counted as quarantined"
        assert staging.held_bytes >= NBYTES, "the timed-out read's slab was given back"
        transfer = fine.read(Ranges.of([CopyOp(0, second)]))
        stalled.resume()
        time.sleep(0.5)  # the stalled shard's late bytes land meanwhile
        transfer.wait(LANDS_S)
        assert torch.equal(second, healthy.bytes[:NBYTES]), "another shard's late bytes were scattered"
        assert not bool(first.any()), "a failed staged read scattered its late bytes"
        assert until(lambda: (staging.reclaim(), staging.quarantined == 0)[1], LANDS_S), \
            "the quarantined slab never came back once its read was over"
        assert staging.held_bytes == 0 and staging.quarantines == 1
    finally:
        stalled.resume()
        late.close()
        fine.close()
        staging.close()


# --- the worker: a late read into KV is fenced off --------------------------------------------

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 3, 2, 8, 16, 24
PAGE = 2 * BLOCK * HEADS * HEAD * 2  # one layer's block in bf16 (K and V): 2 KiB
ENTRY = LAYERS * PAGE
STEP_TIMEOUT_S = 1.0


def _names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def _worker(staging: str = "off") -> tuple[WorkerPart, dict[str, torch.Tensor]]:
    """A worker with CPU KV; ``staging`` off: its NIXL reads land in its KV directly (a host with
    RDMA, or an operator's choice); auto: on this host without RDMA, they land in host slabs."""
    caches = {name: torch.zeros(BLOCKS * PAGE, dtype=torch.uint8).view(torch.bfloat16)
              .view(BLOCKS, HEADS, BLOCK, 2 * HEAD) for name in _names()}
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(layer_names=_names(), kv_cache_spec=spec)])
    w = WorkerPart(config, UcmRayConfig(transport="nixl", nixl_stage_through_host=staging,
                                        transfer_timeout_s=STEP_TIMEOUT_S, lease_s=10.0, reserve_timeout_s=10.0),
                   0, "this-node", pools=PoolConnections("nixl", "this-node", nixl_staging=staging))
    w.register_kv_caches(caches)
    return w, caches


def _load(w: WorkerPart, shard: Shard, job_id: int) -> list[int]:
    """Every block's entry from ``shard`` (block i at slot i), at once: the blocks that failed."""
    rows = [(0, i, Location(shard.desc.shard_id, shard.desc.incarnation, i * ENTRY, ENTRY), b"")
            for i in range(BLOCKS)]
    job = LoadJob(job_id, f"req{job_id}", BlockLoads.of(rows), complete_in_start=True)
    w.bind(UcmRayConnectorMetadata(pools={shard.desc.key: shard.desc}, loads={0: [job]}))
    w.start_load_kv()
    w.wait_for_save()
    results = w.build_worker_meta()
    return sorted(results.load_failures.get(job_id, [])) if results is not None else []


def _kv(caches: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.view(torch.uint8).flatten() for t in caches.values()])


def test_a_late_read_into_kv_is_over_before_the_next_step_runs(stalled):
    """The stalled shard's read times out: every block fails (vLLM recomputes them, or gives them
    to another request, in a later step). The shard runs again 0.3 s later. The next step's
    ``bind`` (before its forward) returns only once that read can no longer land: nothing
    changes in the KV after it. Before: ``bind`` returned at once and the late bytes landed in
    the blocks under the next steps."""
    w, caches = _worker()
    try:
        assert _load(w, stalled, 1) == [], "the shard does not serve loads while it runs"
        for t in caches.values():
            t.view(torch.uint8).fill_(0x5A)
        stalled.stop()
        assert _load(w, stalled, 2) == list(range(BLOCKS)), "a load from a stalled shard did not fail"
        assert w.late_reads, "the timed-out read is not kept as late"
        assert w.stats.totals.get("late_reads") == 1
        resume = threading.Timer(0.3, stalled.resume)
        resume.start()
        w.bind(UcmRayConnectorMetadata())  # the next step, quiet
        after_bind = _kv(caches).clone()
        resume.join()
        time.sleep(0.5)
        assert torch.equal(_kv(caches), after_bind), "the late read landed in the KV after the next step began"
        assert not w.late_reads
    finally:
        stalled.resume()
        w.shutdown()


def test_a_read_still_late_after_the_fence_s_bound_stops_the_worker(stalled):
    """A shard stalled for good: the next step raises ``LateReadError`` rather than run a forward
    over blocks the read may still write (after ``transfer_timeout_s`` more)."""
    w, _ = _worker()
    try:
        assert _load(w, stalled, 1) == []
        stalled.stop()
        assert _load(w, stalled, 2) == list(range(BLOCKS))
        started = time.monotonic()
        with pytest.raises(LateReadError, match="still in flight") as stopped:
            w.bind(UcmRayConnectorMetadata())
        assert time.monotonic() - started >= STEP_TIMEOUT_S * 0.9
        # one line that names the shard and what to do (vLLM's client sees only a 500)
        assert "\n" not in str(stopped.value) and f"from shard {stalled.desc.shard_id} " in str(stopped.value)
        assert "restart the engine" in str(stopped.value)
    finally:
        stalled.resume()
        w.shutdown()


def test_cpu_kv_s_reads_are_staged_by_default_so_a_shard_stalled_for_good_stops_nothing(stalled):
    """The default (``auto``) on a host without RDMA: a CPU worker's NIXL reads land in host slabs.
    The shard stalls for good; the load fails, and the next steps run at once (no fence, no
    ``LateReadError``: before, ``auto`` read into the KV and the next step stopped the worker, a
    CPU engine's death, ``tests/e2e/test_late_read_engine.py``); once the shard runs again its
    late bytes land in the quarantined slab, never in the KV."""
    w, caches = _worker("auto")
    try:
        assert _load(w, stalled, 1) == []
        for t in caches.values():
            t.view(torch.uint8).fill_(0x5A)
        stalled.stop()
        assert _load(w, stalled, 2) == list(range(BLOCKS)), "a load from a stalled shard did not fail"
        assert not w.late_reads and w.stats.totals.get("staging_quarantines", 0) >= 1
        started = time.monotonic()
        w.bind(UcmRayConnectorMetadata())
        w.fence(UcmRayConnectorMetadata())
        assert time.monotonic() - started < STEP_TIMEOUT_S / 2, "the next step waited for the late read"
        before = _kv(caches).clone()
        stalled.resume()
        time.sleep(1.0)  # the late read lands meanwhile (milliseconds)
        assert torch.equal(_kv(caches), before), "a failed read's late bytes landed in the KV"
        assert _load(w, stalled, 3) == [], "the shard does not serve loads once it runs again"
    finally:
        stalled.resume()
        w.shutdown()


def test_a_staged_write_that_timed_out_is_late_until_its_request_is_over(stalled):
    """A save through staging to the stalled shard times out: its bytes may still land in the
    pool's slots (the save then reports its rows uncertain, and the scheduler quarantines the
    slots rather than free them for another key), until the request is over."""
    staging = HostStaging("on", rdma=[])
    transport = NixlPoolTransport(stalled.desc, staging=staging)
    src = _random(NBYTES, seed=9)
    transport.register_local(src)
    try:
        _connected(transport, src.clone())
        stalled.stop()
        transfer = transport.write(Ranges.of([CopyOp(0, src)]))
        with pytest.raises(TransferError, match="timed out"):
            transfer.wait(TIMEOUT_S)
        assert transfer.late(), "a timed-out staged write in flight is not late"
        stalled.resume()
        assert until(lambda: not transfer.late(), LANDS_S), "the late write never finished"
        assert torch.equal(stalled.pool(0, NBYTES), src)
    finally:
        stalled.resume()
        transport.close()
        staging.close()
