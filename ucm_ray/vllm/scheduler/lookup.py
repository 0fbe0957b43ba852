"""Lookups: how much of a request's prompt the store holds, pinned so it stays until loaded.

A lookup is posted once per request (one call per shard per tp rank) and never waited on:
``matched`` answers ``None`` ("ask again") until it lands. Lookups *pin* what they find, so
nothing vLLM was promised can be evicted before the worker copies it. A prompt whose first
block the store surely lacks (this node's published indexes say so) asks for nothing more. A
decode whose prefill announced its saves (``handoff``) is looked up again, with a backoff and
its pins released meanwhile, until the hit they give is there or ``pd_wait_s`` passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ucm_ray import policy
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.slots import SlotSupply
from ucm_ray.store.types import ReadLease
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm.scheduler.answers import StoreAnswers
from ucm_ray.vllm.scheduler.geometry import CacheGeometry
from ucm_ray.vllm.scheduler.handoff import Handoffs
from ucm_ray.vllm.scheduler.prefill_rate import PrefillRate
from ucm_ray.vllm.scheduler.request import Lookup, SlotAsks, TrackedRequest, TrackedRequests
from ucm_ray.vllm.scheduler.saves import SavePlanner
from ucm_ray.vllm.stats import UcmRayStats

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__package__)

LOOKUP_GRACE_S = 0.002
"""How long a new request's lookup may take before the scheduler is told to ask again: most land
within one actor round trip, and answering on the first call saves the request a scheduler step."""


class Lookups:
    """Posts each request's lookup, reads its hit, and releases pins no load took over."""

    def __init__(self, geometry: CacheGeometry, config: UcmRayConfig, store: BlockStore, slots: SlotSupply,
                 requests: TrackedRequests, saves: SavePlanner, answers: StoreAnswers, handoffs: Handoffs,
                 stats: UcmRayStats, clock: Callable[[], float], prefill_rate: PrefillRate) -> None:
        """``prefill_rate``: this engine's, sent with each lookup (a shard reads a disk hit only
        where reading it is faster than this engine recomputes it)."""
        self._geometry = geometry
        self._config = config
        self._store = store
        self._slots = slots
        self._requests = requests
        self._saves = saves
        self._answers = answers
        self._handoffs = handoffs
        self._stats = stats
        self._clock = clock
        self._prefill_rate = prefill_rate
        self._pin_pools: set[PoolKey] = set()  # pools some worker cannot validate unpinned loads of

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: the tokens the store adds to vLLM's own hit,
        and whether they load asynchronously; ``None`` while the lookup (or a hybrid's first
        slots, or a prefill's announced saves) is still on its way."""
        tracked = self._track(request)
        tracked.ask(num_computed_tokens)
        if tracked.async_load_failed:
            return 0, False
        if tracked.lookup_expired(self._clock(), self._config.lease_s / 2):
            self.release(tracked)  # waited so long in the queue that its pins may lapse: look again
        handoff = tracked.handoff
        if handoff is not None and not handoff.may_look(self._clock()):
            return None, False  # its prefill's saves were not there yet: no store call before the backoff
        posted = tracked.lookup is None
        if posted:
            tracked.lookup = self._post(tracked, num_computed_tokens)
            if tracked.lookup is None:
                if handoff is not None:  # nothing the store could add: nothing to wait for
                    self._handoffs.settle(handoff, self._clock(), short=False)
                return 0, False
        lookup = tracked.lookup
        assert lookup is not None
        if not self._answered(lookup.ready, grace=posted):
            return None, False
        if not lookup.answered:
            leases = lookup.take_answers()
            self._stats.add(lookup_calls=sum(lease.calls for lease in leases))
            self._count_promoted(leases)
            tracked.hit_tokens = self._hit_tokens(leases, lookup)
            if self._handoff_waits(tracked, num_computed_tokens):
                self.release(tracked)  # looked up again after the backoff
                return None, False
        if tracked.slot_asks is None:
            tracked.slot_asks = self._ask_slots(tracked, num_computed_tokens)
            posted = True
        asks = tracked.slot_asks
        if not self._answered(lambda: asks.ready(self._slots, self._clock()), grace=posted):
            return None, False
        external = self._external_tokens(tracked, num_computed_tokens)
        return external, self._geometry.async_loads and external > 0

    def _track(self, request: Request) -> TrackedRequest:
        """The request's record; a new one reads what its prefill announced, if anything."""
        tracked = self._requests.get(request.request_id)
        if tracked is None or tracked.request is not request:
            tracked = self._requests.track(request)
            tracked.handoff = self._handoffs.announced(request, self._clock())
        return tracked

    def _handoff_waits(self, tracked: TrackedRequest, num_computed_tokens: int) -> bool:
        """Whether the request waits on for its prefill's saves: the hit (the policy applied) is
        short of what the announced tokens would give, and ``pd_wait_s`` has not passed."""
        handoff = tracked.handoff
        if handoff is None or not handoff.waiting:
            return False
        expected = self._handoffs.expected(handoff, self._lookup_cap(tracked.request, tracked.hashed_tokens()))
        short = (self._policy_hit(tracked.request, num_computed_tokens, tracked.hit_tokens)
                 < self._policy_hit(tracked.request, num_computed_tokens, expected))
        return self._handoffs.waits(handoff, short, self._clock())

    def release(self, tracked: TrackedRequest) -> None:
        """Unpin a lookup no load job took over (no hit used, or never scheduled); one still in
        flight (an abort) is released once its pins are in."""
        lookup, tracked.lookup = tracked.lookup, None
        if lookup is None:
            return
        if lookup.leases is None:
            self._answers.orphan(lookup.futures)
        else:
            self._answers.release([pin for lease in lookup.leases for pin in lease.lease_ids.items()])

    def keep_pools(self, pools: set[PoolKey]) -> None:
        """Forget pools that left the fleet."""
        self._pin_pools &= pools

    def pin_entries_of(self, pools: set[PoolKey]) -> None:
        """A worker cannot validate unpinned loads from these pools (it cannot read their published
        index): their entries are pinned from now on."""
        if pools - self._pin_pools:
            log.info("ucm-ray: a worker cannot read the published index of %s; pinning their entries",
                     sorted(p[0] for p in pools - self._pin_pools))
            self._pin_pools |= pools

    def _ask_slots(self, tracked: TrackedRequest, num_computed_tokens: int) -> SlotAsks:
        """Saves begin where vLLM's cache and the store's hit end. A hybrid's states are saved
        as its chunks compute them: slots for its first chunks now. A dense prompt's slots are
        asked for once its first token is out, as its saves are; a PD prefill's now (its decode
        waits for them)."""
        geometry = self._geometry
        begin = max(num_computed_tokens, tracked.hit_tokens) // geometry.hash_block_size * geometry.hash_block_size
        tracked.expected_until = tracked.unexpected_until = begin
        if geometry.hybrid:
            return SlotAsks(self._saves.expect(tracked, begin + 2 * geometry.chunk_tokens), started=self._clock(),
                            wait_s=self._config.state_slot_wait_s)
        if self._handoffs.hands_off(tracked.request):
            self._saves.expect_prompt_early(tracked)  # its decode waits for these saves
        return SlotAsks({}, started=self._clock(), wait_s=0.0)

    def _external_tokens(self, tracked: TrackedRequest, num_computed_tokens: int) -> int:
        """The tokens vLLM may take from the store (the hit policy applied), counted."""
        request = tracked.request
        external = self._policy_hit(request, num_computed_tokens, tracked.hit_tokens)
        self._stats.add(lookups=1, query_tokens=request.num_tokens, hit_tokens=external,
                        local_hit_tokens=num_computed_tokens,
                        miss_tokens=request.num_tokens - num_computed_tokens - external,
                        recompute_trimmed_tokens=max(0, tracked.hit_tokens - num_computed_tokens - external))
        return external

    def _policy_hit(self, request: Request, num_computed_tokens: int, hit_tokens: int) -> int:
        """The tokens a store hit of ``hit_tokens`` adds to vLLM's own, the hit policy applied."""
        if hit_tokens <= num_computed_tokens:
            return 0
        if self._geometry.hybrid:
            return hit_tokens - num_computed_tokens  # truncated before the lookup: nothing to trim
        return policy.dense_external_hit(request.num_tokens, num_computed_tokens, hit_tokens,
                                         self._geometry.recompute)

    def _answered(self, ready: Callable[[], bool], *, grace: bool) -> bool:
        """Whether ``ready`` holds (within LOOKUP_GRACE_S when ``grace``: just posted, most answers
        land within one actor round trip); if not, the request is put back in the queue (vLLM asks
        again next step) instead of holding up the scheduler."""
        deadline = self._clock() + (LOOKUP_GRACE_S if grace else 0.0)
        while not ready():
            if self._clock() > deadline:
                self._stats.add(lookups_deferred=1)
                return False
            time.sleep(0.0001)  # leave the core to the shard and Ray's threads
        return True

    def _post(self, tracked: TrackedRequest, local_tokens: int) -> Lookup | None:
        """Pin the request's stored blocks, or None when there is nothing to ask: vLLM's own
        prefix cache holds every full block (``local_tokens``; a repeated prompt pays no round trip)."""
        geometry = self._geometry
        request = tracked.request
        hashes = request.block_hashes
        full_tokens = tracked.hashed_tokens()
        max_tokens = self._lookup_cap(request, full_tokens)
        if max_tokens <= 0:
            return None
        if local_tokens >= full_tokens:  # nothing to load, nor to save in the prefill
            self._stats.add(lookups_skipped=1)
            return None
        if self._first_block_absent(tracked):
            return Lookup([], [], [], started=self._clock())  # a cold prompt: no key derived yet, and a hit of 0
        attn_keys, state_keys, futures = [], [], []
        recompute_bytes_s = self._prefill_rate.bytes_per_s
        for rank in range(len(geometry.namespaces)):
            per_group = [tracked.attn_keys(rank, g, range(max_tokens // geometry.block_sizes[g]))
                         for g in geometry.attn]
            per_state = [[geometry.state_key(rank, hashes, g, b * geometry.lcm)
                          for b in range(1, max_tokens // geometry.lcm + 1)] for g in geometry.states]
            attn_keys.append(per_group)
            state_keys.append(per_state)
            flat = [key for keys in per_group + per_state for key in keys]
            chain = len(per_group[0]) if per_group else None
            futures.append(self._store.acquire(flat, self._pin_pools, chain, recompute_bytes_s))
        return Lookup(futures, attn_keys, state_keys, started=self._clock())

    def _lookup_cap(self, request: Request, full_tokens: int) -> int:
        """The most prompt tokens a lookup asks for: the full blocks (``full_tokens``); a hybrid's
        truncated to the LCM boundaries its policy may hit."""
        geometry = self._geometry
        if not geometry.hybrid:
            return full_tokens
        max_lcm = policy.hybrid_max_hit_blocks(request.num_tokens, geometry.recompute, geometry.lcm)
        return min(max_lcm * geometry.lcm, full_tokens)

    def _first_block_absent(self, tracked: TrackedRequest) -> bool:
        """Whether the store surely lacks the prompt's first block on some rank (a hit is a
        prefix on every rank and attention group, so the prompt has none), as this node's
        published indexes say (``surely_absent``: no call; where none can tell, the full lookup
        asks). A long prompt's full lookup derives and locates every block's key per rank, all of
        it host time before a cold request's first token."""
        geometry = self._geometry
        if not geometry.attn or tracked.hashed_tokens() < geometry.block_sizes[geometry.attn[0]]:
            return False  # no attention block to ask for
        group = geometry.attn[0]
        return self._store.surely_absent([tracked.attn_keys(rank, group, range(1))[0]
                                          for rank in range(len(geometry.namespaces))])

    def _count_promoted(self, leases: list[ReadLease]) -> None:
        """The entries (and bytes) shards read from their disk tiers to answer this lookup."""
        promoted = [lease.locations.size[lease.promoted] for lease in leases if lease.promoted is not None]
        if promoted:
            self._stats.add(disk_promoted_entries=sum(len(sizes) for sizes in promoted),
                            disk_promoted_bytes=int(sum(int(sizes.sum()) for sizes in promoted)))

    def _hit_tokens(self, leases: list[ReadLease], lookup: Lookup) -> int:
        """Stage 1 (longest attention prefix over all ranks and groups), then for hybrid
        models stage 2 (furthest LCM boundary whose state every rank and state group has)."""
        if not leases:
            return 0  # the first block was absent: no other key was asked for
        geometry = self._geometry
        prefix: int | None = None
        boundaries = len(lookup.state_keys[0][0]) if geometry.hybrid and lookup.state_keys[0] else 0
        states = [True] * boundaries
        for rank, lease in enumerate(leases):
            found = lease.locations.found()  # attention keys, then states
            at = 0
            for g, keys in zip(geometry.attn, lookup.attn_keys[rank]):
                misses = np.flatnonzero(~found[at:at + len(keys)])
                tokens = (int(misses[0]) if len(misses) else len(keys)) * geometry.block_sizes[g]
                prefix = tokens if prefix is None else min(prefix, tokens)
                at += len(keys)
            for keys in lookup.state_keys[rank]:
                states = [ok and present for ok, present in zip(states, found[at:at + len(keys)].tolist())]
                at += len(keys)
        if not geometry.hybrid:
            return prefix or 0
        return policy.hybrid_hit_blocks((prefix or 0) // geometry.lcm, states) * geometry.lcm
