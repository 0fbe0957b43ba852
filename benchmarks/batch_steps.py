"""Host time of the connector's hooks per engine step while a batch of fresh prompts starts
decoding (issue 43's batch-decode gap), on CPU: the harness's engine (vLLM's real scheduler,
both halves of the connector, a stand-in forward) and a real fleet on this box.

``--requests`` prompts of ``--prompt`` tokens (16-token blocks, ``--layers`` layers: the range
count of a step's save is blocks x layers x 2, as an 8B model's) are added together and decode
``--steps`` steps (after ``--skip`` untimed ones: a quiet decode window). Prints the hooks' total
and the worst steps, per hook, and with ``--profile`` our functions that took the most time
(cProfile inflates small Python calls several times: use it for where, not how much). ``--baseline PATH`` runs another
checkout's code in the same run (alternating processes) and prints ``batch_hooks_vs_baseline``.

With ``--skip 0`` it also prints what saving the fresh prompts cost the engine's host, per prompt
(``save_host_ms_per_prompt``): the hooks' time over the steps after the prefill up to the one
after which every prompt block was sent to commit (the prompts' announcement, plan, any retries
for slots, dispatch and the results' commit: the save window; the store's answer to the commit
is collected later, at a quiet step's cost),
less as many quiet decode steps (the median of the steps after the window, the batch's last step
left out: its requests end there), over ``--requests``. The worker's ``wait_for_save`` is left out: on CPU pools it is
mostly the copy itself (``save_plan.py`` times the worker's planning of a save). The scheduler's
and the worker's shares are printed beside it (``save_scheduler_ms_per_prompt``), and with
``--baseline`` ``save_host_vs_baseline``. ``--async-scheduling``: vLLM's asynchronous scheduler.
Between steps, untimed, it waits (up to a second) for the answers to the slot supply's asks,
as if the store answered within a step (~2 ms on a GPU host): on this box the answers took as
many steps as its load made them, and a prompt whose slots came after its wait
(``PROMPT_SLOT_WAIT_S``) was planned again every step until they did (a save window of 9 to 25
steps, 1.0 to 2.8 ms a prompt, from one run to the next). ``--thread-time``: every figure in the engine
thread's CPU time (``time.thread_time``) instead of wall time, which on a loaded box also counts
other processes' turns on the cores (the baseline's ``timed_calls`` must take a clock).

With ``--skip`` above 0 (a quiet decode window: nothing to load, no prompt left to save) it also
prints a quiet step's hooks, the median over the window's steps but its last (its requests end
there): ``quiet_step_us`` for both halves (``quiet_step_mean_us``: the mean, which counts the
window's steps where a block filled, a decode batch's slots were asked for or the slot supply
ticked in full), ``quiet_scheduler_us`` and ``quiet_worker_us``, of the
worker's ``quiet_layer_hooks_us`` (``wait_for_layer_load`` and ``save_kv_layer``, called per layer
where vLLM calls them) and each hook's median (``quiet_hook_us``). What the clock itself adds to
each timed call (one reading, ~0.7 us for ``time.thread_time`` on this box, against hooks of a
microsecond) is measured in the same process and taken off per call (``clock_us``). With
``--baseline``: ``quiet_step_vs_baseline``.

``--cold``: the host's caches evicted between steps (``save_plan.EVICT_BYTES`` written, untimed), as a
GPU engine's forward, sampling and vLLM's own Python evict them; the harness's stand-in forward
leaves them warm, which makes every hook look cheaper than on a GPU host (docs/performance-log.md,
stop 64).

Run: ``python benchmarks/batch_steps.py [--baseline /path/to/other/checkout]``.
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

log = logging.getLogger("bench.batch_steps")


SAVE_EXCLUDED = ("worker.wait_for_save",)
"""Hooks left out of a save's host time: on CPU pools the worker's wait is mostly the copy."""


def save_host_ms(per_step: list[dict[str, float]], window: int, requests: int) -> dict[str, float]:
    """Per prompt, the host ms the steps after the prefill (steps 1 to ``window``) spent in the
    hooks beyond as many quiet steps (the median of the later ones but the last), in all and
    per half (scheduler, worker), ``wait_for_save`` left out; ``save_window_steps``: ``window``."""
    quiet_steps = per_step[window + 1:-1]
    if len(quiet_steps) < 3:
        raise SystemExit(f"the prompts' saves took {window} of {len(per_step)} steps: too few quiet ones left, "
                         "raise --steps")
    out: dict[str, float] = {"save_window_steps": window}
    for half, key in (("scheduler", "save_scheduler_ms_per_prompt"), ("worker", "save_worker_ms_per_prompt"),
                      ("", "save_host_ms_per_prompt")):
        quiet = statistics.median(_spent(step, half) for step in quiet_steps)
        extra = sum(_spent(step, half) - quiet for step in per_step[1:window + 1])
        out[key] = 1e3 * extra / requests
    return out


def _spent(step: dict[str, float], half: str) -> float:
    """Seconds one step spent in one half's hooks (``""``: both), ``SAVE_EXCLUDED`` left out."""
    return sum(s for name, s in step.items() if name.startswith(half) and name not in SAVE_EXCLUDED)


def clock_cost(clock: Any, samples: int = 20001) -> float:
    """Seconds one reading of ``clock`` adds to a call timed by two of them (the median of
    back-to-back readings' differences): taken off each timed call's figure."""
    gaps = []
    for _ in range(samples):
        started = clock()
        gaps.append(clock() - started)
    return statistics.median(gaps)


LAYER_HOOKS = ("worker.wait_for_layer_load", "worker.save_kv_layer")
"""The hooks vLLM calls per attention layer (where the connector has metadata bound)."""


def quiet_step_us(per_hook: list[dict[str, float]], per_calls: list[dict[str, int]], clock_s: float) \
        -> dict[str, Any]:
    """A quiet step's hooks in us (the median over the steps but the last, where the requests
    end), each call's clock reading taken off: both halves, each half, the layer hooks, per hook."""
    steps = [{name: seconds - clock_s * calls[name] for name, seconds in hooks.items()}
             for hooks, calls in zip(per_hook[:-1], per_calls[:-1])]
    if len(steps) < 3:
        raise SystemExit("too few steps for a quiet step's median: raise --steps")

    def median_us(pick: Any) -> float:
        return round(1e6 * statistics.median(sum(s for name, s in step.items() if pick(name)) for step in steps), 2)

    names = sorted({name for calls in per_calls[:-1] for name, count in calls.items() if count})
    return {"quiet_step_us": median_us(lambda name: True),
            "quiet_step_mean_us": round(1e6 * statistics.mean(sum(step.values()) for step in steps), 2),
            "quiet_scheduler_us": median_us(lambda name: name.startswith("scheduler.")),
            "quiet_worker_us": median_us(lambda name: name.startswith("worker.")),
            "quiet_layer_hooks_us": median_us(lambda name: name in LAYER_HOOKS),
            "quiet_hook_us": {name: median_us(lambda other, name=name: other == name) for name in names},
            "clock_us": round(1e6 * clock_s, 3)}


def _wait_for_slots(slots: Any, timeout_s: float = 1.0) -> None:
    """Until every slot ask the supply posted was answered (its private list of asks: the same
    in the baseline's checkout, which has no public way to say it)."""
    deadline = time.monotonic() + timeout_s
    while any(not ask.answer.poll() for ask in slots._asks) and time.monotonic() < deadline:
        time.sleep(0.0005)


def run(requests: int, prompt_tokens: int, layers: int, steps: int, profile: bool, skip: int,
        async_scheduling: bool, thread_time: bool, cold: bool = False) -> dict[str, Any]:
    """Per hook, seconds over the batch's steps; ``hooks_ms``: all of them; ``worst_step_ms``:
    the step whose hooks took longest; with ``skip`` 0, the prompts' save host time
    (``save_host_ms``)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import numpy as np
    import ray
    from save_plan import EVICT_BYTES  # this script's own folder (first on the path), whichever checkout is timed

    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.engine.client import StoreClient
    from ucm_ray.store.shard.fleet import running_fleet
    from ucm_ray.testing.harness import make_engine, prompt, write_model_dir
    from ucm_ray.testing.timing import CONNECTOR_HOOKS, timed_calls

    # Not benchmarks.measure.local_ray: a --baseline child finds the other checkout's benchmarks.
    ray_temp_dir = tempfile.mkdtemp(prefix="ucmb-", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             _temp_dir=ray_temp_dir)
    cfg = UcmRayConfig(num_shards=2, pool_bytes=256 << 20, ray_namespace="ucm_ray_batch_steps")
    per_step: list[float] = []
    per_hook: list[dict[str, float]] = []  # per step, seconds per hook
    per_calls: list[dict[str, int]] = []  # per step, calls per hook
    clock = time.thread_time if thread_time else time.perf_counter
    window = 0  # the step after which the prompts' saves were committed
    totals: dict[str, float] = {}
    profiler = cProfile.Profile() if profile else None
    try:
        with running_fleet(cfg), tempfile.TemporaryDirectory(prefix="ucmb-model-") as model_dir:
            write_model_dir(model_dir)
            blocks = requests * (prompt_tokens + steps + 64) // 16 + 16
            engine = make_engine(StoreClient(cfg), model_dir, config=cfg, block_size=16, num_layers=layers,
                                 num_blocks=blocks, max_seqs=max(8, requests),
                                 max_batched=requests * prompt_tokens + 64, async_scheduling=async_scheduling)
            try:
                engine.serve("warm", prompt(prompt_tokens, seed=1), max_tokens=2)  # pools mapped, code warm
                engine.settle()
                part = engine.connector.scheduler_part
                saved = part.stats.totals.get("saved_blocks", 0) + requests * (prompt_tokens // 16)
                for i in range(requests):
                    engine.add(f"r{i}", prompt(prompt_tokens, seed=100 + i), max_tokens=skip + steps)
                for _ in range(skip):
                    engine.step()
                targets = [(engine.connector, CONNECTOR_HOOKS, "scheduler"), (engine.worker, CONNECTOR_HOOKS, "worker")]
                evictor = np.ones(EVICT_BYTES, dtype=np.uint8) if cold else None
                gc.collect()
                gc.freeze()
                with timed_calls(targets, clock) as timed:
                    for _ in range(steps):
                        before = {name: sum(calls) for name, calls in timed.items()}
                        counted = {name: len(calls) for name, calls in timed.items()}
                        if profiler is not None:
                            profiler.enable()
                        engine.step()
                        if profiler is not None:
                            profiler.disable()
                        per_hook.append({name: sum(calls) - before[name] for name, calls in timed.items()})
                        per_calls.append({name: len(calls) - counted[name] for name, calls in timed.items()})
                        per_step.append(sum(per_hook[-1].values()))
                        _wait_for_slots(part.slots)
                        if evictor is not None:
                            evictor += 1  # every cache line written: the next step's hooks find none of theirs
                        if not window and part.stats.totals.get("saved_blocks", 0) >= saved:
                            window = len(per_step) - 1
                totals = {name: sum(calls) for name, calls in timed.items() if calls}
                engine.settle()
                if engine.wrong_blocks or engine.failed_loads:
                    raise RuntimeError(f"{engine.wrong_blocks} wrong blocks, {engine.failed_loads} failed loads")
            finally:
                gc.unfreeze()
                engine.shutdown()
    finally:
        ray.shutdown()
    shutil.rmtree(ray_temp_dir, ignore_errors=True)  # its Ray logs (~13 MB): kept when the run failed
    if profiler is not None:
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats("ucm_ray", 40)  # our functions' own time, largest first
    worst = sorted(range(len(per_step)), key=per_step.__getitem__, reverse=True)[:5]
    log.info("worst steps (index: ms): %s", {i: round(1e3 * per_step[i], 2) for i in worst})
    return {"hooks_ms": 1e3 * sum(per_step), "worst_step_ms": 1e3 * max(per_step),
            "median_step_ms": 1e3 * statistics.median(per_step),
            **(save_host_ms(per_hook, window or len(per_hook), requests) if not skip else
               quiet_step_us(per_hook, per_calls, clock_cost(clock))),
            **{f"{name}_ms": round(1e3 * s, 3) for name, s in totals.items()}}


QUIET = ("quiet_step_us", "quiet_step_mean_us", "quiet_scheduler_us", "quiet_worker_us", "quiet_layer_hooks_us",
         "clock_us")
"""A quiet step's figures printed with ``--skip`` (medians over the rounds)."""


def print_figures(got: dict[str, list[dict[str, Any]]], *, quiet: bool) -> None:
    """Each checkout's medians over its rounds (``quiet``: a quiet window's figures, else the
    prompts' saves), and with a baseline the ratios."""
    saves = ("save_host_ms_per_prompt", "save_scheduler_ms_per_prompt", "save_worker_ms_per_prompt",
             "save_window_steps")
    for name, runs in got.items():
        suffix = "" if name == "this" else "_baseline"
        for key in ("hooks_ms", "worst_step_ms", "median_step_ms"):
            print(f"batch_{key}{suffix}={statistics.median(r[key] for r in runs):.3f}")
        for key in QUIET if quiet else saves:
            print(f"{key}{suffix}={statistics.median(r[key] for r in runs):.{2 if quiet else 3}f}")
        if quiet:
            hooks = sorted({hook for r in runs for hook in r["quiet_hook_us"]})
            print(f"quiet_hook_us{suffix}=" + " ".join(
                f"{hook}:{statistics.median(r['quiet_hook_us'].get(hook, 0.0) for r in runs):.2f}" for hook in hooks))
    if "baseline" in got:
        def ratio(key: str) -> float:
            return statistics.median(r[key] for r in got["this"]) / statistics.median(r[key] for r in got["baseline"])
        print(f"batch_hooks_vs_baseline={ratio('hooks_ms'):.3f}")
        print(f"quiet_step_vs_baseline={ratio('quiet_step_us'):.3f}" if quiet
              else f"save_host_vs_baseline={ratio('save_host_ms_per_prompt'):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="processes per checkout, alternating")
    ap.add_argument("--baseline", default=None, help="another checkout whose ucm_ray runs in the same run")
    ap.add_argument("--skip", type=int, default=0, help="steps run untimed first (0: time the prompts' steps)")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--thread-time", action="store_true", help="the engine thread's CPU time, not wall time")
    ap.add_argument("--cold", action="store_true", help="the host's caches evicted between steps")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.child:
        print(json.dumps(run(args.requests, args.prompt, args.layers, args.steps, args.profile, args.skip,
                             args.async_scheduling, args.thread_time, args.cold)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkouts = {"this": here, **({"baseline": args.baseline} if args.baseline else {})}
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, path in checkouts.items():
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--requests", str(args.requests),
                   "--prompt", str(args.prompt), "--layers", str(args.layers), "--steps", str(args.steps),
                   "--skip", str(args.skip)]
            cmd += ["--async-scheduling"] if args.async_scheduling else []
            cmd += ["--thread-time"] if args.thread_time else []
            cmd += ["--cold"] if args.cold else []
            python_path = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH", "")) if p)
            out = subprocess.run(cmd + (["--profile"] if args.profile else []),
                                 env={**os.environ, "PYTHONPATH": python_path}, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"batch_steps in {path} failed:\n{out.stderr[-4000:]}")
            if args.profile:
                sys.stderr.write(out.stderr[-12000:])
            got[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            log.info("%s: %s", name, got[name][-1])
    print_figures(got, quiet=bool(args.skip))

if __name__ == "__main__":
    main()
