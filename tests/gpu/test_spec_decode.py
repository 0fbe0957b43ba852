"""n-gram speculative decoding (k = 2) with FULL CUDA graphs: the recompute count is 2 + k.

With ``k`` speculative tokens, vLLM (0.26's V1 model runner, which ngram needs: the V2 runner
refuses ngram) treats a step as *uniform decode*, and replays a FULL CUDA graph in which no
layer hook runs, when every request in it schedules exactly ``1 + k`` tokens
(``GPUModelRunner._is_uniform_decode``). So a hit must leave ``2 + k`` = 4 tokens, not 2. The
connector reads ``k`` from ``vllm_config.speculative_config.num_speculative_tokens``
(``SchedulerPart.__init__``), which vLLM 0.26 sets for ``method="ngram"`` as for every method.

Three engines in their own processes, each with the same speculation: a reference without the
connector, engine A (computes and saves P and Q, block-aligned 1024 tokens), engine B (fresh):
- P: B hits what ``ucm_ray.policy`` predicts for recompute 2 + k (1020 of 1024), every layer
  load is waited for, and B's greedy tokens equal the reference's.
- Q, with B's recompute count forced to 1 + k = 3 (the counterfactual): the hit leaves 3 tokens,
  vLLM replays a FULL graph without hooks, and the connector must catch the loads no layer
  waited for and fail them, so vLLM recomputes and the tokens still equal the reference's.
Prompts repeat a 256-token segment, so the n-gram proposer finds matches and drafts while
decoding (a random prompt would leave it idle).
"""

from __future__ import annotations

import pytest
import ray

from ucm_ray import policy

pytestmark = pytest.mark.gpu
BLOCK = 16
K = 2
N = 1024
MAX_TOKENS = 16
GRAPHS = {"cudagraph_mode": "FULL_AND_PIECEWISE"}
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# ngram runs on vLLM 0.26's V1 model runner only (the V2 runner lists it as unsupported and raises
# if asked for explicitly); say so rather than rely on the automatic fallback.
ENV = {"PYTHONHASHSEED": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0",
       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def engine(model: str, kv: dict | None):
    from ucm_ray.testing.engines import ProbedEngine

    remote = ray.remote(num_gpus=0.2, runtime_env={"env_vars": ENV})(ProbedEngine)
    return remote.remote(model, kv, None, dtype="bfloat16", block_size=BLOCK, max_model_len=4096,
                         enforce_eager=False, compilation_config=GRAPHS, gpu_memory_utilization=0.15,
                         speculative_config=SPEC, async_scheduling=False)  # layer-by-layer loads: the seed's rule


def kv_config(fleet, **extra) -> dict:
    return {"kv_connector": "UcmRayConnector", "kv_connector_module_path": "ucm_ray.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"ray_namespace": fleet.ray_namespace, "lookup_timeout_s": 60,
                                          "layerwise": True, **extra}}


def totals(handle) -> dict:
    parts = ray.get(handle.connector_totals.remote())
    return {**parts["scheduler"], **parts["worker"]}


def set_recompute(handle, value: int | None) -> int:
    """The connector's recompute count in an engine (set it when ``value`` is given); the old value.
    A closure, so Ray ships it by value (the test module is not importable in the actor)."""
    def probe(eng):
        part = eng.llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_part
        old = part.recompute
        if value is not None:
            part.recompute = value
        return old

    return ray.get(handle.__ray_call__.remote(probe))


def served(handle, prompt: list[int]) -> tuple[dict, dict]:
    before = totals(handle)
    out = ray.get(handle.generate.remote(prompt, MAX_TOKENS))
    after = totals(handle)
    return out, {k: after.get(k, 0) - before.get(k, 0) for k in after}


@pytest.fixture(scope="module")
def prompts(gpu_model):
    from ucm_ray.tiny_model import synthetic_prompt

    return {name: synthetic_prompt(gpu_model, N // 4, seed=seed) * 4 for name, seed in (("P", 41), ("Q", 42))}


@pytest.fixture(scope="module")
def reference(gpu_model, prompts, gpu_cluster):
    ref = engine(gpu_model, None)
    out = {name: ray.get(ref.generate.remote(p, MAX_TOKENS))["tokens"] for name, p in prompts.items()}
    ray.kill(ref)
    return out


@pytest.fixture(scope="module")
def stored(gpu_model, prompts, gpu_fleet, reference):
    a = engine(gpu_model, kv_config(gpu_fleet))
    assert set_recompute(a, None) == policy.recompute_tokens(True, K)  # k read from vLLM's config
    for name, p in prompts.items():
        out, delta = served(a, p)
        assert out["tokens"] == reference[name], f"A's cold {name} differs from the reference"
        assert delta["saved_blocks"] >= N // BLOCK and delta.get("save_failures", 0) == 0
    ray.kill(a)
    return True


@pytest.fixture(scope="module")
def engine_b(gpu_model, gpu_fleet, stored):
    """Loads layer by layer (``load_at_once_ratio: 0``): a hit that leaves 2 + k (or, in the
    counterfactual, 1 + k) tokens alone in its step would otherwise load at once, before the
    forward, and these tests are about the layer hooks under speculation."""
    b = engine(gpu_model, kv_config(gpu_fleet, load_at_once_ratio=0))
    yield b
    ray.kill(b)


def test_speculation_keeps_two_plus_k_tokens_and_outputs_equal(prompts, reference, engine_b):
    assert set_recompute(engine_b, None) == 2 + K
    out, got = served(engine_b, prompts["P"])
    assert got["hit_tokens"] == policy.dense_external_hit(N, 0, N, policy.recompute_tokens(True, K)) == N - 2 - K
    assert out["cached"] == N - 2 - K  # vLLM's own count
    assert got["loaded_blocks"] == N // BLOCK
    assert got.get("load_failures", 0) == 0 and got.get("unwaited_layer_loads", 0) == 0  # hooks ran
    assert out["tokens"] == reference["P"]


def test_one_plus_k_left_replays_a_full_graph_and_is_caught(prompts, reference, engine_b):
    """vLLM recomputes what the connector failed, so the tokens equal the reference's, as they do
    without speculation (``test_full_cuda_graphs``, V1 runner). Once (H200, 2026-11-30) the V1
    runner's tokens differed here, and a later run passed: a difference fails, as the wrong output
    it is."""
    set_recompute(engine_b, 1 + K)  # the counterfactual: leaves 1 + k = 3 tokens, a uniform-decode step
    try:
        out, got = served(engine_b, prompts["Q"])
    finally:
        set_recompute(engine_b, 2 + K)
    assert got["hit_tokens"] == N - 1 - K
    assert got.get("unwaited_layer_loads", 0) > 0, \
        "vLLM ran the 3-token step with layer hooks: no FULL graph replay (has the uniform-decode rule changed?)"
    assert got.get("load_failures", 0) > 0  # caught: vLLM recomputed those blocks
    assert out["tokens"] == reference["Q"]
