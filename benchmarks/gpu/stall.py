"""Diagnostic (GPU): what slows an engine's first decode steps after a long prompt's save.

With the connector, an engine's first decode steps after a 16k-token prompt took several times
as long as without it (``--step-timing``, vLLM 0.26; the figures are in docs/performance-log.md),
while our hooks' host time in those steps and the save's own transfer were far shorter. This
script serves fresh 16k-token prompts on one engine with the connector (A) and one without
(C), each followed by ``--decode`` tokens, and switches one suspect at a time on A between
requests:

- ``base``: as shipped;
- ``switch``: Python's thread switch interval 0.2 ms instead of 5 ms (another thread of ours
  holding the GIL: the commit's call poster, the copy thread);
- ``no-saves``: the scheduler plans no save (nothing is copied or committed): whether the
  stall comes from saving at all;
- ``kernels``: every save part by gather kernels instead of staged DMA (the copy engines: a
  sampled token's device-to-host copy queued behind the save's);
- ``sync``: the host waits for the device right after posting a save (the stall moved to one
  known place, or gone if it came from overlap);
- ``hollow``: every hook of the connector (both halves) answers at once with "nothing" (no
  lookup, no save, no work bound): what is left of A's gap to C is the tier's presence in the
  process (its threads, mapped pools, the hooks' calls), not the hooks' work;
- ``unmapped``: ``hollow``, and the worker's shard pools and their indexes closed too (unmapped,
  no longer page-locked; opened again when the variant ends): what the pools' presence costs.

``N`` among the variants adds engine N (the NullConnector, ``ucm_ray.testing.null_connector``)
and a turn of it there: what vLLM's own connector plumbing costs an engine with no tier, the
yardstick issue 43's decode target is set against.

Per request it logs the decode steps' spread (the first 8 steps' sum is the figure) and each
engine part's, our hooks' time in the first 8 steps, and then a 4k decode of A and C under
cProfile (stats in ``$OUT`` or /tmp). ``--batch N`` serves batches of N fresh prompts instead
(``decode_batch``: rates, then one batch of A and of C with their step parts timed, and one
under cProfile unless ``--profile-tokens 0``; ``--trace-steps K``: one more of each with its
last K decode steps under torch's profiler, host and device timelines in ``$OUT``), ``--shape
8b`` on Llama-3.1-8B's layers (dummy weights, 4k prompts). Nothing here is a benchmark figure;
the variants patch one engine's objects in place and are undone before the next.

What each run found is in docs/performance-log.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

import ray
import torch

from benchmarks.gpu import trace_steps
from benchmarks.gpu.common import (
    EngineCores,
    TtftProfile,
    bench_model,
    connector_config,
    decode_rate,
    engine_actor,
    engine_cores,
    ttft_of,
    ttft_profile,
    turn_cores,
)
from benchmarks.gpu.engine import ProfiledEngine
from benchmarks.gpu.step_timing import parts_table, step_spread
from benchmarks.measure import local_ray
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.shard.fleet import running_fleet

log = logging.getLogger("bench.stall")

VARIANTS = ("base", "switch", "no-saves", "kernels", "sync", "hollow", "unmapped")
PARTS = ("vllm.engine.step", "vllm.executor.execute_model", "vllm.executor.sample_tokens", "vllm.scheduler.schedule",
         "vllm.scheduler.update_from_output", "vllm.output.process_outputs")


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _quiet_step(*args: Any, **kwargs: Any) -> Any:
    from ucm_ray.vllm.metadata import QUIET_STEP

    return QUIET_STEP


HOLLOW_SCHEDULER = {
    "get_num_new_matched_tokens": lambda request, computed: (0, False),
    "update_state_after_alloc": _nothing,
    "build_connector_meta": _quiet_step,
    "update_connector_output": _nothing,
    "request_finished": lambda request, block_ids: (False, None),
    "request_finished_all_groups": lambda request, block_ids: (False, None),
    "get_kv_connector_stats": _nothing,
    "take_events": lambda: (),
}
"""The ``hollow`` variant's scheduler hooks: each answers "nothing" at once."""
HOLLOW_WORKER = {
    "bind_connector_metadata": _nothing,
    "clear_connector_metadata": _nothing,
    "handle_preemptions": _nothing,
    "start_load_kv": _nothing,
    "wait_for_layer_load": _nothing,
    "save_kv_layer": _nothing,
    "wait_for_save": _nothing,
    "get_finished": lambda finished: (None, None),
    "get_block_ids_with_load_errors": lambda: set(),
    "build_connector_worker_meta": _nothing,
    "get_kv_connector_stats": _nothing,
    "get_kv_connector_kv_cache_events": _nothing,
}
"""... and its worker hooks."""


class StallEngine(ProfiledEngine):
    """The GPU benchmark's engine with ``variant(name)``: one suspect switched on (``base``
    switches every one off)."""

    def variant(self, name: str) -> str:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from ucm_ray.transport import gather

        scheduler_connector = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        worker_connector = get_kv_transfer_group()
        scheduler_saves = scheduler_connector.scheduler_part.saves
        worker_saves = worker_connector.worker_part._saves
        self._pools_closed(worker_connector.worker_part, name == "unmapped")
        for connector, hooks in ((scheduler_connector, HOLLOW_SCHEDULER), (worker_connector, HOLLOW_WORKER)):
            for hook, answer in hooks.items():
                if name in ("hollow", "unmapped"):
                    setattr(connector, hook, answer)
                else:
                    connector.__dict__.pop(hook, None)
        sys.setswitchinterval(0.0002 if name == "switch" else 0.005)
        scheduler_saves.__dict__.pop("_plan_saves", None)
        worker_saves.__dict__.pop("_job", None)
        gather.DMA_COPY_BYTES = (1 << 62) if name == "kernels" else (1 << 20)
        if name == "no-saves":
            scheduler_saves._plan_saves = lambda tracked: None
        elif name == "sync":
            job = type(worker_saves)._job

            def post_and_wait(saves: Any, deadline: float, **later: Any) -> Any:
                posted = job(worker_saves, saves, deadline)  # at once, not after the forward
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                return posted

            worker_saves._job = post_and_wait
        return name


    def _pools_closed(self, worker: Any, closed: bool) -> None:
        """The worker's pools closed (their descriptors kept to open them again), or open. Saves
        still copying land first, as the worker's ``bind`` lands them before it changes pools: no
        copy may use a mapping that closes (the turn before may leave a save job in flight, and
        ``hollow``'s hooks never land it)."""
        if closed and not hasattr(self, "_closed_pools"):
            self._closed_pools = dict(worker._pools._descriptors)
            worker._saves.land_all()
            worker._adopt_pools({})
        elif not closed and hasattr(self, "_closed_pools"):
            worker._adopt_pools(self.__dict__.pop("_closed_pools"))
            worker._copies.open_pools()


def first_steps(label: str, result: dict[str, Any]) -> str:
    timed = result["timed"]
    rows = [f"{label}: TTFT {ttft_of(result) * 1e3:.1f} ms"]
    rows += [f"   {part}: {step_spread(timed.get(part, [])[1:])}" for part in PARTS]
    ours = {name: 1e3 * sum(calls[1:9]) for name, calls in timed.items() if name.startswith(("ours.", "in.", "gc."))}
    rows.append("   ours in decode steps 1-8 (ms): " + ", ".join(
        f"{name} {ms:.2f}" for name, ms in sorted(ours.items(), key=lambda kv: -kv[1])[:12] if ms > 0))
    return "\n".join(rows)


def out_dir() -> str:
    """Where profiles and traces go: ``$OUT`` (a device call's results) or the temporary folder."""
    return os.environ.get("OUT", tempfile.gettempdir())


def batch_prompts(model: str, prompt_tokens: int, first_seed: int, size: int) -> list[list[int]]:
    from ucm_ray.tiny_model import synthetic_prompt

    return [synthetic_prompt(model, prompt_tokens, seed=first_seed + i) for i in range(size)]


def timed_batches(engines: dict[str, Any], cores: EngineCores, model: str, prompt_tokens: int,
                  args: argparse.Namespace) -> None:
    """One more batch on A (as shipped) and on C with every step part and hook timed: per
    decode step, where A's extra time goes (our hooks' host time, or vLLM's parts waiting on
    the device longer)."""
    timed = {}
    for round_index, label in enumerate(("A", "C")):
        prompts = batch_prompts(model, prompt_tokens, 7000 + 100 * round_index, args.batch)
        with turn_cores(engines[label], cores):
            result = ray.get(engines[label].decode_batch.remote(prompts, args.decode, True))
        log.info("%s timed batch of %d: %.1f tok/s", label, args.batch, result["rate"])
        timed[label] = result["timed"]
    log.info("per decode step of the timed batches (us):\n%s", "\n".join(parts_table(timed, per_step=True)))
    if args.trace_steps:
        traced_batches(engines, cores, model, prompt_tokens, args)
    if args.profile_tokens:
        cprofiled_batches(engines, cores, model, prompt_tokens, args)


def traced_batches(engines: dict[str, Any], cores: EngineCores, model: str, prompt_tokens: int,
                   args: argparse.Namespace) -> None:
    """One more batch of A and of C, its last ``--trace-steps`` decode steps under torch's
    profiler, and the traces summarized per step (``trace_steps``)."""
    traces = {}
    for round_index, label in enumerate(("A", "C")):
        prompts = batch_prompts(model, prompt_tokens, 7300 + 100 * round_index, args.batch)
        traces[label] = path = os.path.join(out_dir(), f"batch_{label}.trace.json.gz")
        with turn_cores(engines[label], cores):
            result = ray.get(engines[label].decode_batch.remote(prompts, args.decode, trace_path=path,
                                                                trace_steps=args.trace_steps))
        log.info("%s batch of %d, its last %d steps under torch's profiler: %.1f tok/s, trace in %s\n%s", label,
                 args.batch, args.trace_steps, result["rate"], path, result.get("profile_table", ""))
    log.info("traced steps, host against device:\n%s", trace_steps.summary(traces))


def cprofiled_batches(engines: dict[str, Any], cores: EngineCores, model: str, prompt_tokens: int,
                      args: argparse.Namespace) -> None:
    for round_index, label in enumerate(("A", "C")):
        prompts = batch_prompts(model, prompt_tokens, 7500 + 100 * round_index, args.batch)
        path = os.path.join(out_dir(), f"batch_{label}.prof")
        with turn_cores(engines[label], cores):
            result = ray.get(engines[label].decode_batch.remote(prompts, args.decode, False, path))
        log.info("%s batch of %d under cProfile: %.1f tok/s, stats in %s", label, args.batch, result["rate"], path)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--decode", type=int, default=24, help="tokens decoded after each prompt")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"A's, in turn: of {', '.join(VARIANTS)}; C: a turn of engine C; N: a turn of "
                    "engine N (the NullConnector: vLLM's connector plumbing alone), started only if named")
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
    ap.add_argument("--async-scheduling", action="store_true",
                    help="both engines schedule asynchronously (vLLM 0.26's default on GPUs)")
    return ap


def start_engines(remote: Any, model: str, prof: TtftProfile, kv: dict[str, Any],
                  cores: EngineCores, *, null: bool) -> dict[str, Any]:
    """A (the connector), C (none) and, with ``null``, N (the NullConnector: what vLLM's
    connector plumbing costs without any tier), each up once it served a short prompt and one
    of each size it is measured with."""
    from ucm_ray.testing.null_connector import null_kv_transfer_config
    from ucm_ray.tiny_model import synthetic_prompt

    long = max(prof.sizes.values())
    engines = {}
    configs: list[tuple[str, dict[str, Any] | None]] = [("A", kv), ("C", None)]
    if null:
        configs.append(("N", null_kv_transfer_config()))
    for label, kv_config in configs:
        started = time.perf_counter()
        engine = remote.remote(model, kv_config, cpus=cores.parked, **prof.engine)
        for seed, n in ((9999, 64), (9000, prof.sizes["4k"]), (9001, long)):
            ray.get(engine.generate.remote(synthetic_prompt(model, n, seed=seed), 1))
        log.info("engine %s up in %.1f s", label, time.perf_counter() - started)
        engines[label] = engine
    return engines


def run_turns(engines: dict[str, Any], cores: EngineCores, model: str, long: int, args: argparse.Namespace) -> None:
    """C, then A in each variant asked for (``C``: a turn of C), then C and A as shipped again:
    a long prompt each (or a batch of them), its first decode steps logged."""
    from ucm_ray.tiny_model import synthetic_prompt

    turns = [(name, "base") if name in ("C", "N") else ("A", name) for name in args.variants.split(",")]
    order = [("C", "base"), *turns, ("C", "base"), ("A", "base")]
    for seed, (label, name) in enumerate(order, start=500):
        if label == "A":
            ray.get(engines["A"].variant.remote(name))
        with turn_cores(engines[label], cores):
            if args.batch:
                prompts = batch_prompts(model, long, 1000 * seed, args.batch)
                rate = ray.get(engines[label].decode_batch.remote(prompts, args.decode))["rate"]
                log.info("%s %s: a batch of %d decodes %.1f tok/s", label, name, args.batch, rate)
                continue
            result = ray.get(engines[label].generate_timed.remote(synthetic_prompt(model, long, seed=seed),
                                                                  args.decode))
        log.info("%s", first_steps(f"{label} {name}", result))
    ray.get(engines["A"].variant.remote("base"))


def cprofiled_decodes(engines: dict[str, Any], cores: EngineCores, model: str, prof: TtftProfile,
                      profile_tokens: int) -> None:
    """A 4k decode of each engine under cProfile."""
    from ucm_ray.tiny_model import synthetic_prompt

    for label, engine in engines.items():
        path = os.path.join(out_dir(), f"decode_{label}.prof")
        with turn_cores(engine, cores):
            result = ray.get(engine.generate_cprofiled.remote(
                synthetic_prompt(model, prof.sizes["4k"], seed=777), profile_tokens, path))
        log.info("4k decode of %s under cProfile: %.1f tok/s, stats in %s", label, decode_rate(result), path)


def main() -> None:
    args = parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --device cpu for a smoke check")
    prof = ttft_profile(device, False, args.shape)
    if args.async_scheduling:
        prof = replace(prof, engine={**prof.engine, "async_scheduling": True})
    model = bench_model(prof, None)
    long = max(prof.sizes.values())
    local_ray("ucmg-", num_cpus=8, num_gpus=int(device.type == "cuda"),
              logging_level="WARNING", log_to_driver=False, namespace="ucm_ray_gpu_stall")
    # three turns' saves (older ones are evicted): an engine maps and page-locks every pool at
    # start, which took minutes for what keeping every turn's 8B batch would need
    per_turn = max(1, args.batch) * (long + args.decode) * prof.kv_bytes_per_token
    cfg = UcmRayConfig(num_shards=2, ray_namespace="ucm_ray_gpu_stall_tier", transport="shm",
                       pool_bytes=3 * per_turn // 2 + (64 << 20))
    remote = engine_actor(prof, StallEngine)
    cores = engine_cores(device)
    try:
        with running_fleet(cfg):
            engines = start_engines(remote, model, prof, connector_config(cfg), cores,
                                    null="N" in args.variants.split(","))
            run_turns(engines, cores, model, long, args)
            if args.batch:
                timed_batches(engines, cores, model, long, args)
            elif args.profile_tokens:
                cprofiled_decodes(engines, cores, model, prof, args.profile_tokens)
            for engine in engines.values():
                ray.kill(engine)
    finally:
        ray.shutdown()
