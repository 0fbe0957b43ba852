"""The tiny offline model runs in a real vLLM engine, greedily and deterministically: every
end-to-end test of the tier stands on that (the model's files are checked in
``tests/unit/test_tiny_model.py``)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[object]:
    # In-process engine: ~5 s to start instead of ~100 s (see DESIGN.md section 8).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    vllm = pytest.importorskip("vllm")
    engine = vllm.LLM(model=str(model_dir), enforce_eager=True, block_size=128, dtype="float32",
                      max_model_len=8192, seed=0)
    yield engine
    del engine
    gc.collect()


@pytest.mark.e2e
def test_vllm_greedy_generation_is_deterministic(llm: object, model_dir: Path) -> None:
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": synthetic_prompt(model_dir, 300, seed=0)}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    second = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(first) == 8
    assert list(first) == list(second)
