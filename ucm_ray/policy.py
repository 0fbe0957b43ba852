"""Hit accounting: how many prompt tokens the connector may claim from the store.

Pure functions (stdlib only) so the rules can be tested exhaustively without an
engine; the scheduler-side connector calls them and does the I/O. The behaviour
follows UCM PR #1130 (``shared/seed/ucm-pr-1130.md``), DESIGN.md section 4.

The one hazard all of this guards against: when a cache hit leaves only a few
prompt tokens to compute, vLLM dispatches that prefill step as a *uniform
decode* batch and replays it through a FULL CUDA graph. A graph replay runs no
Python, so the connector's ``wait_for_layer_load`` hooks never run: layers
would read KV that has not landed (and, in the seed's layerwise saves, new
blocks would never be saved; ours are taken whole from a later step). We
therefore always leave at least ``R`` tokens for vLLM to compute.

Terms: a *block hit* is block-aligned and counted from token 0. For hybrid
models (attention + mamba / linear attention) hits are counted in LCM blocks,
where ``lcm_block_size`` is the least common multiple of the attention and
state groups' block sizes: a state exists only at LCM-aligned positions.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "recompute_tokens",
    "dense_external_hit",
    "hybrid_max_hit_blocks",
    "hybrid_hit_blocks",
    "state_dump_positions",
]


def _check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int (not a bool) >= ``minimum``, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def recompute_tokens(layerwise: bool, num_speculative_tokens: int = 0) -> int:
    """Minimum number of prompt tokens vLLM must compute itself (``R``).

    Layerwise: ``2 + k``. A step whose remaining query length is at most
    ``1 + k`` (one token plus ``k`` speculative drafts; shorter ones get padded)
    can be dispatched as uniform decode through a FULL CUDA graph, which skips
    the per-layer load/save hooks; ``2 + k`` keeps it a real prefill.
    Not layerwise: ``1``. All loads finish before the forward pass, so the graph
    is harmless; vLLM only asserts that at least one token is left to compute.
    """
    if not isinstance(layerwise, bool):
        raise ValueError(f"layerwise must be a bool, got {type(layerwise).__name__} {layerwise!r}")
    k = _check_int("num_speculative_tokens", num_speculative_tokens, 0)
    return 2 + k if layerwise else 1


def loads_at_once(step_tokens: int, step_loaded_tokens: int, ratio: int) -> bool:
    """Whether a step's loads are posted in one piece before its forward pass rather than
    layer by layer: when the step computes (all its requests together) at most ``1/ratio``
    (``load_at_once_ratio``, 64 by default; 0 never) of the tokens its loads bring, e.g. a
    repeated prompt recomputing its last block's tail. The layer hooks then have next to
    nothing to overlap the copies with (computing a token takes ~15x (1B) to ~170x (70B) the
    time of moving its KV over PCIe on an H200 host), while posting, ordering and awaiting
    each layer apart cost ~0.3 ms of host time per layer there (a 4k-token store hit of a
    16-layer model: ~5 ms, against ~3 ms for its bytes). The step's totals, not a request's:
    loads posted whole hold the compute stream back for every request of the batch until
    they landed.
    """
    return ratio > 0 and step_loaded_tokens > 0 and step_tokens * ratio <= step_loaded_tokens


def dense_external_hit(num_tokens: int, num_computed_tokens: int, hit_tokens: int,
                       recompute: int) -> int:
    """External tokens to report for a dense (attention-only) model.

    ``num_computed_tokens`` is vLLM's block-aligned local prefix hit and
    ``hit_tokens`` the block-aligned prefix found in the store, both counted
    from token 0. The external hit is what the store adds beyond the local one.
    If that leaves ``actual < recompute`` tokens to compute, only the deficit
    ``recompute - actual`` is taken off (not a whole block): the blocks to load
    stay the same, and vLLM recomputes the tail of the last block on top of the
    loaded bytes. A hit that already leaves enough tokens is not touched.
    Never negative: if the local hit alone leaves too few tokens, that cannot be
    fixed here and the result is 0.
    """
    _check_int("num_tokens", num_tokens, 0)
    _check_int("num_computed_tokens", num_computed_tokens, 0)
    _check_int("hit_tokens", hit_tokens, 0)
    _check_int("recompute", recompute, 1)  # 0 would let a hit claim the whole prompt
    if num_computed_tokens > num_tokens:
        raise ValueError(f"num_computed_tokens ({num_computed_tokens}) exceeds num_tokens ({num_tokens})")
    if hit_tokens > num_tokens:
        raise ValueError(f"hit_tokens ({hit_tokens}) exceeds num_tokens ({num_tokens})")
    external = max(hit_tokens - num_computed_tokens, 0)
    actual = num_tokens - (num_computed_tokens + external)
    if actual < recompute:
        external -= recompute - actual
    return max(external, 0)


def hybrid_max_hit_blocks(num_tokens: int, recompute: int, lcm_block_size: int) -> int:
    """Most LCM blocks a hybrid lookup may ask for: ``(num_tokens - R) // lcm``.

    Truncating *before* the lookup (rather than shaving tokens off afterwards,
    as for dense models) matters because a hybrid hit ends on a mamba state:
    cutting tokens after the lookup would load a state from a position beyond
    ``num_computed_tokens``, i.e. a state that already includes tokens vLLM is
    about to recompute. Capping the blocks looked up means stage 2 finds a state
    at or before the cap, or degrades to a shorter hit.
    """
    _check_int("num_tokens", num_tokens, 0)
    _check_int("recompute", recompute, 1)
    _check_int("lcm_block_size", lcm_block_size, 1)
    return max((num_tokens - recompute) // lcm_block_size, 0)


def hybrid_hit_blocks(attention_hit_blocks: int, state_available: Sequence[bool]) -> int:
    """Stage 2 of a hybrid lookup: the furthest LCM boundary usable as a hit.

    ``attention_hit_blocks`` is stage 1: how many leading LCM blocks had all
    their attention blocks in the store (already capped by
    ``hybrid_max_hit_blocks``). ``state_available[i]`` says whether the state at
    boundary ``(i + 1) * lcm`` exists for every state group. An SSM cannot
    resume from attention KV alone, so the hit is the largest ``b <=
    attention_hit_blocks`` with a state at ``b``, or 0 if there is none.
    Entries past ``attention_hit_blocks`` are ignored.
    """
    _check_int("attention_hit_blocks", attention_hit_blocks, 0)
    if isinstance(state_available, (str, bytes)) or not isinstance(state_available, Sequence):
        raise ValueError(f"state_available must be a sequence of bools, got {type(state_available).__name__}")
    if len(state_available) < attention_hit_blocks:
        raise ValueError(f"state_available has {len(state_available)} entries, "
                         f"fewer than attention_hit_blocks ({attention_hit_blocks})")
    for i in range(attention_hit_blocks):
        if not isinstance(state_available[i], bool):
            raise ValueError(f"state_available[{i}] must be a bool, got {state_available[i]!r}")
    for b in range(attention_hit_blocks, 0, -1):
        if state_available[b - 1]:
            return b
    return 0


def state_dump_positions(chunk_start: int, chunk_end: int, lcm_block_size: int) -> list[int]:
    """Token positions at which to save a mamba / linear-attention state for a chunk.

    For the scheduled chunk ``[chunk_start, chunk_end)``: ``[chunk_end]`` when the
    chunk is non-empty and ends exactly on an LCM boundary, else ``[]``. The
    kernel keeps only the running state at the current position in device
    memory, so states at earlier boundaries inside the chunk no longer exist;
    writing them would store garbage under valid keys that a later lookup would
    return as a hit. (Attention blocks of the chunk are always saved; this only
    concerns states.)
    """
    _check_int("chunk_start", chunk_start, 0)
    _check_int("chunk_end", chunk_end, 0)
    _check_int("lcm_block_size", lcm_block_size, 1)
    if chunk_end < chunk_start:
        raise ValueError(f"chunk_end ({chunk_end}) is before chunk_start ({chunk_start})")
    if chunk_end > chunk_start and chunk_end % lcm_block_size == 0:
        return [chunk_end]
    return []
