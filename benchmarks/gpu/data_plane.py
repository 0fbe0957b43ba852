"""Part 1 of the GPU benchmark (always runs, unless ``--ttft-only`` or ``--decode-only``): the
connector worker's real copy path (``worker_bench``) against the link's own speed.

A shard fleet serves a shared-memory pool. In the same run the same number of bytes is copied
once between a pinned host buffer and the GPU (the link's speed). Then one load runs while a
per-layer compute runs: a matmul with the FLOPs of one layer of an 8B model (Llama-3-8B: hidden
4096, q/k/v/o 4096+1024+1024+4096 wide, MLP 3 x 14336) over the chunk being prefilled, launched
after each ``wait_for_layer_load`` as vLLM's forward would. The stall per layer is (overlapped
time - compute-only time) / layers. The same figures are also taken with the HND layout (one
contiguous range per layer-block), to tell the layout's cost from the transport's. Saves and
loads of every layer at once (a store-warm request's step) run both ways in the same run:
staged DMA (the copy engines) and gather kernels (``*_kernels_*``); and decode-shaped work
(HBM-bound matmuls) is timed on the device alone and while a save moves, each way
(``decode_beside_save_{dma,kernels}_slowdown``): what a prompt's save costs the decode steps it
runs beside.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from benchmarks.gpu.worker_bench import Profile, WorkerBench, check_vllm_shape, sync
from benchmarks.measure import best
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.fleet import running_fleet
from ucm_ray.transport import gather

log = logging.getLogger("bench.gpu")

DECODE_GEMVS = 300
"""Decode-shaped matmuls (8 tokens through a 4096 x 14336 bf16 weight) queued while a save
moves: bound by HBM like a decode step, and about as long in all as the save."""

OVERLAP_FIGURES = ("layer_compute_ms", "layer_load_ms", "layer_wait_overlapped_ms", "layer_wait_overlapped_kernels_ms",
                   "layer_wait_cpu_ms", "start_load_kv_ms", "decode_beside_save_dma_slowdown",
                   "decode_beside_save_kernels_slowdown")
"""The NHD pass's figures printed as they are (where the device measured them)."""


def pinned_copy(nbytes: int, device: torch.device, repeat: int) -> tuple[float, float]:
    """GB/s of one plain host->device and device->host copy of ``nbytes`` (pinned host buffer)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.random_(0, 256)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()

    copy(on_device, host)  # warm-up
    h2d = nbytes / best(lambda: copy(on_device, host), repeat)
    d2h = nbytes / best(lambda: copy(host, on_device), repeat)
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
        started = time.perf_counter()
        load()
        times.append(time.perf_counter() - started)
        bench.verify()
    return min(times)


def measure_copies(bench: WorkerBench, nbytes: int, reps: int, first_save: float) -> dict[str, float]:
    """Saves, loads of every layer at once and layer-by-layer loads (one strided copy per
    layer), GB/s, both ways: staged DMA and gather kernels. ``reps`` 1: the first save is the
    save figure."""
    res = {"save_gbps": nbytes / (best(bench.save, reps) if reps > 1 else first_save) / 1e9,
           "load_gbps": nbytes / timed_loads(bench, bench.load, reps) / 1e9,
           "load_at_once_gbps": nbytes / timed_loads(bench, bench.load_at_once, reps) / 1e9}
    with kernels_only():
        res["save_kernels_gbps"] = nbytes / best(bench.save, reps) / 1e9
        res["load_kernels_gbps"] = nbytes / timed_loads(bench, bench.load, reps) / 1e9
        res["load_at_once_kernels_gbps"] = nbytes / timed_loads(bench, bench.load_at_once, reps) / 1e9
    return res


def measure_layout(prof: Profile, cfg: UcmRayConfig, client: StoreClient, device: torch.device,
                   layout: str, overlap: bool, tag: str = "") -> dict[str, float]:
    """``tag``: a pass of its own (its own keys) for a layout measured again."""
    bench = WorkerBench(prof, cfg, client, device, layout, tag)
    res: dict[str, float] = {"segments": bench.segments_per_layer_block()}
    nbytes = prof.blocks * prof.kv.entry_bytes
    try:
        log.info("%s: %d segment(s) per layer-block; first save (maps and pins the pool)", layout, res["segments"])
        started = time.perf_counter()
        bench.save()
        first_save = time.perf_counter() - started
        bench.commit()
        # A layout that needs many small copies can take seconds a pass: then one pass each (and
        # the first save, whose pool mapping is part of it, is the save figure).
        reps = prof.repeat if first_save < 2.0 else 1
        res.update(measure_copies(bench, nbytes, reps, first_save))
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


def measure_decode_beside_save(prof: Profile, bench: WorkerBench, device: torch.device) -> dict[str, float]:
    """How much a save running beside decode-shaped work slows it: device time of DECODE_GEMVS
    matmuls queued right after a save is posted, over the same matmuls alone; for staged DMA
    and for gather kernels (which hold SMs while they write host memory over PCIe)."""
    if device.type != "cuda":
        return {}
    generator = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(8, prof.hidden, device=device, dtype=prof.kv.dtype, generator=generator)
    w = torch.randn(prof.hidden, 14336, device=device, dtype=prof.kv.dtype, generator=generator)
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
    generator = torch.Generator(device=device).manual_seed(2)
    dtype = prof.kv.dtype
    x = torch.randn(prof.chunk_tokens, prof.hidden, device=device, dtype=dtype, generator=generator)
    w = torch.randn(prof.hidden, prof.width, device=device, dtype=dtype, generator=generator) / prof.hidden ** 0.5
    out = torch.empty(prof.chunk_tokens, prof.width, device=device, dtype=dtype)
    layers = len(bench.names)

    def compute_only() -> None:
        for _ in range(layers):
            torch.matmul(x, w, out=out)
        sync(device)

    compute_only()  # warm-up (cuBLAS handles, clocks)
    compute_s = best(compute_only, prof.repeat)
    runs = []
    for _ in range(reps):
        bench.clear_targets()
        sync(device)
        started = time.perf_counter()
        bench.start_load()
        start_s = time.perf_counter() - started
        cpu_wait = 0.0
        for name in bench.names:
            waited = time.perf_counter()
            bench.worker.wait_for_layer_load(name)
            cpu_wait += time.perf_counter() - waited
            torch.matmul(x, w, out=out)  # this layer's compute, queued behind its loaded KV
        sync(device)
        total = time.perf_counter() - started
        bench.finish_load()
        bench.verify()
        runs.append((total, cpu_wait, start_s))
    total, cpu_wait, start_s = min(runs)
    flops = 2 * prof.chunk_tokens * prof.hidden * prof.width
    log.info("overlap: %d layers, compute %.2f ms/layer (%.0f TFLOP/s), load alone %.2f ms/layer, "
             "overlapped step %.2f ms vs compute alone %.2f ms (start_load_kv %.2f ms)", layers,
             compute_s / layers * 1e3, flops * layers / compute_s / 1e12, load_s / layers * 1e3, total * 1e3,
             compute_s * 1e3, start_s * 1e3)
    return {"layer_compute_ms": compute_s / layers * 1e3, "layer_load_ms": load_s / layers * 1e3,
            "layer_wait_overlapped_ms": max(0.0, total - compute_s) / layers * 1e3,
            "layer_wait_cpu_ms": cpu_wait / layers * 1e3, "start_load_kv_ms": start_s * 1e3}


def data_plane(prof: Profile, device: torch.device, shards: int) -> dict[str, float]:
    """Part 1's figures: each path against one pinned copy of the same bytes, the NHD layout
    (vLLM's) and HND, and the NHD pass's overlap and decode figures."""
    check_vllm_shape(prof.kv)
    entries = 2 * prof.blocks  # both layouts' entries stay stored until the fleet stops
    pool = max(entries * prof.kv.entry_bytes // shards + (64 << 20), 64 << 20)
    cfg = UcmRayConfig(num_shards=shards, pool_bytes=pool, ray_namespace="ucm_ray_gpu_bench", transport="shm",
                       transfer_timeout_s=300, lease_s=600, reserve_timeout_s=600, lookup_timeout_s=60)
    nbytes = prof.blocks * prof.kv.entry_bytes
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
    out = dict(pinned_h2d_gbps=h2d, pinned_d2h_gbps=d2h, gpu_load_gbps=vllm["load_gbps"],
               gpu_save_gbps=vllm["save_gbps"], segments_per_layer_block=vllm["segments"],
               gpu_load_vs_pinned_copy=vllm["load_gbps"] / h2d, gpu_save_vs_pinned_copy=vllm["save_gbps"] / d2h,
               gpu_load_kernels_vs_pinned_copy=vllm["load_kernels_gbps"] / h2d,
               gpu_save_kernels_vs_pinned_copy=vllm["save_kernels_gbps"] / d2h,
               gpu_load_at_once_vs_pinned_copy=vllm["load_at_once_gbps"] / h2d,
               gpu_load_at_once_kernels_vs_pinned_copy=vllm["load_at_once_kernels_gbps"] / h2d,
               hnd_load_vs_pinned_copy=hnd["load_gbps"] / h2d, hnd_save_vs_pinned_copy=hnd["save_gbps"] / d2h)
    out.update({key: vllm[key] for key in OVERLAP_FIGURES if key in vllm})
    return out
