"""A popular document's copies under writer-local placement, on five raylets (one shard each):
a document read once by each of several nodes (a random router in a large fleet: no node reads
it twice, so ``remote_copy_reads: 2`` never copies it) is counted popular by its family root's
owner once two other nodes read it within ``POPULAR_WINDOW_S`` (``shard.remote_reads``; within
10 s through stop 65); the next node keeps a copy at its first read, and a later node loads from
that copy, not the writer's pool."""

from __future__ import annotations

import pytest

from tests.support.private_cluster import pinned_nodes, run_driver
from ucm_ray.store.shard.remote_reads import POPULAR

DOC = 6


@pytest.fixture(scope="module")
def result() -> dict:
    return run_driver("writer_local_driver.py", ["popular"], pinned_nodes(5), 300)[0]["popular"]


def test_a_third_nodes_first_read_after_two_other_nodes_within_50_s_keeps_a_copy(result):
    """Stop 66: two other nodes' reads within ``POPULAR_WINDOW_S`` (50 s) make a block popular;
    stop 65's rule (within 10 s) told node 3 nothing here: node 1 read it 12 s before node 2."""
    assert result["written"] == DOC
    first, second, third, fourth = result["reads"]
    for read in (first, second):  # a node's first read, fewer than two other nodes before it
        assert read == {"marks": [0] * DOC, "sources": [0] * DOC, "exact": DOC, "kept": 0}
    # nodes 1 and 2 read it within 50 s: popular, so node 3 keeps a copy at its first read
    assert third == {"marks": [POPULAR] * DOC, "sources": [0] * DOC, "exact": DOC, "kept": DOC}
    before, after = result["hints_registered"]
    assert after == before + DOC  # the copy registered at the family root's owner
    # ... with node 3's id: its places at the root's owner are held, not given back after a while
    assert result["places"] == {"popular_told": DOC, "popular_confirmed": DOC}
    assert fourth["marks"] == [POPULAR] * DOC


def test_a_fourth_nodes_read_loads_from_the_copy_not_the_writer(result):
    fourth = result["reads"][3]
    assert fourth["sources"] == [3] * DOC  # the most recent holder first: node 3's copy
    assert fourth["exact"] == DOC
