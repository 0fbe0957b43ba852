"""A tiny model's shape parameters, checked before anything touches the disk, and the marker
a finished build records them in."""

from __future__ import annotations

from typing import Any

MARKER_NAME = "ucm_tiny_model.json"
"""Written last into a finished build; its contents are the build parameters."""

FORMAT_VERSION = 1
"""Bump when the build recipe changes, so stale directories are rebuilt."""

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
"""Ids 0, 1, 2 in this order (the BPE trainer assigns special tokens first)."""

DTYPES = ("float32", "bfloat16", "float16")

ARCHS = {"llama": "LlamaForCausalLM", "lfm2": "Lfm2ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
"""``arch`` argument -> the HF architecture written into config.json."""


def build_params(
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    seed: int,
    dtype: str,
    arch: str = "llama",
    attention_layers: tuple[int, ...] | list[int] | None = None,
    conv_kernel: int = 3,
    num_experts: int = 0,
) -> dict[str, Any]:
    """Validate the shape parameters and return them as the marker's content.

    Validation happens before anything touches the disk so that a bad value
    fails with a message naming it, not deep inside transformers or vLLM.
    """
    positive = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
    }
    _check_shape(positive, seed=seed, dtype=dtype, arch=arch)
    params = {"format_version": FORMAT_VERSION, "architecture": ARCHS[arch], **positive,
              "seed": seed, "dtype": dtype}
    if arch == "llama":
        if attention_layers is not None:
            raise ValueError("attention_layers: only for hybrid archs (every Llama layer is attention)")
        return params  # unchanged from before arch existed, so existing builds stay valid
    params = {**params, **_hybrid_layers(arch, num_layers, attention_layers, conv_kernel)}
    if arch == "lfm2":
        if num_experts:
            raise ValueError("num_experts: only for arch='qwen3_next'")
        return params  # unchanged from before qwen3_next existed, so existing builds stay valid
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 0 or num_experts == 1:
        raise ValueError(f"num_experts: expected 0 (a dense MLP) or an int >= 2, got {num_experts!r}")
    return {**params, "num_experts": num_experts}


def _check_shape(positive: dict[str, int], *, seed: int, dtype: str, arch: str) -> None:
    """Every architecture's parameters: ``positive`` (by name) positive ints that make a valid
    attention shape and a vocabulary a byte-level BPE can fill."""
    for key, value in positive.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{key}: expected a positive int, got {value!r}")
    hidden_size, num_heads, num_kv_heads = positive["hidden_size"], positive["num_heads"], positive["num_kv_heads"]
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if (hidden_size // num_heads) % 2:
        raise ValueError(f"head size hidden_size/num_heads ({hidden_size // num_heads}) must be even (RoPE)")
    vocab_size = positive["vocab_size"]
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        # A byte-level BPE needs all 256 byte symbols plus the special tokens.
        raise ValueError(f"vocab_size: must be at least {256 + len(SPECIAL_TOKENS) + 1}, got {vocab_size}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {', '.join(ARCHS)}, got {arch!r}")


def _hybrid_layers(arch: str, num_layers: int, attention_layers: tuple[int, ...] | list[int] | None,
                   conv_kernel: int) -> dict[str, Any]:
    """A hybrid architecture's layer plan: which layers are attention (the others hold a state)
    and the width of the state layers' convolution."""
    if attention_layers is None:
        raise ValueError(f"attention_layers: arch={arch!r} needs the indices of its attention layers")
    layers = list(attention_layers)
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers for i in layers) \
            or len(set(layers)) != len(layers) or not layers or len(layers) == num_layers:
        raise ValueError(f"attention_layers: expected distinct layer indices in [0, {num_layers}), at least "
                         f"one attention and one conv layer, got {attention_layers!r}")
    if not isinstance(conv_kernel, int) or isinstance(conv_kernel, bool) or conv_kernel < 2:
        raise ValueError(f"conv_kernel: expected an int >= 2, got {conv_kernel!r}")
    return {"attention_layers": sorted(layers), "conv_kernel": conv_kernel}
