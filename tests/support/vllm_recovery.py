"""The one wrong output of vLLM's recovery from a failed KV load that the GPU tests know of, bound
to the vLLM release and model runner it was seen on. A test marks itself strict xfail only there,
so a fix upstream (XPASS, strict: a failure) and a wrong output anywhere else (an assertion) both
show, where an unconditional "xfail when the tokens differ" hid both."""

from __future__ import annotations

from typing import Any

import pytest
import ray

V2_RUNNER_RECOVERY = ("vLLM 0.26's V2 model runner: after the connector fails the hook-less step's loads, vLLM "
                      "logs 'Recovered from KV load failure' yet the first token still differs from the "
                      "reference (919 and 820 against 2038 in two runs, async scheduling on and off); with "
                      "the V1 runner the same test passes")


def recovery_inexact(vllm_version: str, v2_runner: bool) -> bool:
    """Whether vLLM ``vllm_version`` with this runner is the known case (0.26.x, the V2 runner)."""
    return v2_runner and vllm_version.split(".")[:2] == ["0", "26"]


def engine_runner(handle: Any) -> tuple[str, bool]:
    """The vLLM version an engine actor runs and whether its model runner is the V2 one
    (``vllm.v1.worker.gpu``; V1's is ``vllm.v1.worker.gpu_model_runner``): the runner in use,
    whatever the environment asked for. A closure, so Ray ships it by value."""
    def probe(eng: Any) -> tuple[str, bool]:
        import vllm

        runner = eng.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        return vllm.__version__, type(runner).__module__.startswith("vllm.v1.worker.gpu.")

    return ray.get(handle.__ray_call__.remote(probe))


def xfail_where_recovery_is_known_inexact(request: pytest.FixtureRequest, handle: Any) -> None:
    """Mark the running test strict xfail when the engine ``handle`` is the known case."""
    version, v2_runner = engine_runner(handle)
    if recovery_inexact(version, v2_runner):
        request.applymarker(pytest.mark.xfail(strict=True, reason=V2_RUNNER_RECOVERY))
