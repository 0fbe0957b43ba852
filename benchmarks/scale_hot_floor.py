"""Issue 40, goal 1: what the hottest node's bytes are made of under (k) as built, per node: bytes
served of a hot prefix's blocks (the table's) and of the blocks past it (families, documents).

Runs (k) (``HandoverCopyOnSecondRead``, the defaults: what the package does) once and prints the
hottest node's bytes over the mean, split, and the ratio left if the hot-prefix bytes were
served perfectly evenly (the floor the hot-prefix table's copies can reach; the rest is each
document's writer and its few copies serving every node's reads of it).

Run: ``python benchmarks/scale_hot_floor.py --nodes 1000 --requests 4000 --router random``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

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
    args = parser.parse_args(argv)
    spec, requests, pool = single_run(args)
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
