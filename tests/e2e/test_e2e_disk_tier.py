"""A real vLLM engine (CPU) hits a prompt whose blocks the shard's pool evicted to its disk tier.

Engine A computes prompt 1, then two more prompts that need the pool's room: prompt 1's blocks
leave the pool (write-through put them on disk first). A's own prefix cache is reset, and A asks
prompt 1 again: its same-node lookup finds the blocks listed as on the shard's disk in the
published index, the shard promotes them, and A loads them. Then the shard is killed (-9) and
started again: its pool is empty, its disk adopted from the manifest, and A hits prompt 1 from
disk once more. Hits are vLLM's own Prometheus counter; the tokens equal an engine's without the
connector.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import ray

from tests.support.e2e_helpers import EngineProcess, kv_transfer
from tests.support.store_helpers import restart_shard
from ucm_ray import policy
from ucm_ray.store.shard.fleet import fleet_status
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

pytestmark = pytest.mark.e2e
BLOCK = 128
BLOCKS = 4
PROMPT = BLOCKS * BLOCK
SUFFIX = 40


def block_bytes(model: str) -> int:
    """One 128-token block's KV over all layers (float32 K and V): one store entry."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4 * BLOCK


def engine_counter(engine, name: str) -> float:
    """A counter of the engine's Prometheus registry (what its ``/metrics`` serves), read inside
    the engine's process: vLLM's own (``vllm:external_prefix_cache_hits``) or the connector's."""
    def probe(eng):
        return sum(m.value for m in eng.llm.get_metrics() if m.name == name)

    return ray.get(engine.__ray_call__.remote(probe))


def external_hits(engine) -> float:
    return engine_counter(engine, "vllm:external_prefix_cache_hits")


def disk_counters(engine) -> tuple[float, float, float]:
    """The connector's disk hits as the engine saw them: blocks loaded after a promotion, entries
    and bytes its lookups had promoted."""
    return tuple(engine_counter(engine, f"vllm:ucm_ray_disk_{name}")  # type: ignore[return-value]
                 for name in ("hit_blocks", "promoted_entries", "promoted_bytes"))


def test_a_prompt_evicted_to_disk_is_a_hit_with_the_reference_output(ray_cluster, fleet, tmp_path):
    started = time.monotonic()
    model = str(make_tiny_model(tmp_path / "tiny"))
    entry = block_bytes(model)
    # a pool of 6 blocks (and slack for alignment): prompts 2 and 3 (8 blocks) push prompt 1 out
    cfg = fleet(num_shards=1, pool_bytes=6 * entry + (64 << 10), transport="shm", disk_dir=str(tmp_path),
                disk_bytes=64 * entry, disk_write_policy="through", lookup_timeout_s=60, disk_wait_s=10)
    reference = EngineProcess.remote(model, None)
    a = EngineProcess.remote(model, kv_transfer({"ray_namespace": cfg.ray_namespace, "transport": "shm",
                                                 "lookup_timeout_s": 60}))
    p1, p2, p3 = (synthetic_prompt(model, PROMPT + SUFFIX, seed=s) for s in (71, 72, 73))
    expected = ray.get(reference.generate.remote(p1))["tokens"]
    ray.kill(reference)
    print(f"engines up {time.monotonic() - started:.1f} s into the test", flush=True)

    for prompt in (p1[:PROMPT], p2[:PROMPT], p3[:PROMPT]):
        assert ray.get(a.generate.remote(prompt))["cached"] == 0  # cold: computed and saved
    deadline = time.monotonic() + 30
    while (shard := fleet_status(cfg)["shards"][0])["disk_behind"]:  # the last commit's write
        assert time.monotonic() < deadline, shard
        time.sleep(0.1)
    assert shard["evictions"] >= BLOCKS and shard["evicted_dirty"] == 0 and shard["disk_entries"] == 3 * BLOCKS, shard
    manifests_at_written = shard["disk_manifests"]
    print(f"three prompts saved {time.monotonic() - started:.1f} s into the test", flush=True)
    assert ray.get(a.__ray_call__.remote(lambda eng: eng.llm.reset_prefix_cache()))
    hits_before = external_hits(a)
    assert disk_counters(a) == (0, 0, 0)  # the three cold prompts found nothing on disk

    out = ray.get(a.generate.remote(p1))  # prompt 1 plus a suffix: its blocks come from disk
    hit = policy.dense_external_hit(PROMPT + SUFFIX, 0, PROMPT, policy.recompute_tokens(True))
    assert external_hits(a) - hits_before == hit and out["cached"] == hit
    assert out["tokens"] == expected
    shard = fleet_status(cfg)["shards"][0]
    assert shard["disk_promoted"] == BLOCKS and shard["disk_corrupt"] == 0 and shard["disk_promote_late"] == 0
    # the engine's own metrics say so too: every promoted block loaded (the hit is whole blocks)
    deadline = time.monotonic() + 30  # the stat logger's interval
    while (seen := disk_counters(a)) != (BLOCKS, BLOCKS, BLOCKS * entry) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert seen == (BLOCKS, BLOCKS, BLOCKS * entry), seen

    print(f"first disk hit {time.monotonic() - started:.1f} s into the test", flush=True)

    # kill -9 and up again once a manifest followed the writes: one comes within 1 s of a write, or
    # 10x the last manifest's duration where that is longer (a loaded box: several seconds), and
    # what a crash meets unlisted is lost by design. Not awaited past 30 s (it may have come before
    # the count above was read).
    deadline = time.monotonic() + 30
    while fleet_status(cfg)["shards"][0]["disk_manifests"] <= manifests_at_written and time.monotonic() < deadline:
        time.sleep(0.2)
    restart_shard(cfg, 0)
    shard = fleet_status(cfg)["shards"][0]
    assert shard["entries"] == 0 and shard["disk_adopted"] >= BLOCKS, shard  # prompt 1 was written first
    # A's first request after the restart may still use the old membership (a miss at worst)
    ray.get(a.generate.remote(synthetic_prompt(model, 16, seed=74)))
    time.sleep(1.5)
    assert ray.get(a.__ray_call__.remote(lambda eng: eng.llm.reset_prefix_cache()))
    hits_before = external_hits(a)
    out = ray.get(a.generate.remote(p1))  # from the restarted shard's adopted disk entries
    assert external_hits(a) - hits_before == hit and out["cached"] == hit
    assert out["tokens"] == expected
    shard = fleet_status(cfg)["shards"][0]
    assert shard["disk_promoted"] == BLOCKS and shard["disk_corrupt"] == 0 and shard["disk_promote_late"] == 0
    ray.kill(a)
    print(f"done {time.monotonic() - started:.1f} s into the test", flush=True)
