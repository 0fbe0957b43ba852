"""TTFT benchmark: the same workload with no connector, vLLM's ExampleConnector, and ucm-ray.

Engine A (its own process) serves each 4k-token prompt cold; a fresh engine B
(another process, empty local cache) then serves the same prompt, so B's TTFT
is what a second node sees. Prints TTFT p50 per system and the ratios, then
``ttft_warm_vs_cold=<ucm-ray B / no-connector B>`` and
``ttft_ucm_vs_example=<ucm-ray B / ExampleConnector B>`` as the last lines.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile

import ray

from ucm_ray.config import UcmRayConfig
from ucm_ray.demo import ENGINE_ENV, Engine, kv_transfer_config
from ucm_ray.store.fleet import running_fleet
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

log = logging.getLogger("bench.ttft")


def run_system(name: str, model: str, kv: dict | None, prompts: list[list[int]]) -> dict[str, float]:
    remote = ray.remote(num_cpus=0, runtime_env={"env_vars": ENGINE_ENV})(Engine)
    log.info("%s: loading engine A", name)
    a = remote.remote(model, kv)
    cold = [ray.get(a.generate.remote(p, 1))["seconds"] for p in prompts]
    ray.kill(a)
    log.info("%s: loading engine B", name)
    b = remote.remote(model, kv)
    warm = [ray.get(b.generate.remote(p, 1))["seconds"] for p in prompts]
    ray.kill(b)
    return {"cold_p50": statistics.median(cold), "warm_p50": statistics.median(warm)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for k, v in {**ENGINE_ENV, "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    model = str(make_tiny_model(os.path.join(".models", "tiny")))
    prompts = [synthetic_prompt(model, args.tokens, seed=1000 + i) for i in range(args.prompts)]
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             _temp_dir=tempfile.mkdtemp(prefix="ucmt-", dir="/tmp"), log_to_driver=False)
    cfg = UcmRayConfig(num_shards=2, pool_bytes=512 << 20, ray_namespace="ucm_ray_ttft")
    try:
        with running_fleet(cfg), tempfile.TemporaryDirectory(prefix="example-connector-") as shared:
            results = {
                "none": run_system("none", model, None, prompts),
                "example": run_system("example", model, {
                    "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": shared}}, prompts),
                "ucm-ray": run_system("ucm-ray", model, kv_transfer_config({"ray_namespace": cfg.ray_namespace}),
                                      prompts),
            }
    finally:
        ray.shutdown()
    print(f"\n{'system':>10} {'A cold p50 ms':>14} {'B p50 ms':>10} {'B / A':>7}")
    for name, r in results.items():
        print(f"{name:>10} {r['cold_p50'] * 1e3:>14.1f} {r['warm_p50'] * 1e3:>10.1f} "
              f"{r['warm_p50'] / r['cold_p50']:>7.3f}")
    print(f"ttft_warm_vs_cold={results['ucm-ray']['warm_p50'] / results['none']['warm_p50']:.3f}")
    print(f"ttft_ucm_vs_example={results['ucm-ray']['warm_p50'] / results['example']['warm_p50']:.3f}")


if __name__ == "__main__":
    main()
