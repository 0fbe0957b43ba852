"""The shard's family hints (writer-local placement) and the reader's choice of pools."""

from __future__ import annotations

from ucm_ray.store.engine.family import _fewest_sources
from ucm_ray.store.shard.hints import MAX_POOLS_PER_KEY, FamilyHints

A, B, C = ("a", 1), ("b", 2), ("c", 3)


def test_where_answers_the_registered_pools_most_recent_first():
    hints = FamilyHints(max_keys=100)
    hints.register(A, [b"k1", b"k2"])
    hints.register(B, [b"k2"])
    assert hints.where([b"k1", b"k2", b"k3"]) == [(A,), (B, A), ()]
    hints.register(A, [b"k2"])  # registered again: most recent again, listed once
    assert hints.where([b"k2"]) == [(A, B)]
    assert (hints.asked, hints.answered) == (4, 3)


def test_a_key_keeps_its_most_recent_pools_only():
    hints = FamilyHints(max_keys=100)
    pools = [(f"s{i}", i) for i in range(MAX_POOLS_PER_KEY + 2)]
    for pool in pools:
        hints.register(pool, [b"k"])
    assert hints.where([b"k"]) == [tuple(reversed(pools[-MAX_POOLS_PER_KEY:]))]


def test_the_table_is_bounded_and_drops_the_least_recently_used():
    hints = FamilyHints(max_keys=3)
    hints.register(A, [b"k1", b"k2", b"k3"])
    hints.where([b"k1"])  # asked: used
    hints.register(B, [b"k4"])
    assert len(hints) == 3
    assert hints.where([b"k1", b"k2", b"k3", b"k4"]) == [(A,), (), (A,), (B,)]


def test_consecutive_keys_are_pinned_on_one_pool_where_they_can_be():
    # key 0 only on pool 1; keys 1-2 on pools 2 (most recent) and 1; key 3 only on 2
    assert _fewest_sources([[1], [2, 1], [2, 1], [2]]) == [[1], [1, 2], [1, 2], [2]]
    assert _fewest_sources([[], [3, 1], [1, 3]]) == [[], [3, 1], [3, 1]]


def test_adopted_hints_keep_the_order_they_were_handed_over_in_and_merge_with_registered_ones():
    giver, taker = FamilyHints(max_keys=100), FamilyHints(max_keys=100)
    giver.register(A, [b"k1", b"k2"])
    giver.register(B, [b"k1"])
    handed = dict(zip([b"k1", b"k2"], giver.peek([b"k1", b"k2"])))
    taker.register(C, [b"k2"])  # a writer registered k2 here first
    taker.adopt(handed)
    assert taker.where([b"k1", b"k2"]) == [(B, A), (A, C)]
    assert (taker.adopted, taker.registered) == (2, 1)
    assert taker.stats()["hints_adopted"] == 2


def test_a_lookup_tries_a_few_member_pools_of_a_block_however_many_the_table_names():
    """A hot block's row names up to the copy bound (100 pools at 1,000 nodes); a lookup tries
    the first ``READ_POOLS`` members in the order its node spread them, skipping pools that left."""
    from ucm_ray.store.engine.family import READ_POOLS, read_candidates, spread

    pools = [(f"shard-{i}", i) for i in range(100)]
    at = {pool: i for i, pool in enumerate(pools) if i % 3}  # every third pool left
    order = spread(pools, "node-7")
    got = read_candidates([order, pools[:2], ()], at)
    assert got[0] == [at[pool] for pool in order if pool in at][:READ_POOLS] and READ_POOLS <= 4
    assert got[1:] == [[1], []]


def test_readers_spread_over_a_blocks_copies_once_its_root_owner_names_four():
    """A popular document's copies stop at the copy bound, and the newest would then serve every
    later reader: once a root's owner names 4 pools for a block (all it keeps), each reader
    starts at the one its node picks; with fewer, the most recent writer's first, as before."""
    from collections import Counter

    from ucm_ray.store.engine.family import SPREAD_COPIES_FROM, spread_copies

    assert SPREAD_COPIES_FROM == MAX_POOLS_PER_KEY
    few = (A, B, C)
    assert {spread_copies(few, f"node-{n}") for n in range(50)} == {few}
    full = tuple((f"shard-{i}", i) for i in range(MAX_POOLS_PER_KEY))
    starts = Counter(spread_copies(full, f"node-{n}")[0] for n in range(400))
    assert set(starts) == set(full) and min(starts.values()) > 50
    order = spread_copies(full, "node-3")
    assert sorted(order) == sorted(full) and spread_copies(full, "node-3") == order
