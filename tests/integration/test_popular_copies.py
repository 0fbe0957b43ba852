"""A popular document's copies under writer-local placement, on five raylets (one shard each):
a document read once by each of several nodes (a random router in a large fleet: no node reads
it twice, so ``remote_copy_reads: 2`` never copies it) is counted popular by its family root's
owner once another node read it within ``POPULAR_WINDOW_S`` (``shard.remote_reads``; two within
10 s through stop 65); the next node keeps a copy at its first read, and later nodes load from
the copies, not the writer's pool."""

from __future__ import annotations

import pytest

from tests.support.private_cluster import pinned_nodes, run_driver
from ucm_ray.store.shard.remote_reads import POPULAR

DOC = 6


@pytest.fixture(scope="module")
def result() -> dict:
    return run_driver("writer_local_driver.py", ["popular"], pinned_nodes(5), 300)[0]["popular"]


def test_a_second_nodes_first_read_12_s_after_another_nodes_keeps_a_copy(result):
    """Stop 66: one other node's read within ``POPULAR_WINDOW_S`` (50 s) makes a block popular;
    stop 65's rule (two within 10 s) told node 2 nothing here and node 3 nothing either."""
    assert result["written"] == DOC
    first, second, third, _ = result["reads"]
    assert first == {"marks": [0] * DOC, "sources": [0] * DOC, "exact": DOC, "kept": 0}
    # node 1 read it 12 s before: popular, so node 2 keeps a copy at its first read
    assert second == {"marks": [POPULAR] * DOC, "sources": [0] * DOC, "exact": DOC, "kept": DOC}
    before, after = result["hints_registered"]
    assert after == before + DOC  # the copy registered at the family root's owner
    # ... with node 2's id: its places at the root's owner are held, not given back after a while
    assert result["places"] == {"popular_told": DOC, "popular_confirmed": DOC}
    assert third["marks"] == [POPULAR] * DOC and third["kept"] == DOC


def test_later_nodes_load_from_the_copies_not_the_writer(result):
    third, fourth = result["reads"][2:]
    assert third["sources"] == [2] * DOC  # the most recent holder first: node 2's copy
    assert fourth["sources"] == [3] * DOC
    assert third["exact"] == fourth["exact"] == DOC
