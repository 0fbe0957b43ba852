"""Issue 40: why writer-local placement loses hits where pools evict (10 nodes), split by cause.

Runs per-block placement (a) and the built design (k) over one workload on pools that record
what they hold, and prints per design: the prompt tokens missed, split by what the first
missing block of each prompt was just before the request (``cold``: never stored; ``evicted``:
stored once, held by no pool now; ``unfound``: held by some pool the lookup did not find) and how
many blocks past that break some pool still held (recomputed and, writer-local, saved again);
the blocks a save wrote that another pool already held (``dup writes``) and the share of the
pools' blocks that were such duplicates (sampled); per node, blocks written, evictions and the
mean idle time of an evicted block (requests since its last use: how long a pool keeps a block
it is not asked for; the same on every pool is a global LRU's fairness, uneven is a partitioned
LRU's unfairness).

Variants of (k) (``--variants``) test a cause by removing it: ``pooled``: every node shares one
pool of the fleet's capacity (no partitioning, no duplicates: an upper bound on balancing);
``nodup``: a save skips the blocks another pool holds that the writer's root owner names, and
reads them (refreshing them, as per-block placement's lookup does); ``notouch``: a read from
another node does not make the block recently used in its pool (what the package's touches
prevent). And two fixes that move bytes off the writer's node, counted: ``spill``: a save that
would make its node's pool evict while that pool's least recently used block is idle less than
``--spill-ratio`` of the oldest peer pool's goes to that peer; ``demote``: the save stays and the
blocks it evicts that are younger than that go to the peer.

``--disk-ratio R`` puts a disk tier of R pools behind every pool of (a) and (k) (same capacity per
node for both; ``DiskCluster``): the package's write-back ahead of eviction, clean-first eviction
and promotion of a hit's disk-only blocks, on the real ``BlockIndex``; it asks whether a node's
NVMe lengthens the busiest writer's horizon enough to close the gap without bytes leaving the node.
It adds per design the share of hit tokens read from disk, the bytes that cost, the pools'
evictions of blocks not yet on disk (lost) and the disks' own evictions.

Run: ``python benchmarks/scale_evict.py --nodes 10 --requests 1000 --block-size 128 --router random``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.scale.cluster import WRITER, Cluster, Placement, shard_ids  # noqa: E402
from benchmarks.scale.designs import Design, DesignParams, HandoverCopyOnSecondRead, PerBlock  # noqa: E402
from benchmarks.scale.metrics import RequestTally  # noqa: E402
from benchmarks.scale.runner import pool_tokens_for  # noqa: E402
from benchmarks.scale.workload import (  # noqa: E402
    BYTES_PER_TOKEN,
    Request,
    WorkloadSpec,
    add_single_run_args,
    single_run,
)
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.shard.disk.store import EVICT_AHEAD  # noqa: E402
from ucm_ray.store.shard.disk.tier import clean_low  # noqa: E402
from ucm_ray.store.shard.index import BlockIndex  # noqa: E402

CAUSES = ("cold", "evicted", "unfound")
DEMOTE_HIGH = 0.9
"""``DiskTier``'s default high watermark (the shard passes none): demotion starts above 90 % of the
pool and makes its coldest ``used - low`` clean, ``low`` by default the package's ``clean_low`` of
the disk's and the pool's sizes (0.75 for a disk the pool's size, 0.5 from twice it)."""
SAVE_CHUNK_TOKENS = 8192
"""Tokens a save commits at once with a disk tier (demotion runs between commits): vLLM's default
``max_num_batched_tokens`` for its server, a prefill's step."""
DISK_READ_BYTES_S = 1.2e9
"""A promotion's reads: this box's disk at depth 8 (DESIGN section 9; an NVMe reads 3-7 GB/s)."""
SAMPLE_EVERY = 50
"""Requests between samples of the duplicates' share of the pools."""


class ObservedCluster(Cluster):
    """The pools, recording what a cause split needs: the blocks ever stored, how many pools hold
    each block now, every block's last use per pool, and per pool its writes and evicted idle times."""

    def __init__(self, nodes: int, pool_bytes: int, block_bytes: int, placement: Placement) -> None:
        super().__init__(nodes, pool_bytes, block_bytes, placement)
        self.ever: set[bytes] = set()
        self.holders: Counter[bytes] = Counter()
        self.last_use: dict[tuple[int, bytes], int] = {}
        self.now = 0
        self.writes: np.ndarray = np.zeros(nodes, dtype=np.int64)
        self.dup_writes = 0
        self.evicted_idle: list[list[int]] = [[] for _ in range(nodes)]
        self.last_victims: dict[bytes, int] = {}
        """The last ``store``'s evicted blocks and their idle times (requests since last used)."""

    def pool_of(self, node: int) -> int:
        """The pool ``node`` reads and writes (its own)."""
        return node

    def _used(self, node: int, keys: Sequence[bytes]) -> None:
        pool = self.pool_of(node)
        for key in keys:
            self.last_use[pool, key] = self.now

    def has(self, node: int, keys: Sequence[bytes]) -> list[bool]:
        out = super().has(node, keys)
        self._used(node, [key for key, hit in zip(keys, out) if hit])
        return out

    def read(self, keys: Sequence[bytes], nodes: Sequence[int]) -> None:
        super().read(keys, nodes)
        for key, node in zip(keys, nodes):
            self.last_use[self.pool_of(node), key] = self.now

    def store(self, node: int, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        stored, evicted = self.store_in_pools(node, keys)
        self.last_victims = {}
        self.forget(node, evicted)
        self.dup_writes += sum(self.holders[key] > 0 for key in stored)
        for key in stored:
            self.holders[key] += 1
        self.ever.update(stored)
        self.writes[node] += len(stored)
        self._used(node, stored)
        return stored, evicted

    def store_in_pools(self, node: int, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """The save itself (``Cluster.store``): (the keys stored, the keys ``node`` lost for them)."""
        return super().store(node, keys)

    def forget(self, node: int, lost: Sequence[bytes]) -> None:
        """``node`` holds ``lost`` no more: one holder less each, and how long each was idle."""
        for key in lost:
            self.holders[key] -= 1
            idle = self.last_victims[key] = self.now - self.last_use.pop((self.pool_of(node), key), self.now)
            self.evicted_idle[self.pool_of(node)].append(idle)

    def held_anywhere(self, key: bytes) -> bool:
        return self.holders[key] > 0

    def duplicate_share(self) -> float:
        pools = {id(keys): keys for keys in self.stored}.values()  # ``pooled``: one set for all
        held = sum(len(keys) for keys in pools)
        distinct = len(set().union(*pools))
        return (held - distinct) / held if held else 0.0


class PooledCluster(ObservedCluster):
    """Every node's pool is one pool of the fleet's capacity (``pooled``)."""

    def __init__(self, nodes: int, pool_bytes: int, block_bytes: int, placement: Placement) -> None:
        super().__init__(nodes, pool_bytes * nodes, block_bytes, placement)
        self.pools = [self.pools[0]] * nodes
        self._logs = [self._logs[0]] * nodes
        self.stored = [self.stored[0]] * nodes

    def pool_of(self, node: int) -> int:
        return 0

    def evictions(self) -> int:
        return self.pools[0].stats().evictions


class DiskLru:
    """One node's disk tier as its ``DiskStore`` keeps entries: least recently used first, a write
    or a read makes an entry the most recent, and a write that finds no room evicts the least
    recently used until ``1 / EVICT_AHEAD`` of the tier is free (the store's evict-ahead). Only keys:
    every block is one slot of the same size."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.entries: OrderedDict[bytes, None] = OrderedDict()
        self.evictions = 0

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def put_many(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """(the keys on disk now, the keys evicted for them), as ``DiskStore.put_many``."""
        written: list[bytes] = []
        gone: list[bytes] = []
        ahead = max(1, self.capacity_blocks // EVICT_AHEAD)
        for key in keys:
            if key in self.entries:
                self.entries.move_to_end(key)
                written.append(key)
                continue
            if not self.capacity_blocks:
                continue
            if len(self.entries) >= self.capacity_blocks:
                while self.entries and self.capacity_blocks - len(self.entries) < ahead:
                    gone.append(self.entries.popitem(last=False)[0])
                    self.evictions += 1
            self.entries[key] = None
            written.append(key)
        return written, [key for key in gone if key not in self.entries]

    def read(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.entries.move_to_end(key)


DEMOTER = 2
"""The disk tier's client id towards its pool (its demotion leases), as ``DiskTier``'s own."""


class DiskCluster(ObservedCluster):
    """Every node's pool with a disk tier of ``disk_ratio`` times the pool behind it, run as the
    package's ``DiskTier`` runs (``store/shard/disk/tier.py``), on the real ``BlockIndex`` with
    ``prefer_clean`` and its real ``demotion_batch`` / ``mark_clean`` / ``disk_dropped``:

    - write-back: after each commit (the shard wakes its demoter on every commit), while the pool
      is above its high watermark (or has evicted since its cold end was last clean), the dirty
      entries among its coldest ``used - low`` bytes are written to disk (clean: still in the pool);
    - the pool evicts the least recently used clean entry among its coldest ``CLEAN_SCAN`` first,
      which stays on disk (a hit there); a dirty one evicted is lost (``evicted_dirty``);
    - a save arrives in chunks of ``save_chunk_blocks`` (a prefill's steps), demotion between them;
    - a lookup finds keys on disk as hits (the shard's ``contains``), and loading them promotes them
      (the shard's ``acquire``): read into the pool (which may evict), clean (the disk keeps its
      copy), the disk entry made recently used. Only a hit's keys are promoted, never those past it.

    ``stored[node]`` is what the node's shard holds, pool or disk (the designs' "held there").
    Not modelled: ``disk_wait_s`` unless ``apply_wait`` (every disk hit is read, whatever it costs;
    ``disk_read_blocks`` counts the bytes, ``wait_cut_blocks`` what the bound would cut), the
    read-cost plan, reads and writes taking time, and a save of a block its shard holds only on
    disk (skipped, as a held block; the package's commit would take it into the pool)."""

    def __init__(self, nodes: int, pool_bytes: int, block_bytes: int, placement: Placement,
                 disk_ratio: float = 1.0, save_chunk_blocks: int = 0, demote_low: float | None = None,
                 read_bytes_s: float = DISK_READ_BYTES_S, apply_wait: bool = False) -> None:
        super().__init__(nodes, pool_bytes, block_bytes, placement)
        self.pools = [BlockIndex(pool_bytes, lease_s=1e9, reserve_timeout_s=1e9, clock=self.clock,
                                 published=log, prefer_clean=True) for log in self._logs]
        capacity = self.pools[0].stats().capacity_bytes
        self.high_bytes = int(DEMOTE_HIGH * capacity)
        low = clean_low(int(disk_ratio * pool_bytes), pool_bytes) if demote_low is None else demote_low
        self.low_bytes = int(min(low, DEMOTE_HIGH) * capacity)
        self.disks = [DiskLru(int(disk_ratio * pool_bytes) // block_bytes) for _ in range(nodes)]
        self.in_pool: list[set[bytes]] = [set() for _ in range(nodes)]
        self.save_chunk_blocks = save_chunk_blocks
        self._evictions_seen = [0] * nodes
        self.disk_read_blocks = 0
        """Blocks a hit read from disk (promoted): hits served from disk."""
        self.demoted_blocks = 0
        self.wait_blocks = int(UcmRayConfig().disk_wait_s * read_bytes_s) // block_bytes
        """Blocks one promotion (one shard's ``acquire``) reads within ``disk_wait_s`` at ``read_bytes_s``."""
        self.wait_cut_blocks = 0
        """Hit blocks a lookup would lose had its promotions stopped at ``wait_blocks`` (a prefix
        ends at its first block not read; counted, not applied: the run serves them)."""
        self.largest_promotion = 0
        self.apply_wait = apply_wait
        """Cut each hit where a promotion passes ``wait_blocks`` (else only counted)."""

    def has(self, node: int, keys: Sequence[bytes]) -> list[bool]:
        in_pool = super().has(node, keys)
        disk = self.disks[node]
        on_disk = [not hit and key in disk for key, hit in zip(keys, in_pool)]
        self._used(node, [key for key, found in zip(keys, on_disk) if found])
        return [hit or found for hit, found in zip(in_pool, on_disk)]

    def read(self, keys: Sequence[bytes], nodes: Sequence[int]) -> None:
        super().read(keys, nodes)
        self.load(keys, nodes)

    def read_hit(self, keys: Sequence[bytes], nodes: Sequence[int]) -> int:
        super().read(keys, nodes)
        return self.load(keys, nodes)

    def load(self, keys: Sequence[bytes], nodes: Sequence[int]) -> int:
        """Promote the loaded keys only the disk holds, one batch per node (one ``acquire``); the
        blocks loaded: all, or with ``apply_wait`` those before the first a node's promotion would
        not read within ``disk_wait_s`` (the rest are misses, as the package's ``promote_late``)."""
        per_node: dict[int, list[tuple[int, bytes]]] = {}
        cut = len(keys)
        for position, (key, node) in enumerate(zip(keys, nodes)):
            if key not in self.in_pool[node] and key in self.disks[node]:
                asked = per_node.setdefault(node, [])
                if len(asked) == self.wait_blocks:
                    cut = min(cut, position)
                asked.append((position, key))
        self.wait_cut_blocks += len(keys) - cut
        loaded = cut if self.apply_wait else len(keys)
        for node, placed in per_node.items():
            batch = [key for position, key in placed if position < loaded]
            if not batch:
                continue
            self.disks[node].read(batch)
            promoted, lost = self._commit(node, batch)
            self.pools[node].mark_clean([(key, offset) for key, offset in promoted])
            self.disk_read_blocks += len(promoted)
            self.largest_promotion = max(self.largest_promotion, len(promoted))
            self.forget(node, lost + self._demote(node))
        return loaded

    def store_in_pools(self, node: int, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        keys = [key for key in dict.fromkeys(keys) if key not in self.stored[node]]
        chunk = self.save_chunk_blocks or len(keys) or 1
        stored: list[bytes] = []
        lost: list[bytes] = []
        for at in range(0, len(keys), chunk):
            committed, lost_now = self._commit(node, keys[at:at + chunk])
            stored += [key for key, _ in committed]
            lost += lost_now
            lost += self._demote(node)
        return stored, lost

    def _commit(self, node: int, keys: Sequence[bytes]) -> tuple[list[tuple[bytes, int]], list[bytes]]:
        """Reserve then commit ``keys`` in ``node``'s pool: ((key, offset) committed, the keys the
        node's shard lost for them: evicted dirty)."""
        pool = self.pools[node]
        token, offsets = pool.reserve(WRITER, self.block_bytes, len(keys))
        committed = list(zip(keys, offsets))
        if offsets:
            pool.commit(WRITER, token, [(key, offset, None) for key, offset in committed])
        log = self._logs[node]
        evicted, log.evicted = log.evicted, []
        disk = self.disks[node]
        lost = [key for key in evicted if key not in disk]
        self.in_pool[node].difference_update(evicted)
        self.in_pool[node].update(key for key, _ in committed)
        self.stored[node].difference_update(lost)
        self.stored[node].update(key for key, _ in committed)
        return committed, lost

    def _demote(self, node: int) -> list[bytes]:
        """``DiskTier.demote``: batches until the pool's cold end is clean or a pool's worth was
        written (one batch takes it all: batching only paces the I/O). The keys the shard lost."""
        pool, disk, log = self.pools[node], self.disks[node], self._logs[node]
        capacity = pool.stats().capacity_bytes
        lost: list[bytes] = []
        written = 0
        while written < capacity:
            stats = pool.stats()
            used = capacity if stats.evictions != self._evictions_seen[node] else stats.used_bytes
            if used <= self.high_bytes:
                break
            lease, items = pool.demotion_batch(DEMOTER, used - self.low_bytes, capacity)
            if not items:
                self._evictions_seen[node] = stats.evictions
                break
            on_disk, gone = disk.put_many([key for key, _ in items])
            done = set(on_disk)
            pool.mark_clean([(key, slot.offset) for key, slot in items if key in done])
            pool.disk_dropped(gone)
            log.evicted = []  # disk_dropped unlists the disk-only keys it dropped: lost below
            pool.release(DEMOTER, [lease])
            self.demoted_blocks += len(done)
            written += len(done) * self.block_bytes
            dropped = [key for key in gone if key not in self.in_pool[node]]
            self.stored[node].difference_update(dropped)
            lost += dropped
            if not done:
                break
        return lost

    def dirty_evictions(self) -> int:
        return sum(pool.stats().evicted_dirty for pool in self.pools)


class NoDupSaves(HandoverCopyOnSecondRead):
    """(k), and a save skips the blocks past the hit that another pool holds and the root's owner
    names (it reads them instead, as per-block placement's lookup touches every block it finds)."""

    name = "k nodup"

    def save_local(self, req: Request, keys: Sequence[bytes]) -> list[bytes]:
        keep: list[bytes] = []
        elsewhere: list[bytes] = []
        elsewhere_nodes: list[int] = []
        for key in keys:
            source = self._named_holder(key, req.node)
            if source is None:
                keep.append(key)
            else:
                elsewhere.append(key)
                elsewhere_nodes.append(source)
        self.cluster.read(elsewhere, elsewhere_nodes)
        return super().save_local(req, keep)

    def _named_holder(self, key: bytes, node: int) -> int | None:
        if key in self.cluster.stored[node] or self.hint_root.get(key) != self._root:
            return None
        for where in reversed(self.locs.get(key, ())):
            if where != node and key in self.cluster.stored[where]:
                return where
        return None


class NoRemoteTouch(HandoverCopyOnSecondRead):
    """(k) where a read from another node does not make the block recently used in its pool (what
    the package would do without the touches its readers send, ``store.engine.touches``)."""

    name = "k no remote touch"

    def walk(self, req: Request, tally: RequestTally) -> tuple[int, list[int]]:
        cluster = self.cluster
        read = cluster.read

        def local_only(keys: Sequence[bytes], nodes: Sequence[int]) -> None:
            mine = [index for index, node in enumerate(nodes) if node == req.node]
            read([keys[index] for index in mine], [req.node] * len(mine))

        cluster.read = local_only  # type: ignore[method-assign]
        try:
            return super().walk(req, tally)
        finally:
            del cluster.read


class SpillSaves(HandoverCopyOnSecondRead):
    """(k), and a save that would evict from its node's pool blocks used more recently than the
    least recently used block of another pool goes to the pool whose least recently used block is
    oldest (the bytes leave the node)."""

    name = "k spill"

    spill_ratio = 1.0
    """Spill only while the node's least recently used block is idle less than this share of the
    oldest peer's (1: whenever another pool's is older)."""

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.spilled = 0

    def save_local(self, req: Request, keys: Sequence[bytes]) -> list[bytes]:
        cluster = self.cluster
        assert isinstance(cluster, ObservedCluster)
        target = req.node
        need = len([key for key in keys if key not in cluster.stored[req.node]]) * cluster.block_bytes
        own = cluster.pools[req.node].stats()
        if need and own.used_bytes + need > own.capacity_bytes:
            oldest = {node: self._lru_use(node) for node in range(cluster.nodes)}
            target = min(oldest, key=lambda node: oldest[node])
            now = cluster.now
            if now - oldest[req.node] >= self.spill_ratio * (now - oldest[target]):
                target = req.node
        if target == req.node:
            return super().save_local(req, keys)
        return self._store_on_peer(target, keys)

    def _store_on_peer(self, target: int, keys: Sequence[bytes]) -> list[bytes]:
        """Write ``keys`` into another node's pool, counted as spilled; where they are is noted
        (their hints) and what that pool evicted for them recorded. What was stored."""
        cluster = self.cluster
        assert isinstance(cluster, ObservedCluster)
        stored, evicted = cluster.store(target, keys)
        self.spilled += len(stored)
        for key in stored:
            self.locs.setdefault(key, []).append(target)
        self._evicted.extend((target, key) for key in evicted)
        return stored

    def _lru_use(self, node: int) -> int:
        cluster = self.cluster
        assert isinstance(cluster, ObservedCluster)
        entries = cluster.pools[node]._entries  # noqa: SLF001 -- the LRU head, read only
        first = next(iter(entries), None)
        return cluster.last_use.get((cluster.pool_of(node), first), -1) if first is not None else -1


class DemoteEvicted(SpillSaves):
    """(k), and a block its node's pool evicts while it is idle less than ``spill_ratio`` of the
    oldest peer's least recently used block is written to that peer (a demotion to another node's
    pool, as a disk tier takes a cold block; its hint re-registered), not lost."""

    name = "k demote to peer"

    def save_local(self, req: Request, keys: Sequence[bytes]) -> list[bytes]:
        cluster = self.cluster
        assert isinstance(cluster, ObservedCluster)
        stored, evicted = cluster.store(req.node, keys)
        victims = dict(cluster.last_victims)
        for key in stored:
            self.locs.setdefault(key, []).append(req.node)
        self._evicted.extend((req.node, key) for key in evicted)
        if victims:
            heads = {node: self._lru_use(node) for node in range(cluster.nodes) if node != req.node}
            target = min(heads, key=lambda node: heads[node])
            horizon = self.spill_ratio * (cluster.now - heads[target])
            moving = [key for key, idle in victims.items() if idle < horizon and key not in cluster.stored[target]]
            self._store_on_peer(target, moving)
        return stored


def _observe(design: Design, cluster: ObservedCluster, requests: Sequence[Request]) -> dict[str, float]:
    """Runs ``design`` (as ``Design.run`` does), classifying each prompt's break before it is served."""
    lost: Counter[str] = Counter()
    past_break_held = 0
    prompt_tokens = hit_tokens = 0
    shares = []
    block_tokens = cluster.block_tokens
    for served, req in enumerate(requests, 1):
        cluster.now = req.index
        ever = [key in cluster.ever for key in req.keys]
        held = [cluster.held_anywhere(key) for key in req.keys]
        tally: RequestTally = design.serve(req)
        design.stats.add(tally)
        hit = tally.hit_tokens // block_tokens
        prompt_tokens += tally.prompt_tokens
        hit_tokens += tally.hit_tokens
        if hit < len(req.keys):
            cause = "unfound" if held[hit] else "evicted" if ever[hit] else "cold"
            lost[cause] += (len(req.keys) - hit) * block_tokens
            past_break_held += sum(held[hit + 1:])
        cluster.tick()
        if served % design.params.removal_every == 0:
            design.flush()
        if served % design.params.window == 0:
            design.roll_window()
        if served % SAMPLE_EVERY == 0:
            shares.append(cluster.duplicate_share())
    design.flush()
    out = {f"lost {cause} %": 100.0 * lost[cause] / prompt_tokens for cause in CAUSES}
    out["hit %"] = 100.0 * hit_tokens / prompt_tokens
    out["held past break %"] = 100.0 * past_break_held * block_tokens / prompt_tokens
    out["dup writes %"] = 100.0 * cluster.dup_writes / max(int(cluster.writes.sum()), 1)
    out["dup share %"] = 100.0 * float(np.mean(shares)) if shares else 0.0
    out["evictions"] = float(cluster.evictions())
    if isinstance(cluster, DiskCluster):
        out["from disk %"] = 100.0 * cluster.disk_read_blocks * block_tokens / max(hit_tokens, 1)
        out["disk read MiB/req"] = cluster.disk_read_blocks * cluster.block_bytes / len(requests) / 2**20
        out["dirty evictions"] = float(cluster.dirty_evictions())
        out["disk evictions"] = float(sum(disk.evictions for disk in cluster.disks))
        out["largest promotion MiB"] = cluster.largest_promotion * cluster.block_bytes / 2**20
        out["cut by wait %"] = 100.0 * cluster.wait_cut_blocks * block_tokens / prompt_tokens
    return out


def _per_node(cluster: ObservedCluster) -> str:
    """Blocks each node wrote, and per pool (one, pooled) its evictions and their idle times."""
    writes = cluster.writes
    idle = np.array([np.mean(ages) if ages else np.nan for ages in cluster.evicted_idle])
    evictions = np.array([len(ages) for ages in cluster.evicted_idle])
    return (f"writes/node min {writes.min()} mean {writes.mean():.0f} max {writes.max()}; "
            f"evictions/node min {evictions.min()} max {evictions.max()}; "
            f"evicted idle (requests) per node min {np.nanmin(idle):.0f} mean {np.nanmean(idle):.0f} "
            f"max {np.nanmax(idle):.0f}" if np.isfinite(idle).any() else "no evictions")


VARIANTS: dict[str, tuple[type[Design], type[ObservedCluster]]] = {
    "pooled": (HandoverCopyOnSecondRead, PooledCluster), "nodup": (NoDupSaves, ObservedCluster),
    "spill": (SpillSaves, ObservedCluster), "notouch": (NoRemoteTouch, ObservedCluster),
    "demote": (DemoteEvicted, ObservedCluster)}
"""The variants of (k) by flag, each removing one cause (module docstring)."""


@dataclass
class Observed:
    name: str
    figures: dict[str, float]
    cluster: ObservedCluster
    design: Design


def observe_runs(spec: WorkloadSpec, requests: Sequence[Request], pool_tokens: int, variants: Sequence[str] = (),
                 spill_ratio: float = 1.0, disk_ratio: float = 0.0,
                 save_chunk_tokens: int = SAVE_CHUNK_TOKENS, demote_low: float | None = None,
                 read_bytes_s: float = DISK_READ_BYTES_S, apply_wait: bool = False) -> list[Observed]:
    """(a), (k) and the named variants of (k), each over its own pools of ``pool_tokens`` a node;
    with ``disk_ratio`` (a) and (k) each with a disk tier of that many pools behind every pool
    (``DiskCluster``; the variants have none)."""
    placement = Placement(shard_ids(spec.nodes))
    params = DesignParams(seed=spec.seed)
    runs: list[tuple[str, type[Design], type[ObservedCluster]]] = [
        ("a per-block", PerBlock, ObservedCluster), ("k built", HandoverCopyOnSecondRead, ObservedCluster)]
    runs += [(f"k {name}", *VARIANTS[name]) for name in variants]
    out = []
    for name, design_class, cluster_class in runs:
        pool_bytes = pool_tokens * BYTES_PER_TOKEN
        cluster: ObservedCluster
        if disk_ratio and cluster_class is ObservedCluster and name in ("a per-block", "k built"):
            cluster = DiskCluster(spec.nodes, pool_bytes, spec.block_bytes, placement, disk_ratio,
                                  max(1, save_chunk_tokens // spec.block_size), demote_low, read_bytes_s,
                                  apply_wait)
            name += f" + disk x{disk_ratio:g}"
        else:
            cluster = cluster_class(spec.nodes, pool_bytes, spec.block_bytes, placement)
        design = design_class(cluster, params)
        if isinstance(design, SpillSaves):
            design.spill_ratio = spill_ratio
        out.append(Observed(name, _observe(design, cluster, requests), cluster, design))
    return out


COLUMNS = ("hit %", *(f"lost {cause} %" for cause in CAUSES), "held past break %", "dup writes %", "dup share %",
           "evictions")
DISK_COLUMNS = ("from disk %", "disk read MiB/req", "dirty evictions", "disk evictions", "largest promotion MiB",
                "cut by wait %")
"""With a disk tier: the share of hit tokens read from disk, what they cost it, the pools'
evictions of entries not yet on disk (lost: demotion behind), the disks' own evictions, the most
one shard promoted for one lookup, and the points of hits ``disk_wait_s`` would cut at
``--disk-read-gbs`` (``DiskCluster.wait_cut_blocks``)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_single_run_args(parser)
    parser.add_argument("--pool-fraction", type=float, default=0.5,
                        help="pool per node: this fraction of the distinct tokens over the nodes ...")
    parser.add_argument("--min-pool-tokens", type=int, default=262144, help="... and at least this many tokens")
    parser.add_argument("--variants", default="", help="comma-separated: " + ", ".join(VARIANTS))
    parser.add_argument("--spill-ratio", type=float, default=1.0,
                        help="spill, demote: only blocks (saves; victims) younger than this share of the oldest "
                             "peer's least recently used block")
    parser.add_argument("--disk-ratio", type=float, default=0.0,
                        help="(a) and (k): a disk tier of this many times the pool behind each pool (0: none)")
    parser.add_argument("--save-chunk-tokens", type=int, default=SAVE_CHUNK_TOKENS,
                        help="with a disk tier: tokens a save commits at once, demotion between commits")
    parser.add_argument("--demote-low", type=float, default=None,
                        help="with a disk tier: demotion makes the pool's coldest used - this share clean "
                             "(default: the package's DiskTier default, clean_low of the disk ratio)")
    parser.add_argument("--disk-read-gbs", type=float, default=DISK_READ_BYTES_S / 1e9,
                        help="with a disk tier: a shard's promotion reads in GB/s, for 'cut by wait %%' (counted, "
                             "not applied unless --disk-wait)")
    parser.add_argument("--disk-wait", action="store_true",
                        help="with a disk tier: apply disk_wait_s, a hit ends where a shard's promotion would not "
                             "be read in time (the package's promote_late). Overstates the loss: a block its "
                             "shard holds on disk is never saved again here, so a prefix cut stays cut, where "
                             "the package's commit takes the recomputed block back into the pool")
    args = parser.parse_args(argv)
    spec, requests, _ = single_run(args)
    unique_tokens = len({key for request in requests for key in request.keys}) * spec.block_size
    pool_tokens = pool_tokens_for(unique_tokens, spec.nodes, args.pool_fraction, args.min_pool_tokens)
    print(f"nodes={spec.nodes} block={spec.block_size} router={spec.router} requests={spec.requests}: "
          f"pool {pool_tokens} tokens/node, workload {unique_tokens} distinct tokens")
    columns = COLUMNS + (DISK_COLUMNS if args.disk_ratio else ())
    print("| design | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    variants = [name for name in args.variants.split(",") if name]
    runs = observe_runs(spec, requests, pool_tokens, variants, args.spill_ratio, args.disk_ratio,
                        args.save_chunk_tokens, args.demote_low, args.disk_read_gbs * 1e9, args.disk_wait)
    for run in runs:
        print(f"| {run.name} | " + " | ".join(
            "-" if column not in run.figures else f"{run.figures[column]:.0f}" if "evictions" in column
            else f"{run.figures[column]:.1f}" for column in columns) + " |")
    for run in runs:
        extra = f"; moved to peers {run.design.spilled} blocks" if isinstance(run.design, SpillSaves) else ""
        print(f"{run.name}: {_per_node(run.cluster)}{extra}")


if __name__ == "__main__":
    main()
