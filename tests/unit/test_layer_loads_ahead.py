"""A load layer by layer on stream-ordered pools, posted ``LAYERS_AHEAD`` layers ahead of the hooks.

``start_load_kv`` plans every layer and posts the first ``loads.LAYERS_AHEAD``; layer k's hook
posts through layer k + ``LAYERS_AHEAD`` before its layer computes. On CUDA the posts queue
copies on the pool's stream (``tests/gpu/test_stream_order.py`` checks the device's order). Here
a real worker over CPU KV caches and a real shared-memory pool takes its shm pool as stream-ordered
(``StreamOrderedOnCpu``: the one thing changed), so it runs that same posting code, where a post
is the copy itself: a layer's bytes are in its blocks the moment it is posted. That makes each
rule visible as bytes:
- no layer is read before it landed: when a hook returns, its layer holds the stored bytes;
- none is posted more than ``LAYERS_AHEAD`` layers early, none twice: the test writes over each
  layer once its hook returned (as a forward that overwrote the blocks would), and a second post
  would bring the stored bytes back;
- none is left unposted or half done: a layer whose hook never runs fails its loads (vLLM
  recomputes them), and a layer that was never posted is never written, in this step or after.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.checksum import checksum
from ucm_ray.store.types import Location
from ucm_ray.transport.base import PoolDescriptor, PoolKey
from ucm_ray.transport.pools import PoolConnections
from ucm_ray.transport.shm import SharedPool
from ucm_ray.vllm.metadata import BlockLoads, LoadJob, UcmRayConnectorMetadata
from ucm_ray.vllm.worker import WorkerPart
from ucm_ray.vllm.worker.loads import LAYERS_AHEAD

LAYERS, HEADS, HEAD, BLOCK, N = 7, 2, 8, 4, 8
PAGE = 2 * BLOCK * HEADS * HEAD * 2  # one layer's block in bf16 (K and V)
ENTRY = LAYERS * PAGE
STALE, OVERWRITTEN = 0x5A, 0xC3  # what the blocks held before the load; what the test writes after a hook
LOADED = [6, 1, 3, 7]  # vLLM blocks loaded, from entries 0 .. 3 of the pool


class StreamOrderedOnCpu(PoolConnections):
    """Shared-memory pools taken as stream-ordered on CPU: the worker posts their layer loads
    from the engine's thread, as it does on CUDA (the host lands each layer at its hook, since a
    CPU has no stream to order)."""

    def stream_ordered(self, pool: PoolKey, device: torch.device) -> bool:
        return self.kind(pool) == "shm"


@pytest.fixture
def pool():
    p = SharedPool(os.path.join("/dev/shm", f"ucmray-ahead-{os.getpid()}-{uuid.uuid4().hex[:8]}"),
                   len(LOADED) * ENTRY, create=True)
    p.tensor.copy_(torch.randint(1, 256, (p.size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))
    yield p
    p.close()  # the owner unlinks the file


def names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture
def worker():
    caches = {name: torch.zeros(N * PAGE, dtype=torch.uint8).view(torch.bfloat16).view(N, HEADS, BLOCK, 2 * HEAD)
              for name in names()}
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(layer_names=names(), kv_cache_spec=spec)])
    w = WorkerPart(config, UcmRayConfig(transport="shm"), 0, "this-node", pools=StreamOrderedOnCpu("shm", "this-node"))
    w.register_kv_caches(caches)
    for t in caches.values():
        t.view(torch.uint8).fill_(STALE)
    yield w, caches
    w.shutdown()


def descriptor(pool: SharedPool) -> PoolDescriptor:
    return PoolDescriptor("shard-0", "this-node", pool.size, pool.path, None, None, pool.tensor.data_ptr(),
                          incarnation=7)


def load_meta(desc: PoolDescriptor, job_id: int = 1, blocks: list[int] = LOADED,
              checksums: list[int] | None = None) -> UcmRayConnectorMetadata:
    rows = [(0, block, Location(desc.shard_id, desc.incarnation, i * ENTRY, ENTRY,
                                None if checksums is None else checksums[i]), b"")
            for i, block in enumerate(blocks)]
    return UcmRayConnectorMetadata(pools={desc.key: desc}, loads={0: [LoadJob(job_id, f"req{job_id}",
                                                                             BlockLoads.of(rows))]})


def layer_bytes(caches: dict[str, torch.Tensor], layer: int, block: int) -> torch.Tensor:
    return caches[names()[layer]][block].view(torch.uint8).flatten()


def stored(pool: SharedPool, layer: int, entry: int) -> torch.Tensor:
    at = entry * ENTRY + layer * PAGE
    return pool.tensor[at: at + PAGE]


def landed(caches, pool, layer: int) -> bool:
    return all(torch.equal(layer_bytes(caches, layer, block), stored(pool, layer, i)) for i, block in enumerate(LOADED))


def holds(caches, layer: int, value: int) -> bool:
    return all(bool((layer_bytes(caches, layer, block) == value).all()) for block in LOADED)


def overwrite(caches, layer: int) -> None:
    for block in LOADED:
        layer_bytes(caches, layer, block).fill_(OVERWRITTEN)


def test_each_layer_is_posted_once_a_few_layers_ahead_and_lands_before_its_layer_computes(pool, worker):
    w, caches = worker
    w.bind(load_meta(descriptor(pool)))
    w.start_load_kv()
    assert [landed(caches, pool, layer) for layer in range(LAYERS)] == \
        [layer < LAYERS_AHEAD for layer in range(LAYERS)], "start_load_kv posted other layers than the first"
    for layer, name in enumerate(names()):
        w.wait_for_layer_load(name)
        assert landed(caches, pool, layer), f"layer {layer} computes before its load landed"
        for later in range(layer + 1, LAYERS):
            assert landed(caches, pool, later) == (later <= layer + LAYERS_AHEAD), \
                f"after layer {layer}'s hook, layer {later} is {'not ' * (later <= layer + LAYERS_AHEAD)}posted"
        overwrite(caches, layer)  # a second post of this layer would bring the stored bytes back
    w.wait_for_save()
    assert not w.build_worker_meta().load_failures
    for layer in range(LAYERS):
        assert holds(caches, layer, OVERWRITTEN), f"layer {layer} was posted again after its hook"
    assert w.stats.totals["loaded_blocks"] == len(LOADED) and not w.stats.totals.get("unwaited_layer_loads")


def test_a_step_whose_hooks_never_run_fails_its_layer_loads_and_posts_none_of_the_rest(pool, worker):
    """A FULL CUDA graph replay runs no layer hook: the loads fail (vLLM recomputes them), the
    layers posted in ``start_load_kv`` are landed before the blocks may be reused, and the others
    are never posted, neither at the step's end nor by a later step's hooks."""
    w, caches = worker
    desc = descriptor(pool)
    w.bind(load_meta(desc))
    w.start_load_kv()
    w.wait_for_save()  # the forward's end, no hook run
    failures = w.build_worker_meta().load_failures
    assert sorted(block for _, blocks in failures.items() for block in blocks) == sorted(LOADED)
    assert w.stats.totals["unwaited_layer_loads"] == LAYERS
    for layer in range(LAYERS_AHEAD, LAYERS):
        assert holds(caches, layer, STALE), f"layer {layer} was posted though no hook asked for it"
    moved = LAYERS_AHEAD * len(LOADED) * PAGE  # the layers posted: bytes the byte counters may count
    assert w.stats.totals["loaded_shm_bytes"] == w.stats.totals["loaded_copy_bytes"] == moved, \
        "bytes of layers never posted were counted as loaded"
    other = [0, 2]  # the next step loads other blocks, its hooks run
    w.bind(load_meta(desc, job_id=2, blocks=other))
    w.start_load_kv()
    for name in names():
        w.wait_for_layer_load(name)
    w.wait_for_save()
    assert not w.build_worker_meta().load_failures
    for layer in range(LAYERS_AHEAD, LAYERS):
        assert holds(caches, layer, STALE), f"layer {layer} of the failed step was posted by a later step"
        for i, block in enumerate(other):
            assert torch.equal(layer_bytes(caches, layer, block), stored(pool, layer, i))


def test_a_skipped_hook_fails_the_loads_and_every_later_layer_still_lands_before_it_computes(pool, worker):
    w, caches = worker
    skipped = 3
    w.bind(load_meta(descriptor(pool)))
    w.start_load_kv()
    for layer, name in enumerate(names()):
        if layer == skipped:
            continue
        w.wait_for_layer_load(name)
        assert landed(caches, pool, layer), f"layer {layer} computes before its load landed"
        overwrite(caches, layer)
    w.wait_for_save()
    failures = w.build_worker_meta().load_failures
    assert sorted(block for _, blocks in failures.items() for block in blocks) == sorted(LOADED)
    assert w.stats.totals["unwaited_layer_loads"] == 1
    assert landed(caches, pool, skipped), "the skipped layer was never posted"
    for layer in set(range(LAYERS)) - {skipped}:
        assert holds(caches, layer, OVERWRITTEN), f"layer {layer} was posted twice"


def test_hooks_in_another_order_land_each_layer_before_it_computes_and_none_twice(pool, worker):
    """vLLM calls the hooks in forward order, which is the plan's (a group's layers in order);
    another order costs the lead, not the layer: a hook posts its own layer first if no hook did."""
    w, caches = worker
    w.bind(load_meta(descriptor(pool)))
    w.start_load_kv()
    for layer in (5, 0, 6, 2, 1, 4, 3):
        w.wait_for_layer_load(names()[layer])
        assert landed(caches, pool, layer), f"layer {layer} computes before its load landed"
        overwrite(caches, layer)
    w.wait_for_save()
    assert not w.build_worker_meta().load_failures
    for layer in range(LAYERS):
        assert holds(caches, layer, OVERWRITTEN), f"layer {layer} was posted twice"


def test_checksums_taken_layer_by_layer_as_the_layers_are_posted_fail_only_a_corrupt_entry(pool, worker):
    """Checksums run over each layer's blocks in layer order as they land (the host lands each
    layer at its hook): an entry whose bytes no longer match fails alone."""
    w, caches = worker
    sums = [checksum(pool.tensor[i * ENTRY:(i + 1) * ENTRY]) for i in range(len(LOADED))]
    corrupt = 2
    pool.tensor[corrupt * ENTRY + 5 * PAGE + 3] ^= 0xFF  # one byte of layer 5 of entry 2
    w.bind(load_meta(descriptor(pool), checksums=sums))
    w.start_load_kv()
    for name in names():
        w.wait_for_layer_load(name)
    w.wait_for_save()
    failures = w.build_worker_meta().load_failures
    assert [block for _, blocks in failures.items() for block in blocks] == [LOADED[corrupt]]
    assert w.stats.totals["checksum_mismatches"] == 1


def test_a_pool_that_cannot_be_reached_fails_every_layer_and_the_hooks_still_return(pool, worker):
    w, caches = worker
    desc = descriptor(pool)
    gone = PoolDescriptor("shard-9", "this-node", pool.size, pool.path + "-gone", None, None, 0, incarnation=3)
    meta = load_meta(gone)
    meta.pools = {desc.key: desc, gone.key: gone}
    w.bind(meta)
    w.start_load_kv()
    for name in names():
        w.wait_for_layer_load(name)
    w.wait_for_save()
    failures = w.build_worker_meta().load_failures
    assert sorted(block for _, blocks in failures.items() for block in blocks) == sorted(LOADED)
    assert all(holds(caches, layer, STALE) for layer in range(LAYERS))
    assert not w.stats.totals.get("unwaited_layer_loads")


@pytest.mark.parametrize("hooked", [7, 2], ids=["every_hook", "hooks_stop_after_two"])
def test_two_kv_cache_groups_post_in_the_plans_order_and_a_group_never_hooked_fails(pool, hooked):
    """Two kv-cache groups loaded by layer: the plan's layers are group 0's then group 1's, each
    posted ahead of the hooks in that order. Where the hooks stop after two layers (the rest
    never run), group 1's layers were never posted: its loads fail all the same."""
    split = 4  # group 0: layers 0 .. 3, group 1: layers 4 .. 6
    caches = {name: torch.zeros(N * PAGE, dtype=torch.uint8).view(torch.bfloat16).view(N, HEADS, BLOCK, 2 * HEAD)
              for name in names()}
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(layer_names=names()[:split], kv_cache_spec=spec),
                                            KVCacheGroupSpec(layer_names=names()[split:], kv_cache_spec=spec)])
    w = WorkerPart(config, UcmRayConfig(transport="shm"), 0, "this-node", pools=StreamOrderedOnCpu("shm", "this-node"))
    w.register_kv_caches(caches)
    try:
        for t in caches.values():
            t.view(torch.uint8).fill_(STALE)
        desc = descriptor(pool)
        sizes = [split * PAGE, (LAYERS - split) * PAGE]  # an entry of each group: its layers' blocks
        rows = [(0, 6, 0), (0, 1, sizes[0]), (1, 3, 2 * sizes[0]), (1, 7, 2 * sizes[0] + sizes[1])]
        loads = BlockLoads.of([(group, block, Location(desc.shard_id, desc.incarnation, at, sizes[group]), b"")
                               for group, block, at in rows])
        w.bind(UcmRayConnectorMetadata(pools={desc.key: desc}, loads={0: [LoadJob(1, "req", loads)]}))
        w.start_load_kv()
        for layer in range(hooked):
            w.wait_for_layer_load(names()[layer])
            group, first = (0, 0) if layer < split else (1, split)
            for g, block, at in rows:
                if g == group:
                    at += (layer - first) * PAGE
                    assert torch.equal(layer_bytes(caches, layer, block), pool.tensor[at: at + PAGE]), \
                        f"layer {layer} computes before its load landed"
        w.wait_for_save()
        failures = w.build_worker_meta().load_failures
        failed = sorted(block for _, blocks in failures.items() for block in blocks)
        assert failed == ([] if hooked == LAYERS else [1, 3, 6, 7])
        if hooked < LAYERS:
            assert w.stats.totals["unwaited_layer_loads"] == LAYERS - hooked
            for layer in range(split, LAYERS):  # posted from hook 1 at the latest: layer 3
                assert all(bool((layer_bytes(caches, layer, block) == STALE).all()) for block in (3, 7)), \
                    f"group 1's layer {layer} was posted though no hook came near it"
    finally:
        w.shutdown()


# --- through both halves (vLLM's scheduler, the harness's forward) -----------------------------


HARNESS_LAYERS = 6


def test_a_store_hit_loaded_layer_by_layer_ahead_of_the_hooks_reads_every_byte_right(store, model_dir):
    """The harness checks each loaded block's bytes as each layer computes, right after its hook:
    a hit followed by a long new part, loaded layer by layer through the posting-ahead path."""
    from ucm_ray.testing.harness import make_engine, prompt

    a = make_engine(store.client(), model_dir, num_layers=HARNESS_LAYERS)
    p = prompt(2048, seed=61)
    a.serve("A", p)
    a.settle()
    b = make_engine(store.client(), model_dir, num_layers=HARNESS_LAYERS, pool_connections=StreamOrderedOnCpu)
    modes: dict[str, bool] = {}
    b.before_worker = lambda _engine, meta: modes.update((job.req_id, job.complete_in_start)
                                                         for job in meta.loads.get(0, []))
    assert b.serve("B", p + prompt(1024, seed=62))[0] == 2048
    assert modes == {"B": False}, "the hit was not loaded layer by layer"
    assert b.loaded_blocks["B"] == 16 and b.wrong_blocks == 0 and b.failed_loads == 0
    assert not b.stats().get("unwaited_layer_loads")


def test_a_hit_in_a_step_without_hooks_fails_its_layer_loads_and_no_wrong_block_is_kept(store, model_dir):
    """A 1-token step that a GPU would replay as a FULL CUDA graph (the harness runs no hook
    below ``graph_replay_below``), with the recompute rule forced off: the layers posted in
    ``start_load_kv`` land, the others are never posted, and every layer-by-layer block is failed
    and recomputed (``test_two_halves``' copy-thread counterpart)."""
    from ucm_ray.testing.harness import make_engine, prompt

    layer_by_layer = {"load_at_once_ratio": 0}
    a = make_engine(store.client(), model_dir, num_layers=HARNESS_LAYERS)
    p = prompt(2048, seed=63)
    a.serve("A", p)
    a.settle()
    b = make_engine(store.client(), model_dir, num_layers=HARNESS_LAYERS, extra=layer_by_layer,
                    pool_connections=StreamOrderedOnCpu)
    b.graph_replay_below = 2
    b.connector.scheduler_part.recompute = 1  # test-only: the rule the seed fixed
    assert b.serve("B", p)[0] == 2047
    assert b.failed_loads == 15 and b.wrong_blocks == 0  # the last block lands before the forward
    assert b.stats()["unwaited_layer_loads"] == HARNESS_LAYERS


def test_a_step_without_hooks_reports_its_failed_layer_loads_before_a_deferred_wait_for_save(pool, worker):
    """vLLM's runner with a speculative config defers ``wait_for_save`` past the draft model: right
    after the target forward it asks for the transfer results, the blocks with load errors and the
    worker's metadata, and only then ends the step. A step whose layer hooks never ran (a FULL CUDA
    graph replay) must have its layer loads failed by then: vLLM may be told a block's failure
    only in the step that loaded it (its sampled tokens read the unloaded blocks)."""
    w, caches = worker
    w.bind(load_meta(descriptor(pool)))
    w.start_load_kv()
    # the forward ran no hook; then, as ``_get_kv_connector_output(defer_finalize=True)`` asks:
    w.transfer_results()
    assert w.load_errors() == set(LOADED), "the step's unwaited layer loads were not reported in their step"
    failures = w.build_worker_meta().load_failures
    assert sorted(block for _, blocks in failures.items() for block in blocks) == sorted(LOADED)
    w.wait_for_save()  # ``finalize_kv_connector``, after the draft model
    assert w.load_errors() == set(), "the failures reached vLLM again, in a later step"
    assert w.stats.totals["unwaited_layer_loads"] == LAYERS
    for layer in range(LAYERS_AHEAD, LAYERS):
        assert holds(caches, layer, STALE), f"layer {layer} was posted though no hook asked for it"


def test_a_draft_models_layers_hooked_after_the_step_results_are_asked_for_load_and_do_not_fail(pool, worker):
    """A draft model with attention layers of its own shares the target's KV-cache group (its
    layers last in the plan); vLLM's runner with a speculative config asks for the step's
    results after the target's forward and runs the draft's forward, with its layer hooks, only
    after: layers still awaiting a hook then are the draft's, not a FULL graph's skipped ones.
    (The e2e of it: ``test_e2e_spec_decode.py``'s draft model with KV layers of its own.)"""
    w, caches = worker
    draft = 2
    w.bind(load_meta(descriptor(pool)))
    w.start_load_kv()
    for name in names()[:-draft]:  # the target's forward
        w.wait_for_layer_load(name)
    w.transfer_results()
    assert w.load_errors() == set(), "the draft's layer loads were failed before its forward ran"
    for layer, name in enumerate(names()[-draft:], start=LAYERS - draft):  # the draft's forward
        w.wait_for_layer_load(name)
        assert landed(caches, pool, layer), f"draft layer {layer} computes before its load landed"
    w.wait_for_save()
    assert not w.build_worker_meta().load_failures and w.load_errors() == set()
    assert w.stats.totals["loaded_blocks"] == len(LOADED) and not w.stats.totals.get("unwaited_layer_loads")
