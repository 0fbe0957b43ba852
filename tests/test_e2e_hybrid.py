"""A hybrid model (LFM2: attention + short-conv layers) through the connector, two real vLLM engines.

vLLM serves the tiny LFM2 with three kv-cache groups: two ``MambaSpec`` groups (the conv
layers' states, ``mamba_cache_mode="align"``) and one attention group, all with 128-token
blocks, so the LCM block is 128 tokens. A state exists only where a prefill chunk ended on an
LCM boundary; the connector saves it there and a lookup may only end on such a state.

Every engine runs with a 256-token step budget, so vLLM's align-mode scheduler cuts a cold
424-token prompt into the chunks [0, 256), [256, 384), [384, 424): the chunk ends 256 and 384
are LCM boundaries (states are saved there), 424 is not.
"""

from __future__ import annotations

import pytest
import ray

from ucm_ray import policy
from ucm_ray.tiny_model import make_tiny_hybrid_model, synthetic_prompt
from tests.e2e_helpers import EngineProcess, kv_transfer

pytestmark = pytest.mark.e2e

LCM = 128  # attention and state groups both use vLLM's default 128-token block here
STATE_GROUPS = 2  # vLLM packs the 4 conv layers into 2 groups as large as the attention group (2 layers)
BUDGET = 256  # max_num_batched_tokens: a cold prefill is chunked, so A writes states at 256 and 384
ENGINE_KW = dict(mamba_cache_mode="align", max_num_batched_tokens=BUDGET)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return str(make_tiny_hybrid_model(tmp_path_factory.mktemp("lfm2") / "model"))


@pytest.fixture(scope="module")
def shared(ray_cluster):
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.fleet import start_fleet, stop_fleet

    cfg = UcmRayConfig(num_shards=2, pool_bytes=256 << 20, ray_namespace="e2e_hybrid")
    start_fleet(cfg)
    yield cfg
    stop_fleet(cfg)


def _hit(num_tokens: int, state_at: set[int], attention_blocks: int) -> int:
    """What the hybrid policy claims for a prompt whose first ``attention_blocks`` LCM blocks
    are stored, with states stored at the token positions ``state_at``."""
    max_blocks = policy.hybrid_max_hit_blocks(num_tokens, policy.recompute_tokens(True), LCM)
    blocks = min(attention_blocks, max_blocks)
    avail = [(b + 1) * LCM in state_at for b in range(max_blocks)]
    return policy.hybrid_hit_blocks(blocks, avail) * LCM


def test_hybrid_engine_b_reuses_engine_a_prefix_and_states(shared, lfm2):
    ps = synthetic_prompt(lfm2, 464, seed=11)  # P (424 tokens = 3 LCM blocks + 40) and a 40-token suffix
    p = ps[:424]
    q = ps[:300] + synthetic_prompt(lfm2, 100, seed=12)  # shares 2 LCM blocks and 44 tokens with P

    # Reference: no connector, same engine settings. P+s runs cold; P and Q then reuse this
    # engine's own cached states at 384 and 256, which vLLM computes bit-identically to a cold
    # run because the chunk ends (256, 384) are the same.
    base = EngineProcess.remote(lfm2, None, **ENGINE_KW)
    ref = {name: ray.get(base.generate.remote(prompt, 8, True)) for name, prompt in
           (("P+s", ps), ("P", p), ("Q", q))}
    ray.kill(base)
    assert ref["P+s"]["cached"] == 0

    kv = kv_transfer({"ray_namespace": shared.ray_namespace})
    a = EngineProcess.remote(lfm2, kv, **ENGINE_KW)
    out_a = ray.get(a.generate.remote(p, 8, True))
    totals_a = ray.get(a.connector_totals.remote())
    ray.kill(a)
    assert out_a["tokens"] == ref["P"]["tokens"] and out_a["logprobs"] == ref["P"]["logprobs"]
    # Chunks [0,256), [256,384), [384,424): 3 full attention blocks, and each state group's
    # state at the two chunk ends on an LCM boundary (none at 424, nor during decode).
    states_a = {256, 384}
    assert totals_a["worker"]["saved_blocks"] == 3 + STATE_GROUPS * len(states_a)
    assert totals_a["worker"].get("save_failures", 0) == 0

    b = EngineProcess.remote(lfm2, kv, **ENGINE_KW)  # fresh process: nothing cached locally
    out = ray.get(b.generate.remote(ps, 8, True))
    totals = ray.get(b.connector_totals.remote())
    expected = _hit(len(ps), states_a, attention_blocks=3)
    assert expected == 384
    assert totals["scheduler"]["hit_tokens"] == expected and totals["scheduler"]["local_hit_tokens"] == 0
    assert out["cached"] == expected
    assert totals["worker"]["loaded_blocks"] == 3 + STATE_GROUPS and totals["worker"].get("load_failures", 0) == 0
    assert out["tokens"] == ref["P+s"]["tokens"]
    assert out["logprobs"] == ref["P+s"]["logprobs"]  # bit-identical: same bytes, same chunk ends

    # Q diverges from P inside the third LCM block: two attention blocks match and the state at
    # 256 exists (A's first chunk end), so the hit degrades to 256. B holds no state at 256 of
    # its own (it loaded the one at 384), so all of it comes from the store.
    out_q = ray.get(b.generate.remote(q, 8, True))
    totals_q = ray.get(b.connector_totals.remote())
    expected_q = _hit(len(q), states_a, attention_blocks=2)
    assert expected_q == 256
    assert totals_q["scheduler"]["hit_tokens"] - totals["scheduler"]["hit_tokens"] == expected_q
    assert totals_q["scheduler"]["local_hit_tokens"] == 0
    assert out_q["cached"] == expected_q
    assert totals_q["worker"]["loaded_blocks"] - totals["worker"]["loaded_blocks"] == 2 + STATE_GROUPS
    assert totals_q["worker"].get("load_failures", 0) == 0
    assert out_q["tokens"] == ref["Q"]["tokens"] and out_q["logprobs"] == ref["Q"]["logprobs"]
    ray.kill(b)
