"""The tier under vLLM's asynchronous scheduling (issue 43): decode and store hits against the
tier under synchronous scheduling and an engine without it, in turn on one GPU.

Under asynchronous scheduling the connector loads every hit before its request is scheduled
(``compat.loads_land_before_scheduling``): a failed load is then exact, and the decode speed of
asynchronous scheduling is kept (synchronous scheduling, which the connector required before,
cost 35-39% of it on a ~1B model). The price is the layer-by-layer overlap of a hit's loads with
its forward pass. Three engines, vLLM's V1 runner: ``tier_async`` (the connector, asynchronous
scheduling), ``tier_sync`` (the connector, synchronous: layer-by-layer loads) and ``none_async``
(no connector). Batches of 8 fresh 4k prompts and single 4k requests decoding 128 tokens (the tier
engines' saves run meanwhile), then 4k and 16k store hits: a prompt one tier engine computed, asked
of both with their prefix caches emptied, then again (their own prefix-cache hit). A store hit's
floor over PCIe is that own hit plus the hit's bytes at one pinned host-to-device copy's speed,
measured in the same run: ``store_hit_<size>_vs_floor_<mode>`` is the hit's median TTFT over it.
``batch8_stored``: batches of 8 prompts another engine stored, every prefix cache emptied: the
tier engines load them and save no prompt, so the decode gap of fresh prompts less this one is
the saves' part. Per engine and shape, the median step time of
decode steps 1-16 and of the steps after is printed too, and one more batch of each kind (fresh,
stored) per engine is timed part by part (ms per decode step of each hook). GPU only:
``python benchmarks/gpu_async_tier.py``; the last line is ``async_tier:
decode_batch8=<tier_async / none_async> decode_single=<...>
sync_batch8=<tier_sync / none_async> sync_single=<...> stored_batch8=<...>
store_hit_ttft_async_vs_sync=<ratio>``
(decode tokens/s ratios; the TTFT ratio of medians, 4k), then ``async_tier_floor:
store_hit_4k_vs_floor_async=<ratio> ...`` (4k and 16k, asynchronous and synchronous scheduling).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
from dataclasses import dataclass, field, replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.gpu.common import (  # noqa: E402
    connector_config,
    engine_actor,
    engine_cores,
    probe_start,
    start_engine,
    ttft_of,
    turn_cores,
)
from benchmarks.gpu.data_plane import pinned_copy  # noqa: E402
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.shard.fleet import running_fleet  # noqa: E402
from ucm_ray.tiny_model import synthetic_prompt  # noqa: E402

log = logging.getLogger("bench.gpu")
BATCH, TOKENS, ROUNDS, HITS = 8, 128, 3, 4
HIT_SIZES = {"4k": 4096 + 8, "16k": 16384 + 8}
"""Prompt sizes of the store hits (tokens)."""
ENGINES = {"tier_async": (True, True), "tier_sync": (True, False), "none_async": (False, True)}
"""label -> (with the connector, asynchronous scheduling)"""


def main() -> None:
    device, prof, model = probe_start("ucm_ray_gpu_async_tier")
    n = prof.sizes["4k"]
    warmup = [synthetic_prompt(model, 64, seed=9999), synthetic_prompt(model, n, seed=9000)]
    cores = engine_cores(device)
    cfg = UcmRayConfig(num_shards=2, ray_namespace="ucm_ray_gpu_async_tier", transport="shm", pool_bytes=8 << 30)
    with running_fleet(cfg):
        engines = {}
        for label, (tier, async_scheduling) in ENGINES.items():
            setting = replace(prof, engine={**prof.engine, "async_scheduling": async_scheduling})
            engines[label] = start_engine(engine_actor(setting), model, setting, label,
                                          connector_config(cfg) if tier else None, cores.parked, warmup)
        rates, steps = decode_rounds(engines, cores, model, n)
        parts = {stored: timed_parts(engines, cores, model, n, stored=stored) for stored in (False, True)}
        hits = {size: store_hits(engines, cores, model, tokens) for size, tokens in HIT_SIZES.items()}
        for engine in engines.values():
            ray.kill(engine)
    ray.shutdown()
    for shape, by_label in rates.items():
        log.info("%s decode tok/s: %s", shape,
                 {label: [round(rate, 1) for rate in got] for label, got in by_label.items()})
    for shape, by_label in steps.items():  # which steps the gap is in: the first ones (saves posted) or all
        log.info("%s decode step ms, median of steps 1-16 / of steps 17 on / p90 of 17 on: %s", shape,
                 {label: step_quantiles(runs) for label, runs in by_label.items()})
    for stored, by_engine in parts.items():
        log_parts(by_engine, "stored" if stored else "fresh")
    floors = {size: hit_floor(hit, prof.kv_bytes_per_token, device) for size, hit in hits.items()}
    median = {shape: {label: statistics.median(got) for label, got in by_label.items()}
              for shape, by_label in rates.items()}
    log.info("async_tier: decode_batch8=%.3f decode_single=%.3f sync_batch8=%.3f sync_single=%.3f "
             "stored_batch8=%.3f store_hit_ttft_async_vs_sync=%.3f",
             median["batch8"]["tier_async"] / median["batch8"]["none_async"],
             median["single"]["tier_async"] / median["single"]["none_async"],
             median["batch8"]["tier_sync"] / median["batch8"]["none_async"],
             median["single"]["tier_sync"] / median["single"]["none_async"],
             median["batch8_stored"]["tier_async"] / median["batch8_stored"]["none_async"],
             statistics.median(hits["4k"].ttft["tier_async"]) / statistics.median(hits["4k"].ttft["tier_sync"]))
    log.info("async_tier_floor: %s", " ".join(f"store_hit_{size}_vs_floor_{mode}={ratio:.3f}"
                                              for size, by_mode in floors.items() for mode, ratio in by_mode.items()))


@dataclass
class StoreHits:
    """One prompt size's store hits on both tier engines: per engine, the TTFT of each hit (its
    prefix cache emptied, every block from the store) and of the same prompt asked again right
    after (its own prefix-cache hit), and vLLM's cached tokens of each store hit."""

    ttft: dict[str, list[float]] = field(default_factory=lambda: {"tier_async": [], "tier_sync": []})
    own: dict[str, list[float]] = field(default_factory=lambda: {"tier_async": [], "tier_sync": []})
    cached: dict[str, list[int]] = field(default_factory=lambda: {"tier_async": [], "tier_sync": []})
    same: bool = True
    """Both readers of each stored prompt gave the same first token (same tail over the same bytes)."""


def store_hits(engines: dict[str, Any], cores: Any, model: str, tokens: int) -> StoreHits:
    """``HITS`` prompts of ``tokens`` tokens, each computed by one tier engine (saved and flushed)
    and asked of both with their prefix caches emptied, then asked again (their own hit)."""
    out = StoreHits()
    for i in range(HITS):
        hit = synthetic_prompt(model, tokens, seed=70000 + 100 * tokens + i)
        ray.get(engines["tier_sync" if i % 2 else "tier_async"].generate.remote(hit, 1))  # saved (flushed)
        firsts = []
        for reader in (("tier_async", "tier_sync") if i % 2 else ("tier_sync", "tier_async")):
            ray.get(engines[reader].reset_prefix_cache.remote())  # the writer's own cache too: a store hit
            with turn_cores(engines[reader], cores):
                result = ray.get(engines[reader].generate.remote(hit, 1))
                own = ray.get(engines[reader].generate.remote(hit, 1))
            out.ttft[reader].append(ttft_of(result))
            out.own[reader].append(ttft_of(own))
            out.cached[reader].append(result["cached"])
            firsts.append(result["tokens"])
        out.same = out.same and firsts[0] == firsts[1]
    return out


def hit_floor(hits: StoreHits, kv_bytes_per_token: int, device: torch.device) -> dict[str, float]:
    """Per scheduling mode, the store hit's median TTFT over its floor over PCIe: the engine's own
    prefix hit (median) plus the hit's bytes at one pinned host-to-device copy's speed, measured
    here, in the same run (``pinned_copy``)."""
    nbytes = statistics.median(hits.cached["tier_async"]) * kv_bytes_per_token
    h2d_gb_s, _ = pinned_copy(int(nbytes), device, repeat=5)
    out = {}
    for label, mode in (("tier_async", "async"), ("tier_sync", "sync")):
        own, hit = statistics.median(hits.own[label]), statistics.median(hits.ttft[label])
        floor = own + nbytes / (h2d_gb_s * 1e9)
        out[mode] = hit / floor
        log.info("%s store hit of %d cached tokens (%.0f MiB): TTFT %s ms, own prefix hit %s ms, pinned copy "
                 "%.1f GB/s: floor %.2f ms", label, int(nbytes // kv_bytes_per_token), nbytes / 2**20,
                 [round(s * 1e3, 2) for s in hits.ttft[label]], [round(s * 1e3, 2) for s in hits.own[label]],
                 h2d_gb_s, floor * 1e3)
    log.info("store hits' first tokens equal on both tier engines: %s; vLLM's cached tokens: %s", hits.same,
             hits.cached)
    return out


def decode_rounds(engines: dict[str, Any], cores: Any, model: str, n: int
                  ) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[list[float]]]]]:
    """Per shape and engine: each round's decode rate and its decode steps' seconds."""
    shapes = {"batch8": BATCH, "single": 1, "batch8_stored": BATCH}
    rates: dict[str, dict[str, list[float]]] = {shape: {label: [] for label in ENGINES} for shape in shapes}
    steps: dict[str, dict[str, list[list[float]]]] = {shape: {label: [] for label in ENGINES} for shape in shapes}
    for r in range(ROUNDS):
        order = list(ENGINES) if r % 2 == 0 else list(reversed(ENGINES))
        for shape, size in shapes.items():
            stored = [synthetic_prompt(model, n, seed=60000 + 1000 * r + i) for i in range(size)]
            if shape == "batch8_stored":  # stored by another engine: a tier engine loads them, saves no prompt
                ray.get(engines["tier_sync"].decode_batch.remote(stored, 1))
            for k, label in enumerate(order):  # fresh prompts for each: every tier engine saves its own
                prompts = stored if shape == "batch8_stored" else [
                    synthetic_prompt(model, n, seed=50000 + 1000 * r + 100 * size + 10 * k + i) for i in range(size)]
                ray.get(engines[label].reset_prefix_cache.remote())
                with turn_cores(engines[label], cores):
                    result = ray.get(engines[label].decode_batch.remote(prompts, TOKENS))
                rates[shape][label].append(result["rate"])
                steps[shape][label].append(result["step_s"])
    return rates, steps


def timed_parts(engines: dict[str, Any], cores: Any, model: str, n: int, *,
                stored: bool) -> dict[str, dict[str, float]]:
    """One more batch of 8 prompts on ``tier_async`` and ``none_async``, their decode steps'
    parts timed (the engine's step parts, every connector hook, our code inside them): per
    engine, each part's ms per decode step. Which part the tier's extra step time is in: with
    fresh prompts (the tier saves them) or ``stored`` ones (another engine stored them, every
    prefix cache emptied: the tier loads them and saves none, so its hooks' time per step is
    what a quiet decode step costs)."""
    prompts = [synthetic_prompt(model, n, seed=90000 + i) for i in range(BATCH)]
    if stored:
        ray.get(engines["tier_sync"].decode_batch.remote(prompts, 1))
    out: dict[str, dict[str, float]] = {}
    for k, label in enumerate(("tier_async", "none_async")):
        batch = prompts if stored else [synthetic_prompt(model, n, seed=80000 + 10 * k + i) for i in range(BATCH)]
        ray.get(engines[label].reset_prefix_cache.remote())
        with turn_cores(engines[label], cores):
            result = ray.get(engines[label].decode_batch.remote(batch, TOKENS, timed=True))
        steps = max(1, len(result["step_s"]))
        out[label] = {part: 1e3 * sum(calls) / steps for part, calls in result["timed"].items() if calls}
        out[label]["step_ms_mean"] = 1e3 * sum(result["step_s"]) / steps
    return out


def log_parts(parts: dict[str, dict[str, float]], shape: str) -> None:
    tier, none = parts["tier_async"], parts["none_async"]
    for part in sorted(set(tier) | set(none), key=lambda name: -tier.get(name, 0.0)):
        log.info("timed decode (%s batch), ms per step: %-45s tier %.4f  none %.4f", shape, part,
                 tier.get(part, 0.0), none.get(part, 0.0))


def step_quantiles(runs: list[list[float]]) -> list[float]:
    """Of each run's decode steps: the median of steps 1-16 (the prompts' saves are posted in
    them), the median and the p90 of the steps after, in ms."""
    early = sorted(step for run in runs for step in run[:16]) or [0.0]
    late = sorted(step for run in runs for step in run[16:]) or [0.0]
    return [round(statistics.median(early) * 1e3, 3), round(statistics.median(late) * 1e3, 3),
            round(late[int(0.9 * (len(late) - 1))] * 1e3, 3)]


if __name__ == "__main__":
    main()
