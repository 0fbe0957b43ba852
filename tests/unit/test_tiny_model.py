"""The tiny offline model: built once, reused, and loadable by a real vLLM engine.

Every end-to-end test of the tier stands on this model, so it is checked
here first: if these fail, later failures in connector tests say nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ucm_ray.tiny_model import MARKER_NAME, SPECIAL_TOKENS, make_tiny_model, synthetic_prompt

# The default shape, because that is the model every other end-to-end test and
# benchmark uses (~10 s to build). Kept as one dict so the no-op check passes
# the same parameters.
PARAMS: dict = dict(seed=0)
VOCAB_SIZE = 2048  # make_tiny_model's default
NUM_LAYERS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    parent = tmp_path_factory.mktemp("tiny")
    # Debris of an "interrupted" earlier build: the builder must clear it.
    (parent / ".llama.tmp-stale").mkdir()
    (parent / ".llama.tmp-stale" / "config.json").write_text("{}")
    return make_tiny_model(parent / "llama", **PARAMS)


def _snapshot(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(path.iterdir())} | {".": path.stat().st_mtime_ns}


def test_files_exist(model_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER_NAME):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == NUM_LAYERS
    assert config["vocab_size"] == VOCAB_SIZE
    # No debris of the temporary build directory next to the model.
    assert not [p for p in model_dir.parent.iterdir() if ".tmp-" in p.name]


def test_second_call_is_noop(model_dir: Path) -> None:
    before = _snapshot(model_dir)
    assert make_tiny_model(model_dir, **PARAMS) == model_dir
    assert _snapshot(model_dir) == before


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ucm_ray.tiny_model.build as tiny_build

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-build

    monkeypatch.setattr(tiny_build, "train_tokenizer", boom)
    with pytest.raises(KeyboardInterrupt):
        make_tiny_model(tmp_path / "m", **PARAMS)
    assert not (tmp_path / "m").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_refuses_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        make_tiny_model(tmp_path / "other", **PARAMS)
    assert (tmp_path / "other" / "precious.txt").read_text() == "keep me"


def test_bad_parameter_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_tiny_model(tmp_path / "m", **{**PARAMS, "num_kv_heads": 3})
    assert not (tmp_path / "m").exists()


def test_tokenizer_loads_with_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == VOCAB_SIZE
    ids = tok("Hello tiny world.")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "Hello tiny world."


def test_synthetic_prompt(model_dir: Path) -> None:
    a = synthetic_prompt(model_dir, 300, seed=1)
    assert len(a) == 300
    assert a == synthetic_prompt(model_dir, 300, seed=1)
    assert a != synthetic_prompt(model_dir, 300, seed=2)
    assert synthetic_prompt(model_dir, 1000, seed=1)[:300] == a  # prefix-stable
    assert synthetic_prompt(model_dir, 0, seed=1) == []
    assert all(0 <= t < VOCAB_SIZE for t in a)
    special = set(range(len(SPECIAL_TOKENS)))  # trained first, so ids 0..2
    assert not special & set(synthetic_prompt(model_dir, 5000, seed=3))
