"""The connector's worker half over vLLM-shaped paged KV, driven as an engine step drives it.

An 8B-class KV cache (32 layers, 8 KV heads, head 128, block 16, bf16: one layer's block is
64 KiB, one stored entry 2 MiB) laid out as vLLM 0.26 hands it to a connector (FLASH_ATTN:
logical ``[num_blocks, kv_heads, block, 2 * head]``, stored NHD, i.e. a permuted view of
``[num_blocks, block, kv_heads, 2 * head]``; see ``kv_caches``). ``WorkerPart`` saves layer by
layer into slots a real ``StoreClient`` granted and loads layer by layer from pinned entries,
exactly as in an engine step: ``bind`` (which posts the save of every layer of blocks an
earlier step filled) -> ``wait_for_save``, and ``bind`` -> ``start_load_kv`` ->
``wait_for_layer_load`` x layers. Bytes are verified.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from benchmarks.measure import keys_for
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.types import Location, Locations, Publishes

log = logging.getLogger("bench.gpu")


@dataclass(frozen=True)
class KVShape:
    layers: int = 32
    kv_heads: int = 8
    head: int = 128
    block: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def page_bytes(self) -> int:
        """One layer's block (K and V): 2 * 16 * 8 * 128 * 2 = 64 KiB for the 8B shape."""
        return 2 * self.block * self.kv_heads * self.head * self.dtype.itemsize

    @property
    def entry_bytes(self) -> int:
        return self.layers * self.page_bytes


@dataclass(frozen=True)
class Profile:
    """What one run measures: the H200 figures, or a small smoke check."""

    kv: KVShape
    blocks: int  # blocks loaded/saved per pass (the prefix hit: 256 x 16 = 4096 tokens)
    chunk_tokens: int  # tokens of the chunk whose compute overlaps the loads
    hidden: int  # compute: x[chunk, hidden] @ w[hidden, width]
    width: int
    repeat: int


FULL = Profile(KVShape(), blocks=256, chunk_tokens=2048, hidden=4096,
               width=4096 + 1024 + 1024 + 4096 + 3 * 14336, repeat=3)
QUICK = Profile(KVShape(layers=4), blocks=8, chunk_tokens=64, hidden=256, width=1024, repeat=2)

# vLLM 0.26 FLASH_ATTN: get_kv_cache_shape -> (num_blocks, kv_heads, block, 2 * head) ("K and V are
# packed into the content dim"); get_kv_cache_stride_order() with the NHD layout every connector
# that names no layout gets -> (0, 2, 1, 3); _reshape_attention_kv_cache views the raw per-layer
# allocation in that permuted order and hands ``.permute(inv_order)`` to register_kv_caches.
STRIDE_ORDER = {"nhd": (0, 2, 1, 3), "hnd": (0, 1, 2, 3)}


def kv_caches(shape: KVShape, num_blocks: int, device: torch.device, layout: str) -> dict[str, torch.Tensor]:
    logical = (num_blocks, shape.kv_heads, shape.block, 2 * shape.head)
    order = STRIDE_ORDER[layout]
    physical = tuple(logical[i] for i in order)
    inverse = [order.index(i) for i in range(len(order))]
    caches = {}
    for i in range(shape.layers):  # one allocation per layer, zeroed, as vLLM allocates them
        raw = torch.zeros(num_blocks * shape.page_bytes, dtype=torch.int8, device=device)
        caches[f"model.layers.{i}.self_attn.attn"] = raw.view(shape.dtype).view(physical).permute(*inverse)
    return caches


def check_vllm_shape(shape: KVShape) -> None:
    """Compare the logical shape above with what this vLLM's FLASH_ATTN backend says."""
    try:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        got = tuple(FlashAttentionBackend.get_kv_cache_shape(7, shape.block, shape.kv_heads, shape.head))
    except Exception as e:  # noqa: BLE001 -- e.g. a CPU build without the backend
        log.info("vLLM's FLASH_ATTN backend not available here (%s: %s); using vLLM 0.26's shape",
                 type(e).__name__, e)
        return
    want = (7, shape.kv_heads, shape.block, 2 * shape.head)
    if got != want:
        log.warning("this vLLM's FLASH_ATTN KV shape is %s, the benchmark mirrors vLLM 0.26's %s", got, want)


def kv_cache_config(shape: KVShape, layer_names: list[str], num_blocks: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=shape.block, num_kv_heads=shape.kv_heads, head_size=shape.head,
                             dtype=shape.dtype)
    assert spec.page_size_bytes == shape.page_bytes, (spec.page_size_bytes, shape.page_bytes)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=layer_names, kv_cache_spec=spec)])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WorkerBench:
    """One WorkerPart over vLLM-shaped KV caches: blocks [0, n) are the source of saves,
    [n, 2n) the target of loads; every location comes from a real StoreClient."""

    def __init__(self, prof: Profile, cfg: UcmRayConfig, client: StoreClient, device: torch.device,
                 layout: str, tag: str = "") -> None:
        from ucm_ray.vllm.worker import WorkerPart

        self.prof, self.client, self.device, self.layout = prof, client, device, layout
        n = prof.blocks
        self.caches = kv_caches(prof.kv, 2 * n, device, layout)
        self.names = list(self.caches)
        self.worker = WorkerPart(kv_cache_config(prof.kv, self.names, 2 * n), cfg, 0,
                                 ray.get_runtime_context().get_node_id())
        self.worker.register_kv_caches(self.caches)
        generator = torch.Generator(device=device).manual_seed(1)
        for cache in self.caches.values():  # random bytes in the source blocks, zeros in the targets
            cache[:n].view(torch.int16).copy_(torch.randint(-2**15, 2**15, cache[:n].shape, dtype=torch.int16,
                                                            device=device, generator=generator))
        self.keys = keys_for(f"{layout}{tag}-{os.getpid()}", n)
        self.save_locations = self._reserve()
        self._job = 0
        self.lease: Any = None  # the entries' read lease, once committed

    def segments_per_layer_block(self) -> int:
        from ucm_ray.vllm.layout import layer_layout

        return len(layer_layout("probe", self.caches[self.names[0]], 2 * self.prof.blocks).segments(0))

    def _reserve(self) -> list[tuple[Location, int]]:
        by_pool: dict[Any, list[int]] = {}
        for i, owners in enumerate(self.client.owners(self.keys)):
            by_pool.setdefault(owners[0], []).append(i)
        out: list[Any] = [None] * len(self.keys)
        size = self.prof.kv.entry_bytes
        for pool, indexes in by_pool.items():
            grant = self.client.reserve(pool, size, len(indexes)).result()
            assert grant is not None and len(grant.offsets) == len(indexes), f"pool {pool[0]} has no room"
            for i, offset in zip(indexes, grant.offsets):
                out[i] = (Location(pool[0], pool[1], offset, size), grant.token)
        return out

    def _next(self) -> int:
        self._job += 1
        return self._job

    def _meta(self, **kw: Any) -> Any:
        from ucm_ray.vllm.metadata import UcmRayConnectorMetadata

        return UcmRayConnectorMetadata(pools=self.client.pools().descriptors, **kw)

    def save(self, beside: Callable[[], None] | None = None) -> None:
        """One step's save of blocks [0, n) (every layer) into the granted slots; ``beside``: work
        queued on the compute stream right after the save is posted, as the next steps' would."""
        from ucm_ray.vllm.metadata import BlockSaves

        n = len(self.save_locations)
        saves = BlockSaves(self._next(), np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64),
                           Locations.of([loc for loc, _ in self.save_locations]))
        self.worker.bind(self._meta(saves={0: saves}))
        self.worker.wait_for_save()
        if beside is not None:
            beside()
        landed = {}
        while saves.job_id not in landed:  # a save lands beside the steps after its own: until it did
            sync(self.device)
            results = self.worker.build_worker_meta()
            landed.update(results.saves if results is not None else {})
            time.sleep(0.0001)  # the GIL to a copy thread (CPU and NIXL pools), as an engine's forward leaves it
        assert landed[saves.job_id].landed.all(), "a save failed"

    def commit(self) -> None:
        publish = Publishes.of([(k, loc, token) for k, (loc, token) in zip(self.keys, self.save_locations)])
        assert all(self.client.commit(publish).result()), "commit refused"
        self.lease = self.client.acquire(self.keys).result()
        assert all(loc is not None for loc in self.lease.locations), "a committed entry is missing"

    def start_load(self, at_once: bool = False) -> None:
        """``at_once``: every layer lands before the forward (a store-warm request's step)."""
        from ucm_ray.vllm.metadata import BlockLoads, LoadJob

        assert self.lease is not None
        n = self.prof.blocks
        blocks = BlockLoads(np.zeros(n, dtype=np.int64), np.arange(n, 2 * n, dtype=np.int64), self.lease.locations,
                            list(self.keys), np.zeros(n, dtype=bool))
        job = LoadJob(self._next(), "bench", blocks, complete_in_start=at_once)
        self.worker.bind(self._meta(loads={0: [job]}))
        self.worker.start_load_kv()

    def finish_load(self) -> None:
        results = self.worker.build_worker_meta()
        assert results is not None and not results.load_failures, f"loads failed: {results}"

    def load(self) -> None:
        """One step's layerwise load of the n entries into blocks [n, 2n)."""
        self.start_load()
        for name in self.names:
            self.worker.wait_for_layer_load(name)
        self.finish_load()

    def load_at_once(self) -> None:
        """One step's load of the n entries into blocks [n, 2n), every layer before the forward."""
        self.start_load(at_once=True)
        self.worker.wait_for_save()  # the step's end: the host checks that the loads landed
        self.finish_load()

    def clear_targets(self) -> None:
        n = self.prof.blocks
        for cache in self.caches.values():
            cache[n:].zero_()
        sync(self.device)

    def verify(self) -> None:
        n = self.prof.blocks
        sync(self.device)
        for name, cache in self.caches.items():
            # as int16: the random bf16 bit patterns include NaNs, which never compare equal
            assert torch.equal(cache[:n].view(torch.int16), cache[n:].view(torch.int16)), \
                f"{self.layout}: loaded bytes of {name} differ from the saved ones"

    def close(self) -> None:
        if self.lease is not None:
            self.client.release(self.lease.lease_ids).result()
        self.worker.shutdown()
        self.caches.clear()
