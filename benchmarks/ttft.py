"""TTFT benchmark: the same workload with no connector, vLLM's ExampleConnector, and ucm-ray.

Engine A (its own process) serves each 4k-token prompt cold, then the same
prompts again (a hit in A's own vLLM prefix cache: the best a tier can hope to
match); a fresh engine B (another process, empty local cache) then serves the
same prompts, so B's TTFT is what a second node sees, and then serves them once
more (a hit in B's own prefix cache). Every TTFT is a median over the prompts
(the machine is noisy; nothing here asserts a timing). The systems' engines run
side by side and take each prompt in turn, in an order rotating per prompt, so
the box's drift between minutes lands on all of them alike.

Decode throughput (engines A of "none", "example" and "ucm-ray"): each serves the
same fresh prompts (in no cache nor store) with ``--decode-tokens`` greedy new
tokens while ucm-ray's saves run, and decode tok/s is
``(new tokens - 1) / (total seconds - TTFT)`` per prompt, median over prompts.
TTFT is vLLM's own ``first_token_latency`` as ``Engine.generate`` returns it;
where that is missing, the wall time of a 1-token run of another fresh prompt of
the same length stands in. ``Engine.generate`` has no ``ignore_eos``, so a
run may stop early at EOS: the tokens it did produce are what is counted.

Prints a table per system, then as the last lines (goals in brackets):
``ttft_cold_overhead=`` ucm-ray A cold / none A cold (<= 1.05: a 100% miss
that only saves must not slow a cold request),
``decode_overhead=`` 1 - ucm-ray decode tok/s / none decode tok/s (<= 0.03; the first ratio line,
``decode_overhead_example=``, is the same for ExampleConnector: what any connector costs),
``ttft_store_warm_vs_other_engines_prefix_hit=`` ucm-ray B / ucm-ray A prefix hit,
``ttft_store_warm_vs_prefix_hit=`` ucm-ray B / B's own prefix hit, the same prompts served
again by B right after (<= 1.1: the issue's "a hit in that engine's own prefix cache"; the
same engine in the same minute, so neither warm-up nor the box's drift sits in the ratio),
``ttft_store_warm_first_request_vs_prefix_hit=`` the same for B's very first request (the
first prompt: a fresh engine's first request, which pays whatever the engine left to it),
``ttft_warm_vs_cold=`` ucm-ray B / no-connector B,
``ttft_ucm_vs_example=`` ucm-ray B / ExampleConnector B (<= 0.9).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*
from benchmarks.measure import in_turn, local_ray  # noqa: E402
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.demo import ENGINE_ENV, Engine, kv_transfer_config  # noqa: E402
from ucm_ray.store.shard.fleet import running_fleet  # noqa: E402
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt  # noqa: E402

log = logging.getLogger("bench.ttft")

DECODE_SYSTEMS = ("none", "example", "ucm-ray")
"""Systems whose engine A also measures decode: ExampleConnector tells what any connector costs
vLLM's decode loop from what ucm-ray adds."""


def ttft_one(engine: Any, prompt: list[int]) -> float:
    """Wall seconds of a 1-token request: with one token, the whole request is its TTFT."""
    return ray.get(engine.generate.remote(prompt, 1))["seconds"]


def decode_rate(engine: Any, prompt: list[int], probe: list[int], new_tokens: int) -> float:
    """Decode tokens/s of one request; ``probe`` (another fresh prompt, same length) gives the TTFT
    by a 1-token run only where vLLM reported none, so the cached prefix never helps either."""
    r = ray.get(engine.generate.remote(prompt, new_tokens))
    ttft = r["ttft"] if r["ttft"] is not None else ttft_one(engine, probe)
    produced, decode_s = len(r["tokens"]), r["seconds"] - ttft
    if produced < new_tokens:
        log.warning("decode stopped at %d of %d tokens (EOS; Engine.generate has no ignore_eos)",
                    produced, new_tokens)
    if produced < 2 or decode_s <= 0:
        return math.nan
    return (produced - 1) / decode_s


def interleaved(engines: dict[str, Any], items: list, measure: Callable[[Any, Any], float]) -> dict[str, float]:
    """``in_turn``'s median per system, items that gave no figure left out."""
    medians = {}
    for name, values in in_turn(engines, items, measure).items():
        figures = [value for value in values if not math.isnan(value)]
        medians[name] = statistics.median(figures) if figures else math.nan
    return medians


def run_systems(systems: dict[str, dict | None], model: str, prompts: list[list[int]],
                decode: tuple[list[list[int]], list[list[int]], int]) -> dict[str, dict[str, float]]:
    """Engines A of every system side by side: cold, again (their own prefix caches), decode
    (``DECODE_SYSTEMS``); then fresh engines B side by side: store-warm, then again."""
    remote = ray.remote(num_cpus=0, runtime_env={"env_vars": ENGINE_ENV})(Engine)
    results: dict[str, dict[str, float]] = {name: {} for name in systems}

    def record(key: str, medians: dict[str, float]) -> None:
        for name, value in medians.items():
            results[name][key] = value

    log.info("loading engines A: %s", ", ".join(systems))
    a = {name: remote.remote(model, kv) for name, kv in systems.items()}
    log.info("A: cold, then prefix hits")
    record("cold_p50", interleaved(a, prompts, ttft_one))
    record("prefix_hit_p50", interleaved(a, prompts, ttft_one))
    log.info("A: decode")
    fresh, probes, new_tokens = decode
    record("decode_tok_s", interleaved({name: a[name] for name in DECODE_SYSTEMS}, list(zip(fresh, probes)),
                                       lambda engine, pair: decode_rate(engine, pair[0], pair[1], new_tokens)))
    for engine in a.values():
        ray.kill(engine)
    log.info("loading engines B")
    b = {name: remote.remote(model, kv) for name, kv in systems.items()}
    warm = in_turn(b, prompts, ttft_one)
    record("warm_p50", {name: statistics.median(values) for name, values in warm.items()})
    record("warm_first", {name: values[0] for name, values in warm.items()})  # each fresh engine's first request
    record("warm_prefix_hit_p50", interleaved(b, prompts, ttft_one))  # B's own prefix caches now
    for engine in b.values():
        ray.kill(engine)
    return results


def print_report(results: dict[str, dict[str, float]]) -> None:
    """The table, then the ratios as the last lines (what a CI log or a script greps for)."""
    print(f"\n{'system':>10} {'A cold p50 ms':>14} {'A prefix-hit p50 ms':>20} {'B p50 ms':>10} {'B / A':>7} "
          f"{'B first ms':>11} {'B prefix-hit p50 ms':>20} {'decode tok/s':>13}")
    for name, r in results.items():
        print(f"{name:>10} {r['cold_p50'] * 1e3:>14.1f} {r['prefix_hit_p50'] * 1e3:>20.1f} "
              f"{r['warm_p50'] * 1e3:>10.1f} {r['warm_p50'] / r['cold_p50']:>7.3f} {r['warm_first'] * 1e3:>11.1f} "
              f"{r['warm_prefix_hit_p50'] * 1e3:>20.1f} {r['decode_tok_s']:>13.1f}")
    ucm, none = results["ucm-ray"], results["none"]
    print(f"decode_overhead_example={1 - results['example']['decode_tok_s'] / none['decode_tok_s']:.3f}")
    print(f"ttft_cold_overhead={ucm['cold_p50'] / none['cold_p50']:.3f}")
    print(f"decode_overhead={1 - ucm['decode_tok_s'] / none['decode_tok_s']:.3f}")
    print(f"ttft_store_warm_vs_other_engines_prefix_hit={ucm['warm_p50'] / ucm['prefix_hit_p50']:.3f}")
    print(f"ttft_store_warm_vs_prefix_hit={ucm['warm_p50'] / ucm['warm_prefix_hit_p50']:.3f}")
    print(f"ttft_store_warm_first_request_vs_prefix_hit={ucm['warm_first'] / ucm['warm_prefix_hit_p50']:.3f}")
    print(f"ttft_warm_vs_cold={ucm['warm_p50'] / none['warm_p50']:.3f}")
    print(f"ttft_ucm_vs_example={ucm['warm_p50'] / results['example']['warm_p50']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for k, v in {**ENGINE_ENV, "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    model = str(make_tiny_model(os.path.join(".models", "tiny")))
    prompts = [synthetic_prompt(model, args.tokens, seed=1000 + i) for i in range(args.prompts)]
    # Seeds apart from the TTFT prompts: in no cache nor store when decode runs ("none" saves nothing).
    decode = ([synthetic_prompt(model, args.tokens, seed=2000 + i) for i in range(args.prompts)],
              [synthetic_prompt(model, args.tokens, seed=3000 + i) for i in range(args.prompts)],
              args.decode_tokens)
    local_ray("ucmt-", num_cpus=4, logging_level="WARNING", log_to_driver=False)
    cfg = UcmRayConfig(num_shards=2, pool_bytes=512 << 20, ray_namespace="ucm_ray_ttft")
    systems: dict[str, dict | None] = {"none": None}
    try:
        with running_fleet(cfg), tempfile.TemporaryDirectory(prefix="example-connector-") as shared:
            systems["example"] = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"shared_storage_path": shared}}
            systems["ucm-ray"] = kv_transfer_config({"ray_namespace": cfg.ray_namespace})
            results = run_systems(systems, model, prompts, decode)
    finally:
        ray.shutdown()
    print_report(results)


if __name__ == "__main__":
    main()
