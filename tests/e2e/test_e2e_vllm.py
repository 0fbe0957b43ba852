"""Two real vLLM engines (CPU, separate processes) share one shard fleet.

The engines with the default connector are two processes kept for the whole module (``pair``):
each use of one as a fresh engine first empties vLLM's own prefix cache, so a hit can only come
from the store, and counters are read as changes over that use. The non-layerwise case's one
engine is its A and B the same way: engine starts are most of CI's e2e time, and this module
started 15 before, 8 now.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from tests.support import ROOT
from tests.support.e2e_helpers import EngineProcess, kv_transfer, logprob_drift
from tests.support.store_helpers import corrupt_fleet_entries, restart_shard
from ucm_ray import policy
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

pytestmark = pytest.mark.e2e
BLOCK = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def shared(ray_cluster):
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=256 << 20, ray_namespace="e2e_vllm")) as cfg:
        yield cfg


def connector(cfg, **kw):
    # Generous timeouts: a shard slower than the timeout is a miss, and a busy CI host must not
    # turn an expected hit into one.
    return kv_transfer({"ray_namespace": cfg.ray_namespace, "lookup_timeout_s": 60, **kw})


@pytest.fixture(scope="module")
def pair(shared, tiny):
    """Two engines with the default connector, in processes of their own: the module's "engine A"
    and "engine B" wherever a test's engines have that configuration."""
    engines = [EngineProcess.remote(tiny, connector(shared)) for _ in range(2)]
    yield engines
    for engine in engines:
        ray.kill(engine)


def fresh(engine) -> dict:
    """Empty the engine's own prefix cache (as a new engine's); its counters now, for ``since``."""
    assert ray.get(engine.reset_prefix_cache.remote()), "vLLM refused to reset its prefix cache"
    return ray.get(engine.connector_totals.remote())


def since(engine, before: dict) -> dict:
    """The engine's connector counters changed since ``before`` (scheduler and worker parts)."""
    after = ray.get(engine.connector_totals.remote())
    return {part: {k: v - before[part].get(k, 0) for k, v in after[part].items()} for part in after}


@pytest.fixture(scope="module")
def prompts(tiny):
    return {seed: synthetic_prompt(tiny, 2600, seed=seed) for seed in (1, 2, 3, 6, 7)}


@pytest.fixture(scope="module")
def baseline(tiny, prompts):
    """Greedy outputs with the connector disabled, and that engine's own KV for prompt 1."""
    eng = EngineProcess.remote(tiny, None)
    out = {}
    for seed, p in prompts.items():
        out[(seed, "P")] = ray.get(eng.generate.remote(p[:2560]))["tokens"]
        full = ray.get(eng.generate.remote(p, 8, True))
        out[(seed, "P+s")], out[(seed, "P+s", "logprobs")] = full["tokens"], full["logprobs"]
    out["kv1"] = ray.get(eng.cached_kv.remote(prompts[1][:2560], 3))
    ray.kill(eng)
    return out


@pytest.mark.parametrize("layerwise, seed", [(True, 1), (False, 2)])
def test_engine_b_reuses_engine_a_prefix_with_identical_output(shared, tiny, prompts, pair, baseline, layerwise,
                                                              seed):
    # ``pair`` before ``baseline``: the pair's engines start while the baseline's engine runs
    p = prompts[seed]
    recompute = policy.recompute_tokens(layerwise)
    # layerwise is the default: the module's two engines (B in another process than A); else one
    # of this configuration as A, then, its own cache emptied, as B
    own = [] if layerwise else [EngineProcess.remote(tiny, connector(shared, layerwise=False))] * 2
    a, b = own or pair
    before = fresh(a)
    assert ray.get(a.generate.remote(p[:2560]))["tokens"] == baseline[(seed, "P")]
    assert since(a, before)["scheduler"]["saved_blocks"] == 20

    before = fresh(b)
    out = ray.get(b.generate.remote(p, 8, True))  # P plus a 40-token suffix
    totals = since(b, before)
    assert totals["scheduler"]["hit_tokens"] == policy.dense_external_hit(2600, 0, 2560, recompute) == 2560
    assert out["cached"] == 2560  # vLLM's own count: B's cache was empty, all of it came from the store
    assert totals["worker"]["loaded_blocks"] == 20 and totals["worker"].get("load_failures", 0) == 0
    assert out["tokens"] == baseline[(seed, "P+s")]
    # Finer than tokens: the logprobs match to fp32 rounding (the suffix runs in another batch
    # shape than the reference's single prefill; measured 1e-6). A wrong block moves them ~1e-2.
    drift = logprob_drift(out["logprobs"], baseline[(seed, "P+s", "logprobs")])
    assert drift < 1e-4, f"logprobs drift {drift}"

    # B re-serves P itself: 19 blocks from its own cache, the last from the store minus the recompute
    again = ray.get(b.generate.remote(p[:2560]))
    totals2 = since(b, before)
    assert totals2["scheduler"]["hit_tokens"] - totals["scheduler"]["hit_tokens"] == \
        policy.dense_external_hit(2560, 2432, 2560, recompute) == 128 - recompute
    assert again["cached"] == 2432 + 128 - recompute  # vLLM's own count: its 19 blocks and the store's tail
    assert again["tokens"] == baseline[(seed, "P")]
    for engine in own[:1]:
        ray.kill(engine)


def test_no_hits_across_prompts_or_dtypes(shared, tiny, prompts, pair):
    """A bf16 engine finds nothing of what a float32 engine stored; the control first: what was
    stored is there to be found, by a fresh float32 engine (else "no hits" would hold vacuously)."""
    other = EngineProcess.remote(tiny, connector(shared), dtype="bfloat16")  # starts while the pair runs
    a, same = pair
    before = fresh(a)
    ray.get(a.generate.remote(prompts[3][:2560]))
    assert since(a, before)["scheduler"]["saved_blocks"] == 20
    before = fresh(same)  # same dtype, nothing local
    control = ray.get(same.generate.remote(prompts[3][:2560]))
    hit = policy.dense_external_hit(2560, 0, 2560, policy.recompute_tokens(True))
    assert since(same, before)["scheduler"]["hit_tokens"] == hit == 2558
    assert control["cached"] == hit  # vLLM's own count
    same_tokens = ray.get(other.generate.remote(prompts[3][:2560]))  # other dtype: other namespace
    new_prompt = synthetic_prompt(tiny, 1500, seed=99)
    unrelated = ray.get(other.generate.remote(new_prompt))  # nothing shared at all
    assert ray.get(other.connector_totals.remote())["scheduler"]["hit_tokens"] == 0
    assert same_tokens["cached"] == unrelated["cached"] == 0  # vLLM's own count
    ray.kill(other)


def test_stored_bytes_equal_the_kv_a_plain_engine_computes(shared, tiny, prompts, baseline, pair):
    """Prompt 1 was saved by the first test's engine A; compare layer 3 of each block with the
    KV cache of an engine that ran without the connector."""
    keys = ray.get(pair[0].block_keys.remote(prompts[1][:2560]))
    client = StoreClient(shared)
    entry = 8 * BLOCK * 2 * 2 * 64 * 4  # layers x tokens x (K,V) x kv heads x head size x fp32
    bufs = [torch.zeros(entry, dtype=torch.uint8) for _ in keys]
    for b in bufs:
        client.register_local(b)
    assert all(client.get(keys, bufs))
    layer_bytes = entry // 8
    ref = baseline["kv1"]
    assert len(ref) == len(keys) == 20 and all(r is not None for r in ref)
    for i, (b, r) in enumerate(zip(bufs, ref)):
        assert bytes(b[3 * layer_bytes: 4 * layer_bytes].numpy()) == r, f"block {i} differs"
    client.close()


def test_multiprocess_engine_scheduler_and_worker_in_separate_processes(shared, tiny, tmp_path, ray_cluster, pair):
    """vLLM's own multiprocess engine (engine core and worker are separate processes, neither a
    Ray worker) joins the cluster by address and reuses what an engine in another process saved."""
    import json
    import os
    import subprocess
    import sys

    p = synthetic_prompt(tiny, 2600, seed=4)
    a = pair[0]
    fresh(a)
    ray.get(a.generate.remote(p[:2560]))
    expected = ray.get(a.generate.remote(p))["tokens"]
    req = tmp_path / "request.json"
    req.write_text(json.dumps({"prompt": p, "kv": connector(
        shared, ray_address=ray.get_runtime_context().gcs_address)}))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.support.mp_engine_main", tiny, str(req)], env=env,
                          capture_output=True, text=True, timeout=480, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["cached"] == 2560  # nothing local: all of it came from the store
    assert result["tokens"] == expected


def test_corrupted_bytes_in_the_store_are_recomputed_not_served(shared, tiny, pair):
    """Paranoid mode on the writer: bytes flipped in a shard's pool (real corruption, in the
    /dev/shm file) are caught by the checksum on load, by a reader that did not ask for
    checksums (they are a property of the entry); vLLM recomputes those blocks, the output is
    right, the corrupt entries are removed and the recomputed blocks saved again."""
    p = synthetic_prompt(tiny, 2600, seed=5)
    a = EngineProcess.remote(tiny, connector(shared, checksum=True))
    ray.get(a.generate.remote(p[:2560]))
    expected = ray.get(a.generate.remote(p))["tokens"]  # from A's own cache: no store involved
    keys = ray.get(a.block_keys.remote(p[:2560]))
    ray.kill(a)

    corrupt_fleet_entries(shared, [keys[5], keys[12]])

    b, c = pair  # checksum=False: the default
    before = fresh(b)
    out = ray.get(b.generate.remote(p))
    worker = since(b, before)["worker"]
    assert worker["checksum_mismatches"] == 2 and worker["load_failures"] >= 2
    assert out["tokens"] == expected
    client = StoreClient(shared)
    assert client.lookup(keys) == [True] * 20  # removed, then saved again by B
    client.close()
    before = fresh(c)
    out = ray.get(c.generate.remote(p))
    totals = since(c, before)
    assert out["tokens"] == expected and totals["worker"].get("load_failures", 0) == 0
    assert totals["scheduler"]["hit_tokens"] == 2560
    assert out["cached"] == 2560  # vLLM's own count: C's cache was empty


def test_shard_restarted_under_the_same_name_never_changes_an_output(ray_cluster, tiny, prompts, baseline):
    """Engine A mapped both pools; shard 0 is kill -9'ed and started again (``ucm-ray up``
    again); engine C fills the new pool. A's loads from it must be the new pool's bytes: the
    old code read them through A's mapping of the dead pool and changed A's output."""
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=256 << 20, ray_namespace="e2e_restart")) as cfg:
        a = EngineProcess.remote(tiny, connector(cfg))
        ray.get(a.generate.remote(prompts[6][:2560]))  # A's worker maps both pools now
        restart_shard(cfg, 0)
        c = EngineProcess.remote(tiny, connector(cfg))
        ray.get(c.generate.remote(prompts[7][:2560]))  # saved into the new shard 0 and shard 1
        ray.kill(c)
        # A was idle through the restart: its first request after it may still use the old
        # membership (a miss at worst); the one after runs on the new incarnation.
        ray.get(a.generate.remote(synthetic_prompt(tiny, 300, seed=8)))
        time.sleep(1.5)
        before = ray.get(a.connector_totals.remote())["scheduler"]["hit_tokens"]
        out = ray.get(a.generate.remote(prompts[7], 8, True))
        totals = ray.get(a.connector_totals.remote())
        assert totals["scheduler"]["hit_tokens"] - before == 2560  # all of it from the store
        assert out["cached"] == 2560  # vLLM's own count: A never computed prompt 7
        assert out["tokens"] == baseline[(7, "P+s")]
        drift = logprob_drift(out["logprobs"], baseline[(7, "P+s", "logprobs")])
        assert drift < 1e-4, f"logprobs drift {drift}"
        ray.kill(a)
