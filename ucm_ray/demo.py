"""The main job on an embedded default: two vLLM engines sharing one shard fleet.

A local Ray cluster, a 2-shard fleet, the tiny local model (built if missing),
and three engines in their own processes. Engine A serves each document
cold; engine B then gets the same document with another question and serves
its prefix warm from the store; a reference engine without the connector
serves B's prompt too, and B's tokens must equal the reference's (the promise:
turning the tier on never changes an output). Prints, per request, cold and
warm time-to-first-token (vLLM's own measure), the external hit and the bytes
moved, then ``demo: outputs_identical=<bool> warm_ttft_vs_cold=<ratio> hit_tokens=<n>``.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("ucm_ray.demo")

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # scheduler + worker in the engine's process: fast start
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
}


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """What a user passes as vLLM's ``--kv-transfer-config`` to turn the tier on."""
    return {"kv_connector": "UcmRayConnector", "kv_connector_module_path": "ucm_ray.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


class Engine:
    """One vLLM engine (CPU) with or without the connector; run it as a Ray actor."""

    def __init__(self, model_dir: str, kv: dict[str, Any] | None, dtype: str = "float32",
                 **engine_kwargs: Any) -> None:
        """``engine_kwargs`` go to ``vllm.LLM`` on top of the defaults below (e.g. a hybrid
        model's ``mamba_cache_mode="align"``, another ``block_size``)."""
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kwargs: dict[str, Any] = dict(model=model_dir, enforce_eager=True, block_size=128, dtype=dtype,
                                      max_model_len=8192, max_num_batched_tokens=8192, seed=0,
                                      enable_prefix_caching=True, disable_log_stats=False)
        kwargs.update(engine_kwargs)
        if kv is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
        self.llm = LLM(**kwargs)

    def generate(self, prompt_ids: list[int], max_tokens: int = 8, logprobs: bool = False,
                 ignore_eos: bool = False, flush: bool = True) -> dict[str, Any]:
        """Greedy tokens; with ``logprobs`` also each sampled token's logprob (a finer check than
        the tokens: a slightly wrong state or KV block often leaves the argmax unchanged);
        ``ignore_eos``: all ``max_tokens`` (a decode benchmark's random model may stop early);
        ``flush=False``: return at the last token, the request's saves left to later steps."""
        from vllm import SamplingParams

        t = time.perf_counter()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0 if logprobs else None,
                                ignore_eos=ignore_eos)
        out = self.llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
        result = {"tokens": list(out.outputs[0].token_ids), "seconds": time.perf_counter() - t,
                  "cached": out.num_cached_tokens,
                  "ttft": out.metrics.first_token_latency if out.metrics is not None else None}
        if flush:
            self._flush()
        if logprobs:
            result["logprobs"] = [step[tok].logprob for step, tok in zip(out.outputs[0].logprobs, result["tokens"])]
        return result

    def _flush(self) -> None:
        """Save what this request's last step computed and let the store answer the commits,
        before the caller hands its prefix to another engine. vLLM keeps a finished request's
        blocks for the step after it, which saves them; ``LLM.generate`` returns without running
        that step (an engine that keeps serving runs it at once, and never waits for the store)."""
        from ucm_ray.vllm.connector import UcmRayConnector

        scheduler = self._scheduler()
        if not isinstance(scheduler.connector, UcmRayConnector):  # the benchmark also runs vLLM's own
            return
        deadline = time.monotonic() + 10.0
        while scheduler.has_requests() and time.monotonic() < deadline:
            self.llm.llm_engine.step()
        scheduler.connector.scheduler_part.flush(timeout_s=10.0)

    def _scheduler(self) -> Any:
        """vLLM's scheduler of this in-process engine (its connector's scheduler half hangs off it)."""
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's own prefix cache: the next request's hit can only come from the store."""
        return bool(self.llm.reset_prefix_cache())

    def prefill_bytes_s(self) -> float:
        """This engine's measured prefill rate in KV bytes a second, as its lookups send it to a
        shard deciding between promoting a disk hit and leaving it to be recomputed (0.0: no step
        timed yet)."""
        return float(self._scheduler().connector.scheduler_part.prefill_rate.bytes_per_s)

    def connector_totals(self) -> dict[str, dict[str, Any]]:
        """The connector's counters since start-up (scheduler and worker parts)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return {"scheduler": dict(self._scheduler().connector.scheduler_part.stats.totals),
                "worker": dict(get_kv_transfer_group().worker_part.stats.totals)}


def _delta(after: dict, before: dict, part: str, key: str) -> int:
    return after[part].get(key, 0) - before[part].get(key, 0)


def run_demo(model_dir: str | None = None, *, num_requests: int = 3, prefix_tokens: int = 3072,
             suffix_tokens: int = 64) -> dict[str, Any]:
    import ray

    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import start_fleet, stop_fleet
    from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    model = str(make_tiny_model(model_dir or Path(".models") / "tiny"))
    log.info("[1/4] starting a local Ray cluster and a 2-shard fleet")
    ray_temp_dir = tempfile.mkdtemp(prefix="ucmd-", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             _temp_dir=ray_temp_dir, log_to_driver=False)
    cfg = UcmRayConfig(num_shards=2, pool_bytes=512 << 20, ray_namespace="ucm_ray_demo")
    kv = kv_transfer_config({"ray_namespace": cfg.ray_namespace})
    remote_engine = ray.remote(num_cpus=0, runtime_env={"env_vars": ENGINE_ENV})(Engine)
    try:
        start_fleet(cfg)
        log.info("[2/4] loading engines A and B (the connector on) and a reference engine (without it), "
                 "each in its own process")
        a = remote_engine.remote(model, kv)
        b = remote_engine.remote(model, kv)
        reference = remote_engine.remote(model, None)
        ray.get([a.connector_totals.remote(), b.connector_totals.remote(), reference.generate.remote([1, 2], 1)])
        rows = []
        log.info("[3/4] serving %d requests, each a %d-token document plus a question: cold on A, "
                 "then the same document with another question warm on B", num_requests, prefix_tokens)
        for i in range(num_requests):
            document = synthetic_prompt(model, prefix_tokens, seed=7 + i)
            cold = ray.get(a.generate.remote(document + synthetic_prompt(model, suffix_tokens, seed=100 + i), 16))
            prompt = document + synthetic_prompt(model, suffix_tokens, seed=200 + i)
            before = ray.get(b.connector_totals.remote())
            warm = ray.get(b.generate.remote(prompt, 16))
            after = ray.get(b.connector_totals.remote())
            expected = ray.get(reference.generate.remote(prompt, 16))["tokens"]
            rows.append({"cold_ttft": cold["ttft"], "warm_ttft": warm["ttft"],
                         "hit_tokens": _delta(after, before, "scheduler", "hit_tokens"),
                         "bytes": _delta(after, before, "worker", "loaded_copy_bytes"),
                         "identical": warm["tokens"] == expected})
            r = rows[-1]
            print(f"request {i}: cold TTFT {r['cold_ttft'] * 1e3:8.1f} ms  warm TTFT {r['warm_ttft'] * 1e3:8.1f} ms  "
                  f"external hit {r['hit_tokens']:5d} tokens  moved {r['bytes'] / 2**20:6.1f} MiB  "
                  f"identical={r['identical']}", flush=True)
    finally:
        log.info("[4/4] cleaning up")
        stop_fleet(cfg)
        ray.shutdown()
    shutil.rmtree(ray_temp_dir, ignore_errors=True)  # its Ray logs (~13 MB), kept only when the demo failed
    ratio = statistics.median(r["warm_ttft"] for r in rows) / statistics.median(r["cold_ttft"] for r in rows)
    summary = {"outputs_identical": all(r["identical"] for r in rows), "warm_ttft_vs_cold": round(ratio, 3),
               "hit_tokens": sum(r["hit_tokens"] for r in rows)}
    print("demo: " + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    return summary
