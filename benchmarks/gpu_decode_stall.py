"""Diagnostic (GPU): what slows an engine's first decode steps after a long prompt's save.

On an H200 (vLLM 0.26, ``gpu_data_plane.py --step-timing``) an engine with the connector took
117 ms for the first 8 decode steps after a 16k-token prompt against 30 ms without it (one
step 53.9 ms), vLLM's ``execute_model`` +63 ms and ``sample_tokens`` +41 ms, while our hooks'
host time in those steps was ~3 ms (the save's post 2.1 ms). The 512 MiB save itself moves in
~10-15 ms. This script serves fresh 16k-token prompts on one engine with the connector (A) and
one without (C), each followed by ``--decode`` tokens, and switches one suspect at a time on A
between requests:

- ``base``: as shipped;
- ``switch``: Python's thread switch interval 0.2 ms instead of 5 ms (another thread of ours
  holding the GIL: the commit's call poster, the copy thread);
- ``no-saves``: the scheduler plans no save (nothing is copied or committed): whether the
  stall comes from saving at all;
- ``kernels``: every save part by gather kernels instead of staged DMA (the copy engines: a
  sampled token's device-to-host copy queued behind the save's);
- ``sync``: the host waits for the device right after posting a save (the stall moved to one
  known place, or gone if it came from overlap).

Per request it logs the decode steps' spread (the first 8 steps' sum is the figure) and each
engine part's, our hooks' time in the first 8 steps, and then a 4k decode of A and C under
cProfile (stats in ``$OUT`` or /tmp). ``--batch N`` serves batches of N fresh prompts instead
(``decode_batch``: rates, then one batch of A and of C with their step parts timed, and one
under cProfile unless ``--profile-tokens 0``; ``--trace-steps K``: one more of each with its
last K decode steps under torch's profiler, host and device timelines in ``$OUT``), ``--shape
8b`` on Llama-3.1-8B's layers (dummy weights, 4k prompts). Nothing here is a benchmark figure;
the variants patch one engine's objects in place and are undone before the next.

First run (H200, 1B, 16k prompts, 2026-12-03): the 117-vs-30 ms stall did not recur. C's first
8 decode steps took 97-101 ms as well (vLLM's own: a 54 ms and a 25 ms step), A's 107-108 ms as
shipped and 101 ms without saves; the switch interval, gather kernels and a host wait after the
post did not help (115-128 ms).

Batches of 8 at 8B (``--shape 8b --batch 8 --decode 256``, H200, 2026-12-03, two leases):
- Before the call poster made the answers' futures (package code ``7b64af3``): C 1401 / 1462,
  A 1377 / 1399 / 1396, A without saves 1416 / 1417 tok/s. Timed: A's step 285 us longer than
  C's, and our hooks took 284 us of A's step (the plan 158, the save's post 60 per step on
  average; a quiet step's hooks ~100 us): the gap is our host time.
- After (``CallPoster`` futures, scheduler trims), another lease's (slower) host: C 1426 / 1427
  / 1425, A 1378 / 1377 / 1374 (3.5%), A without saves 1399 / 1393 (2.1%). Timed: A's step 213
  us longer, our hooks 283 us (the plan 135: slot ticks 40 -> 22 and answers 30 -> 13 us a step;
  the save's post 76, of which gather plans 34). Under cProfile C's engine thread waited for the
  device (``Event.synchronize``) 1.09 ms a step, A's 0.66 ms: part of our host time now overlaps
  the device, the rest is still on the step's critical path.
- Device trace (``--trace-steps 32``, package code ``de61b43``, 2026-12-04): the device did the
  same work in A's and C's steps (busy 4,667 vs 4,673 us median, nothing of ours on other
  streams in those steps), and vLLM's own functions took no longer in A; A's step was longer
  by our hooks (the scheduler's plan in ``schedule``, the worker's in ``execute_model``) and
  the launch came later (+130 us median). The gap is host time, and the device idles for it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from typing import Any

import ray
import ray.cloudpickle
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_data_plane as bench  # noqa: E402
import trace_steps  # noqa: E402

from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.fleet import running_fleet  # noqa: E402

log = logging.getLogger("bench.stall")
ray.cloudpickle.register_pickle_by_value(bench)  # the engine class is built there; workers lack the module

VARIANTS = ("base", "switch", "no-saves", "kernels", "sync")
PARTS = ("vllm.engine.step", "vllm.executor.execute_model", "vllm.executor.sample_tokens", "vllm.scheduler.schedule",
         "vllm.scheduler.update_from_output", "vllm.output.process_outputs")


def stall_engine_class() -> type:
    """The GPU benchmark's engine with ``variant(name)``: one suspect switched on (``base``
    switches every one off)."""

    class StallEngine(bench.profiled_engine_class()):  # type: ignore[misc]
        def variant(self, name: str) -> str:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            from ucm_ray.transport import gather

            scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_part
            worker_saves = get_kv_transfer_group().worker_part._saves
            sys.setswitchinterval(0.0002 if name == "switch" else 0.005)
            scheduler.__dict__.pop("_plan_saves", None)
            worker_saves.__dict__.pop("_job", None)
            gather.DMA_COPY_BYTES = (1 << 62) if name == "kernels" else (1 << 20)
            if name == "no-saves":
                scheduler._plan_saves = lambda tracked, saves: False
            elif name == "sync":
                job = type(worker_saves)._job

                def post_and_wait(saves: Any, deadline: float, **later: Any) -> Any:
                    posted = job(worker_saves, saves, deadline)  # at once, not after the forward
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    return posted

                worker_saves._job = post_and_wait
            return name

    return StallEngine


def first_steps(label: str, result: dict[str, Any]) -> str:
    timed = result["timed"]
    rows = [f"{label}: TTFT {bench.ttft_of(result) * 1e3:.1f} ms"]
    rows += [f"   {part}: {bench.step_spread(timed.get(part, [])[1:])}" for part in PARTS]
    ours = {name: 1e3 * sum(calls[1:9]) for name, calls in timed.items() if name.startswith(("ours.", "in.", "gc."))}
    rows.append("   ours in decode steps 1-8 (ms): " + ", ".join(
        f"{name} {ms:.2f}" for name, ms in sorted(ours.items(), key=lambda kv: -kv[1])[:12] if ms > 0))
    return "\n".join(rows)


def timed_batches(engines: dict[str, Any], cores: Any, model: str, prompt_tokens: int,
                  args: argparse.Namespace) -> None:
    """One more batch on A (as shipped) and on C with every step part and hook timed: per
    decode step, where A's extra time goes (our hooks' host time, or vLLM's parts waiting on
    the device longer)."""
    from ucm_ray.tiny_model import synthetic_prompt

    timed = {}
    for round_index, label in enumerate(("A", "C")):
        prompts = [synthetic_prompt(model, prompt_tokens, seed=7000 + 100 * round_index + i) for i in range(args.batch)]
        with bench.turn_cores(engines[label], cores):
            result = ray.get(engines[label].decode_batch.remote(prompts, args.decode, True))
        log.info("%s timed batch of %d: %.1f tok/s", label, args.batch, result["rate"])
        timed[label] = result["timed"]
    log.info("per decode step of the timed batches (us):\n%s", "\n".join(bench.parts_table(timed, per_step=True)))
    out_dir = os.environ.get("OUT", tempfile.gettempdir())
    traces = {}
    for round_index, label in enumerate(("A", "C") if args.trace_steps else ()):
        prompts = [synthetic_prompt(model, prompt_tokens, seed=7300 + 100 * round_index + i) for i in range(args.batch)]
        traces[label] = path = os.path.join(out_dir, f"batch_{label}.trace.json.gz")
        with bench.turn_cores(engines[label], cores):
            result = ray.get(engines[label].decode_batch.remote(prompts, args.decode, trace_path=path,
                                                                trace_steps=args.trace_steps))
        log.info("%s batch of %d, its last %d steps under torch's profiler: %.1f tok/s, trace in %s\n%s", label,
                 args.batch, args.trace_steps, result["rate"], path, result.get("profile_table", ""))
    if traces:
        log.info("traced steps, host against device:\n%s", trace_steps.summary(traces))
    if not args.profile_tokens:
        return
    for round_index, label in enumerate(("A", "C")):
        prompts = [synthetic_prompt(model, prompt_tokens, seed=7500 + 100 * round_index + i) for i in range(args.batch)]
        path = os.path.join(out_dir, f"batch_{label}.prof")
        with bench.turn_cores(engines[label], cores):
            result = ray.get(engines[label].decode_batch.remote(prompts, args.decode, False, path))
        log.info("%s batch of %d under cProfile: %.1f tok/s, stats in %s", label, args.batch, result["rate"], path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", type=int, default=24, help="tokens decoded after each prompt")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"A's, in turn: of {', '.join(VARIANTS)}; C: a turn of engine C")
    ap.add_argument("--profile-tokens", type=int, default=200,
                    help="tokens of the cProfiled 4k decodes (0: none; with --batch, any other: one batch of A and "
                    "of C under cProfile)")
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (a smoke check of the script, small shapes)")
    ap.add_argument("--shape", choices=("1b", "8b"), default="1b", help="the model (gpu_data_plane.py's profiles)")
    ap.add_argument("--batch", type=int, default=0,
                    help="serve batches of this many fresh prompts instead of one request")
    ap.add_argument("--trace-steps", type=int, default=0,
                    help="with --batch: one more batch of A and of C, its last this many decode steps under torch's "
                    "profiler (host and device timelines, batch_A/C.trace.json.gz in $OUT)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from ucm_ray.demo import kv_transfer_config
    from ucm_ray.tiny_model import synthetic_prompt

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --device cpu for a smoke check")
    prof = bench.ttft_profile(device, False, args.shape)
    model = bench.bench_model(prof, None)
    long = max(prof.sizes.values())
    ray.init(num_cpus=8, num_gpus=int(device.type == "cuda"), include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="WARNING",
             _temp_dir=tempfile.mkdtemp(prefix="ucmg-", dir="/tmp"), log_to_driver=False,
             namespace="ucm_ray_gpu_stall")
    # three turns' saves (older ones are evicted): an engine maps and page-locks every pool at
    # start, which took minutes for the 78 GB that keeping every turn's 8B batch would need
    per_turn = max(1, args.batch) * (long + args.decode) * prof.kv_bytes_per_token
    cfg = UcmRayConfig(num_shards=2, ray_namespace="ucm_ray_gpu_stall_tier", transport="shm",
                       pool_bytes=3 * per_turn // 2 + (64 << 20))
    kv = kv_transfer_config({"ray_namespace": cfg.ray_namespace, "lookup_timeout_s": 60, "layerwise": True})
    remote = ray.remote(num_cpus=0, num_gpus=prof.num_gpus, runtime_env={"env_vars": prof.env})(stall_engine_class())
    cores = bench.engine_cores(device)
    out_dir = os.environ.get("OUT", tempfile.gettempdir())
    try:
        with running_fleet(cfg):
            engines = {}
            for label, kv_config in (("A", kv), ("C", None)):
                started = time.perf_counter()
                engine = remote.remote(model, kv_config, cpus=cores.parked, **prof.engine)
                for seed, n in ((9999, 64), (9000, prof.sizes["4k"]), (9001, long)):
                    ray.get(engine.generate.remote(synthetic_prompt(model, n, seed=seed), 1))
                log.info("engine %s up in %.1f s", label, time.perf_counter() - started)
                engines[label] = engine
            turns = [("C", "base") if name == "C" else ("A", name) for name in args.variants.split(",")]
            order = [("C", "base"), *turns, ("C", "base"), ("A", "base")]
            for seed, (label, name) in enumerate(order, start=500):
                if label == "A":
                    ray.get(engines["A"].variant.remote(name))
                with bench.turn_cores(engines[label], cores):
                    if args.batch:
                        prompts = [synthetic_prompt(model, long, seed=1000 * seed + i) for i in range(args.batch)]
                        rate = ray.get(engines[label].decode_batch.remote(prompts, args.decode))["rate"]
                        log.info("%s %s: a batch of %d decodes %.1f tok/s", label, name, args.batch, rate)
                        continue
                    result = ray.get(engines[label].generate_timed.remote(synthetic_prompt(model, long, seed=seed),
                                                                          args.decode))
                log.info("%s", first_steps(f"{label} {name}", result))
            ray.get(engines["A"].variant.remote("base"))
            if args.batch:
                timed_batches(engines, cores, model, long, args)
            for label, engine in engines.items():
                if not args.profile_tokens or args.batch:
                    break
                path = os.path.join(out_dir, f"decode_{label}.prof")
                with bench.turn_cores(engine, cores):
                    result = ray.get(engine.generate_cprofiled.remote(
                        synthetic_prompt(model, prof.sizes["4k"], seed=777), args.profile_tokens, path))
                log.info("4k decode of %s under cProfile: %.1f tok/s, stats in %s", label, bench.decode_rate(result),
                         path)
            for engine in engines.values():
                ray.kill(engine)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
