"""Multi-node on one machine: a three-raylet cluster (``ray.cluster_utils.Cluster``), one
shard per node, writer-local placement (the default). Engine A on node 2 saves a document and
the bytes stay on node 2's shard; engine B on node 1 finds them through the family root's owner
(one call) and node 2's published index, read over NIXL, and loads them over NIXL (what ``transport: auto``
picks for another node's shard); its hit is the policy's and its greedy tokens equal an engine
without the connector, as on one node. A PD handoff across the nodes: A prefills a new prompt,
B decodes it, finding A's saves the same way. B reads the document twice more: the second read
from node 2 keeps a copy on node 1 (``remote_copy_reads``), which serves the next read locally,
and still serves it once node 2's shard is killed; the PD prompt, read from node 2 once, is then
a miss, and every answer equals the reference's. The engines follow the directory through their
node's relay shard (``relay_membership``; the directory path is the integration tests')."""

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
    after = result["after_kill_pd"]
    assert after["scheduler"].get("hit_tokens", 0) == 0  # read once from node 2: its only copy died with its shard
    assert after["tokens"] == after["reference"]


def test_a_document_read_twice_from_another_node_is_copied_to_the_readers_node(result):
    """B's second read of A's document from node 2 (its prefix cache emptied) keeps a copy in
    node 1's pool (``remote_copy_reads`` 2): its next read loads it over shared memory with no
    call, and with node 2's shard killed the copy still serves it; every answer equals the
    reference's."""
    second, third = result["copies"]
    blocks = DOCUMENT // BLOCK
    print(f"multinode copies: kept={second['scheduler'].get('copies_kept', 0)} "
          f"entries={result['copied_entries']} third_calls={third['scheduler'].get('lookup_calls', 0)} "
          f"third_shm={third['worker'].get('loaded_shm_bytes', 0)} "
          f"after_kill_hit={result['after_kill']['scheduler'].get('hit_tokens', 0)}")
    for read in (second, third, result["after_kill"]):
        assert read["tokens"] == read["reference"]
        assert read["scheduler"]["hit_tokens"] == read["cached"] == DOCUMENT
        assert read["worker"].get("load_failures", 0) == 0 and read["worker"].get("stale_loads", 0) == 0
    # the second read still came from node 2, and its blocks were saved again on node 1
    assert second["worker"]["loaded_nixl_bytes"] == second["worker"]["loaded_copy_bytes"] > 0
    assert second["scheduler"]["copies_kept"] == second["scheduler"]["saved_blocks"] == blocks
    entries = dict(result["copied_entries"])
    assert entries.pop(result["writer_node"]) == 2 * blocks  # the document and the PD prompt
    assert sorted(entries.values()) == [0, blocks]  # the reader's node holds the copy, the third none
    # the third read finds the whole document on its own node: no call, no NIXL byte, no new copy
    assert third["scheduler"].get("lookup_calls", 0) == 0 and third["scheduler"].get("copies_kept", 0) == 0
    assert third["worker"]["loaded_shm_bytes"] == third["worker"]["loaded_copy_bytes"] > 0
    assert third["worker"].get("loaded_nixl_bytes", 0) == 0


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


def test_the_engines_follow_the_directory_through_their_nodes_relay(result):
    """``relay_membership`` on: the reader's long poll waits at its own node's shard (its relay),
    which answered it the kill's version; node 0's shard, with no engine of the store on its node,
    relayed nothing. The reads after the kill (above) equal the reference's."""
    relayed = result["relayed_polls"]
    print(f"multinode relay: relayed_polls={relayed}")
    assert relayed[result["reader_node"]] > 0, relayed
    others = [node for node in result["node_ids"] if node not in (result["reader_node"], result["writer_node"])]
    assert [relayed[node] for node in others] == [0], relayed


def test_the_readers_loads_from_another_node_reach_the_directorys_load_figure(result):
    """``pick_by_load`` on: the reader's engine counted what it loaded from the writer's node (the
    scheduler, as the worker reports a load over) and sent it with its long poll to its node's relay,
    which sent it on with its own; the directory's pushed figure names the writer's node's pool (the
    only one read from another node before the kill), and no other."""
    load = result["load"]
    print(f"multinode load figure: {load}")
    assert load["pools_reported"] >= 1, load
    assert list(load["figures"]) == [result["writer_node"]], load
    assert load["figures"][result["writer_node"]] > 0
