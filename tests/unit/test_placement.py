import hashlib

import numpy as np

from ucm_ray.store.placement import owners, writer_owners


def keys(n, seed=0):
    return [hashlib.blake2b(f"{seed}-{i}".encode(), digest_size=16).digest() for i in range(n)]


def test_top_r_are_distinct_and_deterministic():
    ks = keys(1000)
    shards = [f"s{i}" for i in range(5)]
    a = owners(ks, shards, 3)
    assert a.shape == (1000, 3)
    assert all(len(set(row)) == 3 for row in a.tolist())
    assert np.array_equal(a, owners(ks, shards, 3))


def test_adding_a_shard_moves_about_one_over_n():
    ks = keys(20000)
    before = owners(ks, [f"s{i}" for i in range(4)], 1)[:, 0]
    after = owners(ks, [f"s{i}" for i in range(5)], 1)[:, 0]
    moved = np.mean(before != after)
    assert 0.15 < moved < 0.25  # ideal 1/5 = 0.2
    # every moved key moved to the new shard, none between old shards
    assert set(after[before != after].tolist()) == {4}


def test_balance():
    counts = np.bincount(owners(keys(40000), [f"s{i}" for i in range(4)], 1)[:, 0], minlength=4)
    assert counts.min() > 0.9 * 10000 and counts.max() < 1.1 * 10000


def test_removing_a_shard_promotes_the_next_replica():
    ks = keys(2000)
    shards = [f"s{i}" for i in range(4)]
    full = owners(ks, shards, 2)
    without = owners(ks, shards[1:], 1)[:, 0] + 1  # indices shift by one
    lost_primary = full[:, 0] == 0
    assert np.array_equal(without[lost_primary], full[lost_primary, 1])


def test_short_keys_rejected():
    import pytest

    with pytest.raises(ValueError, match="digest"):
        owners([b"abc"], ["s0"], 1)


def test_the_primary_alone_is_the_first_of_the_replica_order():
    """One replica is placed without sorting the scores: the same shard the full order puts first."""
    ks, shards = keys(5000), [f"s{i}" for i in range(7)]
    assert np.array_equal(owners(ks, shards, 1), owners(ks, shards, 7)[:, :1])
    assert owners(ks, shards, 1).shape == (5000, 1)


def test_scores_are_splitmix64_as_published():
    """Every engine and shard must place a key alike, whatever numpy does: the scores are the
    published splitmix64 sequence (seed 0: e220a8397b1dcdaf, 6e789e6aa1b965f4, 06c45d188009454f)."""
    from ucm_ray.store.placement import _splitmix64

    golden = 0x9E3779B97F4A7C15
    states = np.array([0, golden, 2 * golden % 2**64], dtype=np.uint64)
    assert [int(v) for v in _splitmix64(states)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert [int(v) for v in states] == [0, golden, 2 * golden % 2**64], "the input is left as it was"


def test_writer_local_primary_is_on_the_writers_node_and_replicas_elsewhere():
    ks = keys(2000)
    shards = [f"s{i}" for i in range(6)]
    local = [False, True, False, True, False, False]
    placed = writer_owners(ks, shards, local, 3)
    assert placed.shape == (2000, 3)
    assert set(placed[:, 0].tolist()) == {1, 3}  # both local shards share the primaries
    assert not np.isin(placed[:, 1:], [1, 3]).any()  # replicas never on the writer's node
    assert all(len(set(row)) == 3 for row in placed.tolist())
    # the primary among local shards is rendezvous over them alone: a same-node reader agrees
    assert np.array_equal(placed[:, 0], np.asarray([1, 3])[owners(ks, ["s1", "s3"], 1)[:, 0]])


def test_writer_local_is_per_block_on_one_node_or_without_a_local_shard():
    ks = keys(500)
    shards = [f"s{i}" for i in range(4)]
    for local in ([True] * 4, [False] * 4):
        assert np.array_equal(writer_owners(ks, shards, local, 2), owners(ks, shards, 2))


def test_placements_under_two_memberships_are_placed_again_under_the_current_one():
    """A step's saves placed in parts under one membership are joined as they are; where the
    fleet changed between two parts (another pool list, or rows of another width: replication 2
    over one shard, then two), every key is placed again under the current membership, never
    joined (rows of two widths raised; an older row may name a pool that is gone)."""
    from ucm_ray.store.local import LocalBlockStore
    from ucm_ray.vllm.scheduler.save_jobs import one_pool_list

    store = LocalBlockStore(num_shards=1, pool_bytes=1 << 20, replication=2)
    try:
        ks = keys(6)
        first = store.placement(ks[:2])
        same = store.placement(ks[2:])
        pools, owners = one_pool_list([first, same], lambda: ks, store)
        assert pools == first[0] and owners.tolist() == [[0]] * 6
        store.restart("local_shard_1")  # a second shard joins: rows two owners wide
        later = store.placement(ks[2:])
        assert later[1].shape == (4, 2)
        pools, owners = one_pool_list([first, later], lambda: ks, store)
        current = store.placement(ks)
        assert pools == current[0] and np.array_equal(owners, current[1])
        assert one_pool_list([first], lambda: ks[:2], store) == first
    finally:
        store.shutdown()
