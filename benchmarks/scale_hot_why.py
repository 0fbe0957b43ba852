"""Issue 40, stop 61: why (k)'s hottest node serves what it serves. Runs (k) as built (the
package's defaults, ``HandoverCopyOnSecondRead`` through ``scale_hot_floor.SplitBytes``) and classes
every block served across nodes by what its reader did: a hot-prefix row's block (``hot:w`` from its
writer, ``hot:c`` from a copy; ``named...``: how many pools the row named then, ``past`` its copy
bound), or past the hot prefix, from the block's writer or a copy, and the reader then copying
(``copied_now``) or not (``notpopN/everM``: N other nodes read it in the popular window, M ever;
``refused``: popular, no place left; ``had_copy_evicted``). ``kind:`` classes the same reads by the
request's kind.

``--oracle`` makes each read take the least-loaded (bytes served so far) of the pools the reader is
told of (``named``), of every registered one (``locs``), the same for hot rows only (``hotll``), or
a random one of a hot row's per read (``hotrand``), or the least-loaded told for the blocks past the
hot prefix only (``cold``: the most a family root's owner could do, its answers being those
reads'): what a load-aware pick would give, which the package cannot make (one-sided reads: a
pool never sees its load). Figures: docs/scaling.md, stop 61.
``--load-pick`` and the other ``--load-*`` flags make the pick by a load figure engines could be
pushed (``DesignParams.load_pick``, ``LoadSignal``: stale by a push period, decayed, partial), and
print what the signal carries (stop 63, loadpick17). ``--owner-pick`` makes the family root's owner
order a block's pools by the reads it directed itself (``DesignParams.owner_pick``; stop 64,
ownerpick18: no push).

Run: ``python benchmarks/scale_hot_why.py --nodes 100 --requests 2000 --router random``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.scale.cluster import Cluster, Placement, shard_ids  # noqa: E402
from benchmarks.scale.designs import (  # noqa: E402
    DesignParams,
    add_load_args,
    add_owner_pick_args,
    load_params,
    owner_pick_params,
)
from benchmarks.scale.metrics import RequestTally  # noqa: E402
from benchmarks.scale.workload import BYTES_PER_TOKEN, Request, add_single_run_args, single_run  # noqa: E402
from benchmarks.scale_hot_floor import SplitBytes  # noqa: E402


class WhyServed(SplitBytes):
    """(k), each node's blocks served across nodes counted per class (see the module docstring)."""

    def __init__(self, cluster: Cluster, params: DesignParams, oracle: str = "") -> None:
        super().__init__(cluster, params)
        self.oracle = oracle
        self.outcome: defaultdict[int, Counter[str]] = defaultdict(Counter)
        """Per serving node, blocks served per class."""
        self._copied_once: set[tuple[int, bytes]] = set()
        self._refused = False
        self._popular_trace: dict[bytes, str] = {}

    def _first_holding(self, key: bytes, order: list[int], tally: RequestTally) -> int | None:
        mode = self.oracle
        if not mode or (mode.startswith("hot") and key not in self.table) or (mode == "cold" and key in self.table):
            return super()._first_holding(key, order, tally)
        candidates = list(dict.fromkeys(order))
        if mode == "locs":
            candidates += [node for node in self.locs.get(key, ()) if node not in candidates]
            candidates += [node for node in self.table_pools.get(key, ()) if node not in candidates]
        held = [node for node in candidates if key in self.cluster.stored[node]]
        if not held:
            tally.stale += len(candidates)
            return None
        if self._hot_reader in held:
            return self._hot_reader
        if mode == "hotrand":
            return held[int(self.rng.integers(len(held)))]
        return min(held, key=lambda node: self.stats.bytes_served[node])

    def _take_place(self, key: bytes, node: int, bound: int) -> bool:
        taken = super()._take_place(key, node, bound)
        self._refused = self._refused or not taken
        return taken

    def _popular(self, key: bytes, req: Request) -> bool:
        readers = self._readers.get(key, {})
        since = req.index - self.params.popular_window * self.cluster.nodes
        recent = sum(1 for node, at in readers.items() if node != req.node and at > since)
        ever = sum(1 for node in readers if node != req.node)
        self._refused = False
        popular = super()._popular(key, req)
        self._popular_trace[key] = ("popular" if popular else "refused" if self._refused
                                    else f"notpop{min(recent, 2)}/ever{min(ever, 9)}")
        return popular

    def copy_loaded(self, req: Request, tally: RequestTally, hit: int, sources: list[int]) -> list[bytes]:
        bound = self.hot_copy_bound()
        classes = {}
        for position in range(hit):
            source = sources[position]
            if source == req.node:
                continue
            key = req.keys[position]
            writer = self._first.get(key) == source
            if position < self._hot_blocks:
                named = len(self.table_pools.get(key, ()))
                size = ("past" if bound and named >= bound else "1" if named <= 1 else "2-4" if named <= 4
                        else "5-16" if named <= 16 else "17+")
                classes[position] = f"hot:{'w' if writer else 'c'}:named{size}"
            else:
                classes[position] = "writer" if writer else "copy"
        self._popular_trace = {}
        stored = set(super().copy_loaded(req, tally, hit, sources))
        for position, served_as in classes.items():
            key, source = req.keys[position], sources[position]
            counts = self.outcome[source]
            if served_as.startswith("hot"):
                counts["hot"] += 1
                counts[served_as] += 1
                continue
            if key in stored:
                why = "copied_now"
                self._copied_once.add((req.node, key))
            elif (req.node, key) in self._copied_once:
                why = "had_copy_evicted"
            else:
                why = self._popular_trace.get(key, "?")
            counts[f"{served_as}:{why}"] += 1
            counts[f"kind:{served_as}:{req.kind}"] += 1
        return list(stored)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_single_run_args(parser)
    parser.add_argument("--top", type=int, default=3, help="hottest nodes shown")
    parser.add_argument("--oracle", default="", choices=["", "named", "locs", "hotll", "hotrand", "cold"])
    parser.add_argument("--hot-copies-past-bound", action="store_true", help="DesignParams.hot_copies_past_bound")
    parser.add_argument("--hot-copies-past-bound-tokens", type=int, default=0,
                        help="DesignParams.hot_copies_past_bound_tokens")
    parser.add_argument("--hot-copy-nodes-per-pool", type=int, default=0, help="DesignParams.hot_copy_nodes_per_pool")
    parser.add_argument("--popular-readers", type=int, default=DesignParams.popular_readers)
    parser.add_argument("--popular-window", type=float, default=DesignParams.popular_window)
    parser.add_argument("--spread-pools", type=int, default=DesignParams.spread_pools)
    add_load_args(parser)
    add_owner_pick_args(parser)
    args = parser.parse_args(argv)
    spec, requests, pool = single_run(args)
    cluster = Cluster(spec.nodes, pool * BYTES_PER_TOKEN, spec.block_bytes, Placement(shard_ids(spec.nodes)))
    params = DesignParams(seed=spec.seed, hot_copies_past_bound=args.hot_copies_past_bound,
                          hot_copies_past_bound_tokens=args.hot_copies_past_bound_tokens,
                          hot_copy_nodes_per_pool=args.hot_copy_nodes_per_pool,
                          popular_readers=args.popular_readers, popular_window=args.popular_window,
                          spread_pools=args.spread_pools, **load_params(args),
                          **owner_pick_params(args))
    design = WhyServed(cluster, params, args.oracle)
    design.run(requests)
    served = design.stats.bytes_served / cluster.block_bytes
    mean = served.mean()
    calls = design.stats.calls_received
    print(f"nodes={spec.nodes} router={spec.router} requests={spec.requests}: mean blocks served {mean:.1f}, "
          f"hot_spot {served.max() / mean:.2f}, calls {calls.max() / calls.mean():.2f}, copy bound "
          f"{design.copy_bound()}, hot copies past the bound {design.hot_copies_unannounced}, "
          f"evictions {cluster.evictions()}")
    stats = design.stats
    requests_served = max(len(stats.lookup_calls), 1)
    print(f"hits {100 * stats.hit_tokens / max(stats.prompt_tokens, 1):.2f} %, load off node "
          f"{np.mean(stats.load_off) / 2**20:.1f} MiB a request, lookup calls {sum(stats.lookup_calls)} "
          f"({np.mean(stats.lookup_calls):.3f} a request), stale {stats.stale / requests_served:.2f} a request, "
          f"remote pools touched {np.mean(stats.touched):.2f}")
    past_hot = served - design.hot_served / cluster.block_bytes
    print(f"past the hot prefix (what roots' owners answer for): {past_hot.sum() / served.sum():.2f} of the bytes; "
          f"its hottest node {past_hot.max() / past_hot.mean():.2f}x its mean, {past_hot.max() / mean:.2f}x "
          f"the mean of all bytes")
    if design.load is not None:
        print(design.load.summary())
    if design.owner_directed is not None:
        print(design.owner_directed.summary())
    fleet: Counter[str] = Counter()
    for counts in design.outcome.values():
        fleet.update(counts)
    print("fleet's share:", {name: round(float(count / served.sum()), 3) for name, count in fleet.most_common()})
    for node in np.argsort(-served)[:args.top].tolist():
        print(f"node {node}: {served[node] / mean:.2f}x ({int(served[node])} blocks)",
              dict(design.outcome[node].most_common()))


if __name__ == "__main__":
    main()
