"""Engines for tests that must reach inside vLLM (e.g. the GPU tests); importable by Ray workers."""

from __future__ import annotations

from typing import Any

from ucm_ray.demo import Engine


class ProbedEngine(Engine):
    """The demo's engine plus a test-only override of the connector's recompute count."""

    def __init__(self, model_dir: str, kv: dict[str, Any] | None, recompute: int | None = None,
                 **engine_kwargs: Any) -> None:
        super().__init__(model_dir, kv, **engine_kwargs)
        if recompute is not None:  # the counterfactual of the seed's rule, for tests only
            connector = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
            connector.scheduler_part.recompute = recompute
