"""Stream ordering of the worker's copies on CUDA: a test that fails if the ordering were missing.

What orders the worker's side-stream copies against the forward pass (``ucm_ray.vllm.worker``,
``ucm_ray.transport.shm``). Shared-memory copies on CUDA are posted from the engine's own thread:
1. ``ShmPoolTransport.prepare`` / ``prepare_repeated``: the pool's stream ``wait_stream``s the
   *calling thread's current stream* (the compute stream) as a step's copies are prepared, right
   before their parts are posted (``Copier.post_by_pool``, ``post_through``): a load runs after
   work already queued (e.g. vLLM zeroing fresh blocks), a save (taken at the next step's
   ``bind``, prepared and posted once that step's forward is queued) after the forward that
   wrote its blocks.
2. ``WorkerPart.wait_for_layer_load``: the compute stream waits for the event recorded after
   the layer's copies (``_CudaEventTransfer.order_stream``), so the layer's compute queued
   after it reads landed bytes, with no host wait. A load layer by layer is posted
   ``loads.LAYERS_AHEAD`` layers ahead of the hooks: ``start_load_kv`` queues the first layers,
   layer k's hook layer k + ``LAYERS_AHEAD`` (``LAYERS`` is more than that, so most of a load here
   is posted from the hooks, on the pool's stream that waited once at ``prepare``).

How the tests would catch a missing piece. A long kernel (``torch.cuda._sleep``, ~0.3 s) is
queued on the compute stream before the write that matters, so that write runs ~0.3 s after it
is queued, while an unordered copy (64 MiB a layer, ~1 ms) would run at once:
- load after zeroing: the compute stream runs [long kernel, zero the target blocks], then the
  worker loads into those blocks. Unordered, the load lands first and the zeroing wipes it:
  the blocks end up zero instead of the stored bytes.
- save after the step that wrote the blocks: [long kernel, write every layer's new KV] (a
  step's forward), then the next step's ``bind`` posts their save. Unordered, the save copies
  the stale bytes that were there before.
- load then compute: right after ``wait_for_layer_load`` the compute stream snapshots the
  layer's blocks. Had it not waited for the copies (no 2), the snapshot would hold zeros or a
  partial copy.
Each ordering test runs with the forward on a stream of its own (as a runner that forwards on a
non-default stream does) and on the default stream: the copies must follow whichever stream is
current, not the default one. No Ray and no fleet: a stand-alone shared-memory pool, described
the way a shard describes its own, is all the worker needs.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from ucm_ray.transport.nixl.agent import rdma_ports

pytestmark = pytest.mark.gpu
# 256-token blocks: each copy is a 1 MiB range (~20 us on the link) and a layer's 64 of them keep
# the GPU busy well after they were posted, so a compute kernel queued
# without waiting for them would still find the copies running. 5 layers: 3 of them posted from
# the hooks (``LAYERS_AHEAD`` 2).
LAYERS, HEADS, HEAD, BLOCK = 5, 8, 128, 256
PAGE = 2 * BLOCK * HEADS * HEAD * 2  # one layer's block in bf16: 1 MiB
ENTRY = LAYERS * PAGE
N = 64  # blocks moved: 64 MiB per layer
DELAY_S = 0.3


@pytest.fixture(scope="module")
def cycles_for_delay() -> int:
    """``torch.cuda._sleep`` cycles that keep the GPU busy for about DELAY_S."""
    probe = 10_000_000
    torch.cuda._sleep(probe)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * DELAY_S * 1000 / max(start.elapsed_time(end), 1e-3))


@pytest.fixture
def pool():
    from ucm_ray.transport.shm import SharedPool

    p = SharedPool(os.path.join("/dev/shm", f"ucmray-streamtest-{os.getpid()}-{uuid.uuid4().hex[:8]}"),
                   N * ENTRY, create=True)
    yield p
    p.close()  # the owner unlinks the file


def kv_caches() -> dict[str, torch.Tensor]:
    """vLLM 0.26 FLASH_ATTN caches, logical [blocks, heads, block, 2 * head], one allocation per layer
    (HND order, where a layer's block is one contiguous range: big copies, so a copy that is
    not waited for is still running when the compute stream looks)."""
    return {f"model.layers.{i}.self_attn.attn":
            torch.zeros(N * PAGE, dtype=torch.int8, device="cuda").view(torch.bfloat16).view(N, HEADS, BLOCK, 2 * HEAD)
            for i in range(LAYERS)}


def make_worker(caches: dict[str, torch.Tensor], **config):
    """A worker on node "this-node" over ``caches`` (its ``UcmRayConfig`` from ``config``)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from ucm_ray.config import UcmRayConfig
    from ucm_ray.vllm.worker import WorkerPart

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    kv_config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(layer_names=list(caches), kv_cache_spec=spec)])
    w = WorkerPart(kv_config, UcmRayConfig(**config), 0, "this-node")
    w.register_kv_caches(caches)
    return w


def shm_descriptor(pool):
    """The stand-alone pool described the way its shard would (on "this-node")."""
    from ucm_ray.transport.base import PoolDescriptor

    return PoolDescriptor("shard-0", "this-node", pool.size, pool.path, None, None, pool.tensor.data_ptr(),
                          incarnation=7)


@pytest.fixture
def worker(pool):
    caches = kv_caches()
    w = make_worker(caches, transport="shm")
    yield w, caches, shm_descriptor(pool)
    w.shutdown()


def location(desc, i: int):
    from ucm_ray.store.types import Location

    return Location(desc.shard_id, desc.incarnation, i * ENTRY, ENTRY)


def meta(desc, **kw):
    from ucm_ray.vllm.metadata import UcmRayConnectorMetadata

    return UcmRayConnectorMetadata(pools={desc.key: desc}, **kw)


def entry_bytes(caches: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    """Block ``block`` as a stored entry lays it out: every layer's block in layer order."""
    return torch.cat([t[block].contiguous().view(torch.uint8).flatten() for t in caches.values()]).cpu()


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def compute_stream(kind: str) -> torch.cuda.Stream:
    return torch.cuda.Stream() if kind == "own" else torch.cuda.default_stream()


@pytest.fixture(params=["layers", "layers_kernels", "at_once", "at_once_repeated"])
def how(request, monkeypatch) -> str:
    """How a load moves: ``layers`` (layer by layer, a layer's ranges an entry apart: one strided
    copy each), ``layers_kernels`` (the same parts by gather kernels, as where the CUDA runtime
    has no strided copy), ``at_once`` (every layer before the forward: entries side by side in
    the pool, one copy) or ``at_once_repeated`` (the same load as one layer's ranges repeated,
    every layer's copies posted as one transfer: a load at once of many blocks)."""
    from ucm_ray.vllm.worker import copies

    if request.param == "layers_kernels":
        from ucm_ray.transport import gather

        monkeypatch.setattr(gather, "DMA_COPY_BYTES", 1 << 62)
    monkeypatch.setattr(copies, "REPEAT_AT_ONCE_RANGES", 1 if request.param == "at_once_repeated" else 1 << 40)
    return request.param


def load_job(desc, how: str = "layers"):
    """A load of every block; ``how`` as the fixture's."""
    from ucm_ray.vllm.metadata import BlockLoads, LoadJob

    return LoadJob(1, "req", BlockLoads.of([(0, i, location(desc, i), b"") for i in range(N)]),
                   complete_in_start=how.startswith("at_once"))


@pytest.mark.parametrize("stream", ["own", "default"])
def test_load_lands_after_the_zeroing_queued_before_it(pool, worker, cycles_for_delay, stream, how):
    w, caches, desc = worker
    stored = random_bytes(N * ENTRY, seed=1)
    pool.tensor.copy_(stored)
    for t in caches.values():
        t.view(torch.uint8).fill_(0x5A)  # whatever a previous request left in the blocks
    torch.cuda.synchronize()
    compute = compute_stream(stream)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(cycles_for_delay)  # a long kernel queued before ...
        for t in caches.values():
            t.zero_()  # ... vLLM zeroing the fresh blocks the load is for
        w.bind(meta(desc, loads={0: [load_job(desc, how)]}))
        w.start_load_kv()
        for name in caches:
            w.wait_for_layer_load(name)
        w.wait_for_save()  # the forward's end: the step's loads are checked and reported
    torch.cuda.synchronize()
    assert not w.build_worker_meta().load_failures
    for i in (0, N // 2, N - 1):
        got = entry_bytes(caches, i)
        assert got.any(), f"block {i} is zero: the load landed before the zeroing queued ahead of it"
        assert torch.equal(got, stored[i * ENTRY:(i + 1) * ENTRY]), f"block {i} differs from the stored entry"


@pytest.mark.parametrize("stream", ["own", "default"])
def test_compute_after_wait_for_layer_load_sees_the_landed_bytes(pool, worker, stream, how):
    w, caches, desc = worker
    stored = random_bytes(N * ENTRY, seed=2)
    pool.tensor.copy_(stored)
    torch.cuda.synchronize()
    snapshots = {}
    compute = compute_stream(stream)
    with torch.cuda.stream(compute):
        w.bind(meta(desc, loads={0: [load_job(desc, how)]}))
        w.start_load_kv()
        for name, t in caches.items():
            w.wait_for_layer_load(name)
            snapshots[name] = t.view(torch.uint8).clone()  # the layer's attention reading its KV, at once
        w.wait_for_save()
    torch.cuda.synchronize()
    assert not w.build_worker_meta().load_failures
    for name, snap in snapshots.items():
        # as bytes: random bf16 bit patterns include NaNs, which never compare equal
        assert torch.equal(snap, caches[name].view(torch.uint8)), \
            f"{name}: the compute stream read blocks before the load landed"
    assert torch.equal(torch.cat([entry_bytes(caches, i) for i in range(N)]), stored)


@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "full_graph"])
def test_a_layer_load_is_queued_a_few_layers_ahead_of_its_hook_and_never_without_one(pool, worker, hooks):
    """``start_load_kv`` queues layers 0 .. ``LAYERS_AHEAD`` - 1 only, layer k's hook the layers up to
    k + ``LAYERS_AHEAD``. A step whose hooks never run (a FULL CUDA graph replay) fails its loads,
    lands the layers it queued and queues no other: after the device drained, those layers' blocks
    still hold what they held before the step, and nothing waits for a copy never queued."""
    from ucm_ray.vllm.worker.loads import LAYERS_AHEAD

    w, caches, desc = worker
    stored = random_bytes(N * ENTRY, seed=3)
    pool.tensor.copy_(stored)
    torch.cuda.synchronize()
    names = list(caches)

    def landed() -> list[bool]:
        torch.cuda.synchronize()
        return [bool(t.view(torch.uint8).any()) for t in caches.values()]

    w.bind(meta(desc, loads={0: [load_job(desc)]}))
    w.start_load_kv()
    assert landed() == [layer < LAYERS_AHEAD for layer in range(LAYERS)]
    if hooks:
        for layer, name in enumerate(names):
            w.wait_for_layer_load(name)
            assert landed() == [later <= layer + LAYERS_AHEAD for later in range(LAYERS)], f"after layer {layer}"
    w.wait_for_save()
    failures = w.build_worker_meta().load_failures
    assert bool(failures) != hooks
    assert landed() == [hooks or layer < LAYERS_AHEAD for layer in range(LAYERS)]
    if hooks:
        assert torch.equal(torch.cat([entry_bytes(caches, i) for i in range(N)]), stored)
    else:
        assert w.stats.totals["unwaited_layer_loads"] == LAYERS


@pytest.mark.parametrize("stream", ["own", "default"])
def test_save_reads_the_blocks_after_the_step_that_wrote_them(pool, worker, cycles_for_delay, stream):
    from ucm_ray.store.types import Locations
    from ucm_ray.vllm.metadata import BlockSaves

    w, caches, desc = worker
    fresh = {name: random_bytes(N * PAGE, seed=10 + i).cuda() for i, name in enumerate(caches)}
    for t in caches.values():
        t.view(torch.uint8).fill_(0x5A)  # stale bytes: what the blocks held before the step
    pool.tensor.zero_()
    torch.cuda.synchronize()
    compute = compute_stream(stream)
    saves = BlockSaves(100, torch.zeros(N, dtype=torch.int64).numpy(), torch.arange(N).numpy(),
                       Locations.of([location(desc, i) for i in range(N)]))
    with torch.cuda.stream(compute):
        w.bind(meta(desc))  # the step that computes the blocks
        for name, t in caches.items():
            torch.cuda._sleep(cycles_for_delay)  # the layer's attention, still running ...
            t.view(torch.uint8).view(-1).copy_(fresh[name])  # ... then writing the layer's KV
        w.wait_for_save()
        w.bind(meta(desc, saves={0: saves}))  # the next step saves them, beside its own forward
        w.wait_for_save()
    torch.cuda.synchronize()
    results = w.build_worker_meta()
    assert results is not None and all(r.landed.all() for r in results.saves.values())
    for i in (0, N // 2, N - 1):
        saved = pool.tensor[i * ENTRY:(i + 1) * ENTRY]
        assert not torch.all(saved[:PAGE] == 0x5A), f"block {i}: the save copied the stale bytes"
        assert torch.equal(saved, entry_bytes(caches, i)), f"block {i}: the saved entry differs from the KV"


@pytest.mark.parametrize("stream", ["own", "default"])
def test_a_step_that_reuses_blocks_a_save_still_reads_runs_after_it(pool, worker, cycles_for_delay, stream):
    """Saves land beside later steps; the host never waits for them. When vLLM frees blocks a
    save is still reading and a step allocates them to another request, the scheduler names
    the save in the step's ``fences``: the step's stream waits for its copies before the forward
    writes the blocks. Here the save sits behind a long kernel (the previous step's forward,
    ~0.3 s, on another stream) and the next step runs on a stream of its own: unordered, its
    write lands at once and the save copies the new bytes."""
    from ucm_ray.store.types import Locations
    from ucm_ray.vllm.metadata import BlockSaves, UcmRayConnectorMetadata

    w, caches, desc = worker
    for i, t in enumerate(caches.values()):
        t.view(torch.uint8).view(-1).copy_(random_bytes(N * PAGE, seed=20 + i).cuda())
    other = {name: random_bytes(N * PAGE, seed=30 + i).cuda() for i, name in enumerate(caches)}
    pool.tensor.zero_()
    torch.cuda.synchronize()
    expected = [entry_bytes(caches, i) for i in range(N)]
    saves = BlockSaves(200, torch.zeros(N, dtype=torch.int64).numpy(), torch.arange(N).numpy(),
                       Locations.of([location(desc, i) for i in range(N)]))
    earlier, step = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(earlier):
        torch.cuda._sleep(cycles_for_delay)  # work queued before the save: it copies after it
        w.bind(meta(desc, saves={0: saves}))  # a step saves the blocks earlier steps filled
        w.wait_for_save()  # and ends without waiting for the copies
    with torch.cuda.stream(step if stream == "own" else torch.cuda.default_stream()):
        # the next step (membership unchanged: no pools sent) hands those blocks to another request
        w.bind(UcmRayConnectorMetadata(fences={200}))
        for name, t in caches.items():
            t.view(torch.uint8).view(-1).copy_(other[name])  # whose forward writes them
        w.wait_for_save()
    torch.cuda.synchronize()
    results = w.build_worker_meta()
    assert results is not None and results.saves[200].landed.all()
    assert w.stats.totals.get("save_fences") == 1
    for i in range(N):
        assert torch.equal(pool.tensor[i * ENTRY:(i + 1) * ENTRY], expected[i]), \
            f"block {i}: the save copied bytes the next step's forward wrote"


def test_a_save_is_posted_once_the_steps_forward_is_queued(pool, worker):
    """``bind`` only takes a step's save job: planning its copies (an 8B save's gather plans
    took ~1-2 ms of an H200 host) before the forward's launch held the device back. They are
    planned and queued in ``wait_for_save``, after the forward, while the device runs it."""
    from ucm_ray.store.types import Locations
    from ucm_ray.vllm.metadata import BlockSaves

    w, caches, desc = worker
    for i, t in enumerate(caches.values()):
        t.view(torch.uint8).view(-1).copy_(random_bytes(N * PAGE, seed=40 + i).cuda())
    pool.tensor.zero_()
    torch.cuda.synchronize()
    saves = BlockSaves(300, torch.zeros(N, dtype=torch.int64).numpy(), torch.arange(N).numpy(),
                       Locations.of([location(desc, i) for i in range(N)]))
    w.bind(meta(desc, saves={0: saves}))
    w.start_load_kv()
    torch.cuda.synchronize()  # whatever bind queued has run by now
    assert not bool(pool.tensor.any()), "bind queued the save's copies ahead of the step's forward"
    w.wait_for_save()  # the forward was queued: now the save is
    torch.cuda.synchronize()
    results = w.build_worker_meta()
    assert results is not None and results.saves[300].landed.all()
    for i in (0, N // 2, N - 1):
        assert torch.equal(pool.tensor[i * ENTRY:(i + 1) * ENTRY], entry_bytes(caches, i)), \
            f"block {i}: the saved entry differs from the KV"


NO_RDMA = not rdma_ports()
"""This host has no RDMA port: UCX moves a NIXL transfer's device memory with CUDA copies of its own."""


@pytest.mark.parametrize(("forward_stream", "staging"), [
    ("side", "auto"),
    ("legacy_default", "auto"),
    pytest.param("legacy_default", "off", marks=pytest.mark.xfail(
        NO_RDMA, strict=False, reason="no RDMA port and no staging: UCX's own CUDA copies of the NIXL part wait "
        "for the forward on the legacy default stream (H100, stop 64: the step's end at 0.303 s with it there, "
        "0.030 s on a side stream)")),
])
def test_a_save_to_a_shm_and_a_nixl_pool_lets_its_step_end_before_the_forward(pool, cycles_for_delay, forward_stream,
                                                                              staging):
    """A step's save job with a same-node pool (shared memory: queued after the forward, on the
    device) and another node's (NIXL: the copy thread's, waited for by the host at the step's end
    so that thread gets the GIL). The step's end waits for the NIXL part only: waiting for the
    whole job held the host for the whole forward. Both parts land, with the blocks' bytes.

    The NIXL part is a few blocks, its connection made and its time measured by a save of the
    same blocks first, and the forward lasts several times that: on one H100 host NIXL moved
    GPU memory to a host pool on the same machine at ~0.4 GB/s, its first transfer ~0.26 s
    more (stop 63), so half of the 64 blocks (160 MiB) outlasted a 0.3 s forward whatever
    the step's end waited for.

    The forward runs on a stream of its own (``side``, non-blocking) or on the legacy default
    stream, as vLLM's does (``legacy_default``). Without RDMA, UCX moves the NIXL part's device
    memory with CUDA copies of its own, and those waited for work on the legacy default stream:
    the step's end then came after the forward (stop 64, H100)."""
    import time
    import uuid

    from ucm_ray.store.types import Location, Locations
    from ucm_ray.transport.nixl import NixlPoolExporter
    from ucm_ray.vllm.metadata import BlockSaves, UcmRayConnectorMetadata

    caches = kv_caches()
    for i, t in enumerate(caches.values()):
        t.view(torch.uint8).view(-1).copy_(random_bytes(N * PAGE, seed=50 + i).cuda())
    pool.tensor.zero_()
    remote = torch.zeros(N * ENTRY, dtype=torch.uint8)  # another node's pool, reached over NIXL
    exporter = NixlPoolExporter(remote, f"ucmr-gpu-mixed-{uuid.uuid4().hex[:8]}")
    shm_desc = shm_descriptor(pool)
    nixl_desc = exporter.descriptor("shard-1", "other-node", incarnation=8)
    pools = {shm_desc.key: shm_desc, nixl_desc.key: nixl_desc}
    w = make_worker(caches, transport="auto", transfer_timeout_s=30.0, nixl_stage_through_host=staging)
    try:
        over_nixl = 2  # the last blocks go to the other node's pool
        shm_blocks = N - over_nixl

        def to_nixl(i: int) -> Location:
            return Location(nixl_desc.shard_id, nixl_desc.incarnation, i * ENTRY, ENTRY)

        # the NIXL part alone first: it connects, and how long a step's end waits for it is known
        nixl_only = torch.arange(shm_blocks, N).numpy()
        w.bind(UcmRayConnectorMetadata(pools=pools, saves={0: BlockSaves(
            399, torch.zeros(over_nixl, dtype=torch.int64).numpy(), nixl_only,
            Locations.of([to_nixl(i) for i in range(shm_blocks, N)]))}))
        w.start_load_kv()
        started = time.perf_counter()
        w.wait_for_save()
        nixl_s = time.perf_counter() - started
        torch.cuda.synchronize()
        warm = w.build_worker_meta()
        assert warm is not None and 399 in warm.saves and warm.saves[399].landed.all(), "the NIXL part alone failed"
        # (at most ~9 s: well inside the job's 30 s transfer deadline; a slower NIXL part fails below, saying so)
        forward_cycles = int(cycles_for_delay * min(30.0, max(1.0, 5 * nixl_s / DELAY_S)))

        places = [Location(shm_desc.shard_id, shm_desc.incarnation, i * ENTRY, ENTRY) for i in range(shm_blocks)] + \
                 [to_nixl(i) for i in range(shm_blocks, N)]
        saves = BlockSaves(400, torch.zeros(N, dtype=torch.int64).numpy(), torch.arange(N).numpy(),
                           Locations.of(places))
        remote.zero_()
        torch.cuda.synchronize()
        expected = [entry_bytes(caches, i) for i in range(N)]
        w.bind(UcmRayConnectorMetadata(pools=pools, saves={0: saves}))
        w.start_load_kv()  # the NIXL part goes to the copy thread
        # vLLM calls the step's hooks on its forward's stream: the shared-memory part queues behind it there
        with torch.cuda.stream(torch.cuda.Stream() if forward_stream == "side" else torch.cuda.default_stream()):
            torch.cuda._sleep(forward_cycles)  # the step's forward: at least ~0.3 s, 5x the NIXL part
            forward_done = torch.cuda.Event()
            forward_done.record()
            w.wait_for_save()  # the step's end: the shared-memory part is queued now, after the forward
            assert not forward_done.query(), \
                f"the step's end waited for its forward (the job's shared-memory part; NIXL part alone {nixl_s:.3f} s)"
        torch.cuda.synchronize()
        results = w.build_worker_meta()
        assert results is not None and 400 in results.saves, "the save job never landed"
        assert results.saves[400].landed.all(), f"rows not landed: {(~results.saves[400].landed).sum()}"
        for i in (0, shm_blocks - 1):
            assert torch.equal(pool.tensor[i * ENTRY:(i + 1) * ENTRY], expected[i]), f"block {i} (shm) differs"
        for i in (shm_blocks, N - 1):
            assert torch.equal(remote[i * ENTRY:(i + 1) * ENTRY], expected[i]), f"block {i} (NIXL) differs"
    finally:
        w.shutdown()
        exporter.close()


@pytest.mark.parametrize("stream", ["own", "default"])
def test_a_few_blocks_move_one_range_at_a_time_in_stream_order(pool, worker, cycles_for_delay, stream):
    """A decode step's save (a block per layer per request) and a short load take too few ranges
    for a gather plan (``FEW_RANGES``): each range is one ``cudaMemcpyAsync`` on the CUDA
    runtime's raw addresses. The save runs after the step that wrote its blocks (behind a long
    kernel), the load after the zeroing queued before it, and both move every byte."""
    from ucm_ray.store.types import Locations
    from ucm_ray.transport.cudart import has_copy_ranges
    from ucm_ray.transport.shm import FEW_RANGES
    from ucm_ray.vllm.metadata import BlockLoads, BlockSaves, LoadJob

    few = 3
    assert few * LAYERS <= FEW_RANGES and has_copy_ranges()  # the path under test
    w, caches, desc = worker
    fresh = {name: random_bytes(N * PAGE, seed=60 + i).cuda() for i, name in enumerate(caches)}
    for t in caches.values():
        t.view(torch.uint8).fill_(0x5A)
    pool.tensor.zero_()
    torch.cuda.synchronize()
    blocks = [5, 17, 40]  # not adjacent: three ranges a layer
    saves = BlockSaves(400, torch.zeros(few, dtype=torch.int64).numpy(), torch.tensor(blocks).numpy(),
                       Locations.of([location(desc, i) for i in range(few)]))
    with torch.cuda.stream(compute_stream(stream)):
        w.bind(meta(desc))
        for name, t in caches.items():
            torch.cuda._sleep(cycles_for_delay)
            t.view(torch.uint8).view(-1).copy_(fresh[name])
        w.wait_for_save()
        w.bind(meta(desc, saves={0: saves}))
        w.wait_for_save()
    torch.cuda.synchronize()
    results = w.build_worker_meta()
    assert results is not None and results.saves[400].landed.all()
    written = [entry_bytes(caches, b) for b in blocks]
    for i, expected in enumerate(written):
        assert torch.equal(pool.tensor[i * ENTRY:(i + 1) * ENTRY], expected), f"entry {i}: not block {blocks[i]}'s"
    with torch.cuda.stream(compute_stream(stream)):
        torch.cuda._sleep(cycles_for_delay)
        for t in caches.values():
            t.zero_()  # queued before the load: the load must land after it
        job = LoadJob(2, "req", BlockLoads.of([(0, b, location(desc, i), b"") for i, b in enumerate(blocks)]),
                      complete_in_start=True)
        w.bind(meta(desc, loads={0: [job]}))
        w.start_load_kv()
        w.wait_for_save()
    torch.cuda.synchronize()
    assert not w.build_worker_meta().load_failures
    for b, expected in zip(blocks, written):
        assert torch.equal(entry_bytes(caches, b), expected), f"block {b}: not loaded back exactly"
    assert not entry_bytes(caches, 6).any(), "a block outside the load was written"


@pytest.mark.parametrize("stream", ["own", "default"])
@pytest.mark.parametrize("at_once", [False, True], ids=["layers", "at_once"])
def test_a_staged_nixl_load_lands_after_the_zeroing_and_before_its_layer(cycles_for_delay, stream, at_once):
    """A load from another node's pool through host staging (``nixl_stage_through_host`` on):
    the copy thread posts the NIXL read into a pinned slab once the compute stream's work queued
    before ``start_load_kv`` (a long kernel, then vLLM zeroing the blocks) is done, and the
    layer's wait scatters the slab into the blocks on the worker's own stream before it returns.
    Unordered, the zeroing would wipe the landed bytes, or the compute stream's snapshot right
    after ``wait_for_layer_load`` would hold zeros."""
    import uuid

    from ucm_ray.store.types import Location
    from ucm_ray.transport.nixl import NixlPoolExporter
    from ucm_ray.vllm.metadata import BlockLoads, LoadJob, UcmRayConnectorMetadata

    caches = kv_caches()
    stored = random_bytes(N * ENTRY, seed=70)
    remote = stored.clone()  # another node's pool, reached over NIXL
    exporter = NixlPoolExporter(remote, f"ucmr-gpu-staged-{uuid.uuid4().hex[:8]}")
    desc = exporter.descriptor("shard-1", "other-node", incarnation=8)
    w = make_worker(caches, transport="auto", transfer_timeout_s=30.0, nixl_stage_through_host="on")
    try:
        for t in caches.values():
            t.view(torch.uint8).fill_(0x5A)
        torch.cuda.synchronize()
        snapshots = {}
        job = LoadJob(1, "req", BlockLoads.of([(0, i, Location(desc.shard_id, desc.incarnation, i * ENTRY, ENTRY), b"")
                                               for i in range(N)]), complete_in_start=at_once)
        with torch.cuda.stream(compute_stream(stream)):
            torch.cuda._sleep(cycles_for_delay)  # a long kernel queued before ...
            for t in caches.values():
                t.zero_()  # ... vLLM zeroing the fresh blocks the load is for
            w.bind(UcmRayConnectorMetadata(pools={desc.key: desc}, loads={0: [job]}))
            w.start_load_kv()
            for name, t in caches.items():
                w.wait_for_layer_load(name)
                snapshots[name] = t.view(torch.uint8).clone()  # the layer's attention reading its KV
            w.wait_for_save()
        torch.cuda.synchronize()
        assert not w.build_worker_meta().load_failures
        for name, snap in snapshots.items():
            assert torch.equal(snap, caches[name].view(torch.uint8)), \
                f"{name}: the compute stream read blocks before the staged load was scattered into them"
        for i in (0, N // 2, N - 1):
            assert torch.equal(entry_bytes(caches, i), stored[i * ENTRY:(i + 1) * ENTRY]), \
                f"block {i} differs from the stored entry (zeroed after the load landed?)"
    finally:
        w.shutdown()
        exporter.close()
