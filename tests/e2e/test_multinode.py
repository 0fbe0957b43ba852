"""Multi-node on one machine: a three-raylet cluster (``ray.cluster_utils.Cluster``), one
shard per node, writer-local placement (the default). Engine A on node 2 saves a document and
the bytes stay on node 2's shard; engine B on node 1 finds them through the family root's owner
(one call) and node 2's published index, read over NIXL, and loads them over NIXL (what ``transport: auto``
picks for another node's shard); its hit is the policy's and its greedy tokens equal an engine
without the connector, as on one node. A PD handoff across the nodes: A prefills a new prompt,
B decodes it, finding A's saves the same way. With node 2's shard killed, B (its own cache
emptied) misses and still answers as the reference does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.private_cluster import PrivateCluster, cluster_env
from ucm_ray import policy
from ucm_ray.tiny_model import make_tiny_model

pytestmark = pytest.mark.e2e

BLOCK, DOCUMENT = 128, 3072


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def result(model):
    """What the driver saw (one cluster, one fleet, three engines for the whole module)."""
    cluster = PrivateCluster([{"num_cpus": 1, "resources": {f"node_{i}": 1}} for i in range(3)])
    try:
        done = subprocess.run([sys.executable, str(ROOT / "tests/support/multinode_driver.py"), cluster.address, model,
                               str(DOCUMENT)], capture_output=True, text=True, timeout=600, env=cluster_env(), cwd=ROOT)
    finally:
        cluster.close()
    assert done.returncode == 0, done.stderr[-4000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "node_ids": cluster.info["node_ids"]}


def test_saves_stay_on_the_writers_node_and_another_node_loads_them_over_nixl(result):
    assert sorted(result["shard_nodes"].values()) == sorted(result["node_ids"])  # one shard per node
    expected = policy.dense_external_hit(result["num_tokens"], 0, DOCUMENT // BLOCK * BLOCK,
                                         policy.recompute_tokens(True))
    assert result["hit_tokens"] == expected == DOCUMENT
    assert result["cached"] == DOCUMENT  # vLLM's own count: B's cache was empty, all of it came from the store
    assert result["tokens"] == result["reference"]
    entries = dict(result["entries"])
    assert entries.pop(result["writer_node"]) > 0 and set(entries.values()) == {0}  # saves stayed on node 2
    worker = result["worker"]
    print(f"multinode: hit_tokens={result['hit_tokens']} lookup_calls={result['lookup_calls']} "
          f"loaded_shm_bytes={worker.get('loaded_shm_bytes', 0)} "
          f"loaded_nixl_bytes={worker.get('loaded_nixl_bytes', 0)} failures={worker.get('load_failures', 0)}")
    # B's one lookup: one call to the family root's owner; node 2's index is read over NIXL (no
    # pin), and B's worker validates each copy against it (no stale load)
    assert result["lookups"] == 1 and result["lookup_calls"] == 1
    assert worker.get("loaded_shm_bytes", 0) == 0 and worker["loaded_nixl_bytes"] == worker["loaded_copy_bytes"] > 0
    assert worker.get("load_failures", 0) == 0 and worker.get("stale_loads", 0) == 0
    after = result["after_kill"]
    assert after["hit_tokens"] == 0  # no hit: the only copy died with its shard
    assert after["tokens"] == after["reference"]


def test_a_decode_on_another_node_loads_its_prefills_prompt_over_nixl(result):
    """PD across raylets: the prefill on node 2 returned its token before its saves ran; the
    decode on node 1 loads the announced blocks (vLLM's count of cached tokens is the policy's
    hit over them) from node 2's shard over NIXL, waits for no timeout, and its greedy tokens
    equal the reference's."""
    pd = result["pd"]
    scheduler, worker = pd["scheduler"], pd["worker"]
    announced = pd["num_tokens"] // BLOCK * BLOCK
    assert pd["announced"] == announced
    expected = policy.dense_external_hit(pd["num_tokens"], 0, announced, policy.recompute_tokens(True))
    print(f"multinode pd: cached={pd['cached']} expected={expected} lookups={scheduler.get('lookups', 0)} "
          f"lookup_calls={scheduler.get('lookup_calls', 0)} deferred={scheduler.get('lookups_deferred', 0)} "
          f"wait_s={scheduler.get('handoff_wait_seconds', 0):.3f} "
          f"loaded_nixl_bytes={worker.get('loaded_nixl_bytes', 0)} seconds={pd['seconds']:.1f}")
    assert pd["cached"] == expected == scheduler["hit_tokens"] > 0
    assert pd["tokens"] == pd["reference"]
    assert scheduler["handoffs"] == 1 and scheduler.get("handoff_timeouts", 0) == 0
    assert worker.get("loaded_shm_bytes", 0) == 0 and worker["loaded_nixl_bytes"] == worker["loaded_copy_bytes"] > 0
    assert worker.get("load_failures", 0) == 0 and worker.get("stale_loads", 0) == 0
