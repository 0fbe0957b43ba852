"""SlotSupply: write slots reserved ahead of need, so a save is planned without a round trip.

The scheduler decides in ``build_connector_meta`` which blocks a step saves,
and the worker copies them *during* that step. Asking the shards for slots at
that point would put a network round trip either on the scheduler or inside
the forward pass. Instead the scheduler asks ahead: it *expects* a prompt's
saves (a dense prompt's once its first token is out, the step before they are
taken; a hybrid's first chunks when it is looked up, as its states are saved
as they are computed), and it keeps a few free slots per (pool, entry size)
for decode-time blocks and the next prompts, as many as recent steps used
(a worst case — every running request filling a block in the same step —
would hold hundreds of entries' worth of pool per engine, evicting cached
data for nothing). Slots are bound to keys only at commit, once the worker
reported the bytes landed. Free slots nobody used for a while go back to the
shard, so an idle engine holds little.

Expected saves are asked for only where the free stock lacks them: what it holds beyond the
baseline and the saves expected before (promises) covers them first, and an ask takes as much
again as is lacking (within the baseline's cap), which the next announcement then finds here.
The baseline follows the takes nobody announced. A request decoding alone announced each batch
2-3 times, and each announcement was a call per pool; it now asks about once per pool every few
batches. A promise not taken within ``idle_s`` lapses (its request ended or was dropped without
those saves), so none holds slots for long.

Grants are renewed while this engine holds any of their slots, so a slow step
never loses its slots. A slot is only handed out while its grant is known to
outlive the step's copies (``usable_s`` since the call that last confirmed it
was posted): an engine that sat idle (vLLM runs no step without requests, so
nothing renewed its grants) never writes into a slot whose grant may have
lapsed and been handed to another writer. A grant that lapses is quarantined
by the shard, never reused while a late copy might land.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict, deque
from collections.abc import Callable, KeysView, Mapping
from dataclasses import dataclass, field

import numpy as np

from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.types import Pending, Pools, Publishes, SlotGrant
from ucm_ray.transport.base import PoolKey

log = logging.getLogger(__name__)

SlotClass = tuple[PoolKey, int]
"""(pool, entry size): slots of one size on one pool are interchangeable."""


@dataclass
class TakenSlots:
    """Slots taken from the free stock, as columns (a prompt's save takes hundreds per class:
    as (token, offset) pairs they were built, unzipped and listed again per row on the
    scheduler's step): per slot, its grant's token and its offset."""

    tokens: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)


@dataclass
class _Grant:
    """One reservation: its free slots here and how many are out in jobs."""

    pool: PoolKey
    size: int
    token: int
    confirmed: float
    """When the reserve or renew call that last extended the grant was posted: the shard's
    deadline is at least ``reserve_timeout_s`` after it."""
    renewed: float
    """When a renew was last posted."""
    free: list[int] = field(default_factory=list)
    """Offsets of its free slots, handed out from the front: a list, so that a save's slots are
    taken as one slice (one at a time from a deque, a 4k prompt's 256 slots were ~0.1 ms of the
    scheduler's step)."""
    in_use: int = 0


@dataclass
class _Ask:
    slot_class: SlotClass
    count: int
    answer: Pending[SlotGrant | None]
    posted: float


@dataclass
class _Promise:
    """Expected saves of one announcement not taken yet, and until when they are counted on."""

    count: int
    until: float


@dataclass
class _Renewal:
    posted: float
    tokens: set[tuple[PoolKey, int]]
    answer: Pending[set[tuple[PoolKey, int]]]


DEMAND_DECAY = 0.9
"""Per step: how fast the remembered demand of a slot class fades once saves slow down (applied
at the next full tick for the steps whose tick was skipped)."""
FREE_POOL_SHARE = 16
"""At most 1/16 of a pool's bytes is held in one engine's free slots of one size for demand
alone (saves announced ahead are not capped): counted in entries only (``max_free``), a model
with ~5 MiB entries and 256 sequences would hold more than a 1 GiB pool and evict stored
prefixes for nothing."""
REFILL = 2
"""A class taken from whose free slots fell below its baseline is refilled to this many times the
baseline (within the pool's share), so a steady trickle of takes (a request decoding) asks now
and then, not at nearly every slot it takes (each ask a control call on the engine's host)."""
QUIET_TICK_S = 0.5
"""How often, at most, a tick with nothing to collect, give back or count (most decode steps)
still looks at baselines, renewals and idle slots: those move on the scale of ``renew_after_s``
and ``idle_s`` (a third of ``reserve_timeout_s``), and a full tick costs the engine's host tens
of microseconds (at 50 ms apart, most of the tick's mean per step on an H100 host's decode)."""
QUIET_TICK_SHARE = 1 / 20
"""The interval's bound as a share of the shorter of ``renew_after_s`` and ``idle_s``, where
that share is below QUIET_TICK_S (short timeouts): a renewal is posted at most that much late,
well inside the slack between ``renew_after_s`` and ``usable_s`` (the scheduler's are a third
and at least half of ``reserve_timeout_s``)."""


class _Batched:
    """``SlotSupply.batched``'s context, made once: the scheduler enters it every step, and a
    generator-based context cost a decode step a few microseconds more."""

    def __init__(self, supply: SlotSupply) -> None:
        self._supply = supply

    def __enter__(self) -> None:
        self._supply._hold()

    def __exit__(self, *exc: object) -> None:
        self._supply._ask_held()


class SlotSupply:
    """Free slots per (pool, entry size): what recent steps used, plus what lookups said is coming."""

    def __init__(self, store: BlockStore, *, max_free: int, renew_after_s: float, idle_s: float,
                 usable_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``max_free``: the most free slots of one class a baseline keeps for demand alone (a
        refill takes up to ``REFILL`` times the baseline); ``usable_s``: how
        long after its last confirmation a grant's slots may still be written (the reservation
        timeout minus the longest a step's copies may take)."""
        self._store = store
        self._max_free = max_free
        self._usable_s = usable_s
        self._excess: dict[SlotClass, int] = defaultdict(int)  # expected slots that will not be used
        self._demand: dict[SlotClass, float] = {}
        self._used: dict[SlotClass, int] = defaultdict(int)  # unannounced takes and shortfalls since the last tick
        self._base: dict[SlotClass, int] = {}  # free slots kept for demand alone, as of the last full tick
        self._cap: dict[SlotClass, int] = {}  # the most a baseline may be (``max_free``, the pool's share)
        self._promises: dict[SlotClass, deque[_Promise]] = defaultdict(deque)  # oldest first
        self._renew_after_s = renew_after_s
        self._idle_s = idle_s
        self._quiet_tick_s = min(QUIET_TICK_S, QUIET_TICK_SHARE * min(renew_after_s, idle_s))
        self._clock = clock
        self._grants: dict[tuple[PoolKey, int], _Grant] = {}  # (pool, token)
        self._free: dict[SlotClass, deque[_Grant]] = defaultdict(deque)
        self._asks: list[_Ask] = []
        self._last_take: dict[SlotClass, float] = {}
        self._renewing: _Renewal | None = None
        self._returning: list[Pending[list[bool]]] = []
        self._sizes: set[int] = set()
        self._ticked: tuple[int, float] | None = None  # (pools' version, when) of the last full tick
        self._steps = 0  # steps since the last full tick
        self._held: dict[SlotClass, int] | None = None  # inside ``batched``: expected saves not yet asked for
        self._holding: defaultdict[SlotClass, int] = defaultdict(int)  # what ``_held`` is next, empty
        self._later: dict[SlotClass, int] = defaultdict(int)  # expected saves for the next tick to ask for
        self._batched = _Batched(self)

    @property
    def quiet_tick_s(self) -> float:
        """The longest a tick with nothing to do skips the full tick's work (``tick``)."""
        return self._quiet_tick_s

    def want(self, *sizes: int) -> None:
        """Entry sizes to keep free slots of."""
        self._sizes.update(sizes)

    def free_slots(self, slot_class: SlotClass) -> int:
        """Free slots that ``take`` would hand out now (not those of a grant that may have lapsed)."""
        oldest = self._clock() - self._usable_s
        return sum(len(g.free) for g in self._free[slot_class] if g.confirmed >= oldest)

    def expect(self, counts: Mapping[SlotClass, int], *, later: bool = False) -> None:
        """Saves that are coming (a prompt's next chunk, a decode batch): promised at once (a
        take in the same step already counts on them), and the slots the free stock lacks for
        them asked for (``_shortfalls``; the baseline stays for decode, and what ends up unused
        goes back once idle): now, or inside ``batched`` on its exit, or with ``later`` at the
        next tick, one ask per class (requests that finish together between two steps would each
        post a call per pool). ``ready`` says when they are here."""
        until = self._clock() + self._idle_s
        counts = {slot_class: count for slot_class, count in counts.items() if count > 0}
        for slot_class, count in counts.items():
            self._promises[slot_class].append(_Promise(count, until))
        held = self._held if self._held is not None else self._later if later else None
        if held is not None:
            for slot_class, count in counts.items():
                held[slot_class] += count
            return
        for slot_class, count in self._shortfalls(counts).items():
            self._ask(slot_class, count)

    def ready(self, counts: Mapping[SlotClass, int]) -> bool:
        """Whether the slots of ``counts`` are here or answered (the next tick adds them), or no
        ask that could bring more is still out: an announcement may count on another's ask."""
        for slot_class, count in counts.items():
            if count <= 0:
                continue
            asks = [ask for ask in self._asks if ask.slot_class == slot_class]
            answered = sum(ask.count for ask in asks if ask.answer.poll())
            if self.free_slots(slot_class) + answered < count and any(not ask.answer.poll() for ask in asks):
                return False
        return True

    def holds(self, counts: Mapping[SlotClass, int]) -> bool:
        """Whether the free stock has this many slots of each class now."""
        return all(self.free_slots(slot_class) >= count for slot_class, count in counts.items() if count > 0)

    def asking(self, counts: Mapping[SlotClass, int]) -> bool:
        """Whether slots of a class in ``counts`` are asked for and not in yet (held for this
        step's batch, or posted)."""
        held = self._held or {}
        return any(held.get(slot_class, 0) > 0 or self._asked(slot_class) > 0
                   for slot_class, count in counts.items() if count > 0)

    def batched(self) -> _Batched:
        """Expected saves announced inside (``with supply.batched():``) are asked for on exit,
        one ask per slot class: a step in which many requests' decode batches fill (requests
        decoding together cross the same token counts together) posted a call per request and
        pool, ~0.2 ms of the engine's host time each."""
        return self._batched

    def _hold(self) -> None:
        self._held = self._holding  # empty: a step that expects nothing (most) makes no dict

    def _ask_held(self) -> None:
        held, self._held = self._held, None
        if held:
            self._holding = defaultdict(int)
            for slot_class, count in self._shortfalls(held).items():
                self._ask(slot_class, count)

    def unexpect(self, counts: Mapping[SlotClass, int]) -> None:
        """Expected saves that will not happen after all (those blocks were hits): their slots go
        back as soon as they are here."""
        for slot_class, count in counts.items():
            self._excess[slot_class] += count
            self._unpromise(slot_class, count)

    def abandon_pool(self, pool: PoolKey) -> None:
        """Transfers with ``pool`` failed: write nothing more into it; its grants lapse."""
        for grant in [g for g in self._grants.values() if g.pool == pool]:
            self._drop(grant)

    # --- per step ------------------------------------------------------------------------

    def tick(self, pools: Pools, now: float | None = None) -> None:
        """Collect grants that arrived, keep baselines, renew what we hold, give back what
        sat idle. Never blocks. ``pools``: the caller's view of the fleet this step; call it
        once a step. When nothing changed (no slot taken, no ask answered, no return or renewal
        awaited, nothing to give back, the same pools) it does this at most every ``quiet_tick_s``. Demand
        fades by the steps since the last full tick, so a skipped tick only delays what a
        fading demand could cause: a give-back, which waits ``idle_s`` anyway (a full tick on
        every step while demand faded, ~10 steps after each slot taken, was most decode steps'
        tick). ``now``: the supply's clock read by the caller (None: read here)."""
        if now is None:
            now = self._clock()
        self._steps += 1
        # Nothing changed since a full tick less than ``quiet_tick_s`` ago, over the same pools:
        # asks may be out, but none was answered (a full tick would find nothing to take and
        # nothing else to do; one on every step while a cold prompt's asks were out was ~0.1 ms
        # of each of those steps' host time here). Tested here, not in a call of its own: every
        # call a quiet decode step makes costs it several times over with the host's caches cold
        # (docs/performance-log.md, stop 65).
        if (not (self._used or self._excess or self._returning or self._renewing or self._later)
                and self._ticked is not None and self._ticked[0] == pools.version
                and now - self._ticked[1] < self._quiet_tick_s
                and not (self._asks and any(ask.answer.poll() for ask in self._asks))):  # no generator for none
            return
        fade, self._steps = DEMAND_DECAY ** self._steps, 0
        self._ticked = (pools.version, now)
        live = pools.descriptors.keys()
        later, self._later = self._later, defaultdict(int)
        for slot_class, count in self._shortfalls({c: n for c, n in later.items() if c[0] in live}).items():
            self._ask(slot_class, count)
        self._expire_promises(live, now)
        self._take_arrived(live)
        for key in [k for k in self._grants if k[0] not in live]:
            self._drop(self._grants[key])  # a dead shard or an old incarnation
        self._give_excess_back()
        for slot_class in self._balanced(pools):
            self._rebalance(slot_class, pools.descriptors[slot_class[0]].pool_bytes, fade, now,
                            home=pools.is_home(slot_class[0]))
        self._used.clear()  # takes from pools no longer live: nothing to remember them for
        self._renew(now)
        self._returning = [answer for answer in self._returning if not answer.poll()]

    def _expire_promises(self, live: KeysView[PoolKey], now: float) -> None:
        for slot_class, promises in list(self._promises.items()):
            while promises and (promises[0].until < now or slot_class[0] not in live):
                promises.popleft()  # its saves never came (or its pool left)
            if not promises:
                del self._promises[slot_class]

    def _take_arrived(self, live: KeysView[PoolKey]) -> None:
        arrived = [ask for ask in self._asks if ask.answer.poll()]
        self._asks = [ask for ask in self._asks if ask not in arrived]
        for ask in arrived:
            grant = ask.answer.result()
            if grant is not None and grant.offsets and grant.pool in live:
                self._add(grant, ask.posted)

    def _give_excess_back(self) -> None:
        for slot_class, count in list(self._excess.items()):
            back = min(count, self.free_slots(slot_class))
            if back:
                self._give_back(slot_class, back)
            if count - back <= 0 or not self._asked(slot_class):
                del self._excess[slot_class]  # nothing more of it is on its way
            else:
                self._excess[slot_class] = count - back

    def _balanced(self, pools: Pools) -> list[SlotClass]:
        """The classes a full tick balances: every size on the home pools, and any other live
        class this engine took from or still holds slots of (its stock follows its demand down
        to none, and is then forgotten): never every pool of the fleet."""
        live = pools.descriptors
        home = [pool for pool in live if pools.is_home(pool)]
        classes = [(pool, size) for pool in home for size in sorted(self._sizes)]
        classes += [slot_class for slot_class in (*self._used, *self._demand, *self._free) if slot_class[0] in live]
        return list(dict.fromkeys(classes))

    def _rebalance(self, slot_class: SlotClass, pool_bytes: int, fade: float, now: float, *, home: bool) -> None:
        """Follow the demand: ask up to the baseline, give back what sat idle above it. A home
        pool keeps one free slot more than its demand; another keeps slots only while this
        engine's demand there is at least one."""
        demand = max(float(self._used.pop(slot_class, 0)), self._demand.get(slot_class, 0.0) * fade)
        room = max(1, pool_bytes // (slot_class[1] * FREE_POOL_SHARE))
        self._cap[slot_class] = min(self._max_free, room)
        kept = math.ceil(1.5 * demand) + 1 if home else math.ceil(1.5 * demand) if demand >= 1 else 0
        base = self._base[slot_class] = min(self._max_free, kept, room)
        if base == 0 and not self._free.get(slot_class) and not self._asked(slot_class):
            for known in (self._demand, self._base, self._cap, self._free, self._last_take):
                known.pop(slot_class, None)  # nothing of it here: no longer balanced
            return
        self._demand[slot_class] = demand
        have = self.free_slots(slot_class) + self._asked(slot_class)
        if have < base:  # refilled past the baseline once taken from: a trickle of takes asks now and then
            top = max(base, min(REFILL * base, room)) if slot_class in self._last_take else base
            self._ask(slot_class, top - have)
        elif (have > base and now - self._last_take.get(slot_class, -math.inf) > self._idle_s
              and slot_class not in self._promises):  # not what announced saves count on (nor ever taken from)
            self._give_back(slot_class, self.free_slots(slot_class) - base)

    def take(self, pool: PoolKey, size: int, count: int = 1) -> TakenSlots:
        """Up to ``count`` free slots of ``size`` on ``pool``; fewer (the rest of the saves wait)
        when there are not as many."""
        slot_class = (pool, size)
        now = self._clock()
        self._last_take[slot_class] = now
        promised = self._promised(slot_class)
        queue = self._free[slot_class]
        oldest = now - self._usable_s
        offsets: list[int] = []
        tokens: list[int] = []
        counts: list[int] = []  # per grant taken from, its slots taken
        while queue and len(offsets) < count:
            grant = queue[0]
            if grant.confirmed < oldest:
                self._drop(grant)  # may have lapsed: never write into it
            if not grant.free:
                queue.popleft()
                continue
            taken = min(count - len(offsets), len(grant.free))
            grant.in_use += taken
            tokens.append(grant.token)
            counts.append(taken)
            offsets += grant.free[:taken]
            del grant.free[:taken]
        if promised:
            self._unpromise(slot_class, len(offsets), oldest_first=True)
        # The baseline is for saves nobody announced (announced ones were asked for), and for
        # any that found the stock short: without a refill they would wait for one forever.
        demand = max(count - promised, count - len(offsets))
        if demand > 0:
            self._used[slot_class] += demand
        return TakenSlots(np.repeat(np.asarray(tokens, dtype=np.int64), counts), np.asarray(offsets, dtype=np.int64))

    def settled(self, pool: PoolKey, token: int, count: int = 1) -> None:
        """``count`` slots of a grant were published or freed at the shard: no longer ours."""
        grant = self._grants.get((pool, token))
        if grant is not None:
            grant.in_use -= count
            self._forget_if_empty(grant)

    def abandon(self, pool: PoolKey, token: int) -> None:
        """A copy into one of this grant's slots may still land (it timed out): stop renewing the
        grant and use none of its slots again, so the shard quarantines all of them on expiry."""
        grant = self._grants.get((pool, token))
        if grant is not None:
            self._drop(grant)

    def close(self) -> dict[tuple[PoolKey, int], list[int]]:
        """Free slots to hand back at shutdown, per (pool, token)."""
        out = {key: list(g.free) for key, g in self._grants.items() if g.free}
        self._grants.clear()
        self._free.clear()
        return out

    # --- helpers -------------------------------------------------------------------------

    def _asked(self, slot_class: SlotClass) -> int:
        return sum(ask.count for ask in self._asks if ask.slot_class == slot_class)

    def _promised(self, slot_class: SlotClass) -> int:
        return sum(promise.count for promise in self._promises.get(slot_class, ()))

    def _unpromise(self, slot_class: SlotClass, count: int, *, oldest_first: bool = False) -> None:
        """``count`` promised saves were taken (oldest first) or will not come (newest first)."""
        promises = self._promises.get(slot_class)
        while promises and count > 0:
            promise = promises[0] if oldest_first else promises[-1]
            used = min(count, promise.count)
            promise.count -= used
            count -= used
            if not promise.count:
                promises.popleft() if oldest_first else promises.pop()
        if promises is not None and not promises:
            del self._promises[slot_class]

    def _shortfalls(self, counts: Mapping[SlotClass, int]) -> dict[SlotClass, int]:
        """Per class, how many slots to ask for ``counts`` expected saves, already promised (and
        maybe partly taken since, in the same step): none where the free slots and asks in
        flight beyond the baseline and the saves promised before cover them, else what is
        lacking and as much again (within the baseline's cap), for the next announcement. Each
        ask is a control call per pool on the engine's host (~0.3-0.9 ms here). An estimate: a
        save that finds the stock short waits a step for the refill its shortfall asks for."""
        out: dict[SlotClass, int] = {}
        for slot_class, count in counts.items():
            if count <= 0:
                continue
            # a take since the promise lowered the free slots and the promises alike
            spare = (self.free_slots(slot_class) + self._asked(slot_class) - self._base.get(slot_class, 0)
                     - (self._promised(slot_class) - count))
            lacking = count - max(0, spare)
            if lacking > 0:  # and as much again, within the baseline's cap: the next announcement finds it here
                out[slot_class] = lacking + min(lacking, self._cap.get(slot_class, 0))
        return out

    def _ask(self, slot_class: SlotClass, count: int) -> Pending[SlotGrant | None]:
        posted = self._clock()
        answer = self._store.reserve(slot_class[0], slot_class[1], count)
        self._asks.append(_Ask(slot_class, count, answer, posted))
        return answer

    def _add(self, grant: SlotGrant, posted: float) -> None:
        entry = _Grant(grant.pool, grant.size, grant.token, posted, posted, list(grant.offsets))
        self._grants[(grant.pool, grant.token)] = entry
        self._free[(grant.pool, grant.size)].append(entry)

    def _drop(self, grant: _Grant) -> None:
        self._grants.pop((grant.pool, grant.token), None)
        grant.free.clear()

    def _forget_if_empty(self, grant: _Grant) -> None:
        if not grant.free and grant.in_use <= 0:
            self._grants.pop((grant.pool, grant.token), None)

    def _give_back(self, slot_class: SlotClass, count: int) -> None:
        """Return ``count`` idle free slots to the shard (newest grants first)."""
        back: dict[tuple[PoolKey, int], list[int]] = defaultdict(list)
        for grant in reversed(self._free[slot_class]):
            while grant.free and count > 0:
                back[(grant.pool, grant.token)].append(grant.free.pop())
                count -= 1
            self._forget_if_empty(grant)
        if back:
            self._returning.append(self._store.commit(Publishes.of([]), dict(back)))

    def _renew(self, now: float) -> None:
        renewal = self._renewing
        if renewal is not None:
            if not renewal.answer.poll():
                return
            lapsed = renewal.answer.result()
            for key in renewal.tokens:
                grant = self._grants.get(key)
                if grant is None:
                    continue
                if key in lapsed:
                    log.warning("slot grant on shard %s lapsed; its slots are no longer used", key[0][0])
                    self._drop(grant)
                else:
                    grant.confirmed = max(grant.confirmed, renewal.posted)
            self._renewing = None
        due: dict[PoolKey, list[int]] = defaultdict(list)
        for grant in self._grants.values():
            if now - grant.renewed >= self._renew_after_s:
                grant.renewed = now
                due[grant.pool].append(grant.token)
        if due:
            tokens = {(pool, token) for pool, ids in due.items() for token in ids}
            self._renewing = _Renewal(now, tokens, self._store.renew(due))
