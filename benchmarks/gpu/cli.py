"""The GPU benchmark's command line: which parts run, on which device, and the figures printed.

Parts: the data plane (``data_plane``, always unless ``--ttft-only`` or ``--decode-only``),
TTFT and decode (``ttft``, ``--ttft`` / ``--ttft-only``), decode alone (``decode``,
``--decode-only``). It starts and stops its own Ray cluster and fleets and leaves nothing in
/dev/shm.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import time
from typing import Any

import ray
import torch

import benchmarks.gpu
from benchmarks.gpu.common import print_figures
from benchmarks.gpu.data_plane import data_plane
from benchmarks.gpu.decode import decode_only
from benchmarks.gpu.ttft import ttft
from benchmarks.gpu.worker_bench import FULL, QUICK, Profile
from benchmarks.measure import local_ray
from ucm_ray.transport.shm import cluster_tag, pool_prefix

log = logging.getLogger("bench.gpu")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(benchmarks.gpu.__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0), or cpu (a smoke check)")
    ap.add_argument("--quick", action="store_true", help="small shapes: a smoke check, not a measurement")
    ap.add_argument("--ttft", action="store_true", help="also measure TTFT cold / prefix hit / store-warm")
    ap.add_argument("--ttft-only", action="store_true", help="only the TTFT part")
    ap.add_argument("--decode-only", action="store_true",
                    help="only decode with and without the connector (engines A, C, N; decode_overhead_<shape>_*)")
    ap.add_argument("--serving", action="store_true",
                    help="--decode-only with each engine's core in a process of its own, as `vllm serve` runs it")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="--decode-only with vLLM's asynchronous scheduling on every engine (the tier then loads "
                         "hits before their requests are scheduled)")
    ap.add_argument("--shape", choices=("1b", "8b"), default="1b",
                    help="--decode-only's model: the 1B of --ttft, or Llama-3.1-8B's layers (dummy weights)")
    ap.add_argument("--ttft-prompts", type=int, default=6,
                    help="cold prompts per size each engine serves in turn (medians and spread are printed)")
    ap.add_argument("--cold-warmup", type=int, default=3,
                    help="cold prompts per size each engine serves first, not counted: an engine's first cold "
                         "requests ran slower than later ones (+13 and +32 ms outliers at 4k on an H100)")
    ap.add_argument("--decode-prompts", type=int, default=6, help="fresh prompts per size decoded one at a time")
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
    return ap


def leftover_pools(cluster: str) -> list[str]:
    return [p for ns in ("ucm_ray_gpu_bench", "ucm_ray_gpu_bench_ttft")
            for p in glob.glob(pool_prefix("/dev/shm", ns, cluster=cluster) + "*")]


def run_parts(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The parts the flags ask for, in order, on a running Ray cluster."""
    results: dict[str, Any] = {}
    if args.decode_only:
        started = time.perf_counter()
        results.update(decode_only(device, args.shape, args.decode_prompts, args.decode_tokens,
                                   args.decode_batch, args.decode_rounds, args.serving, args.async_scheduling))
        log.info("decode measured in %.1f s", time.perf_counter() - started)
    elif not args.ttft_only:
        prof = QUICK if args.quick else FULL
        if args.blocks:
            prof = Profile(prof.kv, args.blocks, prof.chunk_tokens, prof.hidden, prof.width, prof.repeat)
        started = time.perf_counter()
        results.update(data_plane(prof, device, args.shards))
        log.info("data plane measured in %.1f s", time.perf_counter() - started)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # leave the engines the memory
    if args.ttft or args.ttft_only:
        started = time.perf_counter()
        if args.profile_dir:
            os.makedirs(args.profile_dir, exist_ok=True)
        results.update(ttft(device, args.quick, args.ttft_prompts, args.model_dir, args.profile_dir,
                            args.decode_tokens, args.step_timing, args.decode_batch, args.decode_rounds,
                            args.decode_prompts, args.cold_warmup))
        log.info("TTFT measured in %.1f s", time.perf_counter() - started)
    return results


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.shape != "1b" and not args.decode_only:
        ap.error("--shape applies to --decode-only")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --device cpu --quick for a smoke check")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    local_ray("ucmg-", num_cpus=8, num_gpus=gpus, logging_level="WARNING", log_to_driver=False,
              namespace="ucm_ray_gpu_bench")
    cluster = cluster_tag()
    try:
        results = run_parts(args, device)
    finally:
        ray.shutdown()
        left = leftover_pools(cluster)
        if left:
            log.error("pools left in /dev/shm: %s", left)
    print_figures(device, args.quick, results)
