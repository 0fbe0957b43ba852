"""NIXL transfers staged through host memory (``transport.nixl.staging``), on CPU with staging on.

Staging exists for GPU KV on hosts without RDMA (UCX's own CUDA copies of device memory waited
for vLLM's forward on the legacy default stream); forced ``on``, CPU memory takes the very same
path: the batch's ranges rewritten into a slab, the worker's own copies between its buffers and
the slab (``shm.HostBufferTransport``, as for a same-node pool), NIXL moving the slab. Real NIXL
between this process and pools in other processes (Ray actors), as a worker reaches other nodes.
The worker-level tests run with staging ``on`` and ``off``: both must land and fail the same.
"""

from __future__ import annotations

import os
import time

import numpy as np
import psutil
import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from tests.support.nixl_pool_actor import pool_actor_class
from tests.support.small_ray import own_or_session_ray
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.types import Location, Locations
from ucm_ray.transport.base import CopyOp, LocalTransferError, PoolDescriptor, Ranges, TransferError
from ucm_ray.transport.nixl import NixlPoolTransport, shutdown_client_agent
from ucm_ray.transport.nixl import staging as staging_module
from ucm_ray.transport.nixl.staging import MIN_SLAB_BYTES, HostStaging
from ucm_ray.transport.pools import PoolConnections
from ucm_ray.vllm.metadata import BlockLoads, BlockSaves, LoadJob, UcmRayConnectorMetadata, UcmRayWorkerMetadata
from ucm_ray.vllm.worker import WorkerPart

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

POOL = 8 << 20
WAIT_S = 30.0
LAYERS, HEADS, HEAD, BLOCK, N = 3, 2, 8, 16, 24
PAGE = 2 * BLOCK * HEADS * HEAD * 2  # one layer's block in bf16 (K and V): 2 KiB
ENTRY = LAYERS * PAGE


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def cluster():
    with own_or_session_ray() as ray:
        yield ray
    shutdown_client_agent()


class Shard:
    """A pool actor and its descriptor; ``kill`` makes it die as a shard process does."""

    def __init__(self, ray, shard_id: str, incarnation: int) -> None:
        self.ray = ray
        self.actor = pool_actor_class().remote(POOL)
        self.desc: PoolDescriptor = ray.get(self.actor.descriptor.remote(shard_id, incarnation), timeout=120)
        self.pid = ray.get(self.actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.ray.get(self.actor.read.remote(offset, nbytes), timeout=60)),
                                dtype=torch.uint8)

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)
        deadline = time.monotonic() + 30
        while psutil.pid_exists(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._unlink()

    def close(self) -> None:
        try:
            self.ray.get(self.actor.close.remote(), timeout=60)
        except Exception:  # noqa: BLE001 -- killed already
            pass
        self.ray.kill(self.actor)
        self._unlink()

    def _unlink(self) -> None:
        if self.desc.shm_path and os.path.exists(self.desc.shm_path):
            os.unlink(self.desc.shm_path)


@pytest.fixture
def shards(cluster):
    made = [Shard(cluster, "a", 1), Shard(cluster, "b", 2)]
    yield made
    for shard in made:
        shard.close()


# --- the transport ------------------------------------------------------------------------


def test_a_staged_write_and_read_land_exactly_and_reuse_one_slab(shards):
    """Odd sizes, unaligned offsets, ranges out of pool order and ranges side by side in the
    pool (merged into one NIXL descriptor): every byte lands, nothing around them moves, and
    each later batch reuses the one slab the first made."""
    shard = shards[0]
    staging = HostStaging("on", rdma=[])
    transport = NixlPoolTransport(shard.desc, staging=staging)
    src, dst = _random(4 << 20, seed=7), torch.zeros(4 << 20, dtype=torch.uint8)
    transport.register_local(src)
    transport.register_local(dst)
    try:
        sizes = [4097, 1, 65539, 3, 12345, (1 << 20) - 1, 999_999]
        pool_at = [(3 << 20) + 5, 11, 11 + 1, 200_003, 200_003 + 3, 7 << 20, 1 << 20]  # 11..12: side by side
        local_at = np.cumsum([0] + [n + 13 for n in sizes[:-1]]).tolist()
        ops = [CopyOp(p, src[at:at + n]) for p, at, n in zip(pool_at, local_at, sizes)]
        for round_ in range(3):
            transport.write(Ranges.of(ops)).wait(WAIT_S)
            for op in ops:
                assert torch.equal(shard.read(op.pool_offset, op.local.numel()), op.local), op.pool_offset
            dst.fill_(0xAB)
            back = [CopyOp(op.pool_offset, dst[at + 5:at + 5 + op.local.numel()]) for op, at in zip(ops, local_at)]
            transport.read(Ranges.of(back)).wait(WAIT_S)
            for op, got in zip(ops, back):
                assert torch.equal(got.local, op.local), f"round {round_}: range at {op.pool_offset} read back wrong"
            assert bool(dst[:5].eq(0xAB).all()), "a byte before the first range was written"
            assert staging.held_bytes == 0, "a slab is still held after its transfer's outcome was known"
        assert staging.allocations == 1 and len(staging.slab_addresses) == 1
    finally:
        transport.close()
        staging.close()


def test_a_bad_range_moves_nothing_through_staging(shards):
    shard = shards[0]
    staging = HostStaging("on", rdma=[])
    transport = NixlPoolTransport(shard.desc, staging=staging)
    src = _random(8192, seed=3)
    transport.register_local(src)
    try:
        with pytest.raises(ValueError, match="outside"):
            transport.write(Ranges.of([CopyOp(0, src[:4096]), CopyOp(POOL - 10, src[4096:])]))
        assert not shard.read(0, 4096).any()
        assert staging.held_bytes == 0 and staging.allocations == 0
    finally:
        transport.close()
        staging.close()


def test_a_batch_without_room_takes_back_the_slabs_nobody_waits_on(shards, monkeypatch):
    """Room for one slab: a save that is over gives its slab to the next batch before anyone
    waited for it; a load that landed keeps its slab for its ``wait``, and a batch that finds no
    slab within ``ROOM_WAIT_S`` fails; an abandoned load (its step gave up on it) gives its slab
    back and scatters nothing into its buffer."""
    monkeypatch.setattr(staging_module, "ROOM_WAIT_S", 0.3)
    shard = shards[0]
    staging = HostStaging("on", rdma=[], max_bytes=MIN_SLAB_BYTES)
    transport = NixlPoolTransport(shard.desc, staging=staging)
    src, dst = _random(1 << 20, seed=11), torch.zeros(1 << 20, dtype=torch.uint8)
    transport.register_local(src)
    transport.register_local(dst)
    try:
        first = transport.write(Ranges.of([CopyOp(0, src[:4096])]))  # not waited for yet
        second = transport.write(Ranges.of([CopyOp(8192, src[4096:8192])]))  # takes the first one's slab back
        first.wait(WAIT_S)
        second.wait(WAIT_S)
        assert torch.equal(shard.read(0, 4096), src[:4096]) and torch.equal(shard.read(8192, 4096), src[4096:8192])
        landed = transport.read(Ranges.of([CopyOp(0, dst[:4096])]))  # its bytes wait in its slab
        with pytest.raises(LocalTransferError, match="staging is full"):  # posted failed: not raised by the post
            transport.write(Ranges.of([CopyOp(0, src[:4096])])).wait(WAIT_S)
        landed.abandon()
        other = transport.read(Ranges.of([CopyOp(8192, dst[4096:8192])]))  # takes the abandoned one's slab
        other.wait(WAIT_S)
        assert torch.equal(dst[4096:8192], src[4096:8192])
        assert not dst[:4096].any(), "an abandoned load scattered its bytes"
        with pytest.raises(TransferError, match="abandoned"):
            landed.wait(WAIT_S)
        assert staging.allocations == 1 and staging.held_bytes == 0
    finally:
        transport.close()
        staging.close()


def test_a_larger_batch_gets_room_from_free_slabs_too_small_for_it(shards):
    """Staging made up to its bound of small slabs, every one free again: a larger batch drops
    free slabs to make its own rather than failing (slabs are never merged: kept, a worker that
    once held many small transfers would fail every larger one for good)."""
    shard = shards[0]
    staging = HostStaging("on", rdma=[], max_bytes=4 * MIN_SLAB_BYTES)
    transport = NixlPoolTransport(shard.desc, staging=staging)
    src, dst = _random(2 << 20, seed=13), torch.zeros(2 << 20, dtype=torch.uint8)
    transport.register_local(src)
    transport.register_local(dst)
    try:
        transport.write(Ranges.of([CopyOp(0, src[:MIN_SLAB_BYTES])])).wait(WAIT_S)
        landed = [transport.read(Ranges.of([CopyOp(0, dst[k * 4096:(k + 1) * 4096])])) for k in range(3)]
        transport.write(Ranges.of([CopyOp(MIN_SLAB_BYTES, src[MIN_SLAB_BYTES:])])).wait(WAIT_S)  # a fourth
        for each in landed:  # each held a slab for its wait
            each.wait(WAIT_S)
        assert staging.allocations == 4 and len(staging.slab_addresses) == 4 and staging.held_bytes == 0
        larger = MIN_SLAB_BYTES + (MIN_SLAB_BYTES >> 1)  # at most half the bound: one slab, not pieces
        transport.read(Ranges.of([CopyOp(0, dst[:larger])])).wait(WAIT_S)
        assert torch.equal(dst[:larger], src[:larger])
        assert len(staging.slab_addresses) == 3 and staging.held_bytes == 0  # two dropped for a 2 MiB one
        transport.write(Ranges.of([CopyOp(0, src[:4096])])).wait(WAIT_S)  # the slab made after the drops works
    finally:
        transport.close()
        staging.close()


def test_a_batch_larger_than_the_bound_moves_in_pieces_through_one_slab(shards):
    """A 3.5 MiB batch through staging bounded at 1 MiB (a single slab for it could never be
    made): pieces of half the bound, one after another through one slab, as one transfer. Odd
    sizes, ranges across the cuts, out of pool order and side by side: every byte both ways,
    by ``wait`` and by ``done`` polls alone; never more held than the bound; an abandoned one
    scatters nothing."""
    shard = shards[0]
    staging = HostStaging("on", rdma=[], max_bytes=MIN_SLAB_BYTES)
    transport = NixlPoolTransport(shard.desc, staging=staging)
    sizes = [1_300_001, 4097, 3, 700_000, 999_999, 12345, 654_321]  # 3.5 MiB; the first crosses two cuts
    order = [3, 0, 6, 1, 2, 5, 4]  # pool order: 1 and 2 side by side, the rest 7 bytes apart
    pool_at = dict(zip(order, np.cumsum([0] + [sizes[i] + (0 if i == 1 else 7) for i in order[:-1]]).tolist()))
    local_at = np.cumsum([0] + [n + 13 for n in sizes[:-1]]).tolist()
    room = local_at[-1] + sizes[-1] + 64
    src, dst = _random(room, seed=17), torch.zeros(room, dtype=torch.uint8)
    transport.register_local(src)
    transport.register_local(dst)
    held = []
    try:
        ops = [CopyOp(pool_at[i], src[local_at[i]:local_at[i] + n]) for i, n in enumerate(sizes)]
        back = [CopyOp(pool_at[i], dst[local_at[i] + 5:local_at[i] + 5 + n]) for i, n in enumerate(sizes)]
        assert sum(sizes) > 3 * MIN_SLAB_BYTES
        transport.write(Ranges.of(ops)).wait(WAIT_S)
        for op in ops:
            assert torch.equal(shard.read(op.pool_offset, op.local.numel()), op.local), op.pool_offset
        for by_polls in (False, True):
            dst.fill_(0xAB)
            transfer = transport.read(Ranges.of(back))
            while by_polls and not transfer.done():
                held.append(staging.held_bytes)
            transfer.wait(WAIT_S)
            for op, got in zip(ops, back):
                assert torch.equal(got.local, op.local), f"polled {by_polls}: range at {op.pool_offset} read wrong"
            assert bool(dst[:5].eq(0xAB).all()), "a byte before the first range was written"
        assert max(held, default=0) <= MIN_SLAB_BYTES and staging.held_bytes == 0
        assert staging.allocations == 1, "a piece did not reuse the slab the first one made"
        dst.fill_(0xAB)
        abandoned = transport.read(Ranges.of(back))
        abandoned.abandon()
        with pytest.raises(TransferError, match="abandoned"):
            abandoned.wait(WAIT_S)
        assert bool(dst.eq(0xAB).all()), "an abandoned batch scattered a piece"
        transport.write(Ranges.of(ops[1:2])).wait(WAIT_S)  # takes the abandoned piece's slab back
        assert staging.held_bytes == 0 and staging.allocations == 1
    finally:
        transport.close()
        staging.close()


@pytest.mark.parametrize("bound", [None, MIN_SLAB_BYTES], ids=["whole", "pieces"])
def test_a_killed_shard_fails_the_staged_transfer_and_gives_its_slab_back(cluster, bound):
    """``pieces``: the 1 MiB batch goes in two (a failed piece fails it whole)."""
    shard = Shard(cluster, "k", 3)
    staging = HostStaging("on", rdma=[], max_bytes=bound)
    transport = NixlPoolTransport(shard.desc, staging=staging, default_timeout_s=5.0)
    buf = _random(1 << 20, seed=9)
    transport.register_local(buf)
    try:
        transport.write(Ranges.of([CopyOp(0, buf)])).wait(WAIT_S)  # connected, and working
        kept = buf.clone()
        shard.kill()
        failures = 0
        for _ in range(20):  # the kill is asynchronous to UCX: retry until the peer is gone
            try:
                transport.read(Ranges.of([CopyOp(0, buf)])).wait(5)
            except TransferError as e:
                failures, error = failures + 1, e
                break
        assert failures, "reads from a killed shard kept succeeding"
        assert not isinstance(error, LocalTransferError), "a pool's failure was taken for a local one"
        assert torch.equal(buf, kept), "a failed read scattered bytes into its buffer"
        with pytest.raises(TransferError):
            transport.write(Ranges.of([CopyOp(0, buf)])).wait(5)
        assert staging.held_bytes == 0, "a failed transfer kept its slab"
    finally:
        transport.close()
        staging.close()
        shard.close()


# --- the worker ---------------------------------------------------------------------------


def _names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def _worker(staging: str) -> tuple[WorkerPart, dict[str, torch.Tensor], PoolConnections]:
    caches = {name: torch.zeros(N * PAGE, dtype=torch.uint8).view(torch.bfloat16).view(N, HEADS, BLOCK, 2 * HEAD)
              for name in _names()}
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(layer_names=_names(), kv_cache_spec=spec)])
    pools = PoolConnections("nixl", "this-node", nixl_staging=staging)
    w = WorkerPart(config, UcmRayConfig(transport="nixl", nixl_stage_through_host=staging, transfer_timeout_s=5.0,
                                        lease_s=10.0, reserve_timeout_s=10.0), 0, "this-node", pools=pools)
    w.register_kv_caches(caches)
    return w, caches, pools


def _entry(caches: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([t[block].contiguous().view(torch.uint8).flatten() for t in caches.values()])


def _placed(shards: list[Shard]) -> list[Location]:
    """Block i's entry: on shard i % 2, at slot i // 2."""
    return [Location(shards[i % 2].desc.shard_id, shards[i % 2].desc.incarnation, (i // 2) * ENTRY, ENTRY)
            for i in range(N)]


def _pools(shards: list[Shard]) -> dict:
    return {shard.desc.key: shard.desc for shard in shards}


def _save(w: WorkerPart, shards: list[Shard], job_id: int) -> np.ndarray:
    return _save_results(w, shards, job_id).saves[job_id].landed


def _save_results(w: WorkerPart, shards: list[Shard], job_id: int) -> UcmRayWorkerMetadata:
    saves = BlockSaves(job_id, np.zeros(N, dtype=np.int64), np.arange(N, dtype=np.int64), Locations.of(_placed(shards)))
    w.bind(UcmRayConnectorMetadata(pools=_pools(shards), saves={0: saves}))
    w.start_load_kv()
    w.wait_for_save()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        results = w.build_worker_meta()
        if results is not None and job_id in results.saves:
            return results
        w.bind(UcmRayConnectorMetadata())
        w.wait_for_save()
    raise AssertionError(f"save job {job_id} never reported")


def _load(w: WorkerPart, shards: list[Shard], job_id: int, *, at_once: bool) -> list[int]:
    results = _load_results(w, shards, job_id, at_once=at_once)
    return sorted(results.load_failures.get(job_id, [])) if results is not None else []


def _load_results(w: WorkerPart, shards: list[Shard], job_id: int, *, at_once: bool) -> UcmRayWorkerMetadata | None:
    rows = [(0, i, location, b"") for i, location in enumerate(_placed(shards))]
    job = LoadJob(job_id, f"req{job_id}", BlockLoads.of(rows), complete_in_start=at_once)
    w.bind(UcmRayConnectorMetadata(pools=_pools(shards), loads={0: [job]}))
    w.start_load_kv()
    for name in _names():
        w.wait_for_layer_load(name)
    w.wait_for_save()
    return w.build_worker_meta()


@pytest.mark.parametrize("staging", ["on", "off"])
def test_a_worker_saves_and_loads_every_byte_and_reuses_its_slabs(shards, staging):
    w, caches, pools = _worker(staging)
    try:
        for i, t in enumerate(caches.values()):
            t.view(torch.uint8).view(-1).copy_(_random(N * PAGE, seed=20 + i))
        written = [_entry(caches, i) for i in range(N)]
        assert _save(w, shards, 1).all()
        for i in (0, 1, N - 2, N - 1):
            location = _placed(shards)[i]
            assert torch.equal(shards[i % 2].read(location.offset, ENTRY), written[i]), f"block {i}'s entry differs"
        made = None
        for step, at_once in enumerate([False, True] * 4):
            for t in caches.values():
                t.view(torch.uint8).fill_(0x5A)
            assert _load(w, shards, 10 + step, at_once=at_once) == []
            for i in range(N):
                assert torch.equal(_entry(caches, i), written[i]), f"step {step}: block {i} loaded wrong"
            assert _save(w, shards, 20 + step).all()
            if staging == "on":
                assert pools.staging is not None and pools.staging.held_bytes == 0
                # at most one slab per transfer in flight at once (a layer's loads from both
                # shards, every layer read ahead of its hook: 2 x LAYERS), whatever the steps
                # made before: each step's 2 + 2 x LAYERS or 4 transfers reuse them
                assert pools.staging.allocations <= 2 * LAYERS, f"step {step}: slabs were not reused"
                made = made or pools.staging.slab_addresses
                assert pools.staging.slab_addresses[:len(made)] == made, f"step {step} dropped a slab"
        assert pools.staging is not None and pools.staging.applies(torch.device("cpu"), write=True) == (staging == "on")
    finally:
        w.shutdown()


@pytest.mark.parametrize("staging", ["on", "off"])
def test_a_killed_shard_fails_exactly_its_blocks(cluster, staging):
    """Shard b dies after the worker connected to it: a load fails exactly the blocks stored on
    b (vLLM recomputes those), every block from a lands exactly; a save lands exactly its rows
    for a. Staged or not, the same blocks; no slab stays held."""
    shards = [Shard(cluster, "a", 1), Shard(cluster, "b", 2)]
    w, caches, pools = _worker(staging)
    try:
        for i, t in enumerate(caches.values()):
            t.view(torch.uint8).view(-1).copy_(_random(N * PAGE, seed=40 + i))
        written = [_entry(caches, i) for i in range(N)]
        assert _save(w, shards, 1).all()
        shards[1].kill()
        on_b = [i for i in range(N) if i % 2 == 1]
        for t in caches.values():
            t.view(torch.uint8).fill_(0x5A)
        failed = _load(w, shards, 2, at_once=False)
        assert failed == on_b, f"staging {staging}: failed blocks {failed}, expected those on shard b"
        for i in range(0, N, 2):
            assert torch.equal(_entry(caches, i), written[i]), f"block {i} (shard a) loaded wrong"
        landed = _save(w, shards, 3)
        assert landed.tolist() == [i % 2 == 0 for i in range(N)]
        if staging == "on":
            assert pools.staging is not None and pools.staging.held_bytes == 0
    finally:
        w.shutdown()
        for shard in shards:
            shard.close()


def test_a_local_staging_failure_fails_its_blocks_and_suspects_no_shard(shards, monkeypatch):
    """The worker's staging full (its bound, two 1 MiB slabs here, held by loads nobody has taken
    yet, past ``ROOM_WAIT_S``): its save lands no row and its load fails every block (vLLM
    recomputes them), but no pool is reported failed (the scheduler would suspect a healthy shard
    for a worker's own memory limit). Once the slabs are back, both land exactly."""
    monkeypatch.setattr(staging_module, "MAX_STAGING_BYTES", 2 * MIN_SLAB_BYTES)
    monkeypatch.setattr(staging_module, "ROOM_WAIT_S", 0.1)
    w, caches, pools = _worker("on")
    hog = None
    try:
        for i, t in enumerate(caches.values()):
            t.view(torch.uint8).view(-1).copy_(_random(N * PAGE, seed=60 + i))
        written = [_entry(caches, i) for i in range(N)]
        assert _save(w, shards, 1).all()  # the pools opened, the staging made
        assert pools.staging is not None
        hog = NixlPoolTransport(shards[0].desc, staging=pools.staging)
        held = torch.zeros(MIN_SLAB_BYTES, dtype=torch.uint8)
        hog.register_local(held)
        holding = [hog.read(Ranges.of([CopyOp(0, held)])) for _ in range(2)]  # landed, each in a slab
        saved = _save_results(w, shards, 2)
        assert not saved.saves[2].landed.any() and saved.failed_pools == set(), saved.failed_pools
        for t in caches.values():
            t.view(torch.uint8).fill_(0x5A)
        loaded = _load_results(w, shards, 3, at_once=True)
        assert loaded is not None and sorted(loaded.load_failures.get(3, [])) == list(range(N))
        assert loaded.failed_pools == set(), f"a local staging failure suspected {loaded.failed_pools}"
        for each in holding:
            each.wait(WAIT_S)
        monkeypatch.setattr(staging_module, "ROOM_WAIT_S", 1.0)  # a layer read ahead waits for its hook
        assert pools.staging.allocations == 2
        assert _load(w, shards, 4, at_once=False) == []
        for i in range(N):
            assert torch.equal(_entry(caches, i), written[i]), f"block {i} loaded wrong once the slab came back"
        assert _save(w, shards, 5).all() and pools.staging.held_bytes == 0
    finally:
        if hog is not None:
            hog.close()
        w.shutdown()
