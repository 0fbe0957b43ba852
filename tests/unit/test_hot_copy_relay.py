"""A steward's gathered announcements of readers' hot-prefix copies (``store.hot_copy_relay``):
what a forward carries, in what order, and its bound."""

from __future__ import annotations

from ucm_ray.store.hot_copy_relay import HotCopyRelay, steward_key

POOL_A, POOL_B = ("shard-a", 1), ("shard-b", 2)


def test_a_forward_carries_each_pools_keys_once_in_the_order_announced_then_nothing():
    relay = HotCopyRelay()
    relay.gather({POOL_A: [b"k1", b"k2"]})
    relay.gather({POOL_B: [b"k1"], POOL_A: [b"k2", b"k3"]})  # a pool announced twice: once a key
    assert len(relay) == 4
    assert relay.take() == {POOL_A: [b"k1", b"k2", b"k3"], POOL_B: [b"k1"]}
    assert list(relay.take()) == [POOL_A, POOL_B][:0]  # taken: the next window starts empty
    assert relay.counts.gathered == 5 and relay.counts.forwarded == 1 and relay.counts.dropped == 0


def test_past_its_bound_an_announcement_is_dropped_and_counted():
    relay = HotCopyRelay(max_keys=3)
    relay.gather({POOL_A: [b"k1", b"k2"]})
    relay.gather({POOL_B: [b"k1", b"k2", b"k3"]})
    assert relay.take() == {POOL_A: [b"k1", b"k2"], POOL_B: [b"k1"]}
    assert relay.counts.dropped == 2
    relay.gather({POOL_B: [b"k2"]})  # room again once forwarded
    assert relay.take() == {POOL_B: [b"k2"]}


def test_the_steward_of_an_announcement_is_the_owner_of_its_first_copied_block():
    assert steward_key([b"first", b"second"]) == b"first"
