"""Disk-hit TTFT: a store hit served from the shard's disk tier against recomputing the prompt and
against a hit in the shard's pool (DRAM), at two prompt lengths, and the length where a disk hit
starts to beat recomputing.

One shard with a pool of about 1.25 of the longest prompt's KV, write-through to a disk tier under
``--dir``; engine "ucm-ray" (the connector) and engine "none" (no connector), the project's tiny
model (float32, 8 KiB of KV a token: a 128-token block is a 1 MiB entry). Per length and round:
- recompute: "none" serves a fresh prompt cold (1 token: the request is its TTFT);
- DRAM hit: "ucm-ray" serves prompt P (saved), its own prefix cache is emptied, P again;
- disk hit: "ucm-ray" serves a pool's worth of other prompts (P's blocks leave the pool, already
  on disk), its prefix cache is emptied, P again: the shard promotes P's blocks, then they load.
Each hit's ``cached`` tokens are checked against the prompt's full blocks (a miss is no figure).

Prints per length the medians (ms), then ``disk_hit_vs_recompute_<n>k=``, ``disk_hit_vs_dram_hit_<n>k=``
and ``disk_crossover_tokens=`` (interpolated between the measured lengths where the disk hit starts to
win; ``<N``: it wins at every length measured). The machine is noisy: nothing here asserts a timing.

Run: ``python benchmarks/disk_ttft.py [--lengths 4096,16384 --rounds 2 --dir /mnt/nvme]``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.demo import ENGINE_ENV, Engine, kv_transfer_config  # noqa: E402
from ucm_ray.store.shard.fleet import fleet_status, running_fleet  # noqa: E402
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt  # noqa: E402

log = logging.getLogger("bench.disk_ttft")
BLOCK = 128
KV_PER_TOKEN = 2 * 8 * 2 * 64 * 4
"""The tiny model's KV bytes a token: K and V, 8 layers, 2 KV heads of 64, float32."""


def ttft(engine: Any, prompt: list[int]) -> tuple[float, int]:
    """(seconds, cached tokens) of a 1-token request: with one token, the request is its TTFT."""
    out = ray.get(engine.generate.remote(prompt, 1))
    return out["seconds"], out["cached"]


def wait_demoted(cfg: UcmRayConfig, timeout_s: float = 120.0) -> None:
    """Until the shard's write-through has written every committed entry to disk."""
    deadline = time.monotonic() + timeout_s
    while fleet_status(cfg)["shards"][0]["disk_behind"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the disk tier fell behind for two minutes")
        time.sleep(0.1)


def counters(ucm: Any, cfg: UcmRayConfig) -> dict[str, Any]:
    """What tells where a save went: the engine's save counters and the shard's."""
    engine = ray.get(ucm.connector_totals.remote())["scheduler"]
    shard = fleet_status(cfg)["shards"][0]
    return {**{k: engine.get(k, 0) for k in ("saved_blocks", "saves_dropped", "saves_skipped", "save_failures",
                                              "commits_not_visible")},
            **{f"shard_{k}": shard[k] for k in ("commits", "dropped_saves", "evictions", "evicted_dirty",
                                                "duplicate_commits", "refused_commits", "expired_reservations")},
            "disk_behind": shard["disk_behind"]}


def measure(ucm: Any, none: Any, cfg: UcmRayConfig, model: str, length: int, seed: int,
            filler_length: int) -> dict[str, float]:
    """One round at ``length`` tokens: seconds per case; NaN for a hit that was not one. Prompts of
    ``filler_length`` tokens (the shortest length: prefill grows faster than linearly) fill the
    pool in between."""
    fillers = -(-cfg.pool_bytes // (filler_length * KV_PER_TOKEN)) + 1
    full = length // BLOCK * BLOCK
    prompt = synthetic_prompt(model, length, seed=seed)
    figures = {"recompute": ttft(none, synthetic_prompt(model, length, seed=seed + 1))[0]}
    before = counters(ucm, cfg)
    ttft(ucm, prompt)  # cold: computed and saved
    saved = counters(ucm, cfg)
    assert ray.get(ucm.reset_prefix_cache.remote())
    seconds, dram_cached = ttft(ucm, prompt)
    figures["dram_hit"] = seconds if dram_cached >= full - BLOCK else float("nan")
    if dram_cached < full - BLOCK:  # say why: the counters the cold request's saves moved
        log.warning("%d tokens: DRAM hit cached only %d of %d tokens; the cold request moved %s, then "
                    "the shard had disk_behind=%s", length, dram_cached, full,
                    {k: saved[k] - before[k] for k in saved if k != "disk_behind" and saved[k] != before[k]},
                    saved["disk_behind"])
    wait_demoted(cfg)
    for n in range(fillers):  # a pool's worth and a prompt more: the prompt's blocks leave the pool
        ttft(ucm, synthetic_prompt(model, filler_length, seed=seed + 2 + n))
    wait_demoted(cfg)
    assert ray.get(ucm.reset_prefix_cache.remote())
    before = fleet_status(cfg)["shards"][0]["disk_promoted"]
    seconds, cached = ttft(ucm, prompt)
    promoted = fleet_status(cfg)["shards"][0]["disk_promoted"] - before
    figures["disk_hit"] = seconds if cached >= full - BLOCK and promoted > 0 else float("nan")
    log.info("%d tokens: %s (DRAM hit cached %d tokens; disk hit cached %d, %d blocks promoted)", length,
             {k: round(v * 1e3, 1) for k, v in figures.items()}, dram_cached, cached, promoted)
    return figures


def median(values: list[float]) -> float:
    """Of the rounds that gave a figure (a hit that was not one gives NaN)."""
    got = [v for v in values if not math.isnan(v)]
    return statistics.median(got) if got else math.nan


def crossover(lengths: list[int], disk: list[float], recompute: list[float]) -> str:
    """The length where a disk hit starts to beat recomputing, interpolated between the two measured
    lengths around it; ``<N`` when it wins already at the shortest length N, ``>N`` when it still
    loses at the longest (prefill grows faster than linearly: no line is drawn outside)."""
    gaps = [r - d for d, r in zip(disk, recompute)]  # > 0: the disk hit is faster
    if gaps[0] > 0:
        return f"<{lengths[0]}"
    for (l0, g0), (l1, g1) in zip(zip(lengths, gaps), zip(lengths[1:], gaps[1:])):
        if g0 <= 0 < g1:
            return f"{l0 + (l1 - l0) * -g0 / (g1 - g0):.0f}"
    return f">{lengths[-1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--lengths", default="4096,16384", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk (not tmpfs)")
    args = ap.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(","))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for k, v in {**ENGINE_ENV, "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    longest = max(lengths) + BLOCK
    model = str(make_tiny_model(os.path.join(".models", f"tiny-{longest}"), max_position_embeddings=longest))
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             _temp_dir=tempfile.mkdtemp(prefix="ucmd-", dir="/tmp"), log_to_driver=False)
    disk_dir = tempfile.mkdtemp(prefix="disk-ttft-", dir=args.dir)
    pool = longest * KV_PER_TOKEN * 5 // 4
    cfg = UcmRayConfig(num_shards=1, pool_bytes=pool, transport="shm", ray_namespace="ucm_ray_disk_ttft",
                       disk_dir=disk_dir, disk_bytes=16 * pool, disk_write_policy="through", disk_wait_s=4.0)
    remote = ray.remote(num_cpus=0, runtime_env={"env_vars": ENGINE_ENV})(Engine)
    engine_args = {"max_model_len": longest, "max_num_batched_tokens": 8192}
    results: dict[int, dict[str, list[float]]] = {}
    try:
        with running_fleet(cfg):
            ucm = remote.remote(model, kv_transfer_config({"ray_namespace": cfg.ray_namespace, "transport": "shm"}),
                                **engine_args)
            none = remote.remote(model, None, **engine_args)
            for engine in (ucm, none):  # a fresh engine's first request pays its warm-up
                ttft(engine, synthetic_prompt(model, min(lengths), seed=7))
            for r in range(args.rounds):
                for length in lengths:
                    got = measure(ucm, none, cfg, model, length, 100 * r + length, min(lengths))
                    for case, value in got.items():
                        results.setdefault(length, {}).setdefault(case, []).append(value)
    finally:
        ray.shutdown()
        shutil.rmtree(disk_dir, ignore_errors=True)  # the tier's files (nothing purges a benchmark's)
    medians = {n: {case: median(v) for case, v in cases.items()} for n, cases in results.items()}
    print(f"\n{'tokens':>7} {'recompute ms':>13} {'DRAM hit ms':>12} {'disk hit ms':>12}")
    for n, m in medians.items():
        print(f"{n:>7} {m['recompute'] * 1e3:>13.1f} {m['dram_hit'] * 1e3:>12.1f} {m['disk_hit'] * 1e3:>12.1f}")
    for n, m in medians.items():
        tag = f"{n // 1024}k"
        print(f"disk_hit_vs_recompute_{tag}={m['disk_hit'] / m['recompute']:.3f} "
              f"disk_hit_vs_dram_hit_{tag}={m['disk_hit'] / m['dram_hit']:.3f}")
    print("disk_crossover_tokens=" + crossover(lengths, [medians[n]["disk_hit"] for n in lengths],
                                               [medians[n]["recompute"] for n in lengths]))


if __name__ == "__main__":
    main()
