"""Host time the connector's scheduler half spends on one cold request (issue 43's
``a_scheduler_host_ms_per_cold_request``), per hook, on CPU: the harness's engine (vLLM's real
scheduler, both halves of the connector, a stand-in forward) and a real 2-shard Ray fleet.

Each size (``--prompt``, repeatable; 16-token blocks, ``--layers`` layers) serves ``--requests``
fresh prompts one after another (after one untimed warm-up request), each with ``--max-tokens``
new tokens, and steps on until the store answered its saves (``Engine.settle``): every
scheduler hook called from the request's arrival to then is the request's, as nothing else
runs. Prints, per size, the median over the requests of the hooks' total
(``scheduler_ms_per_cold_request_<size>``), of each hook (``..._hook_ms_<size>``: the lookup's
key hashing and round trip are in ``get_num_new_matched_tokens``, save planning and slot asks in
``build_connector_meta``), the worker half's total beside it (``worker_ms_per_cold_request``)
and the steps taken. ``schedule_ms_per_cold_request`` is the connector's own ``schedule_seconds``
(what ``gpu_data_plane.py`` prints as ``a_scheduler_host_ms_per_cold_request``: the hooks' time
of steps that run tokens) and ``idle_ms_per_cold_request`` its ``idle_schedule_us`` (steps that
run none, while the request's saves are planned, posted and committed after it finished: with
``--max-tokens 2`` most of its save work lands there; under load it lands in other requests'
steps). What the clock adds per timed call is taken off. ``--baseline PATH`` runs
another checkout's code in the same run (alternating processes) and prints
``scheduler_cold_vs_baseline_<size>``. The number of idle steps depends on how soon the store
answers (10-30 on a loaded 2-core box, ~0.06 ms each): ``busy_ms_per_cold_request`` sums only what
each step took beyond such a polling step (the median of the request's last three), and
``scheduler_busy_vs_baseline_<size>`` compares that. ``--thread-time``: the engine thread's CPU time instead of
wall time (which on a loaded box counts other processes' turns on the cores). ``--profile``: our
functions that took the most time (cProfile inflates small calls: for where, not how much;
in wall time it also counts waits for the GIL). ``--parts``: the scheduler half's parts
(``PARTS``) timed too.

Run: ``python benchmarks/cold_request.py --prompt 4096 --prompt 16384 --baseline /path/to/other/checkout``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import logging
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

log = logging.getLogger("bench.cold_request")

SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "request_finished_all_groups",
                   "get_kv_connector_stats", "take_events")
"""The scheduler half's hooks (the ones vLLM's scheduler calls)."""

PARTS = (("part", ("_take_results",)), ("results", ("collect", "take")),
         ("lookups", ("matched",)), ("loads", ("dispatch",)), ("requests", ("take_block_ids", "release_held")),
         ("saves", ("plan_step", "_announce_prompt", "_plan_saves", "_wanted", "expect", "skip")),
         ("jobs", ("bind", "dispatch")),
         ("slots", ("tick", "expect", "unexpect", "holds", "_ask", "_take_arrived", "_rebalance")),
         ("store", ("pools", "placement", "commit", "lookup")))
"""With ``--parts``: the scheduler half's parts timed inside its hooks (nested ones count in
their callers too), as ``attribute.method`` of the scheduler part."""


def clock_cost(clock: Any, samples: int = 20001) -> float:
    """Seconds one reading of ``clock`` adds to a timed call (median of back-to-back readings)."""
    gaps = []
    for _ in range(samples):
        started = clock()
        gaps.append(clock() - started)
    return statistics.median(gaps)


def run(prompt_tokens: int, requests: int, layers: int, max_tokens: int, profile: bool,
        thread_time: bool, parts: bool) -> dict[str, Any]:
    """Per cold request: the scheduler half's hooks (total and per hook, ms), the worker's
    total, and the engine steps it took (to its saves' answer)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.engine.client import StoreClient
    from ucm_ray.store.shard.fleet import running_fleet
    from ucm_ray.testing.harness import make_engine, prompt, write_model_dir
    from ucm_ray.testing.timing import CONNECTOR_HOOKS, Target, timed_calls

    # Not benchmarks.measure.local_ray: a --baseline child finds the other checkout's benchmarks.
    ray_temp_dir = tempfile.mkdtemp(prefix="ucmc-", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             _temp_dir=ray_temp_dir)
    cfg = UcmRayConfig(num_shards=2, pool_bytes=(1 << 30) if prompt_tokens > 8192 else (512 << 20),
                       ray_namespace="ucm_ray_cold_request")
    clock = time.thread_time if thread_time else time.perf_counter
    per_request: list[dict[str, Any]] = []
    profiler = cProfile.Profile(clock) if profile else None  # thread time: no waits for the GIL
    try:
        with running_fleet(cfg), tempfile.TemporaryDirectory(prefix="ucmc-model-") as model_dir:
            write_model_dir(model_dir)
            blocks = 2 * (prompt_tokens + max_tokens + 64) // 16 + 16
            engine = make_engine(StoreClient(cfg), model_dir, config=cfg, block_size=16, num_layers=layers,
                                 num_blocks=blocks, max_batched=prompt_tokens + 64)
            try:
                engine.serve("warm", prompt(prompt_tokens, seed=1), max_tokens=max_tokens)  # pools mapped, code warm
                engine.settle()
                cost = clock_cost(clock)
                part = engine.connector.scheduler_part
                targets: list[Target] = [(engine.connector, SCHEDULER_HOOKS, "scheduler"),
                                         (engine.worker, CONNECTOR_HOOKS, "worker")]
                if parts:
                    owners = {"part": part, "results": part.results, "lookups": part.lookups, "loads": part.loads,
                              "requests": part._requests, "saves": part.saves, "jobs": part.saves.jobs,
                              "slots": part.slots, "store": part._store}
                    targets += [(owners[label], names, label) for label, names in PARTS]
                for i in range(requests):
                    tokens = prompt(prompt_tokens, seed=1000 + i)
                    gc.collect()
                    steps = engine.steps
                    before = dict(part.stats.totals)
                    per_step: list[float] = []  # the scheduler hooks' seconds in each step
                    with timed_calls(targets, clock) as timed:
                        # serve and settle step through it
                        engine.step = _stepped(engine.step, timed, per_step)  # type: ignore[method-assign]
                        if profiler is not None:
                            profiler.enable()
                        try:
                            hit, _ = engine.serve(f"cold{i}", tokens, max_tokens=max_tokens)
                            engine.settle()
                        finally:
                            if profiler is not None:
                                profiler.disable()
                            del engine.step
                    if hit:
                        raise RuntimeError(f"request {i} was not cold: {hit} tokens hit")
                    hooks = {name: 1e3 * (sum(calls) - cost * len(calls)) for name, calls in timed.items() if calls}
                    totals = part.stats.totals
                    polling = statistics.median(per_step[-3:])  # the last steps only poll for the commits' answers
                    per_request.append({"hooks": hooks, "steps": engine.steps - steps, "busy_ms": 1e3 * sum(
                        max(0.0, spent - polling) for spent in per_step), "schedule_ms": 1e3 * (
                        totals.get("schedule_seconds", 0.0) - before.get("schedule_seconds", 0.0)),
                        "idle_ms": 1e-3 * (totals.get("idle_schedule_us", 0) - before.get("idle_schedule_us", 0))})
                if engine.wrong_blocks or engine.failed_loads:
                    raise RuntimeError(f"{engine.wrong_blocks} wrong blocks, {engine.failed_loads} failed loads")
            finally:
                engine.shutdown()
    finally:
        ray.shutdown()
    shutil.rmtree(ray_temp_dir, ignore_errors=True)  # its Ray logs (~13 MB): kept when the run failed
    if profiler is not None:
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("cumulative").print_stats("ucm_ray", 45)
        stats.sort_stats("tottime").print_stats(30)
    names = sorted({name for r in per_request for name in r["hooks"]})

    def median(pick: Any) -> float:
        return round(statistics.median(sum(ms for name, ms in r["hooks"].items() if pick(name))
                                       for r in per_request), 3)

    return {"scheduler_ms": median(lambda name: name.startswith("scheduler.")),
            "worker_ms": median(lambda name: name.startswith("worker.")),
            "parts_ms": {name: median(lambda other, name=name: other == name) for name in names
                         if not name.startswith(("scheduler.", "worker."))},
            "steps": statistics.median(r["steps"] for r in per_request),
            "schedule_ms": round(statistics.median(r["schedule_ms"] for r in per_request), 3),
            "idle_ms": round(statistics.median(r["idle_ms"] for r in per_request), 3),
            "busy_ms": round(statistics.median(r["busy_ms"] for r in per_request), 3),
            "hook_ms": {name: median(lambda other, name=name: other == name) for name in names
                        if name.startswith(("scheduler.", "worker."))},
            "clock_us": round(1e6 * cost, 3)}


def _stepped(step: Any, timed: dict[str, list[float]], per_step: list[float]) -> Any:
    """``step``, recording the seconds the scheduler hooks took in each call into ``per_step``."""
    def timed_step() -> None:
        before = sum(sum(calls) for name, calls in timed.items() if name.startswith("scheduler."))
        step()
        per_step.append(sum(sum(calls) for name, calls in timed.items() if name.startswith("scheduler.")) - before)
    return timed_step


def print_figures(size: int, got: dict[str, list[dict[str, Any]]]) -> None:
    """One size's medians over the rounds, per checkout, and with a baseline the ratio."""
    for name, runs in got.items():
        suffix = f"_{size}" + ("" if name == "this" else "_baseline")
        print(f"scheduler_ms_per_cold_request{suffix}={statistics.median(r['scheduler_ms'] for r in runs):.3f}")
        print(f"worker_ms_per_cold_request{suffix}={statistics.median(r['worker_ms'] for r in runs):.3f}")
        for key in ("busy_ms", "schedule_ms", "idle_ms"):
            print(f"{key}_per_cold_request{suffix}={statistics.median(r[key] for r in runs):.3f}")
        print(f"steps_per_cold_request{suffix}={statistics.median(r['steps'] for r in runs):.0f}")
        hooks = sorted({hook for r in runs for hook in r["hook_ms"]})
        print(f"hook_ms{suffix}=" + " ".join(
            f"{hook}:{statistics.median(r['hook_ms'].get(hook, 0.0) for r in runs):.3f}" for hook in hooks))
        parts = sorted({p for r in runs for p in r["parts_ms"]})
        if parts:
            print(f"parts_ms{suffix}=" + " ".join(
                f"{p}:{statistics.median(r['parts_ms'].get(p, 0.0) for r in runs):.3f}" for p in parts))
    if "baseline" in got:
        for key, name in (("scheduler_ms", "scheduler_cold"), ("busy_ms", "scheduler_busy")):
            this = statistics.median(r[key] for r in got["this"])
            base = statistics.median(r[key] for r in got["baseline"])
            print(f"{name}_vs_baseline_{size}={this / base:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--prompt", type=int, action="append", help="prompt tokens (repeatable; default 4096 and 16384)")
    ap.add_argument("--requests", type=int, default=5, help="cold requests per process")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="processes per checkout and size, alternating")
    ap.add_argument("--baseline", default=None, help="another checkout whose ucm_ray runs in the same run")
    ap.add_argument("--thread-time", action="store_true", help="the engine thread's CPU time, not wall time")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--parts", action="store_true", help="also time the scheduler half's parts (PARTS)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sizes = args.prompt or [4096, 16384]
    if args.child:
        print(json.dumps(run(sizes[0], args.requests, args.layers, args.max_tokens, args.profile, args.thread_time,
                             args.parts)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkouts = {"this": here, **({"baseline": args.baseline} if args.baseline else {})}
    for size in sizes:
        got: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
        for _ in range(args.rounds):
            for name, path in checkouts.items():
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--prompt", str(size),
                       "--requests", str(args.requests), "--layers", str(args.layers),
                       "--max-tokens", str(args.max_tokens)]
                cmd += ["--thread-time"] if args.thread_time else []
                cmd += ["--profile"] if args.profile else []
                cmd += ["--parts"] if args.parts else []
                python_path = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH", "")) if p)
                out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": python_path}, capture_output=True,
                                     text=True)
                if out.returncode:
                    raise SystemExit(f"cold_request in {path} failed:\n{out.stderr[-4000:]}")
                if args.profile:
                    sys.stderr.write(out.stderr[-16000:])
                got[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                log.info("%s %d: %s", name, size, got[name][-1])
        print_figures(size, got)


if __name__ == "__main__":
    main()
