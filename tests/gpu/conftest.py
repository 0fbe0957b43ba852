"""GPU tests: they need an NVIDIA GPU and vLLM with CUDA; elsewhere they are skipped, saying so."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run `make gpu-test` on a GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny dense model in bf16 (FlashAttention 3 takes only fp16 or bf16)."""
    from ucm_ray.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", num_layers=4, hidden_size=256,
                               num_heads=4, num_kv_heads=2, dtype="bfloat16"))
