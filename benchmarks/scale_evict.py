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

Run: ``python benchmarks/scale_evict.py --nodes 10 --requests 1000 --block-size 128 --router random``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.scale.cluster import Cluster, Placement, shard_ids  # noqa: E402
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

CAUSES = ("cold", "evicted", "unfound")
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
        stored, evicted = super().store(node, keys)
        self.last_victims = {}
        for key in evicted:
            self.holders[key] -= 1
            idle = self.last_victims[key] = self.now - self.last_use.pop((self.pool_of(node), key), self.now)
            self.evicted_idle[self.pool_of(node)].append(idle)
        self.dup_writes += sum(self.holders[key] > 0 for key in stored)
        for key in stored:
            self.holders[key] += 1
        self.ever.update(stored)
        self.writes[node] += len(stored)
        self._used(node, stored)
        return stored, evicted

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
            moved, dropped = cluster.store(target, moving)
            self.spilled += len(moved)
            for key in moved:
                self.locs.setdefault(key, []).append(target)
            self._evicted.extend((target, key) for key in dropped)
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
                 spill_ratio: float = 1.0) -> list[Observed]:
    """(a), (k) and the named variants of (k), each over its own pools of ``pool_tokens`` a node."""
    placement = Placement(shard_ids(spec.nodes))
    params = DesignParams(seed=spec.seed)
    runs: list[tuple[str, type[Design], type[ObservedCluster]]] = [
        ("a per-block", PerBlock, ObservedCluster), ("k built", HandoverCopyOnSecondRead, ObservedCluster)]
    runs += [(f"k {name}", *VARIANTS[name]) for name in variants]
    out = []
    for name, design_class, cluster_class in runs:
        cluster = cluster_class(spec.nodes, pool_tokens * BYTES_PER_TOKEN, spec.block_bytes, placement)
        design = design_class(cluster, params)
        if isinstance(design, SpillSaves):
            design.spill_ratio = spill_ratio
        out.append(Observed(name, _observe(design, cluster, requests), cluster, design))
    return out


COLUMNS = ("hit %", *(f"lost {cause} %" for cause in CAUSES), "held past break %", "dup writes %", "dup share %",
           "evictions")


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
    args = parser.parse_args(argv)
    spec, requests, _ = single_run(args)
    unique_tokens = len({key for request in requests for key in request.keys}) * spec.block_size
    pool_tokens = pool_tokens_for(unique_tokens, spec.nodes, args.pool_fraction, args.min_pool_tokens)
    print(f"nodes={spec.nodes} block={spec.block_size} router={spec.router} requests={spec.requests}: "
          f"pool {pool_tokens} tokens/node, workload {unique_tokens} distinct tokens")
    print("| design | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    variants = [name for name in args.variants.split(",") if name]
    runs = observe_runs(spec, requests, pool_tokens, variants, args.spill_ratio)
    for run in runs:
        print(f"| {run.name} | " + " | ".join(f"{run.figures[column]:.1f}" if column != "evictions"
                                              else f"{run.figures[column]:.0f}" for column in COLUMNS) + " |")
    for run in runs:
        extra = f"; moved to peers {run.design.spilled} blocks" if isinstance(run.design, SpillSaves) else ""
        print(f"{run.name}: {_per_node(run.cluster)}{extra}")


if __name__ == "__main__":
    main()
