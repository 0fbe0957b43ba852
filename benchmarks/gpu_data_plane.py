"""GPU data-plane benchmark: the connector worker's real copy path into vLLM-shaped paged KV.

Part 1 (always): an 8B-class KV cache (32 layers, 8 KV heads, head 128, block 16, bf16: one
layer's block is 64 KiB, one stored entry 2 MiB) laid out as vLLM 0.26 hands it to a connector
(FLASH_ATTN: logical ``[num_blocks, kv_heads, block, 2 * head]``, stored NHD, i.e. a permuted
view of ``[num_blocks, block, kv_heads, 2 * head]``; see ``kv_caches`` below). A shard fleet
serves a shared-memory pool; ``WorkerPart`` (``ucm_ray.vllm.worker``, the connector's worker
half) saves layer by layer into granted slots and loads layer by layer from pinned entries,
exactly as in an engine step: ``bind`` (which posts the save of every layer of blocks an
earlier step filled) -> ``wait_for_save``, and
``bind`` -> ``start_load_kv`` -> ``wait_for_layer_load`` x layers. Bytes are verified. In the
same run the same number of bytes is copied once between a pinned host buffer and the GPU
(the link's speed). Then one load runs while a per-layer compute runs: a matmul with the
FLOPs of one layer of an 8B model (Llama-3-8B: hidden 4096, q/k/v/o 4096+1024+1024+4096 wide,
MLP 3 x 14336) over the chunk being prefilled, launched after each ``wait_for_layer_load`` as
vLLM's forward would. The stall per layer is (overlapped time - compute-only time) / layers.
The same figures are also taken with the HND layout (one contiguous range per layer-block),
to tell the layout's cost from the transport's. Saves and loads of every layer at once (a
store-warm request's step) run both ways in the same run: staged DMA (the copy engines) and
gather kernels (``*_kernels_*``); and decode-shaped work (HBM-bound matmuls) is timed on the
device alone and while a save moves, each way (``decode_beside_save_{dma,kernels}_slowdown``):
what a prompt's save costs the decode steps it runs beside.

Part 2 (``--ttft``): TTFT of a 4k and a 16k prompt on a ~1.2B random-weight Llama (Llama-3.2-1B
shape, bf16, FULL_AND_PIECEWISE CUDA graphs), engines as Ray actors in their own processes:
cold (engine A, connector on, store empty), the engine's own prefix-cache hit (A again), and
store-warm (a fresh engine B with the connector), B's own prefix-cache hit, and the same
prompts cold on an engine C without the connector, A and C side by side taking each prompt in
turn (the tier's cost to a cold request, and whether any first token differs with and without
it); then A and C decode fresh prompts the same way (what saves running beside decode cost).
A second engine without the connector, C2, takes every prompt too: its figures against C's
(``*_noise_<size>``) are what two alike engines differ by on that host, in the same run. An
engine N with a connector that does nothing decodes them too. Each
engine is measured on the same cores, one at a time, the others parked together on others
(``engine_cores``, ``turn_cores``). Last, B, C, C2 and N each decode
``--decode-rounds`` batches of ``--decode-batch`` fresh prompts per size served together, in
turn (``decode_batch_overhead_<size>`` and its ``_noise`` and ``_null_connector`` beside it): a
serving engine's decode, the prompts' saves running in its first steps.
Prompts are 8 tokens past a block boundary so that A's repeat is a pure local hit (the store
holds nothing beyond it).

``--profile-dir DIR`` also serves one more prompt per size under torch's profiler, cold on A
and store-warm on B (every thread and CUDA stream; the trace kept to our code, vLLM's engine
step and the device), and writes ``trace_cold_<size>.json.gz`` and
``trace_store_warm_<size>.json.gz`` there: where a request's step spends its time.

``--step-timing`` then serves one more cold request and one more decode per size on A and C
with every part of the engine's step (``vllm.*``) and every connector hook (``ours.*``) timed
by ``perf_counter``, and our code inside the hooks (``in.*``, ``inner_parts``), Python's
collections and each thread's CPU time, plus a kernel-launch probe in each engine: a table per
request in the log (``generate_timed``, ``timed_parts``); and B serves those cold prompts
twice more, from the store and from its own prefix cache, timed alike (``timed_warm``).

Prints ``key=value`` lines, among them ``gpu_load_vs_pinned_copy=``, ``gpu_save_vs_pinned_copy=``
(goal >= 0.9), ``layer_wait_overlapped_ms=`` vs ``layer_compute_ms=`` and, with ``--ttft``,
``ttft_store_warm_vs_cold_4k=`` / ``ttft_store_warm_vs_prefix_hit_4k=`` /
``ttft_cold_overhead_4k=`` (goal <= 1.05), ``decode_overhead_4k=`` (1 - A's decode tok/s over C's,
fresh prompts of that size with ``--decode-tokens`` new tokens each; goal <= 0.03), beside each
``ttft_cold_overhead_noise_4k=`` / ``decode_overhead_noise_4k=`` (C2 against C),
``decode_overhead_null_connector_4k=`` (engine N, whose connector does nothing, against C: what
vLLM's connector hooks cost any connector), and the 16k ones.

Run: ``make gpu-bench`` (both parts) on a GPU machine, or ``python benchmarks/gpu_data_plane.py
--device cpu --quick [--ttft]`` anywhere as a smoke check (small shapes, plain copies).
It starts and stops its own Ray cluster and fleets and leaves nothing in /dev/shm.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from data_plane import best  # noqa: E402  # this folder: the same best-of-N timer
from ttft import in_turn  # noqa: E402  # and the same side-by-side order of engines

from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.blockstore import Location, Publishes  # noqa: E402
from ucm_ray.store.client import StoreClient  # noqa: E402
from ucm_ray.store.fleet import running_fleet  # noqa: E402
from ucm_ray.testing.timing import CONNECTOR_HOOKS, Target, timed_calls  # noqa: E402
from ucm_ray.transport import gather  # noqa: E402
from ucm_ray.transport.shm import cluster_tag, pool_prefix  # noqa: E402

log = logging.getLogger("bench.gpu")
REPO = Path(__file__).resolve().parent.parent


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
    inv = [order.index(i) for i in range(len(order))]
    caches = {}
    for i in range(shape.layers):  # one allocation per layer, zeroed, as vLLM allocates them
        raw = torch.zeros(num_blocks * shape.page_bytes, dtype=torch.int8, device=device)
        caches[f"model.layers.{i}.self_attn.attn"] = raw.view(shape.dtype).view(physical).permute(*inv)
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


def kv_cache_config(shape: KVShape, layer_names: list[str], num_blocks: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=shape.block, num_kv_heads=shape.kv_heads, head_size=shape.head,
                             dtype=shape.dtype)
    assert spec.page_size_bytes == shape.page_bytes, (spec.page_size_bytes, shape.page_bytes)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=layer_names, kv_cache_spec=spec)])


def keys_for(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest() for i in range(n)]


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
        g = torch.Generator(device=device).manual_seed(1)
        for t in self.caches.values():  # random bytes in the source blocks, zeros in the targets
            t[:n].view(torch.int16).copy_(torch.randint(-2**15, 2**15, t[:n].shape, dtype=torch.int16,
                                                        device=device, generator=g))
        self.keys = keys_for(f"{layout}{tag}-{os.getpid()}", n)
        self.save_locations = self._reserve()
        self._job = 0
        self.lease = None

    def segments_per_layer_block(self) -> int:
        from ucm_ray.vllm.layout import layer_layout

        return len(layer_layout("probe", self.caches[self.names[0]], 2 * self.prof.blocks).segments(0))

    def _reserve(self) -> list[tuple[Location, int]]:
        by_pool: dict[Any, list[int]] = {}
        for i, owners in enumerate(self.client.owners(self.keys)):
            by_pool.setdefault(owners[0], []).append(i)
        out: list[Any] = [None] * len(self.keys)
        size = self.prof.kv.entry_bytes
        for pool, ix in by_pool.items():
            grant = self.client.reserve(pool, size, len(ix)).result()
            assert grant is not None and len(grant.offsets) == len(ix), f"pool {pool[0]} has no room"
            for i, off in zip(ix, grant.offsets):
                out[i] = (Location(pool[0], pool[1], off, size), grant.token)
        return out

    def _next(self) -> int:
        self._job += 1
        return self._job

    def _meta(self, **kw):
        from ucm_ray.vllm.metadata import UcmRayConnectorMetadata

        return UcmRayConnectorMetadata(pools=self.client.pools().descriptors, **kw)

    def save(self, beside: Callable[[], None] | None = None) -> None:
        """One step's save of blocks [0, n) (every layer) into the granted slots; ``beside``: work
        queued on the compute stream right after the save is posted, as the next steps' would."""
        from ucm_ray.store.blockstore import Locations
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
        for t in self.caches.values():
            t[n:].zero_()
        sync(self.device)

    def verify(self) -> None:
        n = self.prof.blocks
        sync(self.device)
        for name, t in self.caches.items():
            # as int16: the random bf16 bit patterns include NaNs, which never compare equal
            assert torch.equal(t[:n].view(torch.int16), t[n:].view(torch.int16)), \
                f"{self.layout}: loaded bytes of {name} differ from the saved ones"

    def close(self) -> None:
        if self.lease is not None:
            self.client.release(self.lease.lease_ids).result()
        self.worker.shutdown()
        self.caches.clear()


def pinned_copy(nbytes: int, device: torch.device, repeat: int) -> tuple[float, float]:
    """GB/s of one plain host->device and device->host copy of ``nbytes`` (pinned host buffer)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.random_(0, 256)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()

    copy(dev, host)  # warm-up
    h2d = nbytes / best(lambda: copy(dev, host), repeat)
    d2h = nbytes / best(lambda: copy(host, dev), repeat)
    return h2d / 1e9, d2h / 1e9


@contextmanager
def kernels_only() -> Iterator[None]:
    """Plans made inside move every part by gather kernels (the path before staged DMA): the
    same run's figures for both paths."""
    threshold = gather.DMA_COPY_BYTES
    gather.DMA_COPY_BYTES = 1 << 62
    try:
        yield
    finally:
        gather.DMA_COPY_BYTES = threshold


def timed_loads(bench: WorkerBench, load: Callable[[], None], reps: int) -> float:
    """The best of ``reps`` loads into cleared targets, each verified."""
    times = []
    for _ in range(reps):
        bench.clear_targets()
        t = time.perf_counter()
        load()
        times.append(time.perf_counter() - t)
        bench.verify()
    return min(times)


def measure_layout(prof: Profile, cfg: UcmRayConfig, client: StoreClient, device: torch.device,
                   layout: str, overlap: bool, tag: str = "") -> dict[str, float]:
    """``tag``: a pass of its own (its own keys) for a layout measured again. Saves, loads of
    every layer at once and layer-by-layer loads (one strided copy per layer) are measured both
    ways: staged DMA and gather kernels."""
    bench = WorkerBench(prof, cfg, client, device, layout, tag)
    res: dict[str, float] = {"segments": bench.segments_per_layer_block()}
    nbytes = prof.blocks * prof.kv.entry_bytes
    try:
        log.info("%s: %d segment(s) per layer-block; first save (maps and pins the pool)", layout, res["segments"])
        t = time.perf_counter()
        bench.save()
        first_save = time.perf_counter() - t
        bench.commit()
        # A layout that needs many small copies can take seconds a pass: then one pass each (and
        # the first save, whose pool mapping costs ~0.1 s, is the save figure).
        reps = prof.repeat if first_save < 2.0 else 1
        res["save_gbps"] = nbytes / (best(bench.save, reps) if reps > 1 else first_save) / 1e9
        res["load_gbps"] = nbytes / timed_loads(bench, bench.load, reps) / 1e9
        res["load_at_once_gbps"] = nbytes / timed_loads(bench, bench.load_at_once, reps) / 1e9
        with kernels_only():
            res["save_kernels_gbps"] = nbytes / best(bench.save, reps) / 1e9
            res["load_kernels_gbps"] = nbytes / timed_loads(bench, bench.load, reps) / 1e9
            res["load_at_once_kernels_gbps"] = nbytes / timed_loads(bench, bench.load_at_once, reps) / 1e9
        log.info("%s: load %.2f GB/s layer by layer (kernels %.2f), %.2f at once (kernels %.2f), save %.2f GB/s "
                 "(kernels %.2f) (%d x %d KiB entries, bytes verified)", layout, res["load_gbps"],
                 res["load_kernels_gbps"], res["load_at_once_gbps"], res["load_at_once_kernels_gbps"],
                 res["save_gbps"], res["save_kernels_gbps"], prof.blocks, prof.kv.entry_bytes >> 10)
        if overlap:
            res.update(measure_overlap(prof, bench, device, nbytes / res["load_gbps"] / 1e9, reps))
            with kernels_only():
                kernels = measure_overlap(prof, bench, device, nbytes / res["load_kernels_gbps"] / 1e9, reps)
            res["layer_wait_overlapped_kernels_ms"] = kernels["layer_wait_overlapped_ms"]
            res.update(measure_decode_beside_save(prof, bench, device))
    finally:
        bench.close()
    return res


DECODE_GEMVS = 300
"""Decode-shaped matmuls (8 tokens through a 4096 x 14336 bf16 weight, ~30 us each on an H200:
bound by HBM like a decode step) queued while a save moves: ~9 ms, about as long as the save."""


def measure_decode_beside_save(prof: Profile, bench: WorkerBench, device: torch.device) -> dict[str, float]:
    """How much a save running beside decode-shaped work slows it: device time of DECODE_GEMVS
    matmuls queued right after a save is posted, over the same matmuls alone; for staged DMA
    and for gather kernels (which hold SMs while they write host memory over PCIe)."""
    if device.type != "cuda":
        return {}
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(8, prof.hidden, device=device, dtype=prof.kv.dtype, generator=g)
    w = torch.randn(prof.hidden, 14336, device=device, dtype=prof.kv.dtype, generator=g)
    out = torch.empty(8, 14336, device=device, dtype=prof.kv.dtype)
    times: dict[str, list[float]] = {"alone": [], "dma": [], "kernels": []}

    def decode(into: str) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(DECODE_GEMVS):
            torch.matmul(x, w, out=out)
        end.record()
        end.synchronize()
        times[into].append(start.elapsed_time(end))

    for _ in range(3):  # warm-up, then alone / beside each path in turn (the host drifts)
        decode("alone")
    times["alone"].clear()
    for _ in range(prof.repeat + 2):
        decode("alone")
        bench.save(beside=lambda: decode("dma"))
        with kernels_only():
            bench.save(beside=lambda: decode("kernels"))
    alone = statistics.median(times["alone"])
    slowdowns = {f"decode_beside_save_{path}_slowdown": statistics.median(times[path]) / alone - 1
            for path in ("dma", "kernels")}
    log.info("decode-shaped work beside a save: alone %.2f ms, beside staged DMA %.2f ms, beside gather kernels "
             "%.2f ms (medians of %d)", alone, statistics.median(times["dma"]), statistics.median(times["kernels"]),
             len(times["alone"]))
    return slowdowns


def measure_overlap(prof: Profile, bench: WorkerBench, device: torch.device, load_s: float,
                    reps: int) -> dict[str, float]:
    """A load while each layer's compute runs, launched after its wait_for_layer_load."""
    g = torch.Generator(device=device).manual_seed(2)
    dtype = prof.kv.dtype
    x = torch.randn(prof.chunk_tokens, prof.hidden, device=device, dtype=dtype, generator=g)
    w = torch.randn(prof.hidden, prof.width, device=device, dtype=dtype, generator=g) / prof.hidden ** 0.5
    out = torch.empty(prof.chunk_tokens, prof.width, device=device, dtype=dtype)
    layers = len(bench.names)

    def compute_only() -> None:
        for _ in range(layers):
            torch.matmul(x, w, out=out)
        sync(device)

    compute_only()  # warm-up (cuBLAS handles, clocks)
    t_compute = best(compute_only, prof.repeat)
    runs = []
    for _ in range(reps):
        bench.clear_targets()
        sync(device)
        t0 = time.perf_counter()
        bench.start_load()
        t_start = time.perf_counter() - t0
        cpu_wait = 0.0
        for name in bench.names:
            tw = time.perf_counter()
            bench.worker.wait_for_layer_load(name)
            cpu_wait += time.perf_counter() - tw
            torch.matmul(x, w, out=out)  # this layer's compute, queued behind its loaded KV
        sync(device)
        total = time.perf_counter() - t0
        bench.finish_load()
        bench.verify()
        runs.append((total, cpu_wait, t_start))
    total, cpu_wait, t_start = min(runs)
    flops = 2 * prof.chunk_tokens * prof.hidden * prof.width
    log.info("overlap: %d layers, compute %.2f ms/layer (%.0f TFLOP/s), load alone %.2f ms/layer, "
             "overlapped step %.2f ms vs compute alone %.2f ms (start_load_kv %.2f ms)", layers,
             t_compute / layers * 1e3, flops * layers / t_compute / 1e12, load_s / layers * 1e3, total * 1e3,
             t_compute * 1e3, t_start * 1e3)
    return {"layer_compute_ms": t_compute / layers * 1e3, "layer_load_ms": load_s / layers * 1e3,
            "layer_wait_overlapped_ms": max(0.0, total - t_compute) / layers * 1e3,
            "layer_wait_cpu_ms": cpu_wait / layers * 1e3, "start_load_kv_ms": t_start * 1e3}


def data_plane(prof: Profile, device: torch.device, shards: int) -> dict[str, float]:
    check_vllm_shape(prof.kv)
    entries = 2 * prof.blocks  # both layouts' entries stay stored until the fleet stops
    pool = max(entries * prof.kv.entry_bytes // shards + (64 << 20), 64 << 20)
    cfg = UcmRayConfig(num_shards=shards, pool_bytes=pool, ray_namespace="ucm_ray_gpu_bench", transport="shm",
                       transfer_timeout_s=300, lease_s=600, reserve_timeout_s=600, lookup_timeout_s=60)
    nbytes = prof.blocks * prof.kv.entry_bytes
    out: dict[str, float] = {}
    with running_fleet(cfg):
        client = StoreClient(cfg)
        try:
            h2d, d2h = pinned_copy(nbytes, device, prof.repeat)
            log.info("plain pinned copy of %d MiB: host->device %.2f GB/s, device->host %.2f GB/s",
                     nbytes >> 20, h2d, d2h)
            vllm = measure_layout(prof, cfg, client, device, "nhd", overlap=True)
            hnd = measure_layout(prof, cfg, client, device, "hnd", overlap=False)
        finally:
            client.close()
    out.update(pinned_h2d_gbps=h2d, pinned_d2h_gbps=d2h, gpu_load_gbps=vllm["load_gbps"],
               gpu_save_gbps=vllm["save_gbps"], segments_per_layer_block=vllm["segments"],
               gpu_load_vs_pinned_copy=vllm["load_gbps"] / h2d, gpu_save_vs_pinned_copy=vllm["save_gbps"] / d2h,
               gpu_load_kernels_vs_pinned_copy=vllm["load_kernels_gbps"] / h2d,
               gpu_save_kernels_vs_pinned_copy=vllm["save_kernels_gbps"] / d2h,
               gpu_load_at_once_vs_pinned_copy=vllm["load_at_once_gbps"] / h2d,
               gpu_load_at_once_kernels_vs_pinned_copy=vllm["load_at_once_kernels_gbps"] / h2d,
               hnd_load_vs_pinned_copy=hnd["load_gbps"] / h2d, hnd_save_vs_pinned_copy=hnd["save_gbps"] / d2h)
    for k in ("layer_compute_ms", "layer_load_ms", "layer_wait_overlapped_ms", "layer_wait_overlapped_kernels_ms",
              "layer_wait_cpu_ms",
              "start_load_kv_ms", "decode_beside_save_dma_slowdown", "decode_beside_save_kernels_slowdown"):
        if k in vllm:
            out[k] = vllm[k]
    return out


# --- part 2: TTFT ------------------------------------------------------------------------

GPU_ENGINE_ENV = {"PYTHONHASHSEED": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0",
                  "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


@dataclass(frozen=True)
class TtftProfile:
    model: dict[str, Any]
    sizes: dict[str, int]
    engine: dict[str, Any]
    env: dict[str, str]
    num_gpus: float
    kv_bytes_per_token: int


LLAMA_8B = dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                vocab_size=2048, max_position_embeddings=4096 + 512, dtype="bfloat16")
"""Llama-3.1-8B's layers with a small vocabulary (~7B parameters): a decode step of ~6-8 ms on
an H200, where the 1B's is ~1.5 ms and host-bound; 128 KiB of KV per token, 64 KiB per layer
block of 16 tokens (the issue's block size)."""


def ttft_profile(device: torch.device, quick: bool, shape: str = "1b") -> TtftProfile:
    if shape == "8b":
        if device.type != "cuda":
            raise SystemExit("--shape 8b needs a GPU")
        # vLLM's dummy weights (random, made on the device): writing ~14 GB of random weights
        # took longer than the measurement; a decode's speed does not depend on their values
        engine = dict(dtype="bfloat16", block_size=16, max_model_len=4096 + 512, enforce_eager=False,
                      compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}, gpu_memory_utilization=0.28,
                      load_format="dummy")
        return TtftProfile(LLAMA_8B, {"4k": 4096 + 8}, engine, GPU_ENGINE_ENV, 0.2, 32 * 2 * 8 * 128 * 2)
    if device.type == "cuda":
        # Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads, 8 KV heads of 64) with a small
        # vocabulary: ~1.0B parameters, built in well under a minute; 32 KiB of KV per token.
        model = dict(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                     vocab_size=2048, max_position_embeddings=32768, dtype="bfloat16")
        sizes = {"4k": 4096 + 8, "16k": 16384 + 8}
        engine = dict(dtype="bfloat16", block_size=16, max_model_len=16384 + 512, enforce_eager=False,
                      compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}, gpu_memory_utilization=0.2)
        if quick:
            sizes = {"4k": 4096 + 8}
        return TtftProfile(model, sizes, engine, GPU_ENGINE_ENV, 0.2, 16 * 2 * 8 * 64 * 2)
    from ucm_ray.demo import ENGINE_ENV

    model = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
    # vLLM on CPU: blocks are multiples of 32 (the Engine's default is 128)
    return TtftProfile(model, {"4k": 512 + 8, "16k": 1024 + 8}, {}, {**ENGINE_ENV, "PYTHONHASHSEED": "0"}, 0,
                       4 * 2 * 2 * 64 * 4)


def bench_model(prof: TtftProfile, model_dir: str | None) -> str:
    """The TTFT and decode model's directory (built once, reused): the profile's random weights,
    or for ``load_format="dummy"`` a config of its shape and a tokenizer only (a small model of
    the same vocabulary is built and its config's shape replaced; no weight file is written)."""
    from ucm_ray.tiny_model import MARKER_NAME, make_tiny_model

    dummy = prof.engine.get("load_format") == "dummy"
    name = "bench-{num_layers}x{hidden_size}".format(**prof.model) + ("-dummy" if dummy else "")
    out = Path(model_dir or REPO / ".models" / name)
    if not dummy:
        return str(make_tiny_model(out, **prof.model))
    if (out / "config.json").is_file():
        return str(out)
    small = make_tiny_model(out.with_name(out.name + "-tokenizer"), vocab_size=prof.model["vocab_size"],
                            max_position_embeddings=prof.model["max_position_embeddings"], dtype=prof.model["dtype"])
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(small, staging, ignore=shutil.ignore_patterns("*.safetensors*", MARKER_NAME))
    config = json.loads((staging / "config.json").read_text())
    shape = prof.model
    config.update(num_hidden_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                  num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                  intermediate_size=shape["intermediate_size"], head_dim=shape["hidden_size"] // shape["num_heads"])
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    staging.rename(out)
    return str(out)


PROFILED_SOURCES = ("ucm_ray", "kv_connector", "gpu_model_runner.py", "core.py", "sched/scheduler.py")
"""Python functions kept in a profile's trace (the rest of the interpreter's calls are dropped)."""
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "ac2g", "gpu_user_annotation"}


def _device_profiler() -> Any:
    """torch's profiler over the host (every thread's ops, where this torch can) and the device."""
    from torch.profiler import ProfilerActivity, profile

    extra: dict[str, Any] = {}
    try:  # every thread's ops (the copy thread's too)
        extra["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        pass
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities, with_stack=True, **extra)


def _export_trace(prof: Any, trace_path: str) -> str:
    """The profile as a gzipped Chrome trace at ``trace_path``, kept to the device, annotations
    and our code, vLLM's engine step and scheduler (``PROFILED_SOURCES``); its table of ops."""
    import gzip

    raw = trace_path + ".raw.json"
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    os.unlink(raw)
    kept = [e for e in trace.get("traceEvents", []) if e.get("ph") == "M" or e.get("cat") in DEVICE_CATEGORIES
            or e.get("cat") == "user_annotation"
            or (e.get("cat") == "python_function" and any(s in e.get("name", "") for s in PROFILED_SOURCES))]
    with gzip.open(trace_path, "wt") as f:
        json.dump({"traceEvents": kept}, f)
    table: str = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
    return table


def profiled_engine_class():
    """The demo's engine with one more method: a request served under torch's profiler, every
    thread and the GPU's streams, its trace trimmed to our code, the engine step and the device
    (a diagnostic of where a store-warm request's time goes; never part of the figures)."""
    from ucm_ray.demo import Engine

    class ProfiledEngine(Engine):
        def __init__(self, model_dir: str, kv: dict[str, Any] | None, cpus: list[int] | None = None,
                     serving: bool = False, **engine_kwargs: Any) -> None:
            """``cpus``: the cores this engine's threads may run on, set before vLLM starts any
            (each engine its own, near the GPU): one engine's host time is not another's.
            ``serving``: vLLM's engine core (scheduler and worker) in a process of its own, as
            ``vllm serve`` and Ray Serve run it, not in this one: requests are then added and
            outputs detokenized here while the engine core steps on (the step parts cannot be
            timed, nor the connector's counters read, from here)."""
            if cpus:
                os.sched_setaffinity(0, cpus)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if serving else "0"
            self.serving = serving
            super().__init__(model_dir, kv, **engine_kwargs)
            self.batches = 0  # ``decode_batch`` calls so far: its request ids

        def scheduling(self) -> str:
            """How vLLM runs this engine's steps (what its decode rate depends on)."""
            config = self.llm.llm_engine.vllm_config
            return (f"engine core {'in a process of its own' if self.serving else 'in-process'}, "
                    f"async scheduling {config.scheduler_config.async_scheduling}")

        def _flush(self) -> None:
            if not self.serving:  # a serving engine core steps on by itself while it has requests
                super()._flush()

        def close(self) -> list[str]:
            """Stop a serving engine core's processes; the shared-memory files they had mapped
            (vLLM's queues in /dev/shm), for the caller to remove those still there once this
            actor is gone: killed, the actor left them all; shut down first, one per engine."""
            import psutil

            mapped: set[str] = set()
            for child in psutil.Process().children(recursive=True):
                try:
                    with open(f"/proc/{child.pid}/maps") as maps:
                        mapped |= {line.split()[-1] for line in maps if "/dev/shm/psm_" in line}
                except OSError:
                    continue  # a child that ended meanwhile
            self.llm.llm_engine.engine_core.shutdown()
            return sorted(mapped)

        def affinity(self) -> list[int]:
            return sorted(os.sched_getaffinity(0))

        def pin(self, cpus: list[int]) -> None:
            """Every thread of this process and of its children (a serving engine core's)
            onto ``cpus`` (threads started later inherit it)."""
            import psutil

            for pid in [os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))]:
                try:
                    threads = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue  # a child that ended meanwhile
                for tid in threads:
                    try:
                        os.sched_setaffinity(int(tid), cpus)
                    except OSError:
                        pass  # a thread that ended meanwhile

        def generate_profiled(self, prompt_ids: list[int], max_tokens: int, trace_path: str) -> dict[str, Any]:
            with _device_profiler() as prof:
                result = self.generate(prompt_ids, max_tokens)
            result["profile_table"] = _export_trace(prof, trace_path)
            return result

        def decode_batch(self, prompts: list[list[int]], max_tokens: int, timed: bool = False,
                         stats_path: str | None = None, trace_path: str | None = None,
                         trace_steps: int = 32) -> dict[str, Any]:
            """``prompts`` served together, ``max_tokens`` tokens each (EOS ignored), as a serving
            engine decodes a batch: ``rate``, the tokens per second of the steps after every
            prompt's first token (on an engine with the connector the prompts' saves run in
            them), and each request's ``tokens``, in prompt order. The steps after the first
            tokens are measured too (their cost is in ``rate``): ``timed``, their parts timed as
            in ``generate_timed`` (``result["timed"]``); ``stats_path``, under cProfile (the
            engine's thread), its stats dumped there; ``trace_path``, the last ``trace_steps``
            decode steps under torch's profiler (host and device timelines, as
            ``generate_profiled`` keeps them; ``result["profile_table"]``): whether a step's
            extra time is the host's or the device's."""
            import cProfile

            from vllm import SamplingParams

            engine = self.llm.llm_engine
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            self.batches += 1
            rows: dict[str, int] = {}
            for row, prompt_ids in enumerate(prompts):
                req_id = f"decode-batch-{self.batches}-{row}"
                added = engine.add_request(req_id, {"prompt_token_ids": prompt_ids}, params)
                rows[req_id] = rows[added if isinstance(added, str) else req_id] = row  # some versions add a suffix
            tokens: list[list[int]] = [[] for _ in prompts]
            started, at_start = 0.0, 0
            step_ends: list[float] = []  # after each step from the first tokens on (``step_s``)
            parts: dict[str, list[float]] = {}
            traced = None
            with ExitStack() as timers:
                while engine.has_unfinished_requests():
                    if trace_path and traced is None and started and min(map(len, tokens)) >= max_tokens - trace_steps:
                        traced = timers.enter_context(_device_profiler())
                    for out in engine.step():
                        tokens[rows[out.request_id]] = list(out.outputs[0].token_ids)
                    if started:
                        step_ends.append(time.perf_counter())
                    if not started and all(tokens):
                        started, at_start = time.perf_counter(), sum(map(len, tokens))
                        parts = timers.enter_context(timed_calls(self._timed_targets())) if timed else {}
                        if stats_path:
                            profiler = cProfile.Profile()
                            profiler.enable()
                            timers.callback(profiler.dump_stats, stats_path)
                            timers.callback(profiler.disable)
                rate = (sum(map(len, tokens)) - at_start) / (time.perf_counter() - started)
            self._flush()
            result = {"tokens": tokens, "rate": rate, "timed": parts,
                      "step_s": np.diff([started, *step_ends]).tolist()}
            if traced is not None and trace_path:
                result["profile_table"] = _export_trace(traced, trace_path)
            return result

        def _timed_targets(self) -> list[Target]:
            """The engine's step parts and every connector hook (either half), and our code
            inside the hooks (``inner_parts``)."""
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

            engine = self.llm.llm_engine
            core = engine.engine_core.engine_core
            worker = get_kv_transfer_group() if has_kv_transfer_group() else None
            return [
                (engine, ("step",), "vllm.engine"), (core, ("step_fn",), "vllm.core"),
                (core.scheduler, ("schedule", "update_from_output"), "vllm.scheduler"),
                (core.model_executor, ("execute_model", "sample_tokens"), "vllm.executor"),
                (engine.output_processor, ("process_outputs",), "vllm.output"),
                (engine.logger_manager, ("record",), "vllm.stat_loggers"),
                *inner_parts(core.scheduler.connector, worker),
                (core.scheduler.connector, CONNECTOR_HOOKS, "ours.scheduler"), (worker, CONNECTOR_HOOKS, "ours.worker")]

        def generate_timed(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
            """A request served (up to its last token) with the engine's step parts and every
            connector hook timed (``perf_counter`` around each, no profiler), and Python's
            garbage collections: ``result["timed"]`` maps a part (``vllm.*``, ``ours.*``,
            ``gc.*``) to the seconds of each call; ``vllm.engine.step`` has one per step.
            Which parts an engine with the connector spends more host time in."""
            import gc

            collections: dict[str, list[float]] = {}
            collecting: dict[str, float] = {}

            def on_gc(phase: str, info: dict[str, int]) -> None:
                if phase == "start":
                    collecting["at"] = time.perf_counter()
                elif "at" in collecting:
                    took = time.perf_counter() - collecting.pop("at")
                    collections.setdefault(f"gc.gen{info['generation']}", []).append(took)

            gc.callbacks.append(on_gc)
            threads_before = thread_cpu_seconds()
            try:
                with timed_calls(self._timed_targets()) as timed:
                    result = self.generate(prompt_ids, max_tokens, ignore_eos=True, flush=False)
                threads_after = thread_cpu_seconds()
            finally:
                gc.callbacks.remove(on_gc)
            self._flush()  # untimed: the steps after the request's last token
            result["timed"] = {**timed, **collections}
            result["thread_cpu_s"] = {name: seconds - threads_before.get(name, 0.0)
                                      for name, seconds in threads_after.items()}
            return result

        def launch_probe(self, repeat: int = 2000) -> dict[str, float]:
            """Host time of a tiny kernel launch and of a small pinned host-to-device copy in
            this process (microseconds, median of ``repeat``): whether the process state the
            connector adds (mapped pools, streams, events) makes every launch of vLLM's dearer."""
            if not torch.cuda.is_available():
                return {}
            small = torch.zeros(16, device="cuda")
            host = torch.zeros(1024, pin_memory=True)
            target = torch.empty(1024, device="cuda")
            out: dict[str, float] = {}
            for name, launch in (("launch_us", lambda: small.add_(1)),
                                 ("h2d_copy_us", lambda: target.copy_(host, non_blocking=True))):
                times = []
                for _ in range(repeat):
                    started = time.perf_counter()
                    launch()
                    times.append(time.perf_counter() - started)
                torch.cuda.synchronize()
                out[name] = 1e6 * statistics.median(times)
            return out

        def generate_cprofiled(self, prompt_ids: list[int], max_tokens: int, stats_path: str) -> dict[str, Any]:
            """A request (a decode, or a cold one with ``max_tokens=1``) under cProfile (the engine
            loop's own thread), its stats dumped to ``stats_path``: which host work per step an
            engine with the connector adds."""
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
            try:
                return self.generate(prompt_ids, max_tokens, ignore_eos=True)
            finally:
                profiler.disable()
                profiler.dump_stats(stats_path)

    return ProfiledEngine


def inner_parts(scheduler: Any, worker: Any) -> list[Target]:
    """Our code inside the hooks, timed too (``generate_timed``): where a lookup's and a load's
    host time goes. Class attributes are patched on the class (every instance), and put back."""
    if scheduler is None and worker is None:
        return []
    from ucm_ray.store.client import _Acquire
    from ucm_ray.transport import gather, shm

    out: list[Target] = [
        (gather.GatherPlan, ("__init__", "move"), "in.gather"),
        (shm._CudaCopies, ("__init__", "post"), "in.shm_copies"),
        (_Acquire, ("__init__", "poll", "result"), "in.acquire"),
    ]
    if scheduler is not None:
        part = scheduler.scheduler_part
        out.append((part, ("_post_lookup", "_first_block_absent", "_hit_tokens", "_attn_keys", "_answered",
                           "_expect_saves", "_plan_saves", "_bind", "_dispatch", "_take_results",
                           "_collect_answers"), "in.scheduler"))
        out.append((part._slots, ("tick", "expect"), "in.slots"))
    if worker is not None:
        from ucm_ray.vllm.worker import loads
        from ucm_ray.vllm.worker.plan import KvCaches

        part = worker.worker_part
        out.append((part, ("fence",), "in.worker"))
        out.append((loads, ("plan_loads",), "in.plan"))
        out.append((KvCaches, ("ranges",), "in.plan"))
        out.append((part._loads, ("start", "_finish", "_land", "_validate_unpinned"), "in.loads"))
        out.append((part._copies, ("post_by_pool", "_post_parts", "count_bytes", "compute_ready", "order_compute"),
                    "in.copies"))
        out.append((part._saves, ("_job", "_post_ordered", "poll"), "in.saves"))
        out.append((part._pools, ("prepare", "post_part"), "in.pools"))
    return out


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by each thread of this process, by name (threads of one name
    summed; Linux only, else empty): which threads besides the engine's keep a core busy."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def parts_table(timed: dict[str, dict[str, list[float]]], per_step: bool) -> list[str]:
    """One row per timed part: each engine's (``timed``'s labels) total, in ms per request
    (``per_step`` false) or us per step, its calls and its median call."""
    steps = {label: max(1, len(parts.get("vllm.engine.step", []))) for label, parts in timed.items()}
    scale = {label: 1e6 / steps[label] if per_step else 1e3 for label in timed}
    rows = []
    for part in sorted(set().union(*timed.values())):
        calls = {label: parts.get(part, []) for label, parts in timed.items()}
        if not any(calls.values()):
            continue  # a hook of the other role
        cells = [f"{label} {sum(c) * scale[label]:9.1f} ({len(c):4d}, median "
                 f"{1e6 * statistics.median(c) if c else 0.0:7.1f} us)" for label, c in calls.items()]
        rows.append(f"  {part:<42} " + "   ".join(cells))
    return rows


def step_spread(steps: list[float]) -> str:
    """A decode's step times (ms): quantiles, the first 8 steps' sum and the slowest steps
    (index: ms), telling a gap spread over every step from one made by a few."""
    if not steps:
        return "no steps"
    ms = sorted(1e3 * s for s in steps)
    quantile = {q: ms[min(len(ms) - 1, int(q * len(ms)))] for q in (0.1, 0.5, 0.9, 0.99)}
    slowest = sorted(range(len(steps)), key=lambda i: steps[i], reverse=True)[:5]
    return (" ".join(f"p{int(q * 100)} {v:.2f}" for q, v in quantile.items())
            + f" sum {sum(ms):.0f} first8 {1e3 * sum(steps[:8]):.1f} slowest "
            + ", ".join(f"{i}: {1e3 * steps[i]:.1f}" for i in slowest))


def timed_parts(pair: dict[str, Any], model: str, prof: TtftProfile, decode_tokens: int,
                cores: EngineCores) -> dict[str, Any]:
    """One more cold request and one more decode per size, on A and C, each part of the
    engine's step and each connector hook timed (``generate_timed``): a table per request in
    the log (a cold one's parts in ms per request; a decode's in us per step, and the median
    call, which is a step without saves, and the spread of its steps), and in the results the
    decode steps' mean host time on A and C and the part of A's in our hooks, the cold
    requests' time in our hooks, and the engine steps each took to its first token (a lookup
    answered late costs one). The cold prompts are in the store after: ``timed_warm``."""
    out: dict[str, Any] = {}
    for label, engine in pair.items():
        with turn_cores(engine, cores):
            probe = ray.get(engine.launch_probe.remote())
        for name, value in probe.items():
            out[f"{name}_{label.lower()}"] = value
    for size in prof.sizes:
        for kind, max_tokens in (("cold", 1), ("decode", decode_tokens)):
            prompt = timed_prompt(model, prof, size, max_tokens)
            got = {}
            for label, engine in pair.items():
                with turn_cores(engine, cores):
                    got[label] = ray.get(engine.generate_timed.remote(prompt, max_tokens))
            timed = {label: r["timed"] for label, r in got.items()}
            steps = {label: max(1, len(parts["vllm.engine.step"])) for label, parts in timed.items()}
            rows = parts_table(timed, per_step=kind == "decode")
            for label, r in got.items():
                busy = sorted(((seconds, name) for name, seconds in r["thread_cpu_s"].items() if seconds > 0),
                              reverse=True)
                rows.append(f"  threads of {label} (CPU ms): " + ", ".join(f"{name} {1e3 * seconds:.0f}"
                                                                      for seconds, name in busy[:8]))
                if kind == "decode":
                    for part in ("vllm.engine.step", "vllm.executor.execute_model"):
                        rows.append(f"  {label} {part} ms: {step_spread(timed[label].get(part, []))}")
            unit = "ms per request" if kind == "cold" else "us per step"
            log.info("%s %s timed parts, %s (calls, median call), A %d steps, C %d steps, TTFT A %.1f ms C %.1f ms:"
                     "\n%s", size, kind, unit, steps["A"], steps["C"], ttft_of(got["A"]) * 1e3,
                     ttft_of(got["C"]) * 1e3, "\n".join(rows))
            ours = sum(sum(calls) for part, calls in timed["A"].items() if part.startswith("ours."))
            if kind == "cold":
                out[f"cold_{size}_steps_to_first_token_a"] = steps["A"]
                out[f"cold_{size}_steps_to_first_token_c"] = steps["C"]
                out[f"cold_{size}_connector_hooks_ms"] = ours * 1e3
            else:
                step_us = {label: 1e6 * sum(timed[label]["vllm.engine.step"]) / steps[label] for label in timed}
                out[f"decode_{size}_step_us_a"] = step_us["A"]
                out[f"decode_{size}_step_us_c"] = step_us["C"]
                out[f"decode_{size}_connector_hooks_us_per_step"] = 1e6 * ours / steps["A"]
    return out


def timed_prompt(model: str, prof: TtftProfile, size: str, max_tokens: int) -> list[int]:
    """The prompt of ``timed_parts``'s request of that size and length."""
    from ucm_ray.tiny_model import synthetic_prompt

    j = list(prof.sizes).index(size)
    return synthetic_prompt(model, prof.sizes[size], seed=100 * (j + 1) + 77 + max_tokens)


def timed_warm(engine: Any, model: str, prof: TtftProfile) -> dict[str, Any]:
    """``timed_parts``'s cold prompts (A saved them) served by a fresh engine twice, timed part
    by part: from the store, then from its own prefix cache. Where a store hit's time goes
    beyond the own hit's (the lookup, the loads, the waits for them)."""
    out: dict[str, Any] = {}
    for size in prof.sizes:
        prompt = timed_prompt(model, prof, size, 1)
        got = {label: ray.get(engine.generate_timed.remote(prompt, 1)) for label in ("warm", "own")}
        log.info("%s store-warm vs own prefix hit, timed parts in ms per request (calls, median call), "
                 "TTFT warm %.1f ms own %.1f ms, cached tokens %s:\n%s", size, ttft_of(got["warm"]) * 1e3,
                 ttft_of(got["own"]) * 1e3, [r["cached"] for r in got.values()],
                 "\n".join(parts_table({label: r["timed"] for label, r in got.items()}, per_step=False)))
        ours = sum(sum(calls) for part, calls in got["warm"]["timed"].items() if part.startswith("ours."))
        out[f"store_warm_{size}_connector_hooks_ms"] = ours * 1e3
    return out


@dataclass(frozen=True)
class EngineCores:
    """Where the engines compared run: the one measured on ``turn``, the others parked on
    ``parked`` (None: the host has too few cores to pin; every engine runs anywhere). Engines
    pinned each to cores of its own differed by up to 30% in one run, the same engines in every
    round (a batch decode's C2 and N against C: -0.32 and -0.31): cores differ, so every
    engine is measured on the same ones, one engine at a time."""

    turn: list[int] | None
    parked: list[int] | None


def engine_cores(device: torch.device, per_engine: int = 4) -> EngineCores:
    """``per_engine`` cores to measure on, those nearest the GPU first (its NUMA node's, from
    sysfs), the first two left to the driver and the shards, and as many for the engines not
    measured meanwhile (idle: they share theirs)."""
    usable = sorted(os.sched_getaffinity(0))
    near: list[int] = []
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        bus = f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        try:
            with open(f"/sys/bus/pci/devices/{bus}/local_cpulist") as f:
                near = [c for c in parse_cpulist(f.read()) if c in usable]
        except (OSError, ValueError, AttributeError):
            near = []
    ordered = near + [c for c in usable if c not in near]
    log.info("cores near the GPU: %s of %s", near or "unknown", usable)
    per_engine = min(per_engine, (len(usable) - 2) // 2)
    if per_engine < 2:
        return EngineCores(None, None)
    return EngineCores(ordered[2:2 + per_engine], ordered[2 + per_engine:2 + 2 * per_engine])


@contextmanager
def turn_cores(engine: Any, cores: EngineCores) -> Iterator[None]:
    """``engine`` on the cores every engine is measured on, parked again after."""
    if cores.turn:
        ray.get(engine.pin.remote(cores.turn))
    try:
        yield
    finally:
        if cores.parked:
            ray.get(engine.pin.remote(cores.parked))


def on_turn(cores: EngineCores, measure: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``measure(engine, item)`` (for ``in_turn``) with the engine on the turn cores."""
    def pinned(engine: Any, item: Any) -> Any:
        with turn_cores(engine, cores):
            return measure(engine, item)
    return pinned


def parse_cpulist(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            out.extend(range(int(first), int(last or first) + 1))
    return out


def ttft_of(result: dict[str, Any]) -> float:
    return result["ttft"] if result.get("ttft") else result["seconds"]


def decode_rate(result: dict[str, Any]) -> float:
    """Tokens per second after the first one: ``(tokens - 1) / (seconds - TTFT)``."""
    return (len(result["tokens"]) - 1) / (result["seconds"] - ttft_of(result))


def decode_prompts(model: str, prof: TtftProfile, per_size: int, batch: int, rounds: int
                   ) -> tuple[dict[str, list[list[int]]], dict[str, list[list[list[int]]]], list[list[int]]]:
    """(``per_size`` fresh prompts per size, in no cache nor the store; ``rounds`` batches of
    ``batch`` prompts per size; an engine's warm-up prompts: a short one and one of each size,
    since an engine's first prompt of a size ran slower than the next: 4k 36.5 then 24.4 ms with
    the connector, 25.2 then 19.7 without, on one H200 lease)."""
    from ucm_ray.tiny_model import synthetic_prompt

    sizes = list(prof.sizes.items())
    fresh = {size: [synthetic_prompt(model, n, seed=100 * (j + 1) + 50 + i) for i in range(per_size)]
             for j, (size, n) in enumerate(sizes)}
    batched = {size: [[synthetic_prompt(model, n, seed=20000 + 1000 * j + 100 * r + i) for i in range(batch)]
                      for r in range(rounds)]
               for j, (size, n) in enumerate(sizes)} if batch else {}
    warmup = [synthetic_prompt(model, 64, seed=9999)] + [synthetic_prompt(model, n, seed=9000 + j)
                                                          for j, (_, n) in enumerate(sizes)]
    return fresh, batched, warmup


def start_engine(remote: Any, model: str, prof: TtftProfile, label: str, kv_config: dict[str, Any] | None,
                 cpus: list[int] | None, warmup: list[list[int]]) -> Any:
    """An engine actor, up once it served each ``warmup`` prompt (an engine's first prompt of a
    size ran slower than the next)."""
    started = time.perf_counter()
    engine = remote.remote(model, kv_config, cpus=cpus, **prof.engine)
    for prompt_ids in warmup:
        ray.get(engine.generate.remote(prompt_ids, 1))
    log.info("engine %s up in %.1f s on cores %s", label, time.perf_counter() - started,
             ray.get(engine.affinity.remote()))
    return engine


def ttft(device: torch.device, quick: bool, prompts_per_size: int, model_dir: str | None,
         profile_dir: str | None = None, decode_tokens: int = 256, step_timing: bool = False,
         decode_batch: int = 8, decode_rounds: int = 3) -> dict[str, Any]:
    """``profile_dir``: one more prompt per size, served cold by A and store-warm by B under
    torch's profiler (``profiled_engine_class``); traces go there, outside the medians.
    ``decode_tokens``: A and C also decode that many tokens of fresh prompts of each size (A's
    saves of the prompt and of the decoded blocks run meanwhile): ``decode_overhead_<size>``.
    ``decode_batch`` / ``decode_rounds``: at the end, B (the connector), C, C2 and N each
    decode ``decode_rounds`` batches of ``decode_batch`` fresh prompts of each size together,
    in turn (``decode_batch_overhead_<size>``): a serving engine's decode, where one request's
    host noise weighs less than in a single request's rate.
    ``step_timing``: then one cold request and one decode more per size, timed part by part
    (``timed_parts``), outside the medians."""
    from ucm_ray.demo import kv_transfer_config
    from ucm_ray.testing.null_connector import null_kv_transfer_config
    from ucm_ray.tiny_model import synthetic_prompt

    prof = ttft_profile(device, quick)
    t = time.perf_counter()
    model = bench_model(prof, model_dir)
    log.info("model %s ready in %.1f s", model, time.perf_counter() - t)
    prompts = {size: [synthetic_prompt(model, n, seed=100 * (j + 1) + i) for i in range(prompts_per_size)]
               for j, (size, n) in enumerate(prof.sizes.items())}
    profiled = {size: synthetic_prompt(model, n, seed=100 * (j + 1) + 99)
                for j, (size, n) in enumerate(prof.sizes.items())} if profile_dir else {}
    # decode: more prompts than TTFT prompts (a decode's rate varied by +-15% from one request to
    # the next on the H200 host); batches not counted in the pools' size: saved last, they may
    # evict what nothing reads any more
    fresh, batched, warmup = decode_prompts(model, prof, 2 * prompts_per_size + 2, decode_batch, decode_rounds)
    tokens = (sum(len(p) for p in warmup) + sum(len(p) for ps in prompts.values() for p in ps)
              + sum(len(p) for p in profiled.values())
              + sum(len(p) + decode_tokens for ps in fresh.values() for p in ps))
    shards = 2
    cfg = UcmRayConfig(num_shards=shards, ray_namespace="ucm_ray_gpu_bench_ttft", transport="shm",
                       pool_bytes=int(tokens * prof.kv_bytes_per_token * 1.5) // shards + (64 << 20))
    kv = kv_transfer_config({"ray_namespace": cfg.ray_namespace, "lookup_timeout_s": 60, "layerwise": True})
    remote = ray.remote(num_cpus=0, num_gpus=prof.num_gpus, runtime_env={"env_vars": prof.env})(
        profiled_engine_class())

    cores = engine_cores(device)

    def start(label: str, kv_config: dict[str, Any] | None, cpus: list[int] | None):
        return start_engine(remote, model, prof, label, kv_config, cpus, warmup)

    def hits(engine) -> int:
        return ray.get(engine.connector_totals.remote())["scheduler"].get("hit_tokens", 0)

    res: dict[str, Any] = {}
    with running_fleet(cfg):
        a = start("A (connector, store empty)", kv, cores.parked)
        plain_engine = start("C (no connector)", None, cores.parked)
        other_plain = start("C2 (no connector, a second one: how far two alike engines differ)", None, cores.parked)
        null = start("N (vLLM's connector hooks alone: NullConnector)", null_kv_transfer_config(), cores.parked)
        # A's cold requests (a miss and their saves) against the same prompts, new to an engine
        # without the connector: what the tier costs a cold request, and whether it changed an
        # output. Side by side, one prompt each in turn: a run's drift lands on all three.
        pair = {"A": a, "C": plain_engine}
        trio = {**pair, "C2": other_plain}
        cold, plain, plain2 = {}, {}, {}
        for s, ps in prompts.items():
            before = ray.get(a.connector_totals.remote())["scheduler"]
            got = in_turn(trio, ps, on_turn(cores, lambda engine, p: ray.get(engine.generate.remote(p, 1))))
            cold[s], plain[s], plain2[s] = got["A"], got["C"], got["C2"]
            after = ray.get(a.connector_totals.remote())["scheduler"]
            # the connector's scheduler hooks' host time (lookups, plans, results), per request
            res[f"a_scheduler_host_ms_per_cold_request_{s}"] = 1e3 * (
                after.get("schedule_seconds", 0.0) - before.get("schedule_seconds", 0.0)) / len(ps)
        log.info("A's cold TTFTs: %s", {s: [round(ttft_of(r) * 1e3, 1) for r in rs] for s, rs in cold.items()})
        log.info("C's cold TTFTs: %s", {s: [round(ttft_of(r) * 1e3, 1) for r in rs] for s, rs in plain.items()})
        decode: dict[str, dict[str, list]] = {}
        for s, ps in fresh.items():
            decode[s] = in_turn({**trio, "N": null}, ps, on_turn(cores, lambda engine, p: ray.get(
                engine.generate.remote(p, decode_tokens, ignore_eos=True))))
            log.info("%s decode tok/s: %s", s, ", ".join(f"{label} {[round(decode_rate(r), 1) for r in rs]}"
                                                         for label, rs in decode[s].items()))
        if profile_dir:  # one more decode each under cProfile: where A's extra host time per step goes
            probe = synthetic_prompt(model, min(prof.sizes.values()), seed=4242)
            for label, engine in pair.items():
                path = os.path.join(profile_dir, f"decode_{label}.prof")
                with turn_cores(engine, cores):
                    rate = decode_rate(ray.get(engine.generate_cprofiled.remote(probe, decode_tokens, path)))
                log.info("decode of engine %s under cProfile: %.1f tok/s, stats in %s", label, rate, path)
            with turn_cores(a, cores):
                for j, (s, n) in enumerate(prof.sizes.items()):  # and a cold request of each size on A
                    path = os.path.join(profile_dir, f"cold_A_{s}.prof")
                    ray.get(a.generate_cprofiled.remote(synthetic_prompt(model, n, seed=4343 + j), 1, path))
                    log.info("%s cold request of engine A under cProfile: stats in %s", s, path)
        if step_timing:
            res.update(timed_parts(pair, model, prof, decode_tokens, cores))
        saved = ray.get(a.connector_totals.remote())["scheduler"]
        log.info("A saved %d blocks, dropped %d (no write slot before the request ended)",
                 saved.get("saved_blocks", 0), saved.get("saves_dropped", 0))
        with turn_cores(a, cores):
            for s, p in profiled.items():  # cold, under the profiler: where a cold request's time goes
                assert profile_dir is not None
                path = os.path.join(profile_dir, f"trace_cold_{s}.json.gz")
                result = ray.get(a.generate_profiled.remote(p, 1, path))
                log.info("profiled %s cold request: TTFT %.1f ms under the profiler, trace in %s\n%s", s,
                         ttft_of(result) * 1e3, path, result["profile_table"])
        before = hits(a)
        with turn_cores(a, cores):
            local = {s: [ray.get(a.generate.remote(p, 1)) for p in ps] for s, ps in prompts.items()}
        assert hits(a) == before, "the store added to A's own prefix hit; the prompts should leave it nothing"
        ray.kill(a)
        b = start("B (connector, fresh process)", kv, cores.parked)
        warm, store_hits, own = {}, {}, {}
        with turn_cores(b, cores):  # B alone: every measurement of it on the turn cores
            for s, ps in prompts.items():
                before = hits(b)
                warm[s], store_hits[s] = [], 0
                for p in ps:
                    before = hits(b)
                    worker_before = ray.get(b.connector_totals.remote())["worker"]
                    warm[s].append(ray.get(b.generate.remote(p, 1)))
                    got = hits(b) - before
                    store_hits[s] += got
                    worker = ray.get(b.connector_totals.remote())["worker"]
                    moved = {k: worker.get(k, 0) - worker_before.get(k, 0)
                             for k in ("loaded_blocks", "load_failures", "stale_loads", "load_seconds")}
                    log.info("%s prompt of %d tokens: store-warm TTFT %.1f ms, store hit %d tokens, worker %s", s,
                             len(p), ttft_of(warm[s][-1]) * 1e3, got, moved)
            if step_timing:
                res.update(timed_warm(b, model, prof))
            for s, p in profiled.items():
                assert profile_dir is not None
                path = os.path.join(profile_dir, f"trace_store_warm_{s}.json.gz")
                before = hits(b)
                result = ray.get(b.generate_profiled.remote(p, 1, path))
                log.info("profiled %s store-warm request: TTFT %.1f ms under the profiler, store hit %d tokens, "
                         "trace in %s\n%s", s, ttft_of(result) * 1e3, hits(b) - before, path, result["profile_table"])
            for s, ps in prompts.items():  # B's own prefix cache: the yardstick for a store hit
                own[s] = [ray.get(b.generate.remote(p, 1)) for p in ps]
        batch_decode: dict[str, dict[str, list]] = {}
        for s, rounds in batched.items():
            batch_decode[s] = in_turn({"B": b, "C": plain_engine, "C2": other_plain, "N": null}, rounds, on_turn(
                cores, lambda engine, batch: ray.get(engine.decode_batch.remote(batch, decode_tokens))))
            log.info("%s decode tok/s, batches of %d: %s", s, decode_batch, ", ".join(
                f"{label} {[round(r['rate'], 1) for r in rs]}" for label, rs in batch_decode[s].items()))
        for engine in (b, plain_engine, other_plain, null):
            ray.kill(engine)
    identical = all(w["tokens"] == c["tokens"] == n["tokens"]
                    for s in prompts for w, c, n in zip(warm[s], cold[s], plain[s]))
    for s in prompts:
        c, h, w, o, n = (statistics.median(ttft_of(r) for r in rs[s]) for rs in (cold, local, warm, own, plain))
        log.info("%s (%d tokens): cold %.1f ms (no connector %.1f ms), prefix-cache hit %.1f ms (cached %s), "
                 "store-warm %.1f ms (store hit %d tokens over %d prompts)", s, prof.sizes[s], c * 1e3, n * 1e3,
                 h * 1e3, [r["cached"] for r in local[s]], w * 1e3, store_hits[s], len(prompts[s]))
        res.update({f"ttft_no_connector_{s}_ms": n * 1e3, f"ttft_cold_overhead_{s}": c / n,
                    f"ttft_cold_{s}_ms": c * 1e3, f"ttft_prefix_hit_{s}_ms": h * 1e3,
                    f"ttft_store_warm_{s}_ms": w * 1e3, f"store_hit_tokens_{s}": store_hits[s],
                    f"ttft_store_warm_vs_cold_{s}": w / c, f"ttft_store_warm_vs_other_engines_prefix_hit_{s}": w / h,
                    f"ttft_b_prefix_hit_{s}_ms": o * 1e3, f"ttft_store_warm_vs_prefix_hit_{s}": w / o})
        with_tier, without, again, hooks_only = (statistics.median(decode_rate(r) for r in decode[s][e])
                                                 for e in ("A", "C", "C2", "N"))
        res.update({f"decode_tok_s_{s}": with_tier, f"decode_tok_s_no_connector_{s}": without,
                    f"decode_overhead_{s}": 1 - with_tier / without,
                    # a connector that does nothing: what vLLM's hooks cost any connector
                    f"decode_overhead_null_connector_{s}": 1 - hooks_only / without,
                    # the same figure between two engines without the connector: this host's noise
                    f"decode_overhead_noise_{s}": 1 - again / without,
                    f"ttft_cold_overhead_noise_{s}": statistics.median(ttft_of(r) for r in plain2[s]) / n})
    for s, by_engine in batch_decode.items():
        with_tier, without, again, hooks_only = (statistics.median(r["rate"] for r in by_engine[e])
                                                 for e in ("B", "C", "C2", "N"))
        res.update({f"decode_batch_tok_s_{s}": with_tier, f"decode_batch_tok_s_no_connector_{s}": without,
                    f"decode_batch_overhead_{s}": 1 - with_tier / without,
                    f"decode_batch_overhead_null_connector_{s}": 1 - hooks_only / without,
                    f"decode_batch_overhead_noise_{s}": 1 - again / without})
    res["decode_batch_tokens_identical"] = all(x["tokens"] == y["tokens"] for by_engine in batch_decode.values()
                                               for x, y in zip(by_engine["B"], by_engine["C"]))
    res["ttft_first_tokens_identical"] = identical
    res["decode_tokens_identical"] = all(x["tokens"] == y["tokens"] for s in decode
                                         for x, y in zip(decode[s]["A"], decode[s]["C"]))
    return res


def step_windows(results: list[dict[str, Any]]) -> str:
    """Mean decode step (ms) of batches in three windows, each batch's steps after its first
    tokens: where an engine's extra time goes (its prompts' saves are planned and move in the
    first steps, decode saves later)."""
    windows = ((0, 16), (16, 64), (64, None))
    means = []
    for begin, end in windows:
        steps = [x for r in results for x in r["step_s"][begin:end]]
        means.append(f"{1e3 * statistics.mean(steps):.3f}" if steps else "-")  # fewer tokens than the window
    return " / ".join(means)


def decode_figures(kind: str, tail: str, rate: dict[str, float], runs: dict[str, list[dict[str, Any]]]
                   ) -> dict[str, Any]:
    """``<kind>_*_<tail>``: A's and C's decode rates, A's and N's overhead against C, and whether
    A decoded C's tokens (``runs``: each engine's results, in the same order)."""
    return {f"{kind}_tok_s_{tail}": rate["A"], f"{kind}_tok_s_no_connector_{tail}": rate["C"],
            f"{kind}_overhead_{tail}": 1 - rate["A"] / rate["C"],
            f"{kind}_overhead_null_connector_{tail}": 1 - rate["N"] / rate["C"],
            f"{kind}_tokens_identical_{tail}": all(x["tokens"] == y["tokens"] for x, y in zip(runs["A"], runs["C"]))}


def decode_only(device: torch.device, shape: str, prompts_per_size: int, decode_tokens: int, decode_batch: int,
                decode_rounds: int, serving: bool = False) -> dict[str, Any]:
    """``--decode-only``: engines A (the connector, its saves running), C (none) and N (a
    connector that does nothing) of the ``shape`` profile decode fresh prompts one at a time,
    then ``decode_rounds`` batches of ``decode_batch`` prompts each, in turn on the same cores:
    ``decode_overhead_<shape>_<size>``, ``decode_batch_overhead_<shape>_<size>`` and their
    ``_null_connector`` (N against C). No TTFT part: with an 8B model the five engines of
    ``--ttft`` do not start within one device call. ``serving``: every engine's core in a
    process of its own (``vllm serve``'s way; the figures' names end in ``_serving``)."""
    from ucm_ray.demo import kv_transfer_config
    from ucm_ray.testing.null_connector import null_kv_transfer_config

    prof = ttft_profile(device, False, shape)
    started = time.perf_counter()
    model = bench_model(prof, None)
    log.info("model %s ready in %.1f s", model, time.perf_counter() - started)
    fresh, batched, warmup = decode_prompts(model, prof, prompts_per_size, decode_batch, decode_rounds)
    tokens = (sum(len(p) for p in warmup) + sum(len(p) + decode_tokens for ps in fresh.values() for p in ps)
              + sum(len(p) + decode_tokens for rounds in batched.values() for batch in rounds for p in batch))
    cfg = UcmRayConfig(num_shards=2, ray_namespace="ucm_ray_gpu_bench_ttft", transport="shm",
                       pool_bytes=int(tokens * prof.kv_bytes_per_token * 1.2) // 2 + (64 << 20))
    kv = kv_transfer_config({"ray_namespace": cfg.ray_namespace, "lookup_timeout_s": 60, "layerwise": True})
    remote = ray.remote(num_cpus=0, num_gpus=prof.num_gpus, runtime_env={"env_vars": prof.env})(
        profiled_engine_class())
    cores = engine_cores(device)
    res: dict[str, Any] = {}
    engine_kwargs = {**prof.engine, "serving": serving}
    mode = "_serving" if serving else ""
    with running_fleet(cfg):
        engines = {label: start_engine(remote, model, replace(prof, engine=engine_kwargs), label, kv_config,
                                       cores.parked, warmup)
                   for label, kv_config in (("A", kv), ("C", None), ("N", null_kv_transfer_config()))}
        for label, engine in engines.items():
            log.info("engine %s: %s", label, ray.get(engine.scheduling.remote()))
        for s, ps in fresh.items():
            single = in_turn(engines, ps, on_turn(cores, lambda engine, p: ray.get(
                engine.generate.remote(p, decode_tokens, ignore_eos=True))))
            log.info("%s %s decode tok/s: %s", shape, s, ", ".join(
                f"{label} {[round(decode_rate(r), 1) for r in rs]}" for label, rs in single.items()))
            rate = {label: statistics.median(decode_rate(r) for r in rs) for label, rs in single.items()}
            res.update(decode_figures("decode", f"{shape}_{s}{mode}", rate, single))
        for s, rounds in batched.items():
            together = in_turn(engines, rounds, on_turn(cores, lambda engine, batch: ray.get(
                engine.decode_batch.remote(batch, decode_tokens))))
            log.info("%s %s decode tok/s, batches of %d: %s", shape, s, decode_batch, ", ".join(
                f"{label} {[round(r['rate'], 1) for r in rs]}" for label, rs in together.items()))
            log.info("%s %s batch decode, mean step (ms) in steps 1-16 / 17-64 / 65-: %s", shape, s, "; ".join(
                f"{label} {step_windows(rs)}" for label, rs in together.items()))
            rate = {label: statistics.median(r["rate"] for r in rs) for label, rs in together.items()}
            res.update(decode_figures("decode_batch", f"{shape}_{s}{mode}", rate, together))
        if not serving:  # the counters live in the engine core's process
            saved = ray.get(engines["A"].connector_totals.remote())["scheduler"]
            res[f"decode_saved_blocks_{shape}"] = saved.get("saved_blocks", 0)
        shared = [path for paths in ray.get([engine.close.remote() for engine in engines.values()]) for path in paths]
        for engine in engines.values():
            ray.kill(engine)
    left = [path for path in shared if os.path.exists(path)]
    for path in left:
        os.unlink(path)
    if left:
        log.info("removed %d shared-memory file(s) the engines' cores left in /dev/shm", len(left))
    return res


# --- driver --------------------------------------------------------------------------------

def leftover_pools(cluster: str) -> list[str]:
    return [p for ns in ("ucm_ray_gpu_bench", "ucm_ray_gpu_bench_ttft")
            for p in glob.glob(pool_prefix("/dev/shm", ns, cluster=cluster) + "*")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0), or cpu (a smoke check)")
    ap.add_argument("--quick", action="store_true", help="small shapes: a smoke check, not a measurement")
    ap.add_argument("--ttft", action="store_true", help="also measure TTFT cold / prefix hit / store-warm")
    ap.add_argument("--ttft-only", action="store_true", help="only the TTFT part")
    ap.add_argument("--decode-only", action="store_true",
                    help="only decode with and without the connector (engines A, C, N; decode_overhead_<shape>_*)")
    ap.add_argument("--serving", action="store_true",
                    help="--decode-only with each engine's core in a process of its own, as `vllm serve` runs it")
    ap.add_argument("--shape", choices=("1b", "8b"), default="1b",
                    help="--decode-only's model: the 1B of --ttft, or Llama-3.1-8B's layers (dummy weights)")
    ap.add_argument("--ttft-prompts", type=int, default=2, help="prompts per size (medians are printed)")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens decoded per prompt (decode_overhead_*)")
    ap.add_argument("--decode-batch", type=int, default=8,
                    help="prompts decoded together per batch at the end (decode_batch_overhead_*; 0: none)")
    ap.add_argument("--decode-rounds", type=int, default=3, help="batches per size per engine")
    ap.add_argument("--model-dir", default=None, help="where the TTFT model is built (default .models/)")
    ap.add_argument("--profile-dir", default=None,
                    help="also serve one store-warm request per size under torch's profiler; traces go here")
    ap.add_argument("--step-timing", action="store_true",
                    help="also time each part of A's and C's engine steps (connector hooks, our code in them, GC) "
                         "on one more cold request and decode per size, and of a store-warm request on B")
    ap.add_argument("--shards", type=int, default=1, help="shards of the data-plane fleet")
    ap.add_argument("--blocks", type=int, default=None, help="entries moved per pass (default 256; quick 8)")
    args = ap.parse_args()
    if args.shape != "1b" and not args.decode_only:
        ap.error("--shape applies to --decode-only")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --device cpu --quick for a smoke check")
    prof = QUICK if args.quick else FULL
    if args.blocks:
        prof = Profile(prof.kv, args.blocks, prof.chunk_tokens, prof.hidden, prof.width, prof.repeat)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results: dict[str, Any] = {}
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    ray.init(num_cpus=8, num_gpus=gpus, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             _temp_dir=tempfile.mkdtemp(prefix="ucmg-", dir="/tmp"), log_to_driver=False,
             namespace="ucm_ray_gpu_bench")
    cluster = cluster_tag()
    try:
        if args.decode_only:
            t = time.perf_counter()
            results.update(decode_only(device, args.shape, 2 * args.ttft_prompts + 2, args.decode_tokens,
                                       args.decode_batch, args.decode_rounds, args.serving))
            log.info("decode measured in %.1f s", time.perf_counter() - t)
        elif not args.ttft_only:
            t = time.perf_counter()
            results.update(data_plane(prof, device, args.shards))
            log.info("data plane measured in %.1f s", time.perf_counter() - t)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # leave the engines the memory
        if args.ttft or args.ttft_only:
            t = time.perf_counter()
            if args.profile_dir:
                os.makedirs(args.profile_dir, exist_ok=True)
            results.update(ttft(device, args.quick, args.ttft_prompts, args.model_dir, args.profile_dir,
                                args.decode_tokens, args.step_timing, args.decode_batch, args.decode_rounds))
            log.info("TTFT measured in %.1f s", time.perf_counter() - t)
    finally:
        ray.shutdown()
        left = leftover_pools(cluster)
        if left:
            log.error("pools left in /dev/shm: %s", left)
    print(f"device={torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} "
          f"quick={args.quick}")
    for k, v in results.items():
        print(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}")


if __name__ == "__main__":
    main()
