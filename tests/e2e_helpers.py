"""Real vLLM engines (CPU) in their own processes: Ray actors, one engine each."""

from __future__ import annotations

import os
import time
from typing import Any

import ray

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # scheduler and worker in the actor's process: fast start
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
}


def kv_transfer(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "UcmRayConnector", "kv_connector_module_path": "ucm_ray.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


@ray.remote(num_cpus=0, runtime_env={"env_vars": ENGINE_ENV})
class EngineProcess:
    def __init__(self, model_dir: str, kv: dict[str, Any] | None, dtype: str = "float32") -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kwargs: dict[str, Any] = dict(model=model_dir, enforce_eager=True, block_size=128, dtype=dtype,
                                      max_model_len=8192, max_num_batched_tokens=8192, seed=0,
                                      enable_prefix_caching=True)
        if kv is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
        self.llm = LLM(**kwargs)

    def generate(self, prompt_ids: list[int], max_tokens: int = 8) -> dict[str, Any]:
        from vllm import SamplingParams

        t = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt_ids}],
                                SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
        return {"tokens": list(out.outputs[0].token_ids), "seconds": time.perf_counter() - t,
                "cached": out.num_cached_tokens}

    def ttft(self, prompt_ids: list[int]) -> dict[str, Any]:
        return self.generate(prompt_ids, max_tokens=1)

    def connector_totals(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        core = self.llm.llm_engine.engine_core.engine_core
        return {"scheduler": dict(core.scheduler.connector.scheduler_part.stats.totals),
                "worker": dict(get_kv_transfer_group().worker_part.stats.totals)}

    def _core(self):
        return self.llm.llm_engine.engine_core.engine_core

    def _hashes(self, prompt_ids: list[int]) -> list[bytes]:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        req = Request(request_id="probe", prompt_token_ids=prompt_ids, pooling_params=None,
                      sampling_params=SamplingParams(max_tokens=1),
                      block_hasher=self._core().request_block_hasher)
        return list(req.block_hashes)

    def block_keys(self, prompt_ids: list[int]) -> list[bytes]:
        """The store keys this engine uses for the prompt's full blocks (rank 0, group 0)."""
        from ucm_ray.keys import block_key

        ns = self._core().scheduler.connector.scheduler_part._ns[0]
        return [block_key(ns, h, 0) for h in self._hashes(prompt_ids)]

    def cached_kv(self, prompt_ids: list[int], layer: int) -> list[bytes | None]:
        """Bytes of one attention layer of the prompt's blocks in this engine's own prefix cache."""
        from ucm_ray.vllm.layout import layer_layout

        core = self._core()
        pool = core.scheduler.kv_cache_manager.block_pool
        runner = core.model_executor.driver_worker.worker.model_runner
        tensor = runner.kv_caches[layer]
        lay = layer_layout(f"layer{layer}", tensor, core.scheduler.kv_cache_config.num_blocks)
        out: list[bytes | None] = []
        for h in self._hashes(prompt_ids):
            blocks = pool.get_cached_block(h, [0])
            out.append(None if blocks is None else
                       b"".join(bytes(seg.numpy()) for seg in lay.segments(blocks[0].block_id)))
        return out

    def pid(self) -> int:
        return os.getpid()
