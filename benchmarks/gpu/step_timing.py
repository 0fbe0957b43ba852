"""``--step-timing``: requests served with every part of the engine's step timed, outside the
medians, and the tables the log shows of them.

After the TTFT part's measurements, one more cold request and one more decode per size on A
and C with every part of the engine's step (``vllm.*``) and every connector hook (``ours.*``)
timed by ``perf_counter``, and our code inside the hooks (``in.*``, ``inner_parts``), Python's
collections and each thread's CPU time, plus a kernel-launch probe in each engine: a table per
request in the log (``generate_timed``, ``timed_parts``); and B serves those cold prompts twice
more, from the store and from its own prefix cache, timed alike (``timed_warm``).
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import ray

from benchmarks.gpu.common import EngineCores, TtftProfile, ttft_of, turn_cores

log = logging.getLogger("bench.gpu")


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


def hooks_seconds(timed: dict[str, list[float]]) -> float:
    """Seconds spent in the connector's hooks (``ours.*``)."""
    return sum(sum(calls) for part, calls in timed.items() if part.startswith("ours."))


def launch_probes(pair: dict[str, Any], cores: EngineCores) -> dict[str, float]:
    """Each engine's ``launch_probe`` on the turn cores: ``<probe>_<label>``."""
    out: dict[str, float] = {}
    for label, engine in pair.items():
        with turn_cores(engine, cores):
            probe = ray.get(engine.launch_probe.remote())
        for name, value in probe.items():
            out[f"{name}_{label.lower()}"] = value
    return out


def log_timed_pair(size: str, kind: str, got: dict[str, dict[str, Any]]) -> None:
    """The table of one request per engine of the pair (a cold one's parts in ms per request;
    a decode's in us per step, and the spread of its steps), and its engines' busiest threads."""
    timed = {label: r["timed"] for label, r in got.items()}
    steps = {label: max(1, len(parts["vllm.engine.step"])) for label, parts in timed.items()}
    rows = parts_table(timed, per_step=kind == "decode")
    for label, r in got.items():
        busy = sorted(((seconds, name) for name, seconds in r["thread_cpu_s"].items() if seconds > 0), reverse=True)
        rows.append(f"  threads of {label} (CPU ms): " + ", ".join(f"{name} {1e3 * seconds:.0f}"
                                                              for seconds, name in busy[:8]))
        if kind == "decode":
            for part in ("vllm.engine.step", "vllm.executor.execute_model"):
                rows.append(f"  {label} {part} ms: {step_spread(timed[label].get(part, []))}")
    unit = "ms per request" if kind == "cold" else "us per step"
    log.info("%s %s timed parts, %s (calls, median call), A %d steps, C %d steps, TTFT A %.1f ms C %.1f ms:"
             "\n%s", size, kind, unit, steps["A"], steps["C"], ttft_of(got["A"]) * 1e3,
             ttft_of(got["C"]) * 1e3, "\n".join(rows))


def pair_figures(size: str, kind: str, got: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A cold request's engine steps to its first token on A and C (a lookup answered late costs
    one) and A's time in our hooks; a decode's mean step on A and C and A's hooks per step."""
    timed = {label: r["timed"] for label, r in got.items()}
    steps = {label: max(1, len(parts["vllm.engine.step"])) for label, parts in timed.items()}
    ours = hooks_seconds(timed["A"])
    if kind == "cold":
        return {f"cold_{size}_steps_to_first_token_a": steps["A"], f"cold_{size}_steps_to_first_token_c": steps["C"],
                f"cold_{size}_connector_hooks_ms": ours * 1e3}
    step_us = {label: 1e6 * sum(timed[label]["vllm.engine.step"]) / steps[label] for label in timed}
    return {f"decode_{size}_step_us_a": step_us["A"], f"decode_{size}_step_us_c": step_us["C"],
            f"decode_{size}_connector_hooks_us_per_step": 1e6 * ours / steps["A"]}


def timed_parts(pair: dict[str, Any], model: str, prof: TtftProfile, decode_tokens: int,
                cores: EngineCores) -> dict[str, Any]:
    """One more cold request and one more decode per size, on A and C, each part of the
    engine's step and each connector hook timed (``generate_timed``): a table per request in
    the log, and in the results the decode steps' mean host time on A and C and the part of
    A's in our hooks, the cold requests' time in our hooks, and the engine steps each took to
    its first token. The cold prompts are in the store after: ``timed_warm``."""
    out: dict[str, Any] = launch_probes(pair, cores)
    for size in prof.sizes:
        for kind, max_tokens in (("cold", 1), ("decode", decode_tokens)):
            prompt = timed_prompt(model, prof, size, max_tokens)
            got = {}
            for label, engine in pair.items():
                with turn_cores(engine, cores):
                    got[label] = ray.get(engine.generate_timed.remote(prompt, max_tokens))
            log_timed_pair(size, kind, got)
            out.update(pair_figures(size, kind, got))
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
        out[f"store_warm_{size}_connector_hooks_ms"] = hooks_seconds(got["warm"]["timed"]) * 1e3
    return out
