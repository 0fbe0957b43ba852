"""Engines for tests that must reach inside vLLM (e.g. the GPU tests); importable by Ray workers."""

from __future__ import annotations

import time
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

    def block_keys(self, prompt_ids: list[int]) -> list[bytes]:
        """The store keys this engine uses for the prompt's full blocks (rank 0, group 0)."""
        from ucm_ray.keys import block_key

        namespace = self._core().scheduler.connector.scheduler_part.namespaces[0]
        return [block_key(namespace, block_hash, 0) for block_hash in self._hashes(prompt_ids)]

    def generate_pd(self, prompt_ids: list[int], max_tokens: int, kv_transfer_params: dict[str, Any],
                    flush: bool = True, logprobs: bool = False, ignore_eos: bool = False) -> dict[str, Any]:
        """Greedy tokens of a request carrying a PD proxy's ``kv_transfer_params`` (vLLM reads them
        from the sampling params' ``extra_args``), with the params its output hands the proxy.
        ``flush=False``: return at the last token, its saves left to ``flush`` (or never);
        ``logprobs``: also each sampled token's logprob; ``ignore_eos``: all ``max_tokens``. Times
        as ``generate``'s."""
        from vllm import SamplingParams

        started = time.perf_counter()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0 if logprobs else None,
                                ignore_eos=ignore_eos, extra_args={"kv_transfer_params": kv_transfer_params})
        out = self.llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        if flush:
            self._flush()
        tokens = list(out.outputs[0].token_ids)
        result = {"tokens": tokens, "cached": out.num_cached_tokens, "kv_transfer_params": out.kv_transfer_params,
                  "seconds": seconds, "ttft": out.metrics.first_token_latency if out.metrics is not None else None}
        if logprobs:
            result["logprobs"] = [step[tok].logprob for step, tok in zip(out.outputs[0].logprobs, tokens)]
        return result

    def flush(self) -> None:
        """Run the steps that save what the last request computed, and wait for the commits."""
        self._flush()

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's own prefix cache (nothing running), so the next prompt starts cold."""
        return bool(self.llm.reset_prefix_cache())
