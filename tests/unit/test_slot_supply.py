"""SlotSupply's announced saves on the in-process store, with reserve answers held back (a slow
shard): asked for only where the free stock lacks them, counted on until taken, and ready only
once the asks they count on are answered."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from ucm_ray.store.engine.slots import QUIET_TICK_S, SlotSupply
from ucm_ray.store.local import LocalBlockStore
from ucm_ray.store.types import Pending, SlotGrant
from ucm_ray.transport.base import PoolKey

SIZE = 1 << 16


class _Held(Pending[Any]):
    """A reserve answer that the shard gives only once its store is ``answering``."""

    def __init__(self, store: SlowReserves, answer: Pending[Any]) -> None:
        self._store, self._answer = store, answer

    def poll(self) -> bool:
        return self._store.answering

    def result(self) -> Any:
        return self._answer.result()


class SlowReserves(LocalBlockStore):
    """A client of the in-process shards whose slot grants arrive only while ``answering``."""

    def __init__(self, shared: LocalBlockStore) -> None:
        super().__init__(_shared=shared)
        self.answering = True
        self.asked: list[int] = []

    def reserve(self, pool: PoolKey, size: int, count: int) -> Pending[SlotGrant | None]:
        self.asked.append(count)
        return _Held(self, super().reserve(pool, size, count))


@pytest.fixture
def shards() -> Iterator[LocalBlockStore]:
    local = LocalBlockStore(num_shards=1, pool_bytes=64 << 20)
    yield local
    local.shutdown()


def _supply(shards: LocalBlockStore) -> tuple[SlowReserves, SlotSupply, tuple[PoolKey, int]]:
    store = SlowReserves(shards)
    supply = SlotSupply(store, max_free=8, renew_after_s=20.0, idle_s=20.0, usable_s=50.0)
    supply.want(SIZE)
    supply.tick(store.pools())  # the baseline: one free slot, asked for and granted
    supply.tick(store.pools())
    pool = next(iter(store.pools().descriptors))
    return store, supply, (pool, SIZE)


def test_an_announcement_counting_on_another_ones_ask_is_ready_only_once_it_is_answered(shards):
    """Two hybrid requests looked up together: the first one's ask (what it lacks, and as much
    again) covers the second, which asks nothing. Its states cannot wait for a slot, so it must
    not run before that ask is answered (it ran at once, and found one slot of 8)."""
    store, supply, slot_class = _supply(shards)
    store.answering = False
    supply.expect({slot_class: 10})
    asks = len(store.asked)
    supply.expect({slot_class: 8})
    assert len(store.asked) == asks, "the first announcement's ask covers the second"
    assert not supply.ready({slot_class: 8}) and not supply.ready({slot_class: 10})
    store.answering = True
    assert supply.ready({slot_class: 8})
    supply.tick(store.pools())
    assert len(supply.take(*slot_class, 10)) == 10 and len(supply.take(*slot_class, 8)) == 8


def test_a_save_announced_and_taken_in_one_step_leaves_no_promise_behind(shards):
    """A prompt announced and saved in the same step (its slots were in the free stock): the
    take consumes the announcement, so a later one that the stock beyond the baseline covers asks
    nothing (a promise left behind made every later announcement ask twice what it needed)."""
    store, supply, slot_class = _supply(shards)
    supply.expect({slot_class: 20})
    supply.tick(store.pools())
    assert len(supply.take(*slot_class, 20)) == 20
    with supply.batched():
        supply.expect({slot_class: 4})
        assert len(supply.take(*slot_class, 4)) == 4
    spare = supply.free_slots(slot_class) - 1  # beyond the baseline of one
    assert spare > 0
    asks = len(store.asked)
    supply.expect({slot_class: spare})
    assert len(store.asked) == asks, f"asked {store.asked[asks:]} for {spare} slots the stock holds"


def test_only_home_pools_keep_a_baseline_and_another_pools_slots_go_back_once_unused():
    """Two pools, one of them home (the engine's own node's under writer-local placement): the
    baseline asks only there. A save announced on the other pool (a replica) gets its slots
    there; once they sat unused past ``idle_s`` they go back, and that pool is not balanced any
    more: nothing is held or renewed on it."""
    local = LocalBlockStore(num_shards=2, pool_bytes=64 << 20)
    now = [0.0]
    try:
        store = SlowReserves(local)
        supply = SlotSupply(store, max_free=8, renew_after_s=20.0, idle_s=20.0, usable_s=50.0, clock=lambda: now[0])
        supply.want(SIZE)
        home, other = list(store.pools().descriptors)
        pools = replace(store.pools(), home=frozenset({home}))
        for _ in range(3):
            supply.tick(pools)
            now[0] += 1.0
        assert supply.free_slots((home, SIZE)) == 1 and supply.free_slots((other, SIZE)) == 0
        supply.expect({(other, SIZE): 3})
        supply.tick(pools)
        assert supply.free_slots((other, SIZE)) >= 3
        for _ in range(60):
            now[0] += 1.0
            supply.tick(pools)
        assert supply.free_slots((other, SIZE)) == 0, "unused slots of a pool that is not home went back"
        assert all(grant.pool == home for grant in supply._grants.values())
        assert supply.free_slots((home, SIZE)) == 1
    finally:
        local.shutdown()


def test_ticks_while_asks_are_out_take_each_answer_at_the_first_tick_after_it_and_ask_nothing_more(shards):
    """A tick whose only news could be an answer to an ask does a full tick only once one came:
    none is missed or delayed a step, and waiting for them posts nothing."""
    store, supply, slot_class = _supply(shards)
    store.answering = False
    free = supply.free_slots(slot_class)
    supply.expect({slot_class: 10})
    supply.tick(store.pools())
    asks = len(store.asked)
    for _ in range(3):
        supply.tick(store.pools())
    assert len(store.asked) == asks and supply.free_slots(slot_class) == free
    store.answering = True
    supply.tick(store.pools())
    assert supply.free_slots(slot_class) >= 10, "the answer is taken at the first tick after it came"
    assert len(supply.take(*slot_class, 10)) == 10


@pytest.mark.parametrize("renew_after_s, idle_s, usable_s", [(1.0, 2.0, 3.0), (20.0, 20.0, 50.0)])
def test_asks_that_never_answer_do_not_stop_renewals_or_the_slots_held(shards, renew_after_s, idle_s, usable_s):
    """A shard that never answers an ask (the asks stay out): ticks on ~10 ms steps are quiet
    only up to ``quiet_tick_s`` apart (a short timeout's share, or QUIET_TICK_S), so the grants
    held are still renewed in time and stay usable, and nothing more is asked for the saves
    already asked for."""
    now = [0.0]
    renewals: list[float] = []

    class CountedRenewals(SlowReserves):
        def renew(self, grants):
            renewals.append(now[0])
            return super().renew(grants)

    store = CountedRenewals(shards)
    supply = SlotSupply(store, max_free=8, renew_after_s=renew_after_s, idle_s=idle_s, usable_s=usable_s,
                        clock=lambda: now[0])
    supply.want(SIZE)
    pools = store.pools()
    supply.tick(pools)
    supply.tick(pools)
    slot_class = (next(iter(pools.descriptors)), SIZE)
    assert supply.free_slots(slot_class) == 1
    store.answering = False
    supply.expect({slot_class: 10})
    asks = len(store.asked)
    assert supply.quiet_tick_s <= min(0.05 * renew_after_s, QUIET_TICK_S)
    for _ in range(round(10 * renew_after_s / 0.01)):  # 10 renewals' worth of 10 ms steps
        now[0] += 0.01
        supply.tick(pools)
    assert len(store.asked) == asks, "the asks out cover the saves: nothing asked again"
    gaps = [b - a for a, b in zip(renewals, renewals[1:])]
    assert len(renewals) >= 8 and max(gaps) < renew_after_s + supply.quiet_tick_s + 0.011
    assert supply.free_slots(slot_class) == 1, "the baseline's grant was renewed: still usable"


def test_slots_taken_across_grants_are_each_grants_own_in_order(shards):
    """A take that empties one grant and goes on into the next: per slot its grant's token and
    one of that grant's offsets, none twice, the first grant's first."""
    store, supply, slot_class = _supply(shards)
    supply.expect({slot_class: 5})  # a second grant beside the baseline's
    supply.tick(store.pools())
    grants = list(supply._free[slot_class])
    assert len(grants) >= 2
    free = {grant.token: list(grant.free) for grant in grants}
    wanted = len(free[grants[0].token]) + 1
    taken = supply.take(*slot_class, wanted)
    assert len(taken) == wanted and taken.tokens.dtype == taken.offsets.dtype == np.int64
    pairs = list(zip(taken.tokens.tolist(), taken.offsets.tolist()))
    assert pairs == [(grants[0].token, offset) for offset in free[grants[0].token]] + \
        [(grants[1].token, free[grants[1].token][0])]
