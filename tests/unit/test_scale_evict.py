"""``benchmarks/scale_evict.py``: writer-local placement's lost hits under eviction, split by cause,
on the simulation's real pools (``BlockIndex``) and designs; what the split must show, not fixed
numbers."""

from __future__ import annotations

import pytest

from benchmarks.scale.workload import Workload, WorkloadSpec
from benchmarks.scale_evict import CAUSES, observe_runs

POOL_TOKENS = 131072
"""Per node: small enough that 300 requests over 10 nodes evict (a 128k-token document is a
whole pool), as the full size's 313k-token pools do over 1,000."""


@pytest.fixture(scope="module")
def runs() -> dict:
    spec = WorkloadSpec(nodes=10, requests=300, block_size=128, router="random")
    return {run.name: run for run in observe_runs(spec, Workload(spec).requests(), POOL_TOKENS, ["pooled"])}


def test_the_causes_add_up_to_the_tokens_missed(runs) -> None:
    for run in runs.values():
        figures = run.figures
        lost = sum(figures[f"lost {cause} %"] for cause in CAUSES)
        assert lost == pytest.approx(100.0 - figures["hit %"]), run.name
        assert figures["evictions"] > 0, run.name  # the pools evict: what the split is about


def test_writer_local_loses_its_hits_to_its_pools_partition_not_to_its_index(runs) -> None:
    """(k) loses hits against per-block placement to blocks evicted (held by no pool), and the same
    design with one pool of the fleet's capacity (a global LRU, as per-block placement's hashing
    makes the pools together) gets them back: the cause is how the capacity is split, by writer."""
    per_block, built, pooled = runs["a per-block"], runs["k built"], runs["k pooled"]
    assert built.figures["hit %"] < per_block.figures["hit %"] - 2
    assert built.figures["lost evicted %"] > per_block.figures["lost evicted %"] + 2
    assert pooled.figures["hit %"] > per_block.figures["hit %"] - 1
    assert built.figures["lost unfound %"] < 1  # the index finds what the pools hold
    # writes land on the writers' nodes unevenly; per-block placement spreads them
    assert built.cluster.writes.max() / built.cluster.writes.min() > 2 * (
        per_block.cluster.writes.max() / per_block.cluster.writes.min())
    assert pooled.design.cluster.pools[0] is pooled.design.cluster.pools[-1]
