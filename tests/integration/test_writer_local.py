"""Writer-local placement on a three-node cluster (``ray.cluster_utils.Cluster``, one shard per
node), through ``StoreClient`` in processes on different nodes: saves stay on the writer's node;
a reader on another node finds them in one call to the family root's owner, then reads the
writer's published index over NIXL (no pin, no call) and the bytes exact, validated against that
index after the copy (an entry removed meanwhile is stale); a prompt that diverges mid-way gets
its stored prefix; the writer's shard dying makes its blocks misses. ``per_block`` spreads the
same saves over every node (what writer-local placement is for)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT
from tests.support.private_cluster import PrivateCluster, cluster_env

BLOCKS, DIVERGE_AT = 48, 30


def run_driver(placement: str) -> dict:
    cluster = PrivateCluster([{"num_cpus": 1, "resources": {f"node_{i}": 1}} for i in range(3)])
    try:
        done = subprocess.run([sys.executable, str(ROOT / "tests/support/writer_local_driver.py"), cluster.address,
                               placement], capture_output=True, text=True, timeout=300, env=cluster_env(), cwd=ROOT)
    finally:
        cluster.close()
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_saves_stay_on_the_writers_node_and_other_nodes_find_them_in_two_calls():
    result = run_driver("writer_local")
    assert result["written"] == BLOCKS
    entries = result["entries_by_node"]
    assert entries.pop(result["writer_node"]) == BLOCKS
    assert set(entries.values()) == {0}  # nothing left the writer's node
    assert sum(result["hints_by_node"].values()) == BLOCKS  # all at the family root's owner
    assert result["same_node"] == {"found": BLOCKS, "got": BLOCKS, "exact": BLOCKS, "calls": 0}
    # another node: one call to the root's owner, then the writer's index read over NIXL
    assert result["other_node"] == {"found": BLOCKS, "got": BLOCKS, "exact": BLOCKS, "calls": 1}
    # an entry read unpinned from another node and removed before its copy is validated: stale
    assert result["removed_mid_copy"] == {"unpinned": 8, "calls": 1, "stale_before": 0, "removed": 8,
                                          "stale_after": 8, "unreadable": 0}
    diverged = result["diverged"]
    assert diverged["found"] == diverged["got"] == diverged["exact"] == DIVERGE_AT
    after = result["after_kill"]
    assert after["found"] == after["got"] == after["exact"] == 0
    assert after["calls"] == 1  # the root's owner still answers (or is gone); the dead pool is not asked


def test_per_block_placement_spreads_the_same_saves_over_every_node():
    result = run_driver("per_block")
    assert result["written"] == BLOCKS
    assert all(count > 0 for count in result["entries_by_node"].values())
    assert sum(result["hints_by_node"].values()) == 0
    assert result["other_node"]["exact"] == BLOCKS
