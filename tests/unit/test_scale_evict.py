"""``benchmarks/scale_evict.py``: writer-local placement's lost hits under eviction, split by cause,
on the simulation's real pools (``BlockIndex``) and designs; what the split must show, not fixed
numbers."""

from __future__ import annotations

import pytest

from benchmarks.scale.workload import Workload, WorkloadSpec
from benchmarks.scale_evict import CAUSES, DiskCluster, observe_runs

POOL_TOKENS = 131072
"""Per node: small enough that 300 requests over 10 nodes evict (a 128k-token document is a
whole pool), as the full size's 313k-token pools do over 1,000."""


DISK_RATIO = 4
"""Each node's disk tier, in pools: within a node's NVMe against its DRAM pool (4-16x)."""
SPEC = WorkloadSpec(nodes=10, requests=300, block_size=128, router="random")


@pytest.fixture(scope="module")
def runs() -> dict:
    return {run.name: run for run in observe_runs(SPEC, Workload(SPEC).requests(), POOL_TOKENS, ["pooled"])}


@pytest.fixture(scope="module")
def disk_runs() -> dict:
    """(a) and (k) over the same workload and pools, each pool with a disk tier behind it."""
    out = observe_runs(SPEC, Workload(SPEC).requests(), POOL_TOKENS, disk_ratio=DISK_RATIO)
    return {run.name.split(" + disk")[0]: run for run in out}


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


def test_a_disk_tier_gives_back_what_writer_local_lost_to_eviction(runs, disk_runs) -> None:
    """With a disk tier behind every pool (the package's write-back and promotion, on the real
    index), neither design hits less than without one, (k)'s evicted-cause loss shrinks, hits read
    from disk are counted, and (k)'s gap to per-block placement narrows: the tier lengthens every
    pool's horizon, the busiest writer's too."""
    for name in ("a per-block", "k built"):
        with_disk, without = disk_runs[name].figures, runs[name].figures
        assert with_disk["hit %"] >= without["hit %"], name
        lost = sum(with_disk[f"lost {cause} %"] for cause in CAUSES)
        assert lost == pytest.approx(100.0 - with_disk["hit %"]), name
        cluster = disk_runs[name].cluster
        assert isinstance(cluster, DiskCluster)
        assert cluster.disk_read_blocks > 0 and with_disk["from disk %"] > 0, name
        assert with_disk["disk read MiB/req"] == pytest.approx(
            cluster.disk_read_blocks * cluster.block_bytes / SPEC.requests / 2**20), name
    built, per_block = disk_runs["k built"].figures, disk_runs["a per-block"].figures
    assert built["lost evicted %"] < runs["k built"].figures["lost evicted %"] - 2
    assert per_block["hit %"] - built["hit %"] < runs["a per-block"].figures["hit %"] - runs["k built"].figures["hit %"]


def test_the_disk_tier_mirrors_hold_what_the_pools_and_disks_hold(disk_runs) -> None:
    """What the designs take as a node's holdings is its pool's entries and its disk's, no more;
    a disk never holds more than its capacity; a pool's entries are exactly the mirror's."""
    for run in disk_runs.values():
        cluster = run.cluster
        assert isinstance(cluster, DiskCluster)
        for node in range(cluster.nodes):
            disk = cluster.disks[node]
            assert len(disk.entries) <= disk.capacity_blocks
            assert cluster.stored[node] == cluster.in_pool[node] | set(disk.entries), (run.name, node)
            assert cluster.pools[node].stats().entries == len(cluster.in_pool[node])
            assert all(cluster.pools[node].contains(list(cluster.in_pool[node])))
