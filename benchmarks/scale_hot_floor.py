"""Issue 40, goal 1: what the hottest node's bytes are made of under (k) as built, per node: bytes
served of a hot prefix's blocks (the table's) and of the blocks past it (families, documents).

Runs (k) (``HandoverCopyOnSecondRead``, the defaults: what the package does) once and prints the
hottest node's bytes over the mean, split, and the ratio left if the hot-prefix bytes were
served perfectly evenly (the floor the hot-prefix table's copies can reach; the rest is each
document's writer and its few copies serving every node's reads of it).

Run: ``python benchmarks/scale_hot_floor.py --nodes 1000 --requests 4000 --router random``.

``--any-placement`` runs no design: it replays the workload with pools that never evict and prints
what no placement that keeps a block where it was computed can beat (``placement_floor``): a
block read on another node while one node holds it is sent by that node, so the node that first
computed the most blocks read elsewhere sends them once whatever else is done; over the most
bytes a fleet can serve (nobody copies), that is the floor of the hottest node's bytes over the
mean. And what a placement that copies at every reader's first read and serves each read from
its least-loaded holder reaches (an achievable figure, with room for every copy).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.scale.cluster import Cluster, Placement, shard_ids  # noqa: E402
from benchmarks.scale.designs import DesignParams, HandoverCopyOnSecondRead  # noqa: E402
from benchmarks.scale.metrics import RequestTally  # noqa: E402
from benchmarks.scale.workload import BYTES_PER_TOKEN, Request, add_single_run_args, single_run  # noqa: E402


class SplitBytes(HandoverCopyOnSecondRead):
    """(k), counting each node's bytes served of hot-prefix blocks apart, and of the blocks past
    them those it served as the block's first holder (its writer) apart from its copies'."""

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.hot_served = np.zeros(cluster.nodes)
        self.writer_served = np.zeros(cluster.nodes)
        self._first: dict[bytes, int] = {}

    def walk(self, req: Request, tally: RequestTally) -> tuple[int, list[int]]:
        hit, sources = super().walk(req, tally)
        for position in range(hit):
            source = sources[position]
            if source == req.node:
                continue
            if position < self._hot_blocks:
                self.hot_served[source] += self.cluster.block_bytes
            elif self._first.get(req.keys[position]) == source:
                self.writer_served[source] += self.cluster.block_bytes
        return hit, sources

    def save_local(self, req: Request, keys: Sequence[bytes]) -> list[bytes]:
        stored = super().save_local(req, keys)
        for key in stored:
            self._first.setdefault(key, req.node)
        return stored


@dataclass
class PlacementFloor:
    """``placement_floor``'s figures, in blocks served to other nodes."""

    forced_max: int
    """The most blocks one node must send: blocks it held alone when another node first read them."""
    served_no_copies: int
    """Blocks served across nodes when no reader keeps a copy: the most a fleet serves."""
    served_copies: int
    """... when every reader keeps a copy at its first read (then each node reads a block once)."""
    least_loaded_max: int
    """The hottest node when every reader copies and each read is served by its least-loaded holder."""
    nodes: int

    @property
    def floor(self) -> float:
        """The hottest node's bytes over the mean can be no lower than this."""
        return self.forced_max * self.nodes / max(self.served_no_copies, 1)

    @property
    def least_loaded(self) -> float:
        """The hottest over the mean that copying everywhere and least-loaded serving reach."""
        return self.least_loaded_max * self.nodes / max(self.served_copies, 1)


def placement_floor(requests: Sequence[Request], nodes: int) -> PlacementFloor:
    """Replays ``requests`` in order, pools without eviction: a node's block it does not hold is a
    hit when another node holds it (computed there, or copied), sent by a holder."""
    counts = {}
    for copy in (False, True):
        holders: dict[bytes, list[int]] = {}
        forced, least = np.zeros(nodes, dtype=np.int64), np.zeros(nodes, dtype=np.int64)
        served = 0
        for req in requests:
            for key in req.keys:
                held = holders.get(key)
                if held is None:
                    holders[key] = [req.node]  # computed here
                    continue
                if req.node in held:
                    continue
                served += 1
                if len(held) == 1:
                    forced[held[0]] += 1
                if copy:
                    least[min(held, key=lambda node: least[node])] += 1
                    held.append(req.node)
        counts[copy] = (int(forced.max()), served, int(least.max()))
    return PlacementFloor(forced_max=counts[True][0], served_no_copies=counts[False][1],
                          served_copies=counts[True][1], least_loaded_max=counts[True][2], nodes=nodes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_single_run_args(parser)
    parser.add_argument("--popular-readers", type=int, default=DesignParams.popular_readers,
                        help="(k): DesignParams.popular_readers (0: before stop 55)")
    parser.add_argument("--no-spread-reads", dest="spread_reads", action="store_false",
                        help="(k): DesignParams.spread_reads off (before stop 55)")
    parser.add_argument("--popular-window", type=float, default=DesignParams.popular_window,
                        help="(k): DesignParams.popular_window, requests a node")
    parser.add_argument("--overload-copy", type=float, default=0.0, help="(k): DesignParams.overload_copy")
    parser.add_argument("--spread-pools", type=int, default=DesignParams.spread_pools,
                        help="(k): DesignParams.spread_pools")
    parser.add_argument("--copy-session", type=int, default=DesignParams.copy_session,
                        help="(k): DesignParams.copy_session (remote_copy_reads)")
    parser.add_argument("--copy-nodes-per-pool", type=int, default=DesignParams.copy_nodes_per_pool,
                        help="(k): DesignParams.copy_nodes_per_pool (0: no bound)")
    parser.add_argument("--any-placement", action="store_true",
                        help="no design: the floor no placement beats (placement_floor)")
    args = parser.parse_args(argv)
    spec, requests, pool = single_run(args)
    if args.any_placement:
        floor = placement_floor(requests, spec.nodes)
        print(f"nodes={spec.nodes} router={spec.router} requests={spec.requests} block={spec.block_size}: "
              f"hottest node's bytes over the mean >= {floor.floor:.2f} (a node sends {floor.forced_max} blocks "
              f"it alone held; {floor.served_no_copies / spec.nodes:.1f} blocks a node served at most); "
              f"copies at every first read, least-loaded holder: {floor.least_loaded:.2f}")
        return
    cluster = Cluster(spec.nodes, pool * BYTES_PER_TOKEN, spec.block_bytes, Placement(shard_ids(spec.nodes)))
    design = SplitBytes(cluster, DesignParams(seed=spec.seed, popular_readers=args.popular_readers,
                                              spread_reads=args.spread_reads, popular_window=args.popular_window,
                                              overload_copy=args.overload_copy, spread_pools=args.spread_pools,
                                              copy_session=args.copy_session,
                                              copy_nodes_per_pool=args.copy_nodes_per_pool))
    design.run(requests)
    served = design.stats.bytes_served
    hot = design.hot_served
    rest = served - hot
    mean = served.mean()
    top = int(served.argmax())
    even = (rest + hot.sum() / spec.nodes).max() / mean
    print(f"nodes={spec.nodes} router={spec.router} requests={spec.requests} block={spec.block_size}: "
          f"hottest node {served[top] / mean:.1f}x the mean ({hot[top] / mean:.1f} hot prefix + "
          f"{rest[top] / mean:.1f} past it, of which {design.writer_served[top] / mean:.1f} as the blocks' "
          f"first holder); the most any node serves past the hot prefix: "
          f"{rest.max() / mean:.1f}; of hot prefixes: {hot.max() / mean:.1f}; "
          f"hot-prefix bytes spread evenly: {even:.1f}; hot-prefix share of all bytes served "
          f"{hot.sum() / served.sum():.2f}")


if __name__ == "__main__":
    main()
