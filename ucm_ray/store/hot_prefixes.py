"""Hot prefixes: the fleet's table of blocks so widely shared that their family root is a hot spot.

Under writer-local placement a prompt's lookup asks the owner of its family root, and its writer
tells that owner where its blocks went. A system prompt that most requests start with gives most
prompts the same root, so one shard would answer most of the fleet's lookups and keep most of its
hints (docs/scaling.md: 341x the mean at 1,000 nodes in the simulation). The owner of a root that
is asked often therefore learns what its askers share (``HotPrefixLearner``) and hands those
blocks, with the pools its hints name for them, to the directory, which pushes the table to every
engine with the membership (a new version: no polling). A prompt's leading blocks that are in the
table are found in the pools the table names (no call); its family root moves to the first block
after them, so the prompts under one system prompt spread their lookups and hints over the fleet.
Readers' copies of a hot prefix are announced to the directory (through a steward shard that
batches them, ``store.hot_copy_relay``), whose table then names their pools too (up to the copy
bound, a row's copies named as they double, ``copies_due``); engines get the table's changes as a
delta of the revision they hold (``HotPrefixDelta``; a row that only grew, as the pools added),
readers' copies at most once a second (``PushPacer``).
"""

from __future__ import annotations

import math
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ucm_ray.transport.base import PoolKey

SCAN_BLOCKS = 512
"""Blocks past its root that a lookup shows the root's owner (8 KiB of keys): a hot prefix grows
by at most this much per learning, and a longer one by a later root's learning."""
MAX_HOT_BLOCKS = 4096
"""The table's bound, oldest out. Engines get it whole once (then deltas, ``HotPrefixDelta``): with
readers' copies a row names up to the copy bound, so at 1,000 nodes (100 pools a row) the whole
table pickles to ~12 MiB (review54, measured), ~150 KiB with one pool a row."""
WINDOW_S = 10.0
"""A root's asks are counted over this long: one window for all roots, from the learner's start,
then from the first ask after it ends (asks that straddle its end are split between two)."""
SESSIONS = 4
"""A root's most recent askers whose shared blocks become hot."""
RECORDED_KEYS = 1 << 17
"""Keys of recent lookups a root's owner remembers for a handover (~9 MiB of key objects): a
family whose writer's lookup aged out of them is a miss once for other nodes when its prefix
becomes hot, as before handovers."""
ASKERS_MIN = SESSIONS
"""Distinct asking nodes that make a root hot within a window whatever its asks (with ``ASKERS_SHARE``):
how many nodes share a prefix does not depend on each node's request rate, as the asks do. At
least ``SESSIONS``: the askers' families compared (``shared_prefix``) then come from as many
different nodes (with 2, a chat one other node read twice became a hot prefix on three nodes:
``tests/integration/test_writer_local.py``; the simulation's figures hold, docs/scaling.md, stop 59)."""
ASKERS_SHARE = 0.02
"""... or this share of the fleet's nodes, if more: ``askers_needed``. At 1,000 nodes 20 (the
simulation's best hot spot at 1,000 nodes with ``hot_prefix_asks`` kept for a sticky router's one
asker, docs/scaling.md, stop 58 learn12 and stop 59)."""
MAX_ASKERS = 64
"""A root's distinct askers counted at most (the rule's bound past 3,200 nodes): a root holds at
most this many asker hashes in a window."""
REANNOUNCE_S = 300.0
"""A root announced is counted again after this long: the table's pools are refreshed, and a
restarted directory (whose table starts empty) relearns what is still hot."""


@dataclass(frozen=True)
class HotPrefixes:
    """The table as engines hold it: hot block key -> the pools that hold it (those that held it
    when it became hot, then the copies readers announced, ``HotPrefixTable.add_copies``)."""

    pools: Mapping[bytes, tuple[PoolKey, ...]] = field(default_factory=dict)
    """Read-only by convention (a plain dict: the membership is pickled to every engine)."""
    revision: int = 0
    """The directory table's revision this is (``HotPrefixDelta.base`` names one)."""

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``' leading blocks are hot."""
        pools = self.pools
        count = 0
        for key in keys:
            if key not in pools:
                break
            count += 1
        return count

    def root_position(self, chain: Sequence[bytes]) -> int:
        """Where a prompt's family root is in its block chain: the first block that is not hot
        (the first block when all of them are: a prompt made only of a hot prefix registers where
        it always did)."""
        hot = self.leading(chain)
        return hot if hot < len(chain) else 0

    def __len__(self) -> int:
        return len(self.pools)


NO_HOT_PREFIXES = HotPrefixes()


@dataclass(frozen=True)
class HotPrefixDelta:
    """What changed in the directory's table from revision ``base`` to ``revision``: pushed
    instead of the whole table to an engine that holds ``base`` (a copy announced at 1,000 nodes
    changes one row of a table of up to ``MAX_HOT_BLOCKS``)."""

    base: int
    revision: int
    changed: Mapping[bytes, tuple[PoolKey, ...]]
    """Rows new or changed otherwise than grown since ``base``, whole."""
    dropped: tuple[bytes, ...] = ()
    appended: Mapping[bytes, tuple[PoolKey, ...]] = field(default_factory=dict)
    """Rows that only grew since ``base`` (readers' copies named, ``add_copies``): the pools
    named after those the row had at ``base``. A row grows to the copy bound by doubling, so
    its pools pushed whole sum to twice what it ends with (1,000 nodes, random, in the
    simulation: 409,083 pools pushed whole, 194,480 appended, each to every engine;
    docs/scaling.md, stop 60)."""

    def __setstate__(self, state: dict[str, object]) -> None:
        """Unpickled: a delta from a directory of an older package carries no ``appended`` (a
        field with a default factory has no class default to fall back on), so it appends none."""
        self.__dict__.update({"appended": {}, **state})

    def apply(self, table: HotPrefixes) -> HotPrefixes | None:
        """``table`` with this delta applied; None when ``table`` is not the revision it applies to."""
        if table.revision != self.base:
            return None
        pools = dict(table.pools)
        for key in self.dropped:
            pools.pop(key, None)
        pools.update(self.changed)
        for key, added in self.appended.items():
            row = pools.get(key)
            if row is None:  # not the table the delta was made against
                return None
            pools[key] = row + added
        return HotPrefixes(pools, self.revision)


def delta_between(old: HotPrefixes, new: HotPrefixes) -> HotPrefixDelta:
    """What turns table ``old`` into ``new`` (a row that only grew, as the pools added): a node's
    membership relay builds it for an engine further behind than the delta it got
    (``store.membership_relay``), where the directory reads it from its table's history."""
    changed: dict[bytes, tuple[PoolKey, ...]] = {}
    appended: dict[bytes, tuple[PoolKey, ...]] = {}
    for key, pools in new.pools.items():
        held = old.pools.get(key)
        if held == pools:
            continue
        if held is not None and pools[:len(held)] == held:
            appended[key] = pools[len(held):]
        else:
            changed[key] = pools
    dropped = tuple(key for key in old.pools if key not in new.pools)
    return HotPrefixDelta(old.revision, new.revision, changed, dropped, appended)


HotPrefixPush = HotPrefixes | HotPrefixDelta
"""What a membership carries: the whole table, or what changed since the engine's revision."""


def askers_needed(nodes: int) -> int:
    """Distinct asking nodes that make a root hot in a fleet of ``nodes`` (``ASKERS_MIN``,
    ``ASKERS_SHARE``; at most ``MAX_ASKERS``)."""
    return min(MAX_ASKERS, max(ASKERS_MIN, math.ceil(ASKERS_SHARE * nodes)))


class HotPrefixLearner:
    """At a root's owner: counts the lookups that ask it (one ask a ``where`` call, whatever its
    keys; ``register_hints`` is not counted; a request looked up again, its pins lapsed or its
    prefill's saves awaited, asks again) and the distinct nodes that ask; once
    ``asks`` came within a window, or ``askers_needed`` nodes asked (at least ``SESSIONS`` asks
    either way), the blocks the last ``SESSIONS`` askers share from the root on are hot
    (``shared_prefix``) (a root announced is not counted again for ``REANNOUNCE_S``). The asks
    alone learn what one node asks often (a sticky router sends a document's questions to one
    node); the askers learn what many nodes share whatever each one's request rate (64 asks in
    10 s are out of reach of a 100-node fleet at a request every 5 s a node)."""

    def __init__(self, asks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._asks = asks
        self._clock = clock
        self._window_start = clock()
        self._counts: dict[bytes, int] = {}
        self._askers: dict[bytes, set[int]] = {}
        """Per root asked this window, hashes of the nodes that asked (at most ``MAX_ASKERS``)."""
        self._recent: dict[bytes, deque[tuple[bytes, ...]]] = {}
        self._announced: OrderedDict[bytes, float] = OrderedDict()
        self.learned = 0
        self.asks = 0
        """Lookups shown to ``observe`` (hot prefixes on), those of a root announced lately too."""

    def observe(self, family: Sequence[bytes], asker: str = "", nodes: int = 0) -> list[bytes]:
        """A lookup asked about ``family`` (its root first, at most ``SCAN_BLOCKS`` blocks) from
        node ``asker`` (none: counted as an ask only) of a fleet of ``nodes`` (0: the asks rule
        only): the blocks that became hot with it, in chain order (usually none)."""
        if not self._asks or not family:
            return []
        self.asks += 1
        now = self._clock()
        if now - self._window_start > WINDOW_S:
            self._window_start, self._counts, self._askers, self._recent = now, {}, {}, {}
        root = family[0]
        if now - self._announced.get(root, -REANNOUNCE_S) < REANNOUNCE_S:
            return []
        count = self._counts[root] = self._counts.get(root, 0) + 1
        recent = self._recent.setdefault(root, deque(maxlen=SESSIONS))
        recent.append(tuple(family[:SCAN_BLOCKS]))
        askers = self._askers.setdefault(root, set())
        if asker and nodes and len(askers) < MAX_ASKERS:
            askers.add(zlib.crc32(asker.encode()))
        if len(recent) < SESSIONS or count < self._asks and not (nodes and len(askers) >= askers_needed(nodes)):
            return []
        hot = shared_prefix(recent)
        if not hot:
            return []
        self._announced[root] = now
        self._announced.move_to_end(root)
        while len(self._announced) > MAX_HOT_BLOCKS:
            self._announced.popitem(last=False)
        del self._counts[root], self._recent[root], self._askers[root]
        self.learned += len(hot)
        return hot


class FamilyRecords:
    """At a root's owner: the recent lookups it answered, as (the asker's chain from the root,
    the keys asked). A cold prompt's writer looks it up before it writes, so these name every
    recently written family's blocks with its chain; when a prefix of a root becomes hot they say
    which root each family moves to (``handover``). Remembering is an append (the lookup's own
    lists, kept), bounded by ``max_keys`` keys, oldest out (0: nothing is kept, hot prefixes
    being off)."""

    def __init__(self, max_keys: int = RECORDED_KEYS) -> None:
        self._max_keys = max_keys
        self._records: deque[tuple[Sequence[bytes], Sequence[bytes]]] = deque()
        self._keys = 0

    def record(self, family: Sequence[bytes], keys: Sequence[bytes]) -> None:
        if not family or not keys or not self._max_keys:
            return
        self._records.append((family, keys))
        self._keys += len(keys)
        while self._keys > self._max_keys and len(self._records) > 1:
            self._keys -= len(self._records.popleft()[1])

    def handover(self, hot: Sequence[bytes]) -> dict[bytes, list[bytes]]:
        """``hot`` (a root's leading blocks) became hot: per new family root, the keys recorded
        for the families that now fall under it (each family's first block past the hot ones;
        a family made only of hot blocks stays where it is)."""
        if not hot:
            return {}
        hot_keys = set(hot)
        moved: dict[bytes, dict[bytes, None]] = {}
        for family, keys in self._records:
            if family[0] != hot[0]:
                continue
            leading = next((at for at, key in enumerate(family) if key not in hot_keys), len(family))
            if leading == len(family):
                continue
            moved.setdefault(family[leading], {}).update(dict.fromkeys(key for key in keys if key not in hot_keys))
        return {root: list(keys) for root, keys in moved.items()}

    def __len__(self) -> int:
        return self._keys


def shared_prefix(families: Sequence[Sequence[bytes]]) -> list[bytes]:
    """What several askers of one root share: the blocks up to where they part, or the whole of
    one prompt they all asked. Nothing when they part nowhere but their lengths differ: one chat
    whose turns each extend the last is one user's history, not something many share (made hot,
    each turn's family root would move past the last, and the blocks registered under the old
    root would be lost to other nodes' readers)."""
    shortest = min(len(family) for family in families)
    shared = next((at for at in range(shortest) if len({family[at] for family in families}) > 1), shortest)
    if shared == shortest and any(len(family) != shortest for family in families):
        return []
    return list(families[0][:shared])


COPIES_PUSH_S = 1.0
"""Readers' copies change the table's pools at most this often: each change is one long-poll
answer to every engine (1,000 at 1,000 nodes), so copies announced meanwhile are pushed together
(docs/scaling.md, stop 54: pushed every change, 13 index messages a request at 1,000 nodes)."""


class PushPacer:
    """When the directory pushes a change that may wait (readers' copies): at once if the last
    such push was ``every_s`` ago or more, else once that much time has passed since it; the
    changes that come meanwhile ride on the push already scheduled."""

    def __init__(self, every_s: float = COPIES_PUSH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._last = -every_s
        self._scheduled = False

    def due(self) -> float | None:
        """A change wants pushing: seconds until its push (0: now), or None when a push already
        scheduled will carry it."""
        if self._scheduled:
            return None
        self._scheduled = True
        return max(0.0, self._last + self._every_s - self._clock())

    def pushed(self) -> None:
        self._scheduled = False
        self._last = self._clock()


COPIES_GROWTH = 2
"""A hot row naming ``COPIES_ONE_BY_ONE`` pools or more names the copies readers announced once they
are this many times, less one, the pools it names (a doubling), or fill its copy bound: each
change of a row is pushed to every engine, so a row that grows to the bound is pushed about
log2(bound) times (8 at 1,000 nodes, 100 pools), not once a copy (docs/scaling.md, stop 59)."""
COPIES_ONE_BY_ONE = 4
"""Below this many pools a row names each copy announced (the engine's ``READ_POOLS``: a reader
tries at most 4 of a row's pools, so the first few copies are what spreads a hot prefix's reads)."""


def copies_due(named: int, waiting: int, bound: int, growth: float = COPIES_GROWTH) -> bool:
    """Whether a hot row naming ``named`` pools names the ``waiting`` copies announced since
    (``COPIES_ONE_BY_ONE``, ``COPIES_GROWTH``; ``bound``: its copy bound, 0: none; the simulation
    tries other growths)."""
    return (named < COPIES_ONE_BY_ONE or waiting >= (growth - 1) * named
            or bool(bound) and named + waiting >= bound)


DROP_LOG = 4096
"""Keys dropped from the table (oldest out) that it remembers for deltas: an engine further behind
gets the whole table."""


class HotPrefixTable:
    """The directory's copy: bounded, oldest out; ``add`` and ``add_copies`` say whether anything
    changed (then the membership's version moves and every engine gets what changed since the
    revision it holds, ``since``)."""

    def __init__(self, max_blocks: int = MAX_HOT_BLOCKS, start: int = 0) -> None:
        """``start``: the first revision (the directory's is random, so an engine's revision from
        another directory start is never taken for one of this table's)."""
        self._max_blocks = max_blocks
        self._pools: OrderedDict[bytes, tuple[PoolKey, ...]] = OrderedDict()
        self._start = self._revision = start
        self._changed_at: dict[bytes, int] = {}
        """Per key held, the revision that last changed its row."""
        self._grown: dict[bytes, list[tuple[int, int]]] = {}
        """Per key held, (revision, pools named after it) of each change since the row was last set
        otherwise than grown (that change first): a delta appends to a row held at any of them."""
        self._growing: set[bytes] = set()
        """Keys whose change being committed only appended pools (``_set``'s ``grown``)."""
        self._dropped: deque[tuple[int, bytes]] = deque(maxlen=DROP_LOG)
        """(revision, key) of the keys dropped, oldest first."""
        self._waiting: dict[bytes, dict[PoolKey, None]] = {}
        """Per row, readers' copies announced and not named yet (``copies_due``), in order."""
        self._answers: dict[int, HotPrefixPush] = {}
        """``since``'s and ``snapshot``'s (key -1) answers at this revision: every engine's long
        poll asks at each push, nearly all from the same revision (one diff, not one per engine)."""

    def add(self, entries: Mapping[bytes, Sequence[PoolKey]]) -> bool:
        """Hot blocks a root's owner learned, with the pools its hints name (a row given again is
        replaced)."""
        changed = [key for key, pools in entries.items() if self._set(key, tuple((p[0], p[1]) for p in pools))]
        return self._commit(changed)

    def add_copies(self, pool: PoolKey, keys: Sequence[bytes], bound: int) -> bool:
        """A reader's pool ``pool`` now holds a copy of these hot blocks: a row still naming fewer
        than ``bound`` pools (0: no bound) names it too, last, once ``copies_due`` (the copies
        announced meanwhile wait here). Blocks not in the table are ignored (dropped meanwhile, or
        never hot)."""
        listed = (pool[0], pool[1])
        changed = []
        for key in keys:
            pools = self._pools.get(key)
            if pools is None or listed in pools or (bound and len(pools) >= bound):
                continue
            waiting = self._waiting.setdefault(key, {})
            waiting[listed] = None
            if not copies_due(len(pools), len(waiting), bound):
                continue
            del self._waiting[key]
            added = tuple(waiting_pool for waiting_pool in waiting if waiting_pool not in pools)
            added = added[:bound - len(pools)] if bound else added
            if self._set(key, pools + added, grown=True):
                changed.append(key)
        return self._commit(changed)

    def remove_pool(self, pool: PoolKey) -> bool:
        """A pool left the fleet: no row names it any more, nor waits to (a row naming nothing else
        stays, empty: its blocks are still the hot prefix, found only in readers' own pools)."""
        listed = (pool[0], pool[1])
        for waiting in self._waiting.values():
            waiting.pop(listed, None)
        changed = [key for key, pools in list(self._pools.items())
                   if listed in pools and self._set(key, tuple(p for p in pools if p != listed))]
        return self._commit(changed)

    def _set(self, key: bytes, pools: tuple[PoolKey, ...], grown: bool = False) -> bool:
        """``grown``: ``pools`` is the row held with pools added at its end."""
        if self._pools.get(key) == pools:
            return False
        self._pools[key] = pools
        if grown:
            self._growing.add(key)
        else:
            self._growing.discard(key)
        return True

    def _commit(self, changed: list[bytes]) -> bool:
        if not changed:
            return False
        self._revision += 1
        self._answers.clear()
        for key in changed:
            self._changed_at[key] = self._revision
            step = (self._revision, len(self._pools[key]))
            if key in self._growing and key in self._grown:
                self._grown[key].append(step)
            else:
                self._grown[key] = [step]
        self._growing.clear()
        while len(self._pools) > self._max_blocks:
            key, _ = self._pools.popitem(last=False)
            del self._changed_at[key]
            del self._grown[key]
            self._waiting.pop(key, None)
            self._dropped.append((self._revision, key))
        return True

    def snapshot(self) -> HotPrefixes:
        """The whole table (the same object until it changes: read-only, as ``HotPrefixes`` is)."""
        whole = self._answers.get(-1)
        if whole is None:
            whole = self._answers[-1] = HotPrefixes(dict(self._pools), self._revision)
        assert isinstance(whole, HotPrefixes)
        return whole

    def since(self, revision: int) -> HotPrefixPush:
        """What an engine holding ``revision`` needs: the rows changed after it and the keys
        dropped after it, or the whole table when it holds none (-1), one from another directory
        start, or one older than the drop log remembers. Built once per revision asked about."""
        answer = self._answers.get(revision)
        if answer is None:
            answer = self._answers[revision] = self._since(revision)
        return answer

    def _since(self, revision: int) -> HotPrefixPush:
        if revision == self._revision:
            return HotPrefixDelta(revision, revision, {})
        if not self._start <= revision < self._revision or (self._dropped and len(self._dropped) == self._dropped.maxlen
                                                  and self._dropped[0][0] > revision):
            return self.snapshot()
        changed: dict[bytes, tuple[PoolKey, ...]] = {}
        appended: dict[bytes, tuple[PoolKey, ...]] = {}
        for key, at in self._changed_at.items():
            if at <= revision:
                continue
            held = [named for when, named in self._grown[key] if when <= revision]
            if held:  # the engine's row is this one's first pools: only what came after
                appended[key] = self._pools[key][held[-1]:]
            else:
                changed[key] = self._pools[key]
        dropped = tuple(key for at, key in self._dropped if at > revision and key not in changed)
        return HotPrefixDelta(revision, self._revision, changed, dropped, appended)

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def copies_waiting(self) -> int:
        """Readers' copies announced that no row names yet (``copies_due``)."""
        return sum(len(waiting) for waiting in self._waiting.values())

    @property
    def pools_named(self) -> int:
        """Pools named over all rows (a row counts each of its pools)."""
        return sum(len(pools) for pools in self._pools.values())

    def __len__(self) -> int:
        return len(self._pools)
