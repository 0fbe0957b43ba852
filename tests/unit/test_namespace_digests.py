"""The namespace's digests, from ``engine_namespaces`` on real vLLM config objects (no engine):
every setting that changes a block's bytes (model revision, dtype, KV cache dtype, block size,
tensor-parallel size) gives another digest; the path the weights were loaded from does not once
``model_id`` names them. The end-to-end half is ``tests/e2e/test_namespace.py``."""

from __future__ import annotations

import shutil

import pytest
import torch


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
