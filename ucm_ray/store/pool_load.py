"""The fleet's load figure per pool, and a hot-prefix reader's pick between two pools by it.

NIXL reads are one-sided: a pool never sees what it serves, and (k)'s hottest nodes serve the rows
of hot prefixes, whose readers started at a pool a hash of their node picks (``family.spread``):
3.17x / 8.29x the mean bytes at 100 nodes random / sticky, 4.78x at 1,000 (docs/scaling.md, stops
61-64). So each engine counts the bytes it loaded from each other node's pool (``PoolReads``) and
sends the counts since its last long poll with its next one, to its node's relay, which sums its
engines' and sends them with its own poll (no new call). The directory sums them into a figure per
pool decayed with a time constant of ``DECAY_S`` (``PoolLoad``) and, once it moved by more than
``CHANGE_SHARE``, pushes the ``TOP_POOLS`` most loaded pools' figures with its next membership
version, paced with the readers' copies (at most one push a ``COPIES_PUSH_S``). A hot row's reader
draws two of the row's pools once per lookup and tries the one with the lower figure first
(``pick_two``): power of two choices, which in the simulation kept most of what an oracle knowing
every pool's load now gained, where least-loaded-first herded a push period's readers onto one pool
(docs/scaling.md, stops 63 and 65).
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ucm_ray.transport.base import PoolKey


class _Keyed(Protocol):
    """A member of the shard list (``store.types.ShardRecord``), by what the figures need of it: not
    imported, as ``store.types``' ``Membership`` carries ``LoadFigures`` (no import circle)."""

    @property
    def key(self) -> PoolKey: ...

TOP_POOLS = 100
"""Pools whose figures a push carries (the most loaded; every other pool reads as 0, "not busy").
At 1,000 nodes the simulation's hottest node was 3.44x the mean with the top 100 figures against
3.4 with all 1,000 (stop 63): ~1.2 KB an answer, not ~12 KB. A fleet of fewer pools gets them all."""
DECAY_S = 30.0
"""The figure's time constant: a pool's figure is the bytes read from it, each weighted by
exp(-age / this), over this (so bytes a second, recent ones counting most). Stop 63: 10 s-30 s kept
the gain, 5 s chased last second's quiet pools (4.12 against 3.44 at 1,000 nodes)."""
CHANGE_SHARE = 0.2
"""A report moves the figure enough to push when a pool it names moved by more than this share of
the figure last pushed for it, or of the mean figure where that is larger (the simulation's
``load_change_share``): reads that keep the pools' shares push nothing new. A pool the push left
out (below the top ``TOP_POOLS``) is measured against the least figure it carried, upwards only: it
matters once it would enter the top (against 0, steady reads over more pools than a push carries
moved the figure at every report, a push each pacer period for good, review65b)."""
REBASE_AFTER = 20.0
"""Time constants after which ``PoolLoad`` rescales its sums (they grow by e per time constant)."""

PoolReadCounts = dict[PoolKey, int]
"""Bytes read per pool: what a long poll reports."""


class PoolReads:
    """Bytes read per pool since the last ``drain``: an engine's loads that landed, or a relay's
    engines' reports. Thread-safe (a relay's engines report from the threads of its relay group)."""

    def __init__(self) -> None:
        self._counts: PoolReadCounts = {}
        self._lock = threading.Lock()

    def add(self, counts: Mapping[PoolKey, int]) -> None:
        with self._lock:
            for pool, size in counts.items():
                self._counts[pool] = self._counts.get(pool, 0) + int(size)

    def drain(self) -> PoolReadCounts | None:
        """The counts since the last drain, or None when nothing was read (the poll says nothing)."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts or None


@dataclass(frozen=True)
class LoadFigures:
    """The most loaded pools' figures as a push carries them: places in the membership's shard
    list (the version's own: an answer's shard list, or the one its caller held) and figures."""

    at: tuple[int, ...] = ()
    figure: tuple[float, ...] = ()

    def by_pool(self, shards: Sequence[_Keyed]) -> dict[PoolKey, float]:
        return {shards[i].key: figure for i, figure in zip(self.at, self.figure) if i < len(shards)}


NO_LOAD = LoadFigures()


class PoolLoad:
    """The directory's figure per pool: the engines' reports summed, decayed (``DECAY_S``), and
    whether they moved it enough since the last push to push again (``CHANGE_SHARE``).

    A sum is kept scaled by exp((t - epoch) / decay_s) at each addition, so a report costs its own
    entries only (no pass over every pool to decay them); ``figure`` scales back."""

    def __init__(self, decay_s: float = DECAY_S, top: int = TOP_POOLS, change_share: float = CHANGE_SHARE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._decay_s = decay_s
        self._top = top
        self._change_share = change_share
        self._clock = clock
        self._epoch = clock()
        self._scaled: dict[PoolKey, float] = {}
        self._total = 0.0
        """The sum of ``_scaled``."""
        self._pushed: dict[PoolKey, float] = {}
        """The figures the last push carried (a pool not in it: 0)."""
        self._floor = 0.0
        """The least figure the last push carried when it left pools out (it carried ``top``), else 0."""
        self.moved = False
        """A report moved some pool's figure by more than ``CHANGE_SHARE`` since the last push."""

    def report(self, counts: Mapping[PoolKey, int]) -> None:
        now = self._clock()
        if now - self._epoch > REBASE_AFTER * self._decay_s:
            self._rebase(now)
        weight = math.exp((now - self._epoch) / self._decay_s)
        for pool, size in counts.items():
            added = size * weight
            self._scaled[pool] = self._scaled.get(pool, 0.0) + added
            self._total += added
        if not self.moved:
            scale = self._scale(now)
            mean = self._total * scale / len(self._scaled)
            for pool in counts:
                figure = self._scaled[pool] * scale
                before = self._pushed.get(pool)
                if before is None:  # left out: moved once it would enter the top
                    moved = figure - self._floor > self._change_share * max(self._floor, mean)
                else:
                    moved = abs(figure - before) > self._change_share * max(before, mean)
                if moved:
                    self.moved = True
                    break

    @property
    def pools(self) -> int:
        """Pools reported read from (a departed one's sum, reported after it left, until it decays)."""
        return len(self._scaled)

    def figure(self, pool: PoolKey) -> float:
        """Bytes a second read from ``pool``, recent ones counting most."""
        return self._scaled.get(pool, 0.0) * self._scale(self._clock())

    def publish(self, shards: Sequence[_Keyed]) -> LoadFigures:
        """The ``TOP_POOLS`` most loaded of ``shards``' pools, as the next push carries them (and
        what later reports are measured against)."""
        if not self._scaled:
            return NO_LOAD
        place = {record.key: i for i, record in enumerate(shards)}
        scale = self._scale(self._clock())
        top = heapq.nlargest(self._top, (item for item in self._scaled.items() if item[0] in place),
                             key=lambda item: item[1])
        self._pushed = {pool: scaled * scale for pool, scaled in top}
        self._floor = top[-1][1] * scale if len(top) == self._top else 0.0
        self.moved = False
        return LoadFigures(tuple(place[pool] for pool, _ in top), tuple(self._pushed.values()))

    def remove(self, pool: PoolKey) -> None:
        """A pool that left: it is read no more."""
        self._total -= self._scaled.pop(pool, 0.0)
        self._pushed.pop(pool, None)

    def _scale(self, now: float) -> float:
        return math.exp(-(now - self._epoch) / self._decay_s) / self._decay_s

    def _rebase(self, now: float) -> None:
        shrink = math.exp(-(now - self._epoch) / self._decay_s)
        self._scaled = {pool: scaled * shrink for pool, scaled in self._scaled.items() if scaled * shrink > 1e-3}
        self._total = sum(self._scaled.values())
        self._epoch = now


def pick_two(pools: Sequence[PoolKey], load: Mapping[PoolKey, float], draw: int) -> Sequence[PoolKey]:
    """A hot row's pools (in the order ``family.spread`` gives) as its reader tries them: the two at
    the places ``draw`` picks first, the one with the lower figure before the other (equal: as
    drawn), then the rest in their order. ``draw`` is drawn once per lookup, so the rows of one
    prefix, which mostly name the same pools, are read from the same pool (the simulation's
    ``load_pair_per_request``). No figures held (none pushed, or the switch off): ``pools`` as given."""
    count = len(pools)
    if count < 2 or not load:
        return pools
    first = draw % count
    second = (first + 1 + (draw // count) % (count - 1)) % count
    one, other = pools[first], pools[second]
    if load.get((other[0], other[1]), 0.0) < load.get((one[0], one[1]), 0.0):
        one, other = other, one
    return (one, other, *(pool for i, pool in enumerate(pools) if i != first and i != second))
