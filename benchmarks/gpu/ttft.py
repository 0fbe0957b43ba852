"""Part 2 of the GPU benchmark (``--ttft``, ``--ttft-only``): TTFT and decode with and without
the connector, engines as Ray actors in their own processes.

A 4k and a 16k prompt on a ~1.2B random-weight Llama (Llama-3.2-1B shape, bf16,
FULL_AND_PIECEWISE CUDA graphs): cold (engine A, connector on, store empty), the engine's own
prefix-cache hit (A again), and store-warm (a fresh engine B with the connector), B's own
prefix-cache hit, and the same prompts cold on an engine C without the connector, A and C side
by side taking each prompt in turn (the tier's cost to a cold request, and whether any first
token differs with and without it); then A and C decode fresh prompts the same way (what saves
running beside decode cost). A second engine without the connector, C2, takes every prompt too:
its figures against C's (``*_noise_<size>``) are what two alike engines differ by on that host,
in the same run. An engine N with a connector that does nothing decodes them too. Each engine
is measured on the same cores, one at a time, the others parked together on others
(``engine_cores``, ``turn_cores``). Last, B, C, C2 and N each decode ``--decode-rounds`` batches
of ``--decode-batch`` fresh prompts per size served together, in turn
(``decode_batch_overhead_<size>`` and its ``_noise`` and ``_null_connector`` beside it): a
serving engine's decode, the prompts' saves running in its first steps. Prompts are 8 tokens
past a block boundary so that A's repeat is a pure local hit (the store holds nothing beyond it).
Every engine serves ``--cold-warmup`` cold prompts per size first, not counted (its first cold
requests ran slower), and the cold medians come with their lowest and highest (``_min_ms``, ``_max_ms``).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from benchmarks.gpu.common import (
    EngineCores,
    TtftProfile,
    bench_model,
    connector_config,
    decode_prompts,
    decode_rate,
    engine_actor,
    engine_cores,
    on_turn,
    start_engine,
    ttft_of,
    ttft_profile,
    turn_cores,
)
from benchmarks.gpu.step_timing import timed_parts, timed_warm
from benchmarks.measure import in_turn
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.shard.fleet import running_fleet

log = logging.getLogger("bench.gpu")


@dataclass(frozen=True)
class TtftPrompts:
    """Every prompt of a run, per size: ``ttft`` (served cold, then as hits), ``profiled`` (one
    more under torch's profiler), ``fresh`` (decoded one at a time), ``batched`` (decoded in
    batches) and ``warmup`` (every engine's, before it is measured)."""

    ttft: dict[str, list[list[int]]]
    profiled: dict[str, list[int]]
    fresh: dict[str, list[list[int]]]
    batched: dict[str, list[list[list[int]]]]
    warmup: list[list[int]]

    def tokens(self, decode_tokens: int) -> int:
        """Tokens the store may be asked to keep; batches not counted: saved last, they may evict
        what nothing reads any more."""
        return (sum(len(p) for p in self.warmup) + sum(len(p) for ps in self.ttft.values() for p in ps)
                + sum(len(p) for p in self.profiled.values())
                + sum(len(p) + decode_tokens for ps in self.fresh.values() for p in ps))


def ttft_prompts(model: str, prof: TtftProfile, prompts_per_size: int, profiled: bool, decode_batch: int,
                 decode_rounds: int, decode_per_size: int = 6, cold_warmup: int = 3) -> TtftPrompts:
    """``cold_warmup``: cold prompts per size every engine serves before it is measured (not
    counted): an engine's first cold requests ran slower, and with 2 prompts per size the median
    took them as the tier's cost (an H100 probe: 1.09 over 8 prompts, +1.2 ms over the last 5)."""
    from ucm_ray.tiny_model import synthetic_prompt

    sizes = list(prof.sizes.items())
    ttft = {size: [synthetic_prompt(model, n, seed=100 * (j + 1) + i) for i in range(prompts_per_size)]
            for j, (size, n) in enumerate(sizes)}
    under_profiler = {size: synthetic_prompt(model, n, seed=100 * (j + 1) + 99)
                      for j, (size, n) in enumerate(sizes)} if profiled else {}
    fresh, batched, warmup = decode_prompts(model, prof, decode_per_size, decode_batch, decode_rounds, cold_warmup)
    return TtftPrompts(ttft, under_profiler, fresh, batched, warmup)


@dataclass
class Served:
    """What the engines returned, per size (each engine's results in prompt order)."""

    cold: dict[str, list] = field(default_factory=dict)  # A, store empty
    plain: dict[str, list] = field(default_factory=dict)  # C, no connector
    plain2: dict[str, list] = field(default_factory=dict)  # C2, no connector
    decode: dict[str, dict[str, list]] = field(default_factory=dict)  # A, C, C2, N
    local: dict[str, list] = field(default_factory=dict)  # A again: its own prefix hits
    warm: dict[str, list] = field(default_factory=dict)  # B, fresh: the store's hits
    store_hits: dict[str, int] = field(default_factory=dict)  # B's hit tokens
    own: dict[str, list] = field(default_factory=dict)  # B again: its own prefix hits
    batch_decode: dict[str, dict[str, list]] = field(default_factory=dict)  # B, C, C2, N


def hits(engine: Any) -> int:
    """The tokens an engine's connector has found in the store so far."""
    return ray.get(engine.connector_totals.remote())["scheduler"].get("hit_tokens", 0)


class TtftRun:
    """One run's engines on one fleet, in the order they are measured (``measure``); what they
    served goes to ``served``, the figures taken along the way to ``res``."""

    def __init__(self, model: str, prof: TtftProfile, prompts: TtftPrompts, cfg: UcmRayConfig,
                 cores: EngineCores, decode_tokens: int, profile_dir: str | None, step_timing: bool) -> None:
        self.model, self.prof, self.prompts, self.cores = model, prof, prompts, cores
        self.decode_tokens, self.profile_dir, self.step_timing = decode_tokens, profile_dir, step_timing
        self.kv = connector_config(cfg)
        self.remote = engine_actor(prof)
        self.served = Served()
        self.res: dict[str, Any] = {}

    def start(self, label: str, kv_config: dict[str, Any] | None) -> Any:
        return start_engine(self.remote, self.model, self.prof, label, kv_config, self.cores.parked,
                            self.prompts.warmup)

    def measure(self) -> None:
        from ucm_ray.testing.null_connector import null_kv_transfer_config

        a = self.start("A (connector, store empty)", self.kv)
        plain_engine = self.start("C (no connector)", None)
        other_plain = self.start("C2 (no connector, a second one: how far two alike engines differ)", None)
        null = self.start("N (vLLM's connector hooks alone: NullConnector)", null_kv_transfer_config())
        pair = {"A": a, "C": plain_engine}
        trio = {**pair, "C2": other_plain}
        self.cold_side_by_side(trio)
        self.decode_side_by_side({**trio, "N": null})
        if self.profile_dir:
            self.cprofiled(pair)
        if self.step_timing:
            self.res.update(timed_parts(pair, self.model, self.prof, self.decode_tokens, self.cores))
        saved = ray.get(a.connector_totals.remote())["scheduler"]
        log.info("A saved %d blocks, dropped %d (no write slot before the request ended)",
                 saved.get("saved_blocks", 0), saved.get("saves_dropped", 0))
        with turn_cores(a, self.cores):
            self.profiled(a, "cold")
        self.own_prefix_hits(a)
        ray.kill(a)
        b = self.start("B (connector, fresh process)", self.kv)
        self.store_warm(b)
        self.batch_decodes({"B": b, "C": plain_engine, "C2": other_plain, "N": null})
        for engine in (b, plain_engine, other_plain, null):
            ray.kill(engine)

    def cold_side_by_side(self, trio: dict[str, Any]) -> None:
        """A's cold requests (a miss and their saves) against the same prompts, new to engines
        without the connector: what the tier costs a cold request, and whether it changed an
        output. Side by side, one prompt each in turn: a run's drift lands on all three."""
        a, served = trio["A"], self.served
        for s, ps in self.prompts.ttft.items():
            before = ray.get(a.connector_totals.remote())["scheduler"]
            got = in_turn(trio, ps, on_turn(self.cores, lambda engine, p: ray.get(engine.generate.remote(p, 1))))
            served.cold[s], served.plain[s], served.plain2[s] = got["A"], got["C"], got["C2"]
            after = ray.get(a.connector_totals.remote())["scheduler"]
            # the connector's scheduler hooks' host time (lookups, plans, results), per request
            self.res[f"a_scheduler_host_ms_per_cold_request_{s}"] = 1e3 * (
                after.get("schedule_seconds", 0.0) - before.get("schedule_seconds", 0.0)) / len(ps)
        for label, by_size in (("A", served.cold), ("C", served.plain), ("C2", served.plain2)):
            log.info("%s's cold TTFTs (ms, in turn): %s", label,
                     {s: [round(ttft_of(r) * 1e3, 1) for r in rs] for s, rs in by_size.items()})

    def decode_side_by_side(self, engines: dict[str, Any]) -> None:
        for s, ps in self.prompts.fresh.items():
            self.served.decode[s] = got = in_turn(engines, ps, on_turn(self.cores, lambda engine, p: ray.get(
                engine.generate.remote(p, self.decode_tokens, ignore_eos=True))))
            log.info("%s decode tok/s: %s", s, ", ".join(f"{label} {[round(decode_rate(r), 1) for r in rs]}"
                                                         for label, rs in got.items()))

    def cprofiled(self, pair: dict[str, Any]) -> None:
        """One more decode each under cProfile (where A's extra host time per step goes), and a
        cold request of each size on A."""
        from ucm_ray.tiny_model import synthetic_prompt

        assert self.profile_dir is not None
        probe = synthetic_prompt(self.model, min(self.prof.sizes.values()), seed=4242)
        for label, engine in pair.items():
            path = os.path.join(self.profile_dir, f"decode_{label}.prof")
            with turn_cores(engine, self.cores):
                rate = decode_rate(ray.get(engine.generate_cprofiled.remote(probe, self.decode_tokens, path)))
            log.info("decode of engine %s under cProfile: %.1f tok/s, stats in %s", label, rate, path)
        a = pair["A"]
        with turn_cores(a, self.cores):
            for j, (s, n) in enumerate(self.prof.sizes.items()):
                path = os.path.join(self.profile_dir, f"cold_A_{s}.prof")
                ray.get(a.generate_cprofiled.remote(synthetic_prompt(self.model, n, seed=4343 + j), 1, path))
                log.info("%s cold request of engine A under cProfile: stats in %s", s, path)

    def profiled(self, engine: Any, kind: str) -> None:
        """The profiled prompts under torch's profiler, served ``kind`` (``cold`` on A,
        ``store_warm`` on B): where such a request's time goes."""
        for s, p in self.prompts.profiled.items():
            assert self.profile_dir is not None
            path = os.path.join(self.profile_dir, f"trace_{kind}_{s}.json.gz")
            before = hits(engine)
            result = ray.get(engine.generate_profiled.remote(p, 1, path))
            log.info("profiled %s %s request: TTFT %.1f ms under the profiler, store hit %d tokens, trace in %s\n%s",
                     s, kind.replace("_", "-"), ttft_of(result) * 1e3, hits(engine) - before, path,
                     result["profile_table"])

    def own_prefix_hits(self, a: Any) -> None:
        before = hits(a)
        with turn_cores(a, self.cores):
            self.served.local = {s: [ray.get(a.generate.remote(p, 1)) for p in ps]
                                 for s, ps in self.prompts.ttft.items()}
        assert hits(a) == before, "the store added to A's own prefix hit; the prompts should leave it nothing"

    def store_warm(self, b: Any) -> None:
        """B alone, every measurement of it on the turn cores: the prompts from the store, then
        (B's own prefix cache) again: the issue's yardstick for a store hit."""
        served = self.served
        with turn_cores(b, self.cores):
            for s, ps in self.prompts.ttft.items():
                served.store_hits[s] = 0
                served.warm[s] = [self.store_warm_one(b, s, p) for p in ps]
            if self.step_timing:
                self.res.update(timed_warm(b, self.model, self.prof))
            self.profiled(b, "store_warm")
            for s, ps in self.prompts.ttft.items():
                served.own[s] = [ray.get(b.generate.remote(p, 1)) for p in ps]

    def store_warm_one(self, b: Any, s: str, p: list[int]) -> dict[str, Any]:
        before = hits(b)
        worker_before = ray.get(b.connector_totals.remote())["worker"]
        result = ray.get(b.generate.remote(p, 1))
        got = hits(b) - before
        self.served.store_hits[s] += got
        worker = ray.get(b.connector_totals.remote())["worker"]
        moved = {k: worker.get(k, 0) - worker_before.get(k, 0)
                 for k in ("loaded_blocks", "load_failures", "stale_loads", "load_seconds")}
        log.info("%s prompt of %d tokens: store-warm TTFT %.1f ms, store hit %d tokens, worker %s", s,
                 len(p), ttft_of(result) * 1e3, got, moved)
        return result

    def batch_decodes(self, engines: dict[str, Any]) -> None:
        for s, rounds in self.prompts.batched.items():
            self.served.batch_decode[s] = got = in_turn(engines, rounds, on_turn(
                self.cores, lambda engine, batch: ray.get(engine.decode_batch.remote(batch, self.decode_tokens))))
            log.info("%s decode tok/s, batches of %d: %s", s, len(rounds[0]) if rounds else 0, ", ".join(
                f"{label} {[round(r['rate'], 1) for r in rs]}" for label, rs in got.items()))


def median_ttft(results: list[dict[str, Any]]) -> float:
    return statistics.median(ttft_of(r) for r in results)


def ttft_spread(results: list[dict[str, Any]]) -> tuple[float, float]:
    """(lowest, highest) TTFT in seconds: beside a median, whether a few slow requests moved it."""
    times = [ttft_of(r) for r in results]
    return min(times), max(times)


def cold_spread_figures(served: Served, s: str) -> dict[str, Any]:
    """The spread of one size's cold TTFTs on A, C and C2 (ms), printed beside their medians."""
    res: dict[str, Any] = {}
    for name, by_size in (("ttft_cold", served.cold), ("ttft_no_connector", served.plain),
                          ("ttft_no_connector2", served.plain2)):
        low, high = ttft_spread(by_size[s])
        res[f"{name}_{s}_min_ms"], res[f"{name}_{s}_max_ms"] = low * 1e3, high * 1e3
    res[f"ttft_cold_prompts_{s}"] = len(served.cold[s])
    return res


def size_figures(prof: TtftProfile, served: Served, s: str, prompts: int) -> dict[str, Any]:
    """One size's TTFT figures (medians over its prompts) and its single-request decode figures."""
    c, h, w, o, n = (median_ttft(rs[s]) for rs in (served.cold, served.local, served.warm, served.own, served.plain))
    log.info("%s (%d tokens): cold %.1f ms (no connector %.1f ms), prefix-cache hit %.1f ms (cached %s), "
             "store-warm %.1f ms (store hit %d tokens over %d prompts)", s, prof.sizes[s], c * 1e3, n * 1e3,
             h * 1e3, [r["cached"] for r in served.local[s]], w * 1e3, served.store_hits[s], prompts)
    with_tier, without, again, hooks_only = (statistics.median(decode_rate(r) for r in served.decode[s][e])
                                             for e in ("A", "C", "C2", "N"))
    return {f"ttft_no_connector_{s}_ms": n * 1e3, f"ttft_cold_overhead_{s}": c / n,
            f"ttft_cold_{s}_ms": c * 1e3, f"ttft_prefix_hit_{s}_ms": h * 1e3,
            f"ttft_store_warm_{s}_ms": w * 1e3, f"store_hit_tokens_{s}": served.store_hits[s],
            f"ttft_store_warm_vs_cold_{s}": w / c, f"ttft_store_warm_vs_other_engines_prefix_hit_{s}": w / h,
            f"ttft_b_prefix_hit_{s}_ms": o * 1e3, f"ttft_store_warm_vs_prefix_hit_{s}": w / o,
            f"decode_tok_s_{s}": with_tier, f"decode_tok_s_no_connector_{s}": without,
            f"decode_overhead_{s}": 1 - with_tier / without,
            # a connector that does nothing: what vLLM's hooks cost any connector
            f"decode_overhead_null_connector_{s}": 1 - hooks_only / without,
            # the same figure between two engines without the connector: this host's noise
            f"decode_overhead_noise_{s}": 1 - again / without,
            f"ttft_cold_overhead_noise_{s}": median_ttft(served.plain2[s]) / n}


def batch_figures(s: str, by_engine: dict[str, list]) -> dict[str, Any]:
    with_tier, without, again, hooks_only = (statistics.median(r["rate"] for r in by_engine[e])
                                             for e in ("B", "C", "C2", "N"))
    return {f"decode_batch_tok_s_{s}": with_tier, f"decode_batch_tok_s_no_connector_{s}": without,
            f"decode_batch_overhead_{s}": 1 - with_tier / without,
            f"decode_batch_overhead_null_connector_{s}": 1 - hooks_only / without,
            f"decode_batch_overhead_noise_{s}": 1 - again / without}


def ttft_figures(prof: TtftProfile, prompts: TtftPrompts, served: Served) -> dict[str, Any]:
    """The part's figures from what the engines served, and whether the engines with the
    connector produced the tokens those without it did."""
    identical = all(w["tokens"] == c["tokens"] == n["tokens"] for s in prompts.ttft
                    for w, c, n in zip(served.warm[s], served.cold[s], served.plain[s]))
    res: dict[str, Any] = {}
    for s, ps in prompts.ttft.items():
        res.update(size_figures(prof, served, s, len(ps)))
        res.update(cold_spread_figures(served, s))
    for s, by_engine in served.batch_decode.items():
        res.update(batch_figures(s, by_engine))
    res["decode_batch_tokens_identical"] = all(x["tokens"] == y["tokens"] for by_engine in served.batch_decode.values()
                                               for x, y in zip(by_engine["B"], by_engine["C"]))
    res["ttft_first_tokens_identical"] = identical
    res["decode_tokens_identical"] = all(x["tokens"] == y["tokens"] for s in served.decode
                                         for x, y in zip(served.decode[s]["A"], served.decode[s]["C"]))
    return res


def ttft(device: torch.device, quick: bool, prompts_per_size: int, model_dir: str | None,
         profile_dir: str | None = None, decode_tokens: int = 256, step_timing: bool = False,
         decode_batch: int = 8, decode_rounds: int = 3, decode_per_size: int = 6,
         cold_warmup: int = 3) -> dict[str, Any]:
    """``profile_dir``: one more prompt per size, served cold by A and store-warm by B under
    torch's profiler (``ProfiledEngine``); traces go there, outside the medians.
    ``decode_tokens``: A and C also decode that many tokens of fresh prompts of each size (A's
    saves of the prompt and of the decoded blocks run meanwhile): ``decode_overhead_<size>``.
    ``decode_batch`` / ``decode_rounds``: at the end, B (the connector), C, C2 and N each
    decode ``decode_rounds`` batches of ``decode_batch`` fresh prompts of each size together,
    in turn (``decode_batch_overhead_<size>``): a serving engine's decode, where one request's
    host noise weighs less than in a single request's rate. ``decode_per_size``: prompts per
    size decoded one at a time; ``cold_warmup``: see ``ttft_prompts``.
    ``step_timing``: then one cold request and one decode more per size, timed part by part
    (``timed_parts``), outside the medians."""
    prof = ttft_profile(device, quick)
    started = time.perf_counter()
    model = bench_model(prof, model_dir)
    log.info("model %s ready in %.1f s", model, time.perf_counter() - started)
    prompts = ttft_prompts(model, prof, prompts_per_size, profile_dir is not None, decode_batch, decode_rounds,
                           decode_per_size, cold_warmup)
    shards = 2
    cfg = UcmRayConfig(num_shards=shards, ray_namespace="ucm_ray_gpu_bench_ttft", transport="shm",
                       pool_bytes=int(prompts.tokens(decode_tokens) * prof.kv_bytes_per_token * 1.5) // shards
                       + (64 << 20))
    run = TtftRun(model, prof, prompts, cfg, engine_cores(device), decode_tokens, profile_dir, step_timing)
    with running_fleet(cfg):
        run.measure()
    return {**run.res, **ttft_figures(prof, prompts, run.served)}
