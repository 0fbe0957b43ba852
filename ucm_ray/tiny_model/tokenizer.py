"""The tiny model's tokenizer, a byte-level BPE trained locally on synthetic text, and the
prompts tests and benchmarks draw from it."""

from __future__ import annotations

import functools
import itertools
import logging
import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ucm_ray.tiny_model.params import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

logger = logging.getLogger(__name__)


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


def train_tokenizer(vocab_size: int, seed: int, max_len: int) -> Any:
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
