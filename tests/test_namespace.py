"""The namespace: engines share stored blocks exactly when their target-model KV is the same.

Fast part: ``engine_namespaces`` on real vLLM config objects (no engine): every setting that
changes a block's bytes (model revision, dtype, KV cache dtype, block size, tensor-parallel size)
gives another digest; the path the weights were loaded from does not once ``model_id`` names
them. End to end: two real engines loading the same weights from two directories share
through ``model_id``, and do not without it.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import ray
import torch

from tests.e2e_helpers import EngineProcess, kv_transfer, logprob_drift
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

log = logging.getLogger(__name__)
BLOCK = 128
PREFIX = 8 * BLOCK


# --- the digests, from vLLM's config objects --------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two directories holding the same model config (no weights: nothing runs it)."""
    from ucm_ray.testing.harness import write_model_dir

    first = write_model_dir(str(tmp_path_factory.mktemp("ns") / "first"))
    second = str(tmp_path_factory.mktemp("ns") / "second")
    shutil.copytree(first, second)
    return first, second


def namespaces(model: str, *, dtype: str = "float32", cache_dtype: str = "auto", block_size: int = 128,
               tp: int = 1, revision: str | None = None, model_id: str = "", label: str = "ucm") -> list[bytes]:
    """The digests an engine with these settings mixes into its keys. The kv-cache spec is held
    fixed, so each difference found comes from the setting itself, not from the spec's repr
    (a real engine's spec follows some of them too: more reasons to differ, never fewer)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from ucm_ray.vllm.scheduler import engine_namespaces

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=4096, dtype=dtype,
                                 revision=revision),
        cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
        parallel_config=ParallelConfig(tensor_parallel_size=tp), device_config=DeviceConfig("cpu"))
    assert vllm_config.parallel_config.tensor_parallel_size == tp
    spec = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    return engine_namespaces(vllm_config, kv_cache_config, label, model_id)


DIFFERENCES = {
    "dtype": {"dtype": "bfloat16"},
    "kv cache dtype": {"cache_dtype": "fp8"},
    "block size": {"block_size": 256},
    "tp size": {"tp": 2},
    "revision": {"revision": "v2"},
    "namespace label": {"label": "other"},
}


@pytest.mark.parametrize("model_id", ["", "org/tiny"])
@pytest.mark.parametrize("change", DIFFERENCES.values(), ids=DIFFERENCES.keys())
def test_a_setting_that_changes_the_bytes_changes_the_namespace(model_dirs, change, model_id):
    base = namespaces(model_dirs[0], model_id=model_id)
    other = namespaces(model_dirs[0], model_id=model_id, **change)
    assert not set(base) & set(other)  # no rank of one engine shares with any rank of the other


def test_tp_ranks_of_one_engine_never_share(model_dirs):
    ranks = namespaces(model_dirs[0], tp=2)
    assert len(ranks) == 2 and ranks[0] != ranks[1]


def test_the_path_names_the_model_unless_model_id_does(model_dirs):
    first, second = model_dirs
    assert namespaces(first) != namespaces(second)  # without model_id: the path is the name
    assert namespaces(first, model_id="org/tiny") == namespaces(second, model_id="org/tiny")
    assert namespaces(first, model_id="org/tiny", tp=2) == namespaces(second, model_id="org/tiny", tp=2)
    assert namespaces(first, model_id="org/tiny") != namespaces(second, model_id="org/other")
    assert namespaces(first, model_id="org/tiny") != namespaces(first)


# --- end to end: the same weights in two directories ------------------------------------------

@pytest.fixture(scope="module")
def two_copies(tmp_path_factory):
    """The tiny model's weights, and a copy of them in another directory (another mount)."""
    first = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    second = tmp_path_factory.mktemp("mount") / "model"
    shutil.copytree(first, second)
    return str(first), str(second)


@pytest.fixture(scope="module")
def shared(ray_cluster):
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=128 << 20, ray_namespace="e2e_ns")) as cfg:
        yield cfg


def connector(cfg, **kw):
    # Generous timeouts: a shard slower than the timeout is a miss, and a busy host must not
    # turn an expected hit into one.
    return kv_transfer({"ray_namespace": cfg.ray_namespace, "lookup_timeout_s": 60, **kw})


def serve(model: str, kv, prompts: list[list[int]]) -> tuple[list[dict], dict]:
    """Serve ``prompts`` in order on a fresh engine; its outputs and scheduler counters."""
    engine = EngineProcess.remote(model, kv)
    try:
        outs = [ray.get(engine.generate.remote(p, 8, True)) for p in prompts]
        totals = ray.get(engine.connector_totals.remote())["scheduler"] if kv is not None else {}
    finally:
        ray.kill(engine)
    return outs, totals


@pytest.mark.e2e
def test_same_weights_from_two_paths_share_only_through_model_id(shared, two_copies):
    first, second = two_copies
    p = synthetic_prompt(first, PREFIX + 40, seed=41)
    r = synthetic_prompt(first, PREFIX + 40, seed=42)
    (ref_p, ref_r), _ = serve(first, None, [p, r])

    # Without model_id: the same weights under another path are another model.
    (cold,), _ = serve(first, connector(shared), [r])
    (other_path,), totals = serve(second, connector(shared), [r])
    assert cold["cached"] == other_path["cached"] == 0 and totals.get("hit_tokens", 0) == 0
    assert other_path["tokens"] == ref_r["tokens"] and other_path["logprobs"] == ref_r["logprobs"]

    # With the same model_id on both: B loads what A computed.
    (cold,), _ = serve(first, connector(shared, model_id="org/tiny"), [p[:PREFIX]])
    assert cold["cached"] == 0
    (warm,), totals = serve(second, connector(shared, model_id="org/tiny"), [p])
    assert warm["cached"] == PREFIX and totals["hit_tokens"] == PREFIX
    assert warm["tokens"] == ref_p["tokens"]
    # The 40-token tail runs in another batch shape than the reference's one prefill: logprobs
    # agree to fp32 rounding (measured ~1e-6); a wrong block moves them by ~1e-2.
    drift = logprob_drift(warm["logprobs"], ref_p["logprobs"])
    log.info("model_id hit: logprobs drift %.3g", drift)
    assert drift < 1e-4, f"logprobs drift {drift}"
