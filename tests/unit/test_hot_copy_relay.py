"""A steward's gathered announcements of readers' hot-prefix copies (``store.hot_copy_relay``):
what a forward carries, in what order, and its bound."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter

from ucm_ray.store.hot_copy_relay import HotCopyRelay, steward_key
from ucm_ray.store.placement import owners

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


def test_the_steward_of_an_announcement_is_placed_by_its_first_copied_block_salted_apart_from_its_owner():
    """One steward per first block (a prefix's readers gather at one shard), whatever else was
    copied; not the first block's own owner (its prefix's root owner while it was learned: both
    roles on one node made the fleet's hottest node at 1,000 nodes, docs/scaling.md, stop 60)."""
    first = hashlib.sha256(b"first").digest()[:16]
    salted = steward_key([first, b"second"])
    assert salted == steward_key([first]) != first
    assert len(salted) == 16 and steward_key([hashlib.sha256(b"other").digest()[:16]]) != salted
    ids = [f"shard-{i}" for i in range(64)]
    firsts = [hashlib.sha256(i.to_bytes(4, "little")).digest()[:16] for i in range(256)]
    stewards = owners([steward_key([key]) for key in firsts], ids, 1)[:, 0]
    assert (stewards != owners(firsts, ids, 1)[:, 0]).mean() > 0.9  # ~63/64 apart


def test_announcements_gathered_while_forwards_are_taken_are_each_forwarded_once():
    """The shard's calls gather on their threads while its forward timer takes on another: every
    (pool, key) announced lands in exactly one forward, none lost between a take and a gather."""
    relay = HotCopyRelay()
    announced = [(POOL_A if i % 2 else POOL_B, i.to_bytes(4, "little")) for i in range(20_000)]
    forwards: list[dict] = []
    done = threading.Event()

    def gather(start: int) -> None:
        for pool, key in announced[start::4]:
            relay.gather({pool: [key]})

    def forward() -> None:
        while not done.is_set():
            forwards.append(relay.take())
        forwards.append(relay.take())

    taker = threading.Thread(target=forward)
    taker.start()
    gatherers = [threading.Thread(target=gather, args=(start,)) for start in range(4)]
    for thread in gatherers:
        thread.start()
    for thread in gatherers:
        thread.join()
    done.set()
    taker.join()
    forwarded = Counter((pool, key) for out in forwards for pool, keys in out.items() for key in keys)
    assert forwarded == Counter(announced)
    assert len(relay) == 0 and relay.counts.gathered == len(announced) and not relay.counts.dropped
