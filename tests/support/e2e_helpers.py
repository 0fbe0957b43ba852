"""Real vLLM engines (CPU) in their own processes: Ray actors, one engine each."""

from __future__ import annotations

import os

import ray

from ucm_ray.demo import ENGINE_ENV
from ucm_ray.demo import kv_transfer_config as kv_transfer
from ucm_ray.testing.engines import ProbedEngine

__all__ = ["ENGINE_ENV", "EngineProcess", "kv_transfer", "logprob_drift"]


class _ProbedEngine(ProbedEngine):
    """Probes into one engine's internals, for byte-level assertions."""

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

    def kv_cache_groups(self) -> list[tuple[str, int, list[str]]]:
        """The kv-cache groups vLLM formed: (spec type, block size in tokens, layer names)."""
        return [(type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, list(g.layer_names))
                for g in self._core().scheduler.kv_cache_config.kv_cache_groups]

    def hash_block_size(self) -> int:
        """The granularity (tokens) of ``request.block_hashes``: ``prefix_match_unit`` where set."""
        return self._core().scheduler.kv_cache_config.hash_block_size

    def pid(self) -> int:
        return os.getpid()


def logprob_drift(got: list[float], expected: list[float]) -> float:
    """The largest difference between two outputs' logprobs, token by token. A warm engine that
    computes a prompt's tail in another batch shape than the reference's single prefill differs
    by fp32 rounding (~1e-6); a wrong block moves the logprobs by ~1e-2."""
    return max(abs(x - y) for x, y in zip(got, expected, strict=True))


EngineProcess = ray.remote(num_cpus=0, runtime_env={"env_vars": ENGINE_ENV})(_ProbedEngine)
