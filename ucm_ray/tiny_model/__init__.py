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

The package's parts, one job each: ``params`` (the shape parameters, checked, and the marker
they become), ``tokenizer`` (the locally trained tokenizer and the prompts drawn from it),
``architectures`` (each architecture's config and weights), ``build`` (the idempotent, atomic
build of a model directory).

Floor 1: imports nothing else of ucm_ray, nor Ray, nor vLLM.
"""

from ucm_ray.tiny_model.build import make_tiny_gdn_model, make_tiny_hybrid_model, make_tiny_model
from ucm_ray.tiny_model.params import (
    BOS_TOKEN,
    EOS_TOKEN,
    FORMAT_VERSION,
    MARKER_NAME,
    PAD_TOKEN,
    REQUIRED_FILES,
    SPECIAL_TOKENS,
)
from ucm_ray.tiny_model.tokenizer import synthetic_prompt

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "FORMAT_VERSION",
    "MARKER_NAME",
    "PAD_TOKEN",
    "REQUIRED_FILES",
    "SPECIAL_TOKENS",
    "make_tiny_gdn_model",
    "make_tiny_hybrid_model",
    "make_tiny_model",
    "synthetic_prompt",
]
