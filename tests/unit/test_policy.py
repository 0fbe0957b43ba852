"""Hit policy: the seed's three tables (shared/seed/ucm-pr-1130.md) row by row, plus edges."""

from __future__ import annotations

import pytest

from ucm_ray.config import UcmRayConfig
from ucm_ray.policy import (
    dense_external_hit,
    hybrid_hit_blocks,
    hybrid_max_hit_blocks,
    loads_at_once,
    recompute_tokens,
    state_dump_positions,
)

# ---------------------------------------------------------------------------
# Table 1: dense QwQ-32B, block 128, k=3, layerwise -> R=5; request A stored 64 blocks.
BLOCK = 128
STORED = 64 * BLOCK  # 8192

TABLE_1 = [
    # (length of B, hit, actual_recompute, workaround?, deficit, ext_hit_tokens, vLLM recompute)
    pytest.param(8192, STORED, 0, True, 5, 8187, 5, id="full-hit"),
    pytest.param(8193, STORED, 1, True, 4, 8188, 5, id="1-token-short"),
    pytest.param(8196, STORED, 4, True, 1, 8191, 5, id="4-tokens-short"),
    pytest.param(8197, STORED, 5, False, 0, 8192, 5, id="borderline"),
    pytest.param(8200, STORED, 8, False, 0, 8192, 8, id="enough-new-tokens"),
]


@pytest.mark.parametrize("length,hit,actual,workaround,deficit,ext,vllm_recompute", TABLE_1)
def test_table1_dense(length, hit, actual, workaround, deficit, ext, vllm_recompute):
    r = recompute_tokens(layerwise=True, num_speculative_tokens=3)
    assert r == 5
    assert length - hit == actual
    assert (actual < r) is workaround
    assert (r - actual if workaround else 0) == deficit
    got = dense_external_hit(length, 0, hit, r)
    assert got == ext
    assert length - got == vllm_recompute
    # Only tokens are taken off, never a block: the computed prefix still reaches every hit block.
    assert -(-got // BLOCK) == hit // BLOCK


def test_table1_dense_no_hit():
    r = recompute_tokens(True, 3)
    assert dense_external_hit(8192, 0, 0, r) == 0  # different prompt: vLLM recomputes everything


# ---------------------------------------------------------------------------
# Tables 2 and 3: hybrid Qwen3.5-35B-A3B, LCM block 2048.
LCM = 2048


def states_written(chunks: list[tuple[int, int]], lcm: int = LCM) -> set[int]:
    """Positions whose state request A left in the store, given how A was chunked."""
    return {p for s, e in chunks for p in state_dump_positions(s, e, lcm)}


def hybrid_lookup(length: int, shared_prefix: int, states: set[int], r: int, lcm: int = LCM):
    """What the hybrid connector does for request B: (max_hit_lcm_blocks, looked up, ext_hit_tokens).

    ``shared_prefix`` is how many leading tokens B shares with the stored request A; A's
    attention blocks cover all of it (attention blocks of every chunk are always written).
    """
    max_blocks = hybrid_max_hit_blocks(length, r, lcm)
    looked_up = min(max_blocks, length // lcm)
    stage1 = min(looked_up, shared_prefix // lcm)
    available = [(i + 1) * lcm in states for i in range(stage1)]
    return max_blocks, looked_up, hybrid_hit_blocks(stage1, available) * lcm


TABLE_2 = [
    # (length of B, max_hit_lcm_blocks, truncated?, blocks looked up, ext_hit_tokens, vLLM recompute)
    pytest.param(8192, 3, True, 3, 6144, 2048, id="full-hit"),
    pytest.param(8193, 3, True, 3, 6144, 2049, id="1-token-short"),
    pytest.param(8196, 3, True, 3, 6144, 2052, id="4-tokens-short"),
    pytest.param(8197, 4, False, 4, 8192, 5, id="borderline"),
    pytest.param(8200, 4, False, 4, 8192, 8, id="enough-new-tokens"),
]


@pytest.mark.parametrize("length,max_blocks,truncated,looked_up,ext,vllm_recompute", TABLE_2)
def test_table2_hybrid_with_mtp(length, max_blocks, truncated, looked_up, ext, vllm_recompute):
    r = recompute_tokens(True, 3)
    # EAGLE pruning chunks the 8192-token request A as 6144 + 2048.
    states = states_written([(0, 6144), (6144, 8192)])
    assert states == {6144, 8192}
    got_max, got_looked_up, got_ext = hybrid_lookup(length, 8192, states, r)
    assert got_max == max_blocks
    assert (got_max < length // LCM) is truncated
    assert got_looked_up == looked_up
    assert got_ext == ext
    assert length - got_ext == vllm_recompute


def test_table2_hybrid_with_mtp_no_hit():
    states = states_written([(0, 6144), (6144, 8192)])
    _, _, ext = hybrid_lookup(8192, 0, states, recompute_tokens(True, 3))
    assert ext == 0


TABLE_3 = [
    # (length of B, max_hit_lcm_blocks, truncated?, ext_hit_tokens, vLLM recompute)
    pytest.param(8192, 3, True, 0, 8192, id="full-hit-graceful-degradation"),
    pytest.param(8194, 4, False, 8192, 2, id="borderline"),
    pytest.param(8200, 4, False, 8192, 8, id="enough-new-tokens"),
]


@pytest.mark.parametrize("length,max_blocks,truncated,ext,vllm_recompute", TABLE_3)
def test_table3_hybrid_without_mtp(length, max_blocks, truncated, ext, vllm_recompute):
    r = recompute_tokens(True, 0)
    assert r == 2
    states = states_written([(0, 8192)])  # one chunk: only the state at its end is valid
    assert states == {8192}
    got_max, _, got_ext = hybrid_lookup(length, 8192, states, r)
    assert got_max == max_blocks
    assert (got_max < length // LCM) is truncated
    assert got_ext == ext
    assert length - got_ext == vllm_recompute


@pytest.mark.parametrize("length,ext,vllm_recompute", [
    pytest.param(8192, 6144, 2048, id="full-hit"),
    pytest.param(8194, 8192, 2, id="borderline"),
    pytest.param(8200, 8192, 8, id="enough-new-tokens"),
])
def test_table3_hint_chunks_of_one_lcm_block(length, ext, vllm_recompute):
    # max_num_batched_tokens == lcm_block_size: every chunk is one block, every boundary has a state.
    states = states_written([(s, s + LCM) for s in range(0, 8192, LCM)])
    assert states == {2048, 4096, 6144, 8192}
    _, _, got_ext = hybrid_lookup(length, 8192, states, recompute_tokens(True, 0))
    assert got_ext == ext
    assert length - got_ext == vllm_recompute


# ---------------------------------------------------------------------------
# recompute_tokens


@pytest.mark.parametrize("k", range(5))
def test_recompute_tokens_speculative(k):
    assert recompute_tokens(True, k) == 2 + k
    assert recompute_tokens(False, k) == 1


def test_recompute_tokens_default_k():
    assert recompute_tokens(True) == 2
    assert recompute_tokens(False) == 1


@pytest.mark.parametrize("k", range(5))
def test_full_hit_leaves_exactly_r_tokens(k):
    for layerwise in (True, False):
        r = recompute_tokens(layerwise, k)
        assert dense_external_hit(8192, 0, 8192, r) == 8192 - r
    # Hybrid, one state per block: the cap drops the last block whatever k is (k < lcm).
    states = states_written([(s, s + LCM) for s in range(0, 8192, LCM)])
    assert hybrid_lookup(8192, 8192, states, recompute_tokens(True, k))[2] == 6144


# ---------------------------------------------------------------------------
# dense_external_hit with a local hit (num_computed_tokens > 0)


@pytest.mark.parametrize("num_tokens,local,hit,r,expected", [
    pytest.param(8192, 4096, 8192, 5, 4091, id="store-extends-local-full-hit"),
    pytest.param(8200, 4096, 8192, 5, 4096, id="store-extends-local-enough-left"),
    pytest.param(8192, 4096, 4096, 5, 0, id="store-equals-local"),
    pytest.param(8192, 4096, 2048, 5, 0, id="store-shorter-than-local"),
    pytest.param(8192, 4096, 0, 5, 0, id="store-miss"),
    pytest.param(8192, 8064, 8192, 5, 123, id="one-external-block-full-hit"),
    pytest.param(8193, 8064, 8192, 5, 124, id="one-external-block-1-short"),
    pytest.param(132, 0, 128, 5, 127, id="deficit-of-one"),
    pytest.param(130, 128, 128, 5, 0, id="local-alone-leaves-too-few"),
    pytest.param(8192, 8190, 8192, 5, 0, id="deficit-exceeds-external-clamped"),
])
def test_dense_local_hits(num_tokens, local, hit, r, expected):
    assert dense_external_hit(num_tokens, local, hit, r) == expected


def test_dense_invariants_small_grid():
    for block in (1, 4, 16):
        for num_tokens in range(0, 41):
            for local in range(0, num_tokens + 1, block):
                for hit in range(0, num_tokens + 1, block):
                    for r in range(1, 7):
                        ext = dense_external_hit(num_tokens, local, hit, r)
                        beyond = max(hit - local, 0)
                        assert ext == max(0, min(beyond, num_tokens - local - r))
                        assert 0 <= ext <= beyond
                        if num_tokens - local >= r:
                            assert num_tokens - local - ext >= r
                        if num_tokens > local:
                            assert local + ext < num_tokens  # never the whole prompt


# ---------------------------------------------------------------------------
# Block sizes, recompute larger than the prompt


def test_tiny_block_size():
    assert dense_external_hit(8192, 0, 8192, 5) == 8187
    assert dense_external_hit(10, 0, 10, 1) == 9
    assert hybrid_max_hit_blocks(10, 2, 1) == 8
    every_token = states_written([(i, i + 1) for i in range(10)], lcm=1)
    assert every_token == set(range(1, 11))
    assert hybrid_lookup(10, 10, every_token, 2, lcm=1)[2] == 8
    assert hybrid_lookup(10, 10, states_written([(0, 10)], lcm=1), 2, lcm=1)[2] == 0


def test_huge_block_size():
    huge = 1 << 30
    assert hybrid_max_hit_blocks(8192, 5, huge) == 0
    assert hybrid_max_hit_blocks(huge + 5, 5, huge) == 1
    assert hybrid_max_hit_blocks(huge + 4, 5, huge) == 0
    assert state_dump_positions(0, 8192, huge) == []
    assert state_dump_positions(0, huge, huge) == [huge]
    assert dense_external_hit(8192, 0, 0, 5) == 0


@pytest.mark.parametrize("num_tokens,hit", [(0, 0), (1, 0), (3, 0), (4, 4), (5, 5)])
def test_recompute_at_least_prompt(num_tokens, hit):
    assert dense_external_hit(num_tokens, 0, hit, 5) == 0
    assert hybrid_max_hit_blocks(num_tokens, 5, 1) == 0


def test_hybrid_max_hit_blocks_values():
    assert hybrid_max_hit_blocks(8192, 5, 2048) == 3
    assert hybrid_max_hit_blocks(8197, 5, 2048) == 4
    assert hybrid_max_hit_blocks(2052, 5, 2048) == 0
    assert hybrid_max_hit_blocks(2053, 5, 2048) == 1


def test_hybrid_invariants_small_grid():
    for lcm in (1, 2, 4):
        for num_tokens in range(0, 25):
            for r in range(1, 6):
                for chunk in (lcm, 3, 5, num_tokens or 1):
                    chunks = [(s, min(s + chunk, num_tokens)) for s in range(0, num_tokens, chunk)]
                    states = states_written(chunks, lcm)
                    max_blocks, _, ext = hybrid_lookup(num_tokens, num_tokens, states, r, lcm)
                    assert ext % lcm == 0
                    assert ext <= max_blocks * lcm
                    assert ext == 0 or ext in states  # never a state that was not written
                    assert ext == 0 or num_tokens - ext >= r


# ---------------------------------------------------------------------------
# hybrid_hit_blocks and state_dump_positions


@pytest.mark.parametrize("stage1,available,expected", [
    pytest.param(0, [], 0, id="nothing"),
    pytest.param(0, [True, True], 0, id="no-attention-hit"),
    pytest.param(3, [False, False, True], 3, id="last"),
    pytest.param(3, [True, False, False], 1, id="first-only"),
    pytest.param(3, [True, True, False, True], 2, id="beyond-stage1-ignored"),
    pytest.param(2, [False, True, True, True], 2, id="capped-by-stage1"),
    pytest.param(3, [False, False, False], 0, id="degrade-to-zero"),
    pytest.param(2, (True, False), 1, id="tuple"),
])
def test_hybrid_hit_blocks(stage1, available, expected):
    assert hybrid_hit_blocks(stage1, available) == expected


@pytest.mark.parametrize("start,end,expected", [
    pytest.param(0, 8192, [8192], id="one-chunk-ends-on-boundary"),
    pytest.param(0, 8193, [], id="ends-past-boundary"),
    pytest.param(0, 6144, [6144], id="eagle-first-chunk"),
    pytest.param(6144, 8192, [8192], id="eagle-last-chunk"),
    pytest.param(2047, 2048, [2048], id="one-token-onto-boundary"),
    pytest.param(2048, 4095, [], id="stops-short"),
    pytest.param(4000, 6144, [6144], id="unaligned-start"),
    pytest.param(8192, 8192, [], id="empty-chunk-on-boundary"),
    pytest.param(0, 0, [], id="empty-at-zero"),
])
def test_state_dump_positions(start, end, expected):
    assert state_dump_positions(start, end, LCM) == expected


# ---------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize("fn,args,name", [
    (recompute_tokens, (1, 0), "layerwise"),
    (recompute_tokens, ("yes", 0), "layerwise"),
    (recompute_tokens, (True, -1), "num_speculative_tokens"),
    (recompute_tokens, (True, 1.0), "num_speculative_tokens"),
    (recompute_tokens, (True, True), "num_speculative_tokens"),
    (recompute_tokens, (True, None), "num_speculative_tokens"),
    (dense_external_hit, (-1, 0, 0, 1), "num_tokens"),
    (dense_external_hit, (10.0, 0, 0, 1), "num_tokens"),
    (dense_external_hit, (10, -1, 0, 1), "num_computed_tokens"),
    (dense_external_hit, (10, 11, 0, 1), "num_computed_tokens"),
    (dense_external_hit, (10, 0, -1, 1), "hit_tokens"),
    (dense_external_hit, (10, 0, 11, 1), "hit_tokens"),
    (dense_external_hit, (10, 0, "5", 1), "hit_tokens"),
    (dense_external_hit, (10, 0, 0, 0), "recompute"),
    (dense_external_hit, (10, 0, 0, -1), "recompute"),
    (hybrid_max_hit_blocks, (-1, 1, 1), "num_tokens"),
    (hybrid_max_hit_blocks, (10, 0, 1), "recompute"),
    (hybrid_max_hit_blocks, (10, 1, 0), "lcm_block_size"),
    (hybrid_max_hit_blocks, (10, 1, -2048), "lcm_block_size"),
    (hybrid_max_hit_blocks, (10, 1, 2048.0), "lcm_block_size"),
    (hybrid_hit_blocks, (-1, []), "attention_hit_blocks"),
    (hybrid_hit_blocks, (1.0, [True]), "attention_hit_blocks"),
    (hybrid_hit_blocks, (2, [True]), "state_available"),
    (hybrid_hit_blocks, (1, "T"), "state_available"),
    (hybrid_hit_blocks, (1, [1]), "state_available"),
    (hybrid_hit_blocks, (1, None), "state_available"),
    (hybrid_hit_blocks, (1, {True}), "state_available"),
    (state_dump_positions, (-1, 0, 1), "chunk_start"),
    (state_dump_positions, (0, -1, 1), "chunk_end"),
    (state_dump_positions, (10, 9, 1), "chunk_end"),
    (state_dump_positions, (0, 10.0, 2), "chunk_end"),
    (state_dump_positions, (0, 10, 0), "lcm_block_size"),
])
def test_bad_arguments(fn, args, name):
    with pytest.raises(ValueError, match=name):
        fn(*args)


def test_hit_below_local_is_valid():
    # The store may hold less than the local prefix cache: not an error, just no external hit.
    assert dense_external_hit(8192, 4096, 128, 5) == 0


@pytest.mark.parametrize("scheduled,loaded,at_once", [
    pytest.param(5, 8187, True, id="seed-full-hit-recomputes-5"),
    pytest.param(8, 4096, True, id="repeated-4k-prompt"),
    pytest.param(64, 4096, True, id="1/64-of-the-hit"),
    pytest.param(65, 4096, False, id="just-over-1/64"),
    pytest.param(5 + 1024, 2048, False, id="a-repeat-batched-with-a-long-prefill"),
    pytest.param(4096, 4096, False, id="hit-then-as-much-new"),
    pytest.param(1, 0, False, id="nothing-to-load"),
])
def test_loads_at_once_when_the_step_computes_little_beside_its_loads(scheduled, loaded, at_once):
    assert loads_at_once(scheduled, loaded, 64) is at_once
    assert loads_at_once(scheduled, loaded, 0) is False  # load_at_once_ratio 0: the rule never applies


def test_the_ratio_is_the_config_key():
    assert loads_at_once(8, 4096, 512) is True and loads_at_once(9, 4096, 512) is False
    assert UcmRayConfig().load_at_once_ratio == 64
