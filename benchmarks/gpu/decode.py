"""``--decode-only``: decode with and without the connector, engines A, C and N alone.

Engines A (the connector, its saves running), C (none) and N (a connector that does nothing)
of the ``--shape`` profile decode fresh prompts one at a time, then ``--decode-rounds`` batches
of ``--decode-batch`` prompts each, in turn on the same cores: ``decode_overhead_<shape>_<size>``,
``decode_batch_overhead_<shape>_<size>`` and their ``_null_connector`` (N against C). No TTFT
part: with an 8B model the five engines of ``--ttft`` do not start within one device call.
``--serving``: every engine's core in a process of its own (``vllm serve``'s way; the figures'
names end in ``_serving``).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import ray
import torch

from benchmarks.gpu.common import (
    EngineCores,
    bench_model,
    connector_config,
    decode_prompts,
    decode_rate,
    engine_actor,
    engine_cores,
    on_turn,
    start_engine,
    ttft_profile,
)
from benchmarks.measure import in_turn
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.shard.fleet import running_fleet

log = logging.getLogger("bench.gpu")


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


def single_decodes(engines: dict[str, Any], cores: EngineCores, fresh: dict[str, list[list[int]]],
                   decode_tokens: int, shape: str, mode: str) -> dict[str, Any]:
    """Fresh prompts decoded one at a time, each engine in turn: ``decode_*_<shape>_<size><mode>``."""
    res: dict[str, Any] = {}
    for s, ps in fresh.items():
        single = in_turn(engines, ps, on_turn(cores, lambda engine, p: ray.get(
            engine.generate.remote(p, decode_tokens, ignore_eos=True))))
        log.info("%s %s decode tok/s: %s", shape, s, ", ".join(
            f"{label} {[round(decode_rate(r), 1) for r in rs]}" for label, rs in single.items()))
        rate = {label: statistics.median(decode_rate(r) for r in rs) for label, rs in single.items()}
        res.update(decode_figures("decode", f"{shape}_{s}{mode}", rate, single))
    return res


def batch_decodes(engines: dict[str, Any], cores: EngineCores, batched: dict[str, list[list[list[int]]]],
                  decode_tokens: int, shape: str, mode: str) -> dict[str, Any]:
    """Batches of fresh prompts decoded together, each engine in turn:
    ``decode_batch_*_<shape>_<size><mode>``."""
    res: dict[str, Any] = {}
    for s, rounds in batched.items():
        together = in_turn(engines, rounds, on_turn(cores, lambda engine, batch: ray.get(
            engine.decode_batch.remote(batch, decode_tokens))))
        log.info("%s %s decode tok/s, batches of %d: %s", shape, s, len(rounds[0]) if rounds else 0, ", ".join(
            f"{label} {[round(r['rate'], 1) for r in rs]}" for label, rs in together.items()))
        log.info("%s %s batch decode, mean step (ms) in steps 1-16 / 17-64 / 65-: %s", shape, s, "; ".join(
            f"{label} {step_windows(rs)}" for label, rs in together.items()))
        rate = {label: statistics.median(r["rate"] for r in rs) for label, rs in together.items()}
        res.update(decode_figures("decode_batch", f"{shape}_{s}{mode}", rate, together))
    return res


def close_engines(engines: dict[str, Any]) -> list[str]:
    """Each engine's core shut down before its actor is killed: the shared-memory files its
    processes had mapped (``remove_left``)."""
    shared = [path for paths in ray.get([engine.close.remote() for engine in engines.values()]) for path in paths]
    for engine in engines.values():
        ray.kill(engine)
    return shared


def remove_left(shared: list[str]) -> None:
    """The files of ``shared`` a serving engine core still left in /dev/shm, once the actors are
    gone (and the fleet stopped)."""
    left = [path for path in shared if os.path.exists(path)]
    for path in left:
        os.unlink(path)
    if left:
        log.info("removed %d shared-memory file(s) the engines' cores left in /dev/shm", len(left))


def decode_only(device: torch.device, shape: str, prompts_per_size: int, decode_tokens: int, decode_batch: int,
                decode_rounds: int, serving: bool = False, async_scheduling: bool = False) -> dict[str, Any]:
    """The ``--decode-only`` figures; ``prompts_per_size`` fresh prompts per size decoded one at a
    time, then the batches; ``async_scheduling``: every engine scheduling asynchronously (the
    figures' names get ``_async``)."""
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
    kv = connector_config(cfg)
    remote = engine_actor(prof)
    cores = engine_cores(device)
    res: dict[str, Any] = {}
    serving_prof = replace(prof, engine={**prof.engine, "serving": serving, "async_scheduling": async_scheduling})
    mode = ("_serving" if serving else "") + ("_async" if async_scheduling else "")
    with running_fleet(cfg):
        engines = {label: start_engine(remote, model, serving_prof, label, kv_config, cores.parked, warmup)
                   for label, kv_config in (("A", kv), ("C", None), ("N", null_kv_transfer_config()))}
        for label, engine in engines.items():
            log.info("engine %s: %s", label, ray.get(engine.scheduling.remote()))
        res.update(single_decodes(engines, cores, fresh, decode_tokens, shape, mode))
        res.update(batch_decodes(engines, cores, batched, decode_tokens, shape, mode))
        if not serving:  # the counters live in the engine core's process
            saved = ray.get(engines["A"].connector_totals.remote())["scheduler"]
            res[f"decode_saved_blocks_{shape}"] = saved.get("saved_blocks", 0)
        shared = close_engines(engines)
    remove_left(shared)
    return res
