"""The fleet's load figure per pool (``store.pool_load``): what engines report, how the directory
decays and sums it, what a push carries (the top ``TOP_POOLS``, only once it moved), and how a hot
row's reader picks between two pools by it."""

from __future__ import annotations

import math
import threading

import pytest

from ucm_ray.store.engine.family import spread
from ucm_ray.store.pool_load import CHANGE_SHARE, NO_LOAD, PoolLoad, PoolReads, pick_two
from ucm_ray.store.types import ShardRecord
from ucm_ray.transport.base import PoolDescriptor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def records(n: int) -> list[ShardRecord]:
    return [ShardRecord(f"s{i}", None, PoolDescriptor(f"s{i}", "node", 1 << 20, None, None, None, 0,  # type: ignore[arg-type]
                                                      incarnation=i + 1))
            for i in range(n)]


def pool(i: int) -> tuple[str, int]:
    return (f"s{i}", i + 1)


def test_reads_are_summed_per_pool_and_drained_once():
    reads = PoolReads()
    assert reads.drain() is None  # nothing read: the poll reports nothing
    reads.add({pool(0): 100, pool(1): 5})
    reads.add({pool(0): 20})
    assert reads.drain() == {pool(0): 120, pool(1): 5}
    assert reads.drain() is None

    threads = [threading.Thread(target=lambda: [reads.add({pool(2): 1}) for _ in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reads.drain() == {pool(2): 4000}


def test_the_figure_decays_with_its_time_constant_and_sums_reports():
    clock = Clock()
    load = PoolLoad(decay_s=10.0, clock=clock)
    load.report({pool(0): 1000})
    assert load.figure(pool(0)) == pytest.approx(100.0)  # bytes over the time constant: a rate
    clock.now += 10.0
    assert load.figure(pool(0)) == pytest.approx(100.0 / math.e)
    load.report({pool(0): 1000, pool(1): 500})
    assert load.figure(pool(0)) == pytest.approx(100.0 / math.e + 100.0)
    assert load.figure(pool(1)) == pytest.approx(50.0)
    clock.now += 10.0 * 25  # past the rebase: the sums are rescaled, the figures are not
    load.report({pool(1): 10})
    assert load.figure(pool(1)) == pytest.approx(50.0 * math.exp(-25) + 1.0)
    assert load.figure(pool(0)) == pytest.approx(0.0, abs=1e-9)
    load.remove(pool(1))
    assert load.figure(pool(1)) == 0.0


def test_a_push_carries_the_most_loaded_member_pools_and_reads_elsewhere_are_zero():
    clock = Clock()
    shards = records(6)
    load = PoolLoad(decay_s=10.0, top=3, clock=clock)
    assert load.publish(shards) is NO_LOAD  # nothing reported: no figure
    load.report({pool(i): 100 * (i + 1) for i in range(5)})
    load.report({("gone", 9): 10_000})  # not a member (left since): never named
    figures = load.publish(shards)
    assert figures.at == (4, 3, 2)  # places in the shard list, most loaded first
    by_pool = figures.by_pool(shards)
    assert by_pool == pytest.approx({pool(4): 50.0, pool(3): 40.0, pool(2): 30.0})
    assert figures.by_pool(shards[:3]) == pytest.approx({pool(2): 30.0})  # a shorter list: its places only


def test_a_report_asks_for_a_push_only_when_it_moved_a_pool_by_more_than_the_change_share():
    clock = Clock()
    shards = records(4)
    load = PoolLoad(decay_s=1000.0, clock=clock)
    assert not load.moved
    load.report({pool(0): 1000, pool(1): 1000})
    assert load.moved  # from nothing pushed
    load.publish(shards)
    assert not load.moved
    load.report({pool(0): int(1000 * CHANGE_SHARE / 2)})  # within the share of what was pushed
    assert not load.moved
    load.report({pool(0): int(1000 * CHANGE_SHARE)})  # past it, added up
    assert load.moved
    load.publish(shards)
    load.report({pool(2): 10})  # a quiet pool's small reads: below the share of the mean
    assert not load.moved
    load.report({pool(2): 400})
    assert load.moved


def test_steady_reads_over_more_pools_than_a_push_carries_push_nothing_once_settled():
    """A pool left out of the push (below the top) reads as 0, but it only matters once it would
    enter the top: steady reads over more pools than ``top`` (1,000 nodes, ``TOP_POOLS`` 100) used
    to move the figure at every report (a left-out pool measured against 0), a push each pacer
    period forever (review65b)."""
    clock = Clock()
    shards = records(9)
    load = PoolLoad(decay_s=10.0, top=3, clock=clock)
    pushes = []
    for second in range(200):
        clock.now += 1.0
        load.report({pool(i): 1000 for i in range(9)})
        if load.moved:
            load.publish(shards)
            pushes.append(second)
    assert pushes and pushes[-1] < 100  # the figures rose to their level, then nothing moved
    load.report({pool(8): 100})  # a left-out pool: not yet past the least pushed by the share
    assert not load.moved
    load.report({pool(8): 10_000})  # now it is: it would enter the top
    assert load.moved
    assert pool(8) in load.publish(shards).by_pool(shards)


def test_the_reader_tries_the_less_loaded_of_two_drawn_pools_then_the_rest_in_order():
    pools = [pool(i) for i in range(5)]
    assert pick_two(pools, {}, 7) == pools  # no figure held: exactly the order given
    assert pick_two(pools[:1], {pool(0): 5.0}, 7) == pools[:1]
    # draw 7 over 5 pools: places 2 and (2 + 1 + 1 % 4) % 5 = 4
    assert pick_two(pools, {pool(2): 9.0, pool(4): 1.0}, 7) == (pool(4), pool(2), pool(0), pool(1), pool(3))
    assert pick_two(pools, {pool(2): 1.0, pool(4): 9.0}, 7) == (pool(2), pool(4), pool(0), pool(1), pool(3))
    assert pick_two(pools, {pool(0): 1.0}, 7) == (pool(2), pool(4), pool(0), pool(1), pool(3))  # a tie: as drawn
    assert pick_two([list(p) for p in pools], {pool(2): 9.0}, 7)[0] == ["s4", 5]  # rows as lists (through Ray)
    # every draw: the two are distinct places, and every pool is tried once
    for draw in range(200):
        got = pick_two(pools, {pool(0): 1.0}, draw)
        assert sorted(got) == sorted(pools) and got[0] != got[1]


def test_a_pool_far_busier_than_the_rest_is_never_first_and_the_rest_share_the_readers():
    pools = spread([pool(i) for i in range(4)], "reader-node")
    busy = pools[0]  # where today's order starts every lookup of this node
    firsts = [pick_two(pools, {busy: 1000.0, pool(9): 1.0}, draw)[0] for draw in range(400)]
    assert busy not in firsts
    assert {first: firsts.count(first) for first in set(firsts)}.keys() == set(pools[1:])
    assert min(firsts.count(p) for p in pools[1:]) > 60  # spread over the other three
