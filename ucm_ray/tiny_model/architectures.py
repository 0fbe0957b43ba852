"""Each architecture's config and weights: Llama, the hybrid LFM2 (attention and short-conv
layers) and Qwen3-Next (gated delta nets and attention), as transformers builds them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _lfm2_model(params: dict[str, Any], tokenizer: Any) -> tuple[Any, Any]:
    """An LFM2 config and its model class (transformers' own implementation)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    attention = set(params["attention_layers"])
    config = Lfm2Config(
        **_common_config(params, tokenizer),
        layer_types=["full_attention" if i in attention else "conv" for i in range(params["num_layers"])],
        conv_L_cache=params["conv_kernel"],
        # The MLP width is intermediate_size as given (no 2/3 and rounding-up games).
        block_auto_adjust_ff_dim=False,
        tie_word_embeddings=True,  # vLLM's Lfm2ForCausalLM always ties lm_head to the embedding
    )
    # vLLM's LFM2 reads these two (the released checkpoints' configs carry them; transformers'
    # Lfm2Config does not): the short-conv width and the feed-forward block's input width.
    config.conv_dim = params["hidden_size"]
    config.block_dim = params["hidden_size"]
    return config, Lfm2ForCausalLM


def _qwen3_next_model(params: dict[str, Any], tokenizer: Any) -> tuple[Any, Any]:
    """A Qwen3-Next config and its model class (transformers' own implementation).

    The gated delta nets take their head counts and widths from the attention
    shape (value heads = query heads, key heads = kv heads, one head width),
    which keeps the parameter list that of the other archs. ``num_experts`` 0
    gives every layer the dense MLP; otherwise a sparse MoE of that many
    experts (two per token) with a shared expert, each ``intermediate_size`` wide.
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    attention = set(params["attention_layers"])
    head_dim = params["hidden_size"] // params["num_heads"]
    config = Qwen3NextConfig(
        **_common_config(params, tokenizer),
        layer_types=["full_attention" if i in attention else "linear_attention"
                     for i in range(params["num_layers"])],
        head_dim=head_dim,
        linear_conv_kernel_dim=params["conv_kernel"],
        linear_num_key_heads=params["num_kv_heads"],
        linear_num_value_heads=params["num_heads"],
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        num_experts=params["num_experts"],
        num_experts_per_tok=min(2, params["num_experts"]),
        moe_intermediate_size=params["intermediate_size"],
        shared_expert_intermediate_size=params["intermediate_size"],
        tie_word_embeddings=False,
    )
    return config, Qwen3NextForCausalLM


def write_model(tmp_dir: Path, params: dict[str, Any], tokenizer: Any) -> None:
    """Write config, weights and tokenizer files of the model into ``tmp_dir``."""
    import torch
    from transformers import LlamaForCausalLM

    torch_dtype = getattr(torch, params["dtype"])
    if params["architecture"] == "Lfm2ForCausalLM":
        config, model_cls = _lfm2_model(params, tokenizer)
    elif params["architecture"] == "Qwen3NextForCausalLM":
        config, model_cls = _qwen3_next_model(params, tokenizer)
    else:
        config, model_cls = _llama_config(params, tokenizer), LlamaForCausalLM
    # Which attribute transformers writes as the checkpoint dtype changed in 5.x
    # (torch_dtype -> dtype); set the one this version has.
    if hasattr(config, "dtype"):
        config.dtype = torch_dtype
    else:  # pragma: no cover - transformers 4.x
        config.torch_dtype = torch_dtype
    # Seed right before construction: weight init is the only consumer of the
    # RNG, so equal parameters give byte-identical weights.
    torch.manual_seed(params["seed"])
    model = model_cls(config).to(torch_dtype).eval()
    model.save_pretrained(tmp_dir, safe_serialization=True)
    if params["architecture"] == "Lfm2ForCausalLM":
        _check_config_keys(tmp_dir / "config.json", ("conv_dim", "block_dim", "layer_types"))
    tokenizer.save_pretrained(tmp_dir)
    # Pin the tokenizer class: otherwise AutoTokenizer (and vLLM) may pick
    # LlamaTokenizer from the model type and rebuild it from a sentencepiece
    # model that does not exist.
    cfg_path = tmp_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True))


def _check_config_keys(path: Path, keys: tuple[str, ...]) -> None:
    """Make sure ``keys`` made it into config.json (a transformers version may drop unknown
    attributes on save); fail loudly rather than build a model vLLM rejects."""
    cfg = json.loads(path.read_text())
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise RuntimeError(f"{path}: transformers did not write {missing}; vLLM cannot load the model")


def _common_config(params: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Config fields every architecture here shares."""
    return dict(
        vocab_size=params["vocab_size"],
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        num_key_value_heads=params["num_kv_heads"],
        max_position_embeddings=params["max_position_embeddings"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _llama_config(params: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_common_config(params, tokenizer), tie_word_embeddings=False)
