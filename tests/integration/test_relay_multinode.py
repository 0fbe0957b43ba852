"""Readers' copies of a hot prefix on a three-node cluster (``ray.cluster_utils.Cluster``, one
shard per node), through ``StoreClient`` in processes on different nodes: relayed through a
steward (``relay_hot_copies``), the directory takes a few forwards instead of one call per
copying request, and its table names the same pools."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.private_cluster import PrivateCluster, cluster_env

COPIES = 6


@pytest.fixture(scope="module")
def result() -> dict:
    cluster = PrivateCluster([{"num_cpus": 1, "resources": {f"node_{i}": 1}} for i in range(3)])
    try:
        done = subprocess.run([sys.executable, str(ROOT / "tests/support/relay_driver.py"), cluster.address],
                              capture_output=True, text=True, timeout=300, env=cluster_env(), cwd=ROOT)
    finally:
        cluster.close()
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_relayed_announcements_take_the_directorys_calls_down_and_name_the_same_pools(result):
    off, on = result["off"], result["on"]
    for phase in (off, on):
        assert phase["written"] == COPIES and phase["copied"] == 2 * COPIES
        assert phase["named"] == [3] * COPIES  # the writer's pool and both readers' copies
    # direct: one directory call per copying request; relayed: the steward's forwards, at most
    # one a second and one at the start (the 12 copies took ~0.08 s here: 2 forwards)
    assert off["directory_calls"] == 2 * COPIES
    assert on["directory_calls"] == result["steward"]["relay_forwards"] <= 2 + int(on["seconds"])
    assert on["directory_calls"] < off["directory_calls"]
    assert result["steward"]["relayed_copies"] == 2 * COPIES and result["steward"]["relay_dropped"] == 0
