"""Prefill/decode through the tier with real vLLM engines (CPU), each in its own process, as a PD
proxy drives them: the prefill gets ``do_remote_decode`` and one token, the decode the params
the prefill's output carries. What the two-halves harness (``tests/unit/test_pd_handoff.py``)
cannot show: the decode's greedy tokens equal an engine's without the connector, while its
lookup waits for a prefill that has not saved yet, and when the prefill's process dies before
its saves land (then nothing it held on the shards outlives their timeouts).
"""

from __future__ import annotations

import time

import pytest
import ray

from tests.support.e2e_helpers import EngineProcess, kv_transfer
from tests.support.serve_run import pools_left
from ucm_ray import policy
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e_pd_faults"
PD_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
PROMPT = 2600  # 20 full blocks of 128 and 40 tokens
WAIT_S = 6.0
"""The decode's ``pd_wait_s``: longer than the pause before the prefill saves in the wait test."""
TIMEOUT_S = 2.0
"""The shards' and engines' grant timeout: a killed engine's grants lapse after it (and as long
again in quarantine)."""
TIMEOUTS = {"reserve_timeout_s": TIMEOUT_S, "transfer_timeout_s": TIMEOUT_S / 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def shared(ray_cluster):
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=256 << 20, ray_namespace=NAMESPACE, **TIMEOUTS)) as cfg:
        yield cfg
    assert not pools_left(NAMESPACE), "the fleet left pool files in /dev/shm"


@pytest.fixture(scope="module")
def prompts(tiny):
    return {seed: synthetic_prompt(tiny, PROMPT, seed=seed) for seed in (41, 42)}


@pytest.fixture(scope="module")
def reference(tiny, prompts):
    """Greedy tokens of an engine without the connector."""
    engine = EngineProcess.remote(tiny, None)
    tokens = {seed: ray.get(engine.generate.remote(p, 8))["tokens"] for seed, p in prompts.items()}
    ray.kill(engine)
    return tokens


def _engine(tiny, cfg, **extra):
    return EngineProcess.remote(tiny, kv_transfer({"ray_namespace": cfg.ray_namespace, "lookup_timeout_s": 60,
                                                   **TIMEOUTS, **extra}))


@pytest.fixture(scope="module")
def engines(shared, tiny, reference):
    """A prefill engine and a decode engine with the connector (the fault test kills both)."""
    prefill, decode = _engine(tiny, shared), _engine(tiny, shared, pd_wait_s=WAIT_S)
    ray.get([prefill.pid.remote(), decode.pid.remote()])  # both started
    yield prefill, decode
    for engine in (prefill, decode):
        ray.kill(engine)


def _totals(engine) -> dict[str, float]:
    return ray.get(engine.connector_totals.remote())["scheduler"]


def _held(cfg) -> dict[str, int]:
    """Pins, granted and quarantined bytes left on the shards."""
    from ucm_ray.store.shard.fleet import fleet_status

    shards = fleet_status(cfg)["shards"]
    return {name: sum(s[name] for s in shards) for name in ("pins", "pending_bytes", "quarantined_bytes")}


def test_the_decode_waits_for_a_prefill_that_saves_late_then_loads_its_prompt(shared, prompts, reference, engines):
    """The prefill returned its token and has not saved yet (its engine idles for half a second
    before the step that saves; a serving engine runs that step at once, but the decode's lookup
    can still come before the commit lands); the decode's lookup arrives first and asks vLLM
    again until the saves are there, then loads the announced blocks, as vLLM's own count of
    cached tokens says, and its tokens are the reference's."""
    prefill, decode = engines
    p = prompts[41]
    params = ray.get(prefill.generate_pd.remote(p, 1, PD_PREFILL, flush=False))["kv_transfer_params"]
    assert params["ucm_ray"]["tokens"] == 2560
    pending = decode.generate_pd.remote(p, 8, params)
    # the decode's lookup is in and waiting; within HOLD_S (1 s), after which an engine that
    # took no step gives a finished request's unsaved blocks up
    time.sleep(0.5)
    ray.get(prefill.flush.remote())
    assert _totals(prefill)["saved_blocks"] == 20
    out = ray.get(pending, timeout=120)
    assert out["tokens"] == reference[41]
    assert out["cached"] == policy.dense_external_hit(PROMPT, 0, 2560, policy.recompute_tokens(True)) == 2560
    totals = _totals(decode)
    assert totals["handoffs"] == 1 and totals.get("handoff_timeouts", 0) == 0
    assert totals["handoff_wait_seconds"] > 0, "the decode's lookup came after the prefill's commit: no wait"


def test_a_prefill_killed_before_its_saves_land_leaves_a_decode_that_computes_and_nothing_held(
        shared, prompts, reference, engines):
    """The prefill's process dies right after its response, before the step that saves its
    prompt: the decode waits ``pd_wait_s``, counts a timeout and computes the prompt itself,
    with the reference's tokens; once both engines are gone, every pin and grant they held on
    the shards lapses (and the fleet leaves no file in /dev/shm, checked as it stops)."""
    prefill, decode = engines
    p = prompts[42]
    params = ray.get(prefill.generate_pd.remote(p, 1, PD_PREFILL, flush=False))["kv_transfer_params"]
    ray.kill(prefill)
    before = _totals(decode)
    out = ray.get(decode.generate_pd.remote(p, 8, params), timeout=120)
    assert out["tokens"] == reference[42] and out["cached"] == 0
    totals = _totals(decode)
    assert totals["handoff_timeouts"] - before.get("handoff_timeouts", 0) == 1
    assert totals["handoff_wait_seconds"] - before["handoff_wait_seconds"] >= WAIT_S
    ray.kill(decode)
    deadline = time.monotonic() + 4 * TIMEOUT_S + 10
    while any((held := _held(shared)).values()):
        assert time.monotonic() < deadline, f"still held on the shards: {held}"
        time.sleep(0.2)
