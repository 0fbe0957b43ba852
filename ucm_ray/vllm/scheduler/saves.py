"""Save planning: which blocks each step saves, and the slots announced for them ahead.

A prompt's blocks are saved from the step after its first token, beside that step's forward
pass, so no save delays a cold request's first token; generated blocks are saved
DECODE_SAVE_TOKENS at a time, the rest when the request ends. Saves go into write slots granted
ahead of time (``SlotSupply``): a prompt's saves are announced once its first token is out (a
hybrid's first chunks, and a PD prefill's prompt, once its lookup answered: the states are
saved when computed, and the decode waits for the prefill's saves), a decode batch's as its
blocks fill. A hybrid model's states are saved in the step that computes
them, or lost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ucm_ray import policy
from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.slots import SlotSupply
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm.metadata import UcmRayConnectorMetadata
from ucm_ray.vllm.scheduler.geometry import NULL_BLOCK_ID, CacheGeometry
from ucm_ray.vllm.scheduler.request import SlotCounts, TrackedRequest, TrackedRequests, place_together
from ucm_ray.vllm.scheduler.save_jobs import SaveJobs, SaveRowsByRank, WantedSaves, one_pool_list, save_rows
from ucm_ray.vllm.stats import UcmRayStats

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

PROMPT_SLOT_WAIT_S = 0.05
"""How long a dense prompt's first save may wait for the slots asked for it when its first token
came out: saved with what the free stock held, it would go as two jobs a step or two apart, each
planned, posted and committed (a call per shard) on its own. A grant takes a round trip; an ask
that fails ends the wait too."""
DECODE_SAVE_TOKENS = 256
"""Tokens a request generates before their blocks are saved, as one job (the rest at its end):
every save job costs the engine host time (planning, posting the copies, the results and their
commit), a sizeable share of a small model's decode step, so saving each block as it filled
slowed decode. A prompt's blocks are saved as soon as its first token is out, whatever their
number."""
DECODE_ANNOUNCE_TOKENS = DECODE_SAVE_TOKENS * 3 // 8
"""Generated tokens past the last announcement at which a decode batch's slots are announced
again: slots for the batch are asked for 2-3 times as its blocks fill, the last well before the
batch is saved (the free stock covers the rest); each ask is a call per pool."""


@dataclass
class StepClaims:
    """The saves planned so far in this step, bound to slots together once every request is
    planned: a prompt planned after them asks whether the free stock holds its slots beyond
    theirs (bound request by request, theirs were taken by then). Counted only when asked (a
    prompt's first plan: most steps ask nothing), each request's once."""

    planned: list[WantedSaves] = field(default_factory=list)
    counts: SlotCounts = field(default_factory=dict)
    counted: int = 0
    """Of ``planned``, how many are in ``counts``."""


class SavePlanner:
    """Plans each step's saves into ``meta`` and tells the slot supply which saves are coming."""

    def __init__(self, geometry: CacheGeometry, store: BlockStore, slots: SlotSupply, requests: TrackedRequests,
                 jobs: SaveJobs, stats: UcmRayStats, clock: Callable[[], float]) -> None:
        self._geometry = geometry
        self._store = store
        self._slots = slots
        self._requests = requests
        self.jobs = jobs
        self._stats = stats
        self._clock = clock
        self._claims = StepClaims()
        self.finished: list[TrackedRequest] = []
        """Requests finished since the last plan whose last blocks are still to be announced
        (``expect_finished``; the plan asks this list, not a call, every step)."""

    # --- announcements to the slot supply ---------------------------------------------------

    def expect(self, tracked: TrackedRequest, until: int, start: int | None = None, *,
               later: bool = False) -> SlotCounts:
        """Tell the slot supply which saves the prompt's tokens ``[start, until)`` bring
        (``start``: where the last announcement ended, unless blocks must be saved again;
        ``later``: asked for at the next step's tick); their counts per (pool, entry size),
        recorded as announced (``expected_until``)."""
        until = min(until, tracked.hashed_tokens())
        if start is None:
            start = tracked.expected_until
        tracked.expected_until = max(tracked.expected_until, until)
        counts = self.counts(tracked, start, until)
        self._slots.expect(counts, later=later)
        return counts

    def expect_finished(self, tracked: TrackedRequest) -> None:
        """A finished request's generated blocks past its last announcement (an unfinished
        decode batch), announced at the next plan's start (``announce_finished``, where any
        are queued), before the tick that asks for their slots: requests end together (a
        batch's ``max_tokens``), and announced one by one at vLLM's call each placed its few
        new keys in a call of its own (a cold placement call costs about as much as placing a
        prompt's keys)."""
        self.finished.append(tracked)

    def announce_finished(self) -> None:
        """The announcements ``expect_finished`` queued, their new blocks placed in one call;
        their slots asked for at this step's tick."""
        finished, self.finished = self.finished, []
        geometry = self._geometry
        runs: list[tuple[TrackedRequest, int, int, range]] = []
        for tracked in finished:
            start, until = tracked.expected_until, tracked.hashed_tokens()
            for g in geometry.attn if until > start else ():
                blocks = range(start // geometry.block_sizes[g], until // geometry.block_sizes[g])
                runs += [(tracked, rank, g, blocks) for rank in range(len(geometry.namespaces)) if len(blocks)]
        if len(runs) > 1:
            place_together(runs, self._store)
        for tracked in finished:
            self.expect(tracked, tracked.hashed_tokens(), later=True)

    def counts(self, tracked: TrackedRequest, start: int, until: int) -> SlotCounts:
        """Per (pool, entry size), how many entries saving the prompt's ``[start, until)`` writes."""
        until = min(until, tracked.hashed_tokens())
        if until <= start:
            return {}
        return self._counts_of(*self._owners_between(tracked, start, until))

    @staticmethod
    def _counts_of(pools: list[PoolKey], owners: np.ndarray, sizes: list[int]) -> SlotCounts:
        """Per (pool, entry size), how many entries saving keys of these ``owners`` (rows of
        indices into ``pools``, and ``sizes``) writes."""
        if not len(owners):
            return {}
        distinct = set(sizes)  # a model's groups have one or two entry sizes
        out: SlotCounts = {}
        for size in distinct:
            # every replica of every key of this size, counted per owner: one ``bincount``
            # (``np.unique`` of (owner, size) pairs was slower, and every decoding request
            # makes such an announcement)
            rows = owners if len(distinct) == 1 else owners[np.asarray(sizes) == size]
            counts = np.bincount(rows.ravel(), minlength=len(pools)).tolist()
            out.update(((pools[pool_at], size), count) for pool_at, count in enumerate(counts) if count)
        return out

    def _owners_between(self, tracked: TrackedRequest, start: int,
                        until: int) -> tuple[list[PoolKey], np.ndarray, list[int]]:
        """The owners (and entry sizes) of the keys of the blocks and states of the prompt's
        ``[start, until)``: the blocks' as placed once per request, the states' placed now."""
        geometry = self._geometry
        hashes = tracked.request.block_hashes
        placed: list[tuple[list[PoolKey], np.ndarray]] = []
        runs: list[tuple[int, int, range]] = []  # (rank, group, blocks) of each attention placement
        sizes: list[int] = []
        state_keys: list[bytes] = []
        for rank in range(len(geometry.namespaces)):
            for g in geometry.attn:
                blocks = range(start // geometry.block_sizes[g], until // geometry.block_sizes[g])
                if len(blocks):
                    placed.append(tracked.attn_owners(rank, g, blocks, self._store))
                    runs.append((rank, g, blocks))
                    sizes.extend([geometry.entry_bytes[g]] * len(blocks))
            for g in geometry.states:
                for pos in range((start // geometry.lcm + 1) * geometry.lcm, until + 1, geometry.lcm):
                    state_keys.append(geometry.state_key(rank, hashes, g, pos))
                    sizes.append(geometry.entry_bytes[g])
        if state_keys:
            placed.append(self._store.placement(state_keys))
        pools, owners = one_pool_list(
            placed, lambda: [key for run in runs for key in tracked.attn_keys(*run)] + state_keys, self._store)
        return pools, owners, sizes

    def skip(self, tracked: TrackedRequest, until: int) -> None:
        """Blocks up to token ``until`` came from vLLM's own cache or the store (a loaded tail
        block whole): no save, and the slots expected for them go back. (A block vLLM's cache
        shares with a request loading it this very step may yet fail to load: saving it here
        could publish garbage.)"""
        for g in self._geometry.attn:
            tracked.saved_blocks[g] = max(tracked.saved_blocks.get(g, 0), -(-until // self._geometry.block_sizes[g]))
        skipped = min(until, tracked.expected_until)
        if skipped > tracked.unexpected_until:
            self._slots.unexpect(self.counts(tracked, tracked.unexpected_until, skipped))
            tracked.unexpected_until = skipped

    def keep_copies(self, tracked: TrackedRequest, rank: int, blocks: dict[int, list[int]]) -> None:
        """Blocks of the request's hit (per attention group, their indices) that its landed load
        brought from another node, to be saved again into this node's pool by the next plans,
        as a pending save is; their slots are announced now."""
        placed: list[tuple[list[PoolKey], np.ndarray]] = []
        sizes: list[int] = []
        for g, indices in blocks.items():
            tracked.keep_copies(g, rank, indices)
            placed.append(tracked.attn_owners(rank, g, indices, self._store))
            sizes.extend([self._geometry.entry_bytes[g]] * len(indices))
        # one ask per class a tick, whatever the ranks
        placed_once = one_pool_list(
            placed, lambda: [key for g, indices in blocks.items() for key in tracked.attn_keys(rank, g, indices)],
            self._store)
        self._slots.expect(self._counts_of(*placed_once, sizes), later=True)
        self._stats.add(copies_kept=len(sizes))

    # --- the step's plan --------------------------------------------------------------------

    def plan_step(self, out: SchedulerOutput, meta: UcmRayConnectorMetadata, to_plan: list[TrackedRequest]) -> None:
        """This step's saves (of blocks filled before it), into ``meta``; slots expected for the
        prompts whose first token is out and for decode batches as their blocks fill. Every
        request's blocks are bound to slots together: bound request by request, a decode batch
        whose blocks filled in the same step paid the binding's fixed cost (its columns, the
        slot classes, a slot take per class) once per request (0.1-0.26 ms each under the
        profiler on an H100 host, 8B). Slots expected here are asked for once the step is
        planned, one ask per class (``SlotSupply.batched``). ``to_plan``: the requests whose
        last plan does not stand (``TrackedRequests.to_plan``, asked by the caller)."""
        if not to_plan and not self._geometry.hybrid:
            return  # most decode steps: nothing to plan, nothing to announce
        with self._slots.batched():
            if to_plan:
                self._plan_requests(to_plan, meta)
            if self._geometry.hybrid:
                states = save_rows()
                self._plan_every_state(out, states)
                if states:
                    meta.state_saves = self.jobs.dispatch(states, [])

    def _plan_requests(self, to_plan: list[TrackedRequest], meta: UcmRayConnectorMetadata) -> None:
        """The saves of the requests whose last plan does not stand, bound together."""
        wanted: list[tuple[TrackedRequest, WantedSaves]] = []
        self._claims = StepClaims()
        self._place_ahead(to_plan)
        for tracked in to_plan:
            planned = self._plan_request(tracked)
            if planned is not None:
                wanted.append((tracked, planned))
                self._claims.planned.append(planned)
        if wanted:
            self._bind(wanted, meta)

    def _bind(self, wanted: list[tuple[TrackedRequest, WantedSaves]], meta: UcmRayConnectorMetadata) -> None:
        """Bind every request's wanted blocks to slots in one go and dispatch them as the step's
        save jobs; each request's blocks left without a slot stay pending."""
        saves = save_rows()
        bound = self.jobs.bind(saves, WantedSaves.joined([planned for _, planned in wanted]))
        saving: list[str] = []  # requests with rows in this step's saves
        start = 0
        for tracked, planned in wanted:
            mine = bound[start: start + len(planned)]
            start += len(planned)
            if tracked.pending or not mine.all():
                self._settle_pending(tracked, planned, mine)
            if mine.any():
                saving.append(tracked.request.request_id)
        if saves:
            meta.saves = self.jobs.dispatch(saves, saving)

    def _place_ahead(self, to_plan: list[TrackedRequest]) -> None:
        """The keys of the blocks this step's plans announce, placed in one call before them:
        the prompts whose first tokens came out (``_announce_prompt``: prompts that started
        together put them out together) and the next decode batches of requests that reached
        their announcement (``_still_waiting``: requests decoding together reach it together).
        Each announcement then finds its blocks placed; a placement call per request was a
        sizeable share of those steps' plans. (A request that saves instead of announcing gets
        a few of its next blocks placed early: placements are kept until the pools change.)"""
        if self._geometry.hybrid:
            return  # a hybrid's chunks are announced as they come, with its states' keys
        geometry = self._geometry
        runs: list[tuple[TrackedRequest, int, int, range]] = []
        for tracked in to_plan:
            hashed = tracked.hashed_tokens()
            if not tracked.prompt_expected:
                if not tracked.may_save():  # as ``_plan_request`` asks before announcing it
                    continue
                start = max(tracked.expected_until, tracked.saved_tokens())  # as the announcement counts them
                until = min(tracked.request.num_prompt_tokens, hashed)
            elif hashed - tracked.expected_until >= DECODE_ANNOUNCE_TOKENS:
                start, until = tracked.expected_until, hashed
            else:
                continue
            for g in geometry.attn if until > start else ():
                blocks = range(start // geometry.block_sizes[g], until // geometry.block_sizes[g])
                runs += [(tracked, rank, g, blocks) for rank in range(len(geometry.namespaces)) if len(blocks)]
        if len(runs) > 1:
            place_together(runs, self._store)

    def _plan_request(self, tracked: TrackedRequest) -> WantedSaves | None:
        """One request's blocks to save in this step (None: none)."""
        if not tracked.may_save():
            return None
        if not self._geometry.hybrid and not tracked.prompt_expected:
            self._announce_prompt(tracked)
        if tracked.awaited is not None:
            if self._slots_on_their_way(tracked.awaited, tracked.awaited_until):
                return None  # saved whole, as one job, once they are here
            tracked.awaited = None
        return self._plan_saves(tracked) if tracked.block_ids else None

    def _announce_prompt(self, tracked: TrackedRequest) -> None:
        """Once, from where its saves begin (vLLM's own cache may have held the prompt's start, or
        all of it); decode blocks take slots from the supply's stock. Its first save waits for
        the slots the free stock lacks, at most PROMPT_SLOT_WAIT_S (a PD prefill's were asked
        for at its lookup: ``expect_prompt_early``)."""
        tracked.prompt_expected = True
        tracked.expected_until = max(tracked.expected_until, tracked.saved_tokens())
        counts = self.expect(tracked, tracked.request.num_prompt_tokens)
        for slot_class, count in (tracked.awaited or {}).items():
            counts[slot_class] = counts.get(slot_class, 0) + count
        tracked.awaited = None
        if not self._stock_holds(counts):
            tracked.await_slots(counts, self._clock() + PROMPT_SLOT_WAIT_S)

    def expect_prompt_early(self, tracked: TrackedRequest) -> None:
        """A PD prefill's prompt saves (``do_remote_decode``), announced once its lookup answered
        instead of at its first token: that token is its last, the decode it hands off to waits
        for these saves, and slots asked for only then would add a round trip before the first
        of them. The request itself waits for none of them (they still begin after its token)."""
        tracked.awaited = self.expect(tracked, tracked.request.num_prompt_tokens)

    def _slots_on_their_way(self, counts: SlotCounts, until: float) -> bool:
        return not self._stock_holds(counts) and self._slots.asking(counts) and self._clock() < until

    def _stock_holds(self, counts: SlotCounts) -> bool:
        """Whether the free stock holds these slots beyond those the saves planned earlier in
        this step will take (``StepClaims``; counted only where the stock holds these alone)."""
        if not self._slots.holds(counts):
            return False
        claims = self._claims
        for planned in claims.planned[claims.counted:]:
            for slot_class, count in self._slot_counts(planned).items():
                claims.counts[slot_class] = claims.counts.get(slot_class, 0) + count
        claims.counted = len(claims.planned)
        return self._slots.holds({slot_class: count + claims.counts.get(slot_class, 0)
                                  for slot_class, count in counts.items()})

    def _slot_counts(self, wanted: WantedSaves) -> SlotCounts:
        """Per (pool, entry size), the slots binding ``wanted`` takes (every replica of each row
        but vLLM's placeholder block's)."""
        _, groups, _, block_ids = wanted.columns()
        real = block_ids != NULL_BLOCK_ID
        pools, owners = one_pool_list(wanted.placed, lambda: wanted.keys, self._store)
        sizes = np.asarray(self._geometry.entry_bytes, dtype=np.int64)[groups[real]]
        return self._counts_of(pools, owners[real], sizes.tolist())

    def _plan_saves(self, tracked: TrackedRequest) -> WantedSaves | None:
        """Blocks that the steps before this one filled (and hashed), copied while this one runs
        (generated ones once a batch is full or the request ended: ``_saves_wait``); blocks
        still pending (no slot yet, or recomputed after a failed load) first. Their owners are
        placed in one call for the whole request (not one per block). None when none is due."""
        computed = tracked.request.num_computed_tokens  # before this step: vLLM advances it after planning
        since = tracked.computed if tracked.computed < computed else computed  # (no ``min`` call: every fill)
        tracked.computed = computed
        hashed = tracked.hashed_tokens()
        filled = computed if computed < hashed else hashed
        if not tracked.pending and not tracked.finishing and self._still_waiting(tracked, filled, hashed):
            return None
        tracked.waiting_at = None
        wanted = self._wanted(tracked, since, filled)
        # the slots expected for what is planned now are used: a resumed request's local hit
        # must not hand them back (``skip``), or the free stock would drain
        tracked.unexpected_until = max(tracked.unexpected_until, min(tracked.saved_tokens(), tracked.expected_until))
        return wanted if len(wanted) else None

    def _settle_pending(self, tracked: TrackedRequest, wanted: WantedSaves, bound: np.ndarray) -> None:
        """Blocks planned now that got a slot are no longer pending; those without one stay
        resident while the request runs (or is held), pending, counted as skipped once (not at
        every retry)."""
        ranks, groups, blocks, _ = wanted.columns()
        if tracked.pending:
            for block in zip(*(column[bound].tolist() for column in (groups, ranks, blocks))):
                tracked.pending.pop(block, None)
        waiting = 0
        for block in zip(*(column[~bound].tolist() for column in (groups, ranks, blocks))):
            waiting += not tracked.pending.get(block, False)
            tracked.pending[block] = True
        if waiting:
            self._stats.add(saves_skipped=waiting)

    def _still_waiting(self, tracked: TrackedRequest, filled: int, hashed: int) -> bool:
        """Whether a running request's blocks wait for a later plan (``_saves_wait``), recorded
        as its plan's answer until its filled or hashed tokens move (``waiting_at``)."""
        if tracked.waiting_at == (filled, hashed):
            return True  # as at the last plan: nothing to save yet
        if not self._saves_wait(tracked, filled):
            return False
        if hashed - tracked.expected_until >= DECODE_ANNOUNCE_TOKENS:
            self.expect(tracked, hashed)
        tracked.waiting_at = (filled, hashed)
        return True  # no block filled since the last plan, or too few past the prompt yet

    def _wanted(self, tracked: TrackedRequest, since: int, filled: int) -> WantedSaves:
        """The blocks to save now: those filled since the last plan, and pending ones now valid
        (first), a run per group and rank (no Python per block but for pending ones)."""
        wanted = WantedSaves()
        for g in self._geometry.attn:
            size = self._geometry.block_sizes[g]
            full = filled // size
            first = tracked.saved_blocks.get(g, 0)
            computed_now = range(since // size, full)
            self._drop_stale(tracked, g, computed_now.start)
            ids = tracked.block_ids[g]
            for rank in range(len(self._geometry.namespaces)):
                retry = sorted(i for (pg, pr, i), ready in tracked.pending.items()
                               if pg == g and pr == rank and i < full and (ready or i in computed_now))
                blocks: range | list[int] = range(first, full)  # most plans: sliced, never listed
                copies: set[int] = set()
                if retry:
                    blocks = list(dict.fromkeys(retry + list(blocks)))
                    copies = {i for i in retry if tracked.pending.get((g, rank, i), False)}  # kept copies, valid now
                    block_ids = np.asarray([ids[i] for i in blocks], dtype=np.int64)
                else:
                    block_ids = np.asarray(ids[first:full], dtype=np.int64)
                family = tracked.family(rank, self._store.hot_prefix)
                at = np.arange(first, full) if isinstance(blocks, range) else np.asarray(blocks, dtype=np.int64)
                wanted.add(rank, g, at, block_ids, tracked.attn_keys(rank, g, blocks),
                           family.roots(g == self._geometry.attn[0], blocks, copies),
                           tracked.attn_owners(rank, g, blocks, self._store))
            tracked.saved_blocks[g] = max(first, full)
        return wanted

    @staticmethod
    def _drop_stale(tracked: TrackedRequest, group: int, recomputed_from: int) -> None:
        """Pending blocks of ``group`` whose bytes are not valid (``resume``) and that no step will
        compute again (below ``recomputed_from``: vLLM resumed the request with them from its own
        cache, or its computing starts past them): never saved, so never kept pending. A pending
        block keeps the request out of the decode fast path (``TrackedRequests.to_plan``) and off the batching
        of its generated blocks' saves."""
        stale = [block for block, ready in tracked.pending.items()
                 if not ready and block[0] == group and block[2] < recomputed_from]
        for block in stale:
            del tracked.pending[block]

    def _saves_wait(self, tracked: TrackedRequest, filled: int) -> bool:
        """Whether a running request's blocks filled up to token ``filled`` wait for a later
        plan: no block filled since the last one, or every group's prompt blocks are planned and
        fewer than DECODE_SAVE_TOKENS generated tokens are unsaved (counted in tokens over all
        groups, so groups of different block sizes save in the same step)."""
        sizes, saved, attn = self._geometry.block_sizes, tracked.saved_blocks, self._geometry.attn
        # loops, not generators: asked of every request in the step after a block filled
        for g in attn:
            if filled // sizes[g] > saved.get(g, 0):
                break
        else:
            return True
        prompt = tracked.request.num_prompt_tokens
        for g in attn:
            if saved.get(g, 0) < prompt // sizes[g]:
                return False
        return filled - tracked.saved_tokens() < DECODE_SAVE_TOKENS

    # --- a hybrid model's states --------------------------------------------------------------

    def _plan_every_state(self, out: SchedulerOutput, states: SaveRowsByRank) -> None:
        """A hybrid model's states that this step's scheduled requests compute, and slots for
        the next chunk of a prompt while this one runs."""
        for req_id, n_sched in out.num_scheduled_tokens.items():
            scheduled = self._requests.get(req_id)
            if scheduled is None or not scheduled.block_ids:
                continue
            end = scheduled.request.num_computed_tokens + n_sched
            self._plan_states(scheduled, end, states)
            if end < scheduled.request.num_prompt_tokens:
                self.expect(scheduled, end + 2 * self._geometry.chunk_tokens)

    def _plan_states(self, tracked: TrackedRequest, end: int, saves: SaveRowsByRank) -> None:
        """The mamba states at the LCM boundaries this step's chunk reaches (up to token ``end``),
        saved after its forward: the next step overwrites them."""
        geometry = self._geometry
        hashes = tracked.request.block_hashes
        runs: list[tuple[int, int, int, bytes, bytes]] = []  # rank, group, block index, key, family root
        for pos in policy.state_dump_positions(tracked.request.num_computed_tokens, end, geometry.lcm):
            if pos > tracked.hashed_tokens() or pos <= tracked.last_state_pos:
                continue
            for rank in range(len(geometry.namespaces)):
                family = tracked.family(rank, self._store.hot_prefix).root
                for g in geometry.states:
                    runs.append((rank, g, pos // geometry.block_sizes[g] - 1, geometry.state_key(rank, hashes, g, pos),
                                 family))
            tracked.last_state_pos = pos
            tracked.state_positions.append(pos)
        wanted = WantedSaves()
        if runs:
            pools, owners = self._store.placement([key for _, _, _, key, _ in runs])  # one call for the step's states
            for at, (rank, g, block, key, family) in enumerate(runs):
                wanted.add(rank, g, np.asarray([block], dtype=np.int64),
                           np.asarray([tracked.block_ids[g][block]], dtype=np.int64), [key], [family],
                           (pools, owners[at:at + 1]))
        if len(wanted):
            lost = int((~self.jobs.bind(saves, wanted)).sum())  # a state cannot wait: it is lost
            if lost:
                self._stats.add(saves_skipped=lost)
