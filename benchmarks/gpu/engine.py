"""The benchmark's engine actor: the demo's engine with what the GPU benchmark measures besides
a request's tokens (pinning to cores, a serving engine core, batches decoded together, timed
step parts, profiles), and the diagnostics those use.

``--profile-dir DIR`` serves one more prompt per size under torch's profiler, cold on A and
store-warm on B (every thread and CUDA stream; the trace kept to our code, vLLM's engine step
and the device), and writes ``trace_cold_<size>.json.gz`` and ``trace_store_warm_<size>.json.gz``
there: where a request's step spends its time. Nothing measured here under a profiler or timer
is one of the printed figures.
"""

from __future__ import annotations

import cProfile
import gc
import glob
import gzip
import json
import os
import statistics
import time
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch

from ucm_ray.demo import Engine
from ucm_ray.testing.timing import CONNECTOR_HOOKS, Target, timed_calls

PROFILED_SOURCES = ("ucm_ray", "kv_connector", "gpu_model_runner.py", "core.py", "sched/scheduler.py")
"""Python functions kept in a profile's trace (the rest of the interpreter's calls are dropped)."""
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "ac2g", "gpu_user_annotation"}


def _device_profiler() -> Any:
    """torch's profiler over the host (every thread's ops, where this torch can) and the device."""
    from torch.profiler import ProfilerActivity, profile

    extra: dict[str, Any] = {}
    try:  # every thread's ops (the copy thread's too)
        extra["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        pass
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities, with_stack=True, **extra)


def _export_trace(prof: Any, trace_path: str) -> str:
    """The profile as a gzipped Chrome trace at ``trace_path``, kept to the device, annotations
    and our code, vLLM's engine step and scheduler (``PROFILED_SOURCES``); its table of ops."""
    raw = trace_path + ".raw.json"
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    os.unlink(raw)
    kept = [e for e in trace.get("traceEvents", []) if e.get("ph") == "M" or e.get("cat") in DEVICE_CATEGORIES
            or e.get("cat") == "user_annotation"
            or (e.get("cat") == "python_function" and any(s in e.get("name", "") for s in PROFILED_SOURCES))]
    with gzip.open(trace_path, "wt") as f:
        json.dump({"traceEvents": kept}, f)
    table: str = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
    return table


def inner_parts(scheduler: Any, worker: Any) -> list[Target]:
    """Our code inside the hooks, timed too (``generate_timed``): where a lookup's and a load's
    host time goes. Class attributes are patched on the class (every instance), and put back."""
    if scheduler is None and worker is None:
        return []
    from ucm_ray.store.engine.acquire import Acquire
    from ucm_ray.transport import gather, shm

    out: list[Target] = [
        (gather.GatherPlan, ("__init__", "move"), "in.gather"),
        (shm._CudaCopies, ("__init__", "post", "post_each", "post_whole"), "in.shm_copies"),
        (Acquire, ("__init__", "poll", "result"), "in.acquire"),
    ]
    if scheduler is not None:
        from ucm_ray.vllm.scheduler.request import TrackedRequest

        part = scheduler.scheduler_part
        out.append((part.lookups, ("_post", "_first_block_absent", "_hit_tokens", "_answered"), "in.scheduler"))
        out.append((TrackedRequest, ("attn_keys",), "in.scheduler"))
        out.append((part.saves, ("expect", "_plan_saves"), "in.scheduler"))
        out.append((part.saves.jobs, ("bind", "dispatch"), "in.scheduler"))
        out.append((part.results, ("take", "collect"), "in.scheduler"))
        out.append((part.slots, ("tick", "expect"), "in.slots"))
    if worker is not None:
        from ucm_ray.vllm.worker import loads
        from ucm_ray.vllm.worker.plan import KvCaches

        part = worker.worker_part
        out.append((part, ("fence",), "in.worker"))
        out.append((loads, ("plan_loads",), "in.plan"))
        out.append((KvCaches, ("ranges", "repeated_ranges"), "in.plan"))
        out.append((part._loads, ("start", "_finish", "_land", "_validate_unpinned"), "in.loads"))
        out.append((part._copies, ("post_by_pool", "prepare_parts", "post_through", "_post_parts", "count_bytes",
                                   "compute_ready", "order_compute"),
                    "in.copies"))
        out.append((part._saves, ("_job", "_post_ordered", "poll"), "in.saves"))
        out.append((part._pools, ("prepare", "post_part"), "in.pools"))
    return out


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by each thread of this process, by name (threads of one name
    summed; Linux only, else empty): which threads besides the engine's keep a core busy."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def own_processes() -> list[int]:
    """This process and its children (a serving engine core's), by pid."""
    import psutil

    return [os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))]


class ProfiledEngine(Engine):
    """The demo's engine with one more set of methods: requests served under torch's profiler,
    cProfile or per-part timers, batches decoded together, its threads pinned to given cores (a
    diagnostic of where a request's time goes; the figures come from the untimed requests)."""

    def __init__(self, model_dir: str, kv: dict[str, Any] | None, cpus: list[int] | None = None,
                 serving: bool = False, **engine_kwargs: Any) -> None:
        """``cpus``: the cores this engine's threads may run on, set before vLLM starts any
        (each engine its own, near the GPU): one engine's host time is not another's.
        ``serving``: vLLM's engine core (scheduler and worker) in a process of its own, as
        ``vllm serve`` and Ray Serve run it, not in this one: requests are then added and
        outputs detokenized here while the engine core steps on (the step parts cannot be
        timed, nor the connector's counters read, from here)."""
        if cpus:
            os.sched_setaffinity(0, cpus)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if serving else "0"
        self.serving = serving
        super().__init__(model_dir, kv, **engine_kwargs)
        self.batches = 0  # ``decode_batch`` calls so far: its request ids

    def scheduling(self) -> str:
        """How vLLM runs this engine's steps (what its decode rate depends on)."""
        config = self.llm.llm_engine.vllm_config
        return (f"engine core {'in a process of its own' if self.serving else 'in-process'}, "
                f"async scheduling {config.scheduler_config.async_scheduling}")

    def _flush(self) -> None:
        if not self.serving:  # a serving engine core steps on by itself while it has requests
            super()._flush()

    def close(self) -> list[str]:
        """Stop a serving engine core's processes; the shared-memory files they had mapped
        (vLLM's queues in /dev/shm), for the caller to remove those still there once this
        actor is gone: killed, the actor left them all; shut down first, one per engine."""
        mapped: set[str] = set()
        for pid in own_processes()[1:]:
            try:
                with open(f"/proc/{pid}/maps") as maps:
                    mapped |= {line.split()[-1] for line in maps if "/dev/shm/psm_" in line}
            except OSError:
                continue  # a child that ended meanwhile
        self.llm.llm_engine.engine_core.shutdown()
        return sorted(mapped)

    def affinity(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    def pin(self, cpus: list[int]) -> None:
        """Every thread of this process and of its children (a serving engine core's)
        onto ``cpus`` (threads started later inherit it)."""
        for pid in own_processes():
            try:
                threads = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue  # a child that ended meanwhile
            for tid in threads:
                try:
                    os.sched_setaffinity(int(tid), cpus)
                except OSError:
                    pass  # a thread that ended meanwhile

    def generate_profiled(self, prompt_ids: list[int], max_tokens: int, trace_path: str) -> dict[str, Any]:
        with _device_profiler() as prof:
            result = self.generate(prompt_ids, max_tokens)
        result["profile_table"] = _export_trace(prof, trace_path)
        return result

    def _add_batch(self, prompts: list[list[int]], max_tokens: int) -> dict[str, int]:
        """``prompts`` added as requests of the next batch: each request id's row."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.batches += 1
        rows: dict[str, int] = {}
        for row, prompt_ids in enumerate(prompts):
            req_id = f"decode-batch-{self.batches}-{row}"
            added = self.llm.llm_engine.add_request(req_id, {"prompt_token_ids": prompt_ids}, params)
            rows[req_id] = rows[added if isinstance(added, str) else req_id] = row  # some versions add a suffix
        return rows

    def _time_decode_steps(self, timers: ExitStack, timed: bool, stats_path: str | None) -> dict[str, list[float]]:
        """From here on (every prompt has its first token): the step parts timed (``timed``), and
        the engine's thread under cProfile, its stats dumped to ``stats_path`` when ``timers`` close."""
        parts = timers.enter_context(timed_calls(self._timed_targets())) if timed else {}
        if stats_path:
            profiler = cProfile.Profile()
            profiler.enable()
            timers.callback(profiler.dump_stats, stats_path)
            timers.callback(profiler.disable)
        return parts

    def decode_batch(self, prompts: list[list[int]], max_tokens: int, timed: bool = False,
                     stats_path: str | None = None, trace_path: str | None = None,
                     trace_steps: int = 32) -> dict[str, Any]:
        """``prompts`` served together, ``max_tokens`` tokens each (EOS ignored), as a serving
        engine decodes a batch: ``rate``, the tokens per second of the steps after every
        prompt's first token (on an engine with the connector the prompts' saves run in
        them), and each request's ``tokens``, in prompt order. The steps after the first
        tokens are measured too (their cost is in ``rate``): ``timed``, their parts timed as
        in ``generate_timed`` (``result["timed"]``); ``stats_path``, under cProfile (the
        engine's thread), its stats dumped there; ``trace_path``, the last ``trace_steps``
        decode steps under torch's profiler (host and device timelines, as
        ``generate_profiled`` keeps them; ``result["profile_table"]``): whether a step's
        extra time is the host's or the device's."""
        engine = self.llm.llm_engine
        rows = self._add_batch(prompts, max_tokens)
        tokens: list[list[int]] = [[] for _ in prompts]
        started, at_start = 0.0, 0
        step_ends: list[float] = []  # after each step from the first tokens on (``step_s``)
        parts: dict[str, list[float]] = {}
        traced = None
        with ExitStack() as timers:
            while engine.has_unfinished_requests():
                if trace_path and traced is None and started and min(map(len, tokens)) >= max_tokens - trace_steps:
                    traced = timers.enter_context(_device_profiler())
                for out in engine.step():
                    tokens[rows[out.request_id]] = list(out.outputs[0].token_ids)
                if started:
                    step_ends.append(time.perf_counter())
                if not started and all(tokens):
                    started, at_start = time.perf_counter(), sum(map(len, tokens))
                    parts = self._time_decode_steps(timers, timed, stats_path)
            rate = (sum(map(len, tokens)) - at_start) / (time.perf_counter() - started)
        self._flush()
        result = {"tokens": tokens, "rate": rate, "timed": parts,
                  "step_s": np.diff([started, *step_ends]).tolist()}
        if traced is not None and trace_path:
            result["profile_table"] = _export_trace(traced, trace_path)
        return result

    def _timed_targets(self) -> list[Target]:
        """The engine's step parts and every connector hook (either half), and our code
        inside the hooks (``inner_parts``)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        engine = self.llm.llm_engine
        core = engine.engine_core.engine_core
        worker = get_kv_transfer_group() if has_kv_transfer_group() else None
        return [
            (engine, ("step",), "vllm.engine"), (core, ("step_fn",), "vllm.core"),
            (core.scheduler, ("schedule", "update_from_output"), "vllm.scheduler"),
            (core.model_executor, ("execute_model", "sample_tokens"), "vllm.executor"),
            (engine.output_processor, ("process_outputs",), "vllm.output"),
            (engine.logger_manager, ("record",), "vllm.stat_loggers"),
            *inner_parts(core.scheduler.connector, worker),
            (core.scheduler.connector, CONNECTOR_HOOKS, "ours.scheduler"), (worker, CONNECTOR_HOOKS, "ours.worker")]

    def generate_timed(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        """A request served (up to its last token) with the engine's step parts and every
        connector hook timed (``perf_counter`` around each, no profiler), and Python's
        garbage collections: ``result["timed"]`` maps a part (``vllm.*``, ``ours.*``,
        ``gc.*``) to the seconds of each call; ``vllm.engine.step`` has one per step.
        Which parts an engine with the connector spends more host time in."""
        collections: dict[str, list[float]] = {}
        collecting: dict[str, float] = {}

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                collecting["at"] = time.perf_counter()
            elif "at" in collecting:
                took = time.perf_counter() - collecting.pop("at")
                collections.setdefault(f"gc.gen{info['generation']}", []).append(took)

        gc.callbacks.append(on_gc)
        threads_before = thread_cpu_seconds()
        try:
            with timed_calls(self._timed_targets()) as timed:
                result = self.generate(prompt_ids, max_tokens, ignore_eos=True, flush=False)
            threads_after = thread_cpu_seconds()
        finally:
            gc.callbacks.remove(on_gc)
        self._flush()  # untimed: the steps after the request's last token
        result["timed"] = {**timed, **collections}
        result["thread_cpu_s"] = {name: seconds - threads_before.get(name, 0.0)
                                  for name, seconds in threads_after.items()}
        return result

    def launch_probe(self, repeat: int = 2000) -> dict[str, float]:
        """Host time of a tiny kernel launch and of a small pinned host-to-device copy in
        this process (microseconds, median of ``repeat``): whether the process state the
        connector adds (mapped pools, streams, events) makes every launch of vLLM's dearer."""
        if not torch.cuda.is_available():
            return {}
        small = torch.zeros(16, device="cuda")
        host = torch.zeros(1024, pin_memory=True)
        target = torch.empty(1024, device="cuda")
        out: dict[str, float] = {}
        for name, launch in (("launch_us", lambda: small.add_(1)),
                             ("h2d_copy_us", lambda: target.copy_(host, non_blocking=True))):
            times = []
            for _ in range(repeat):
                started = time.perf_counter()
                launch()
                times.append(time.perf_counter() - started)
            torch.cuda.synchronize()
            out[name] = 1e6 * statistics.median(times)
        return out

    def generate_cprofiled(self, prompt_ids: list[int], max_tokens: int, stats_path: str) -> dict[str, Any]:
        """A request (a decode, or a cold one with ``max_tokens=1``) under cProfile (the engine
        loop's own thread), its stats dumped to ``stats_path``: which host work per step an
        engine with the connector adds."""
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            return self.generate(prompt_ids, max_tokens, ignore_eos=True)
        finally:
            profiler.disable()
            profiler.dump_stats(stats_path)
