"""Issue 43's batch-decode gap: which threads of an engine's process spend CPU while it decodes.

Engines A (the connector) and C (none), the 1B model of ``--ttft``, batches of 8 fresh 4k prompts
decoded together (their prompts' saves run in the decode steps on A), taken in turn. Around each
batch it reads every thread's CPU time in the engine's process (Python threads by name, the
others by their kernel name) and prints each thread's CPU seconds beside the batch's wall time,
and the step times; then the same with ``sys.setswitchinterval(SWITCH_S)`` in both processes.
The hypothesis it tests: the engine thread waits for the GIL while another Python thread of ours
(the poster's Ray calls) holds it. GPU only; run ``python benchmarks/gpu_thread_cpu.py``.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from benchmarks.gpu.common import (  # noqa: E402
    connector_config,
    engine_actor,
    engine_cores,
    probe_start,
    start_engine,
    turn_cores,
)
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.shard.fleet import running_fleet  # noqa: E402
from ucm_ray.tiny_model import synthetic_prompt  # noqa: E402

log = logging.getLogger("bench.gpu")
BATCH, TOKENS, ROUNDS = 8, 128, 2
SWITCH_S = 0.0005


def thread_cpu(_actor: Any) -> dict[str, float]:
    """CPU seconds of every thread of this process: Python threads by name (nanoseconds), the
    others summed by kernel name (clock ticks). Runs inside the engine actor."""
    import threading
    import time

    out: dict[str, float] = {}
    python_tids = set()
    for thread in threading.enumerate():
        if thread.ident is None or thread.native_id is None:
            continue
        python_tids.add(thread.native_id)
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ProcessLookupError):
            continue
        out[f"py:{thread.name}"] = out.get(f"py:{thread.name}", 0.0) + seconds
    ticks = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in python_tids:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat_file:
                stat = stat_file.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"os:{name}"] = out.get(f"os:{name}", 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def set_switch(_actor: Any, seconds: float) -> float:
    import sys as actor_sys

    actor_sys.setswitchinterval(seconds)
    return actor_sys.getswitchinterval()


def measured_batch(engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    before = ray.get(engine.__ray_call__.remote(thread_cpu))
    result = ray.get(engine.decode_batch.remote(prompts, TOKENS))
    after = ray.get(engine.__ray_call__.remote(thread_cpu))
    used = {name: after[name] - before.get(name, 0.0) for name in after}
    wall = sum(result["step_s"])
    return {"rate": result["rate"], "wall": wall, "step_s": result["step_s"],
            "cpu": {name: s for name, s in sorted(used.items(), key=lambda kv: -kv[1]) if s >= 0.005}}


def report(label: str, runs: list[dict[str, Any]]) -> None:
    for i, run in enumerate(runs):
        steps = [1e3 * s for s in run["step_s"]]
        log.info("%s #%d rate %.1f tok/s, decode wall %.3f s, steps ms mean %.2f median %.2f max %.2f "
                 "(0-8 %.2f, 8-24 %.2f, 24- %.2f)", label, i, run["rate"], run["wall"], statistics.mean(steps),
                 statistics.median(steps), max(steps), statistics.mean(steps[:8]), statistics.mean(steps[8:24]),
                 statistics.mean(steps[24:]))
        log.info("%s #%d thread CPU s over the whole batch: %s", label, i,
                 ", ".join(f"{name} {s:.3f}" for name, s in run["cpu"].items()))


def main() -> None:
    device, prof, model = probe_start("ucm_ray_gpu_cpu")
    n = prof.sizes["4k"]
    batches = [[synthetic_prompt(model, n, seed=40000 + 100 * r + i) for i in range(BATCH)] for r in range(2 * ROUNDS)]
    warmup = [synthetic_prompt(model, 64, seed=9999), synthetic_prompt(model, n, seed=9000)]
    tokens = (2 + BATCH * 2 * ROUNDS) * (n + TOKENS)
    cfg = UcmRayConfig(num_shards=2, ray_namespace="ucm_ray_gpu_cpu_fleet", transport="shm",
                       pool_bytes=int(tokens * prof.kv_bytes_per_token * 1.5) // 2 + (64 << 20))
    cores = engine_cores(device)
    remote = engine_actor(prof)
    with running_fleet(cfg):
        pair = {"A": start_engine(remote, model, prof, "A", connector_config(cfg), cores.parked, warmup),
                "C": start_engine(remote, model, prof, "C", None, cores.parked, warmup)}
        for phase, switch in (("default", None), ("switch", SWITCH_S)):
            if switch is not None:
                log.info("switch interval now %s", [ray.get(e.__ray_call__.remote(set_switch, switch))
                                                    for e in pair.values()])
            runs: dict[str, list[dict[str, Any]]] = {"A": [], "C": []}
            offset = 0 if switch is None else ROUNDS
            for r in range(ROUNDS):
                for label in (("A", "C") if r % 2 == 0 else ("C", "A")):
                    with turn_cores(pair[label], cores):
                        runs[label].append(measured_batch(pair[label], batches[offset + r]))
            for label, label_runs in runs.items():
                report(f"{phase} {label}", label_runs)
            rate = {label: statistics.mean(run["rate"] for run in label_runs) for label, label_runs in runs.items()}
            log.info("%s: batch decode rate A/C %.3f (A %.1f, C %.1f tok/s)", phase, rate["A"] / rate["C"],
                     rate["A"], rate["C"])
        for engine in pair.values():
            ray.kill(engine)
    ray.shutdown()


if __name__ == "__main__":
    main()
