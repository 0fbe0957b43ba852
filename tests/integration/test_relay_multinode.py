"""Readers' copies of a hot prefix on a three-node cluster (``ray.cluster_utils.Cluster``, one
shard per node), through ``StoreClient`` in processes on different nodes: relayed through a
steward (``relay_hot_copies``), the directory takes a few forwards instead of one call per
copying request, and its table names the same pools."""

from __future__ import annotations

import pytest

from tests.support.private_cluster import pinned_nodes, run_driver

COPIES = 6


@pytest.fixture(scope="module")
def result() -> dict:
    return run_driver("relay_driver.py", [], pinned_nodes(3), 300)[0]


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
