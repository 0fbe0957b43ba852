"""The namespace: engines share stored blocks exactly when their target-model KV is the same.

End to end (the digests themselves: ``tests/unit/test_namespace_digests.py``): two real engines
loading the same weights from two directories share through ``model_id``, and do not without it.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import ray

from tests.support.e2e_helpers import EngineProcess, kv_transfer, logprob_drift
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

log = logging.getLogger(__name__)
BLOCK = 128
PREFIX = 8 * BLOCK


# --- end to end: the same weights in two directories ------------------------------------------

@pytest.fixture(scope="module")
def two_copies(tmp_path_factory):
    """The tiny model's weights, and a copy of them in another directory (another mount)."""
    first = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    second = tmp_path_factory.mktemp("mount") / "model"
    shutil.copytree(first, second)
    return str(first), str(second)


@pytest.fixture(scope="module")
def shared(ray_cluster):
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=128 << 20, ray_namespace="e2e_ns")) as cfg:
        yield cfg


def connector(cfg, **kw):
    # Generous timeouts: a shard slower than the timeout is a miss, and a busy host must not
    # turn an expected hit into one.
    return kv_transfer({"ray_namespace": cfg.ray_namespace, "lookup_timeout_s": 60, **kw})


def serve(engine, prompts: list[list[int]], with_connector: bool = True) -> tuple[list[dict], dict]:
    """Serve ``prompts`` in order on a fresh engine, then end it; its outputs and scheduler counters."""
    try:
        outs = [ray.get(engine.generate.remote(p, 8, True)) for p in prompts]
        totals = ray.get(engine.connector_totals.remote())["scheduler"] if with_connector else {}
    finally:
        ray.kill(engine)
    return outs, totals


@pytest.mark.e2e
def test_same_weights_from_two_paths_share_only_through_model_id(shared, two_copies):
    first, second = two_copies
    p = synthetic_prompt(first, PREFIX + 40, seed=41)
    r = synthetic_prompt(first, PREFIX + 40, seed=42)
    # Each engine starts at once (their start-ups overlap) and
    # serves in its turn, on a cache of its own that is still empty.
    ref = EngineProcess.remote(first, None)
    cold_a, other_b = EngineProcess.remote(first, connector(shared)), EngineProcess.remote(second, connector(shared))
    (ref_p, ref_r), _ = serve(ref, [p, r], with_connector=False)
    same_id = [EngineProcess.remote(path, connector(shared, model_id="org/tiny")) for path in (first, second)]

    # Without model_id: the same weights under another path are another model.
    (cold,), _ = serve(cold_a, [r])
    (other_path,), totals = serve(other_b, [r])
    assert cold["cached"] == other_path["cached"] == 0 and totals.get("hit_tokens", 0) == 0
    assert other_path["tokens"] == ref_r["tokens"] and other_path["logprobs"] == ref_r["logprobs"]

    # With the same model_id on both: B loads what A computed.
    (cold,), _ = serve(same_id[0], [p[:PREFIX]])
    assert cold["cached"] == 0
    (warm,), totals = serve(same_id[1], [p])
    assert warm["cached"] == PREFIX and totals["hit_tokens"] == PREFIX
    assert warm["tokens"] == ref_p["tokens"]
    # The 40-token tail runs in another batch shape than the reference's one prefill: logprobs
    # agree to fp32 rounding (measured ~1e-6); a wrong block moves them by ~1e-2.
    drift = logprob_drift(warm["logprobs"], ref_p["logprobs"])
    log.info("model_id hit: logprobs drift %.3g", drift)
    assert drift < 1e-4, f"logprobs drift {drift}"
