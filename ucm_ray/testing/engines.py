"""Engines for tests that must reach inside vLLM (e.g. the GPU tests); importable by Ray workers."""

from __future__ import annotations

from typing import Any

from ucm_ray.demo import Engine


class ProbedEngine(Engine):
    """The demo's engine plus a test-only override of the connector's recompute count, and what
    probes of its internals need (the engine core in this process)."""

    def __init__(self, model_dir: str, kv: dict[str, Any] | None, recompute: int | None = None,
                 **engine_kwargs: Any) -> None:
        super().__init__(model_dir, kv, **engine_kwargs)
        if recompute is not None:  # the counterfactual of the seed's rule, for tests only
            connector = self._core().scheduler.connector
            connector.scheduler_part.recompute = recompute

    def _core(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core

    def _hashes(self, prompt_ids: list[int]) -> list[bytes]:
        """vLLM's block hashes of the prompt's full blocks, as this engine computes them."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        req = Request(request_id="probe", prompt_token_ids=prompt_ids, pooling_params=None,
                      sampling_params=SamplingParams(max_tokens=1),
                      block_hasher=self._core().request_block_hasher)
        return list(req.block_hashes)
