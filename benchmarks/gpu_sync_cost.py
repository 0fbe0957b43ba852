"""What the connector's refusal of asynchronous scheduling costs (issue 43): decode without the
tier, vLLM's V1 runner, synchronous against asynchronous scheduling, in turn on one GPU.

The connector refuses vLLM's asynchronous scheduling (``compat.check_load_recovery_exact``: with
it a failed load's recompute keeps a token computed from the failed blocks), and the serve
builder turns it off. This prints the price: batches of 8 fresh 4k prompts and single 4k
requests decoding 128 tokens, on two engines without the connector that differ only in
``async_scheduling``, taken in turn (a run's drift lands on both). GPU only:
``python benchmarks/gpu_sync_cost.py``; the last line is ``sync_vs_async: batch8=<ratio>
single=<ratio>`` (decode tokens/s, synchronous over asynchronous).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from benchmarks.gpu.common import engine_actor, engine_cores, probe_start, start_engine, turn_cores  # noqa: E402
from ucm_ray.tiny_model import synthetic_prompt  # noqa: E402

log = logging.getLogger("bench.gpu")
BATCH, TOKENS, ROUNDS = 8, 128, 3


def main() -> None:
    device, prof, model = probe_start("ucm_ray_gpu_sync")
    n = prof.sizes["4k"]
    warmup = [synthetic_prompt(model, 64, seed=9999), synthetic_prompt(model, n, seed=9000)]
    cores = engine_cores(device)
    engines = {}
    for label, async_scheduling in (("sync", False), ("async", True)):
        setting = replace(prof, engine={**prof.engine, "async_scheduling": async_scheduling})
        engines[label] = start_engine(engine_actor(setting), model, setting, label, None, cores.parked, warmup)
    rates: dict[str, dict[str, list[float]]] = {shape: {"sync": [], "async": []} for shape in ("batch8", "single")}
    for r in range(ROUNDS):
        for label in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
            for shape, size in (("batch8", BATCH), ("single", 1)):
                prompts = [synthetic_prompt(model, n, seed=50000 + 1000 * r + 100 * size + i + (label == "async") * 37)
                           for i in range(size)]
                with turn_cores(engines[label], cores):
                    result = ray.get(engines[label].decode_batch.remote(prompts, TOKENS))
                rates[shape][label].append(result["rate"])
    ratios = {}
    for shape, by_label in rates.items():
        log.info("%s decode tok/s: %s", shape,
                 {label: [round(rate, 1) for rate in got] for label, got in by_label.items()})
        ratios[shape] = statistics.median(by_label["sync"]) / statistics.median(by_label["async"])
    for engine in engines.values():
        ray.kill(engine)
    ray.shutdown()
    log.info("sync_vs_async: batch8=%.3f single=%.3f", ratios["batch8"], ratios["single"])


if __name__ == "__main__":
    main()
