"""One request as the scheduler half sees it: an explicit phase, and what each phase keeps.

A request is looked up (LOOKUP), loads its hit if vLLM took one (LOADING, until the step's
plan hands its load jobs to the workers), runs while its blocks are saved as they fill
(RUNNING), and, where vLLM finished it with blocks unsaved or still being copied, is held until
they are (FINISHING). A request vLLM preempts stays RUNNING until vLLM asks for its hit again.
The request's methods own these transitions and answer the questions the parts ask of it.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from vllm.v1.request import RequestStatus

from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.slots import SlotSupply
from ucm_ray.store.types import NO_HINT, Pending, ReadLease
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm.scheduler.geometry import CacheGeometry
from ucm_ray.vllm.stats import UcmRayStats

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

@dataclass(frozen=True)
class Family:
    """Where writer-local placement registers a request's blocks (``TrackedRequest.family``)."""

    root: bytes
    """The family root: the first block past the fleet's hot prefix (what readers ask about)."""
    first: bytes
    """The prompt's first block: the root its hot prefix's own blocks are registered under (its
    owner learned them; its hints keep the hot-prefix table's pools current when it is announced
    again)."""
    hot: int
    """Leading blocks of the first attention group in the hot prefix."""

    def roots(self, group_is_chain: bool, blocks: range | list[int], copies: set[int]) -> list[bytes]:
        """The root each of these blocks is registered under (``copies``: those among them that
        are copies kept of another node's block): ``NO_HINT`` for a copy of a hot prefix's block
        (``remote_copy_reads``): readers of a hot prefix take the table's pools or their own
        node's, and never ask its first block's owner, where every node's copy would be posted
        (at 1,000 nodes that owner was the fleet's hottest: docs/scaling.md, stop 53); the copy
        is announced to the directory instead, whose table names it (stop 54). Only the hot
        prefix's blocks (usually none) are looked at one by one."""
        out = [self.root] * len(blocks)
        if group_is_chain and self.hot:
            for at, block in enumerate(blocks):
                if block < self.hot:
                    out[at] = NO_HINT if block in copies else self.first
        return out


HOLD_S = 1.0
"""How long a finished request's blocks may be kept for saves still waiting for write slots;
then they are dropped (``saves_dropped``) and vLLM frees the blocks. A grant takes a round trip,
but an engine's first ones take longer (docs/performance-log.md, "Figures moved out of code")."""

FIRST_LOOK_AGAIN_S = 0.002
"""A decode waiting for its prefill's saves looks again after this, then after twice as long
each time, up to LOOK_AGAIN_MAX_S: a prefill's saves usually land within a step or two of its
response, and looking at every scheduler step would cost a store call per step."""
LOOK_AGAIN_MAX_S = 0.05

SlotCounts = dict[tuple[PoolKey, int], int]
"""Slots per (pool, entry size)."""
BlockAt = tuple[int, int, int]
"""(group, rank, block index) of one of a request's attention blocks."""


class Phase(enum.Enum):
    LOOKUP = "lookup"
    """vLLM asked for its hit: its lookup (and a hybrid's first slots) may be in flight."""
    LOADING = "loading"
    """vLLM allocated for its hit: load jobs planned, handed to the workers by the next plan."""
    RUNNING = "running"
    """vLLM computes it (or preempted it: vLLM's status says): its blocks are saved as they fill."""
    FINISHING = "finishing"
    """vLLM finished it while blocks of it were unsaved or being copied: held until they landed,
    or ``HOLD_S``."""


@dataclass
class Lookup:
    """One request's lookup: per tp rank, the keys asked for and the pins that came back."""

    futures: list[Pending[ReadLease]]
    attn_keys: list[list[list[bytes]]]  # [rank][attention group][block]
    state_keys: list[list[list[bytes]]]  # [rank][state group][lcm boundary - 1]
    started: float
    leases: list[ReadLease] | None = None

    def ready(self) -> bool:
        return all(f.poll() for f in self.futures)

    @property
    def answered(self) -> bool:
        """Whether the pins were taken (every rank answered, and the answers were read)."""
        return self.leases is not None

    def take_answers(self) -> list[ReadLease]:
        self.leases = [f.result() for f in self.futures]
        return self.leases

    def flat_keys(self, rank: int) -> list[bytes]:
        """The keys of one rank's acquire, in the order they were asked for."""
        return [key for keys in self.attn_keys[rank] + self.state_keys[rank] for key in keys]


@dataclass
class Handoff:
    """A decode request's wait for what its prefill announced it saves (``kv_transfer_params``):
    its lookup is redone, with a backoff, until the hit those tokens give is there or
    ``pd_wait_s`` passed since the first lookup."""

    tokens: int
    """Block-aligned prompt tokens the prefill announced."""
    started: float
    """When vLLM first asked for the request's hit."""
    states: tuple[int, ...] | None = None
    """A hybrid prefill's LCM boundaries with a state in the store (None: not announced): a hit
    can end on these only, so the decode waits for no other."""
    look_again_at: float = 0.0
    """No lookup before this (the backoff)."""
    backoff_s: float = FIRST_LOOK_AGAIN_S
    waiting: bool = True
    """Until the expected hit was there, or the wait ran out: then the hit is what it is."""

    def may_look(self, now: float) -> bool:
        return not self.waiting or now >= self.look_again_at

    def look_later(self, now: float) -> None:
        """The hit was short: look again after the backoff, doubled for the next time."""
        self.look_again_at = now + self.backoff_s
        self.backoff_s = min(2 * self.backoff_s, LOOK_AGAIN_MAX_S)


@dataclass
class SlotAsks:
    """Slots asked for the saves of a hybrid request's first chunks, once its lookup said where
    its saves begin (asked for with the lookup, they were also asked for blocks that turn out to
    be hits, and a full pool evicted other prompts' entries, or this prompt's own, to make room
    for slots handed straight back)."""

    counts: SlotCounts
    """Slots per (pool, entry size) the chunks' states need."""
    started: float
    wait_s: float
    """``state_slot_wait_s`` (a dense request's asks, empty, are ready at once)."""

    def ready(self, supply: SlotSupply, now: float) -> bool:
        """The slots are here or answered (asked for by this request or by another whose asks
        it counts on: a state cannot wait for a slot, it is lost), or too slow to wait for:
        then the request runs without them rather than being delayed."""
        return supply.ready(self.counts) or now - self.started > self.wait_s


@dataclass(eq=False)
class TrackedRequest:
    """A request vLLM asked about, from its lookup until vLLM may free its blocks."""

    request: Request
    geometry: CacheGeometry
    phase: Phase = Phase.LOOKUP
    lookup: Lookup | None = None
    """LOOKUP: the pins it holds until a load job takes them, or it is released."""
    slot_asks: SlotAsks | None = None  # set once, when its first lookup answered
    handoff: Handoff | None = None
    """A decode's wait for its prefill's saves (LOOKUP), where its params announced them."""
    hit_tokens: int = 0  # LCM/block-aligned prefix found in the store
    local_tokens: int = 0  # vLLM's block-aligned local hit at lookup time
    external_tokens: int = 0  # what vLLM took from the store at allocation (its loads bring them)
    block_ids: list[list[int]] = field(default_factory=list)  # per group, as the scheduler output says
    saved_blocks: dict[int, int] = field(default_factory=dict)  # group -> blocks already planned
    last_state_pos: int = 0
    state_positions: list[int] = field(default_factory=list)
    """A hybrid's LCM boundaries whose states it saved or loaded, ascending (what a PD prefill
    announces: its chunk ends, not every boundary, hold one)."""
    pending: dict[BlockAt, bool] = field(default_factory=dict)
    """(group, rank, block index) of attention blocks still to save, and whether their bytes are
    valid yet (a block whose load failed is not, until a step recomputes it)."""
    keys: dict[tuple[int, int], list[bytes]] = field(default_factory=dict)
    """(rank, attention group) -> the keys of the request's first blocks (``attn_keys``)."""
    owners: dict[tuple[int, int], tuple[list[PoolKey], np.ndarray]] = field(default_factory=dict)
    """(rank, attention group) -> the pools and the owners of the first of those keys, as the
    store placed them under ``placed_under`` (``attn_owners``)."""
    placed_under: int = -1
    """The version of the fleet's pools that ``owners`` were placed under."""
    _families: dict[int, Family] = field(default_factory=dict)
    """Rank -> the request's family root (``family``)."""
    expected_until: int = 0  # saves of tokens below this were announced to the slot supply
    unexpected_until: int = 0  # ... and those below this were taken back (hits) or used by saves
    computed: int = 0  # vLLM's computed tokens at the last save plan
    waiting_at: tuple[int, int] | None = None
    """(filled, hashed tokens) when the last plan found the request's blocks waiting for a later
    one: until either moves, its answer stands (most decode steps). Only set while nothing is
    pending and it is not finishing (``finish`` and ``save_again`` clear it)."""
    prompt_expected: bool = False  # a dense prompt's saves were announced to the slot supply
    awaited: SlotCounts | None = None
    """Slots per (pool, entry size) that a dense prompt's first save waits for, until
    ``awaited_until`` (``PROMPT_SLOT_WAIT_S``), where the free stock lacked them (a PD
    prefill's from its lookup on, when they were asked for: ``expect_prompt_early``)."""
    awaited_until: float = 0.0
    finished_at: float = 0.0
    """FINISHING: when vLLM finished it (vLLM keeps its blocks until the scheduler knows they
    landed and reports the request ``finished_sending``: an idle engine would look no more)."""
    save_jobs: set[int] = field(default_factory=set)
    """Save jobs with blocks of the request whose results are not in yet."""
    async_load_failed: bool = False
    """A load of it failed while it waited for it (an asynchronous load): vLLM cut its hit at the
    first failed block, and where that is its first block vLLM frees its blocks and asks for its
    hit again. The store claims none for it any more: the same entries would fail again, for
    ever where they stay (a pool this engine cannot reach)."""

    # --- transitions ----------------------------------------------------------------------

    def ask(self, local_tokens: int) -> None:
        """vLLM asks for its hit (again, after a preemption): vLLM's own hit is ``local_tokens``."""
        if self.phase is Phase.RUNNING:
            self.phase = Phase.LOOKUP
        self.local_tokens = local_tokens

    def start_loading(self, external_tokens: int) -> None:
        """vLLM allocated for ``external_tokens`` of the hit: the pins now belong to load jobs."""
        self.phase = Phase.LOADING
        self.external_tokens = external_tokens
        self.lookup = None

    def allocated(self) -> None:
        """vLLM allocated for it without a hit to load (or again, for an asynchronous load)."""
        if self.phase is Phase.LOOKUP:
            self.phase = Phase.RUNNING

    def loads_dispatched(self) -> None:
        """Its load jobs were handed to the workers."""
        self.phase = Phase.RUNNING

    def finish(self, now: float) -> None:
        """vLLM finished it while blocks of it are unsaved: held for them."""
        self.phase = Phase.FINISHING
        self.finished_at = now
        self.waiting_at = None

    def resume(self, block_ids: list[list[int]]) -> None:
        """vLLM resumed it (after a preemption) with new blocks: what was pending is saved once
        recomputed (or never, if it was not)."""
        self.block_ids = block_ids
        self.pending = dict.fromkeys(self.pending, False)

    def save_again(self, group: int, rank: int, index: int) -> None:
        """A block whose load failed: saved once a step recomputed it (its bytes are garbage until then)."""
        self.pending[(group, rank, index)] = False
        self.waiting_at = None

    def keep_copies(self, group: int, rank: int, indices: Sequence[int]) -> None:
        """Blocks it loaded from another node (its load landed whole): saved again, into this
        node's pool, as blocks whose bytes are valid now (``remote_copy_reads``)."""
        self.pending.update(((group, rank, index), True) for index in indices)
        self.waiting_at = None

    def await_slots(self, counts: SlotCounts, until: float) -> None:
        """Its prompt's first save waits for these slots, at most until ``until``."""
        self.awaited, self.awaited_until = counts, until

    # --- questions ------------------------------------------------------------------------

    @property
    def finishing(self) -> bool:
        return self.phase is Phase.FINISHING

    def lookup_expired(self, now: float, max_age_s: float) -> bool:
        """Whether its lookup waited so long in the queue that its pins may lapse."""
        return self.lookup is not None and now - self.lookup.started > max_age_s

    def hashed_tokens(self) -> int:
        """Tokens of its full (hashed) blocks."""
        return len(self.request.block_hashes) * self.geometry.hash_block_size

    def attn_keys(self, rank: int, group: int, blocks: range | list[int]) -> list[bytes]:
        """The keys of these blocks of an attention group on one rank, derived once per request:
        its lookup, the slot counts of its chunks and its saves all ask for them."""
        known = self.keys.setdefault((rank, group), [])
        needed = max(blocks, default=-1) + 1
        if needed > len(known):
            known.extend(self.geometry.attn_block_keys(rank, group, self.request.block_hashes,
                                                       range(len(known), needed)))
        if isinstance(blocks, range) and blocks.step == 1:
            return known[blocks.start:blocks.stop]
        return [known[i] for i in blocks]

    def attn_owners(self, rank: int, group: int, blocks: range | list[int],
                    store: BlockStore) -> tuple[list[PoolKey], np.ndarray]:
        """The owners of these blocks' keys (``BlockStore.placement``: the pools, and per block
        a row of indices into them), placed once per request while the fleet's pools stay as
        they are: its prompt's announcement and its saves both ask (placed twice, they cost a
        4k prompt ~0.1-0.2 ms of the scheduler's step here)."""
        pools, known = self._placed(rank, group, store.pools().version)
        needed = max(blocks, default=-1) + 1
        if needed > len(known):
            pools, known = self.add_owners(rank, group, *store.placement(
                self.attn_keys(rank, group, range(len(known), needed))))
        if isinstance(blocks, range) and blocks.step == 1:
            return pools, known[blocks.start:blocks.stop]
        return pools, known[np.asarray(blocks, dtype=np.int64)]

    def unplaced_keys(self, rank: int, group: int, blocks: range, version: int) -> list[bytes]:
        """The keys of these blocks (and of any before them) that ``attn_owners`` would place
        now, under pools of ``version`` (``place_together``)."""
        known = len(self._placed(rank, group, version)[1])
        return self.attn_keys(rank, group, range(known, blocks.stop)) if blocks.stop > known else []

    def _placed(self, rank: int, group: int, version: int) -> tuple[list[PoolKey], np.ndarray]:
        """The owners placed so far of an attention group's keys on one rank (none where they
        were placed under other pools than those of ``version``)."""
        if version != self.placed_under:
            self.owners.clear()
            self.placed_under = version
        return self.owners.get((rank, group), ([], np.zeros((0, 0), dtype=np.int64)))

    def add_owners(self, rank: int, group: int, pools: list[PoolKey],
                   more: np.ndarray) -> tuple[list[PoolKey], np.ndarray]:
        """Keep ``more``, the owners of the keys right after those placed so far (under the
        pools ``_placed`` was last asked about); the group's owners placed so far, with them."""
        placed = self.owners.get((rank, group))
        known = more if placed is None or not len(placed[1]) else np.concatenate([placed[1], more])
        self.owners[(rank, group)] = (pools, known)
        return pools, known

    def family(self, rank: int, hot_prefix: Callable[[Sequence[bytes]], int]) -> Family:
        """The family of the request's blocks on one rank: its root is the first block of its
        prompt's chain (its first attention group's keys) past the fleet's hot prefix
        (``hot_prefix``: the store's), as its lookup finds it (``Lookups._post``). Fixed at the
        first ask: every block of a request is registered under one root, but for the hot
        prefix's own blocks (``Family.of``). Keys are derived only as far as the hot prefix
        reaches (a cold prompt's saves derive the rest as they go)."""
        family = self._families.get(rank)
        if family is None:
            geometry = self.geometry
            if geometry.attn:
                group = geometry.attn[0]
                blocks = max(self.hashed_tokens() // geometry.block_sizes[group], 1)
                known = min(blocks, 16)
                while (hot := hot_prefix(self.attn_keys(rank, group, range(known)))) == known < blocks:
                    known = min(blocks, known * 4)
                first = self.attn_keys(rank, group, range(1))[0]
                family = Family(self.attn_keys(rank, group, range(hot, hot + 1))[0] if hot < blocks else first,
                                first, hot if hot < blocks else 0)
            else:
                state = geometry.state_key(rank, self.request.block_hashes, geometry.states[0], geometry.lcm)
                family = Family(state, state, 0)
            self._families[rank] = family
        return family

    def saved_tokens(self) -> int:
        """Tokens below which every attention group's blocks are saved or need no save."""
        sizes, saved = self.geometry.block_sizes, self.saved_blocks
        out: int | None = None
        for g in self.geometry.attn:  # a loop, not a generator: asked in every step a block filled
            tokens = saved.get(g, 0) * sizes[g]
            if out is None or tokens < out:
                out = tokens
        return out or 0

    def unsaved(self) -> bool:
        """Whether blocks the request computed are still to be saved, or being copied."""
        computed = min(self.request.num_computed_tokens, self.hashed_tokens())
        sizes = self.geometry.block_sizes
        return (any(computed // sizes[g] > self.saved_blocks.get(g, 0) for g in self.geometry.attn)
                or any(self.pending.values()) or bool(self.save_jobs))

    def may_save(self) -> bool:
        """Whether blocks of it may be saved in this step: it runs and its first token is out (no
        save delays that token), or it is finishing. A request vLLM does not run loses its block
        ids: waiting, or preempted, its blocks are not (or no longer) its own."""
        if self.phase is Phase.FINISHING:
            return True
        if self.request.status != RequestStatus.RUNNING:
            self.block_ids = []
            return False
        return bool(self.request.num_output_tokens)

    def hold_over(self, now: float) -> bool:
        """Finishing, whether vLLM may free its blocks: nothing is still to be copied from them,
        or no slot came for what is left within HOLD_S."""
        return not self.save_jobs and (not self.unsaved() or now - self.finished_at > HOLD_S)

    def dropped_saves(self) -> int:
        """Blocks still to save whose bytes were valid: never saved if it is forgotten now."""
        return sum(1 for ready in self.pending.values() if ready)

    def unplanned_saves(self) -> int:
        """Full blocks it computed that no save plan reached (its first save still waited for
        slots), on every rank: never saved either if its hold ends now, and not ``pending``."""
        computed = min(self.request.num_computed_tokens, self.hashed_tokens())
        sizes = self.geometry.block_sizes
        per_rank = sum(max(0, computed // sizes[g] - self.saved_blocks.get(g, 0)) for g in self.geometry.attn)
        return per_rank * len(self.geometry.namespaces)


def place_together(runs: Sequence[tuple[TrackedRequest, int, int, range]], store: BlockStore) -> None:
    """The owners of these runs' blocks (request, rank, attention group, blocks) that their
    requests have not placed yet, placed in one call and kept by each request, where
    ``attn_owners`` finds them: requests that started or decode together announce their
    blocks in the same step (``SavePlanner._place_ahead``), a placement call each."""
    version = store.pools().version
    unplaced = [(tracked, rank, group, keys) for tracked, rank, group, blocks in runs
                if (keys := tracked.unplaced_keys(rank, group, blocks, version))]
    if len(unplaced) < 2:
        return  # ``attn_owners`` places one request's keys as it would here
    pools, owners = store.placement([key for *_, keys in unplaced for key in keys])
    at = 0
    for tracked, rank, group, keys in unplaced:
        tracked.add_owners(rank, group, pools, owners[at:at + len(keys)])
        at += len(keys)


class TrackedRequests:
    """The requests the scheduler half tracks, by id, and which of them vLLM finished."""

    def __init__(self, geometry: CacheGeometry, stats: UcmRayStats) -> None:
        self._geometry = geometry
        self._stats = stats
        self.by_id: dict[str, TrackedRequest] = {}
        self.finishing: set[str] = set()
        """Ids of requests that were finishing when last seen (most steps none)."""

    def track(self, request: Request) -> TrackedRequest:
        """The request's record: a new one for a request not seen before under its id."""
        tracked = self.by_id.get(request.request_id)
        if tracked is None or tracked.request is not request:
            tracked = self.by_id[request.request_id] = TrackedRequest(request, self._geometry)
        return tracked

    def get(self, req_id: str) -> TrackedRequest | None:
        return self.by_id.get(req_id)

    def finish(self, tracked: TrackedRequest, now: float) -> None:
        tracked.finish(now)
        self.finishing.add(tracked.request.request_id)

    def drop(self, req_id: str) -> None:
        """Forget a request; blocks of it still unsaved are never saved."""
        tracked = self.by_id.pop(req_id)
        self.finishing.discard(req_id)
        dropped = tracked.dropped_saves()
        if dropped:
            self._stats.add(saves_dropped=dropped)

    def release_held(self, now: float) -> Sequence[str]:
        """The finishing requests whose blocks vLLM may free now (``hold_over``), forgotten."""
        if not self.finishing:
            return ()  # most steps
        released = []
        for req_id in list(self.finishing):
            tracked = self.by_id.get(req_id)
            if tracked is None or not tracked.finishing:  # tracked anew under its id
                self.finishing.discard(req_id)
            elif tracked.hold_over(now):
                released.append(req_id)
                unplanned = tracked.unplanned_saves()
                if unplanned:
                    self._stats.add(saves_dropped=unplanned)
                self.drop(req_id)
        return released

    def any_finishing(self) -> bool:
        return any(tracked.finishing for tracked in self.by_id.values())

    def to_plan(self) -> list[TrackedRequest]:
        """The requests whose last plan's answer does not stand. It stands for a running request
        whose blocks waited then (``waiting_at``) while neither its filled nor its hashed tokens
        moved since (most decode steps); such a request only has its computed tokens recorded.
        Asked of every request every step, before anything else, here in one loop: with many
        requests decoding, visiting each one was the scheduler hook's largest cost, and a call
        per request most of that."""
        hash_block_size = self._geometry.hash_block_size
        running = RequestStatus.RUNNING
        out: list[TrackedRequest] = []
        for tracked in self.by_id.values():
            waiting_at = tracked.waiting_at
            if waiting_at is not None:
                request = tracked.request
                hashed = len(request.block_hashes) * hash_block_size
                computed = request.num_computed_tokens
                if (waiting_at[1] == hashed and waiting_at[0] == (computed if computed < hashed else hashed)
                        and request.status == running):
                    tracked.computed = computed
                    continue
            out.append(tracked)
        return out

    def take_block_ids(self, out: SchedulerOutput) -> None:
        """Each running request's block ids, from the scheduler output alone (vLLM 0.26 never
        binds its cache manager to a connector): new requests list all, cached ones append,
        resumed ones start over."""
        for new in out.scheduled_new_reqs:
            tracked = self.by_id.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids) if resumed else ():
            tracked = self.by_id.get(req_id)
            if tracked is not None and req_id in resumed:
                tracked.resume([list(ids) for ids in new_ids] if new_ids is not None else [])
        # requests allocated a block this step (a few in a decode step), picked out without
        # Python per request: ``compress`` keeps the pairs whose ids are not None
        for req_id, new_ids in itertools.compress(zip(cached.req_ids, cached.new_block_ids), cached.new_block_ids):
            tracked = self.by_id.get(req_id)
            if tracked is not None and req_id not in resumed:
                for group, ids in enumerate(new_ids):
                    tracked.block_ids[group].extend(ids)
