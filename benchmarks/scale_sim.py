"""Scale-out simulation (issue 40, part 1): placement and index designs at 10 to 1,000 nodes.

Drives the project's real rendezvous placement (``ucm_ray.store.placement.owners``), store keys
(``ucm_ray.keys.block_keys``) and shard index (``BlockIndex``: capacity, LRU eviction, two-phase
writes; one per node, with an injected clock) with a seeded workload of hot system prompts
(Zipf), multi-turn chats extending their own prefix, and 8k-128k documents asked about
repeatedly (Zipf 1.1); 8 engines per node, one shard per node; router random or sticky.

Designs (``benchmarks/scale/designs.py``): (a) per-block rendezvous placement, today's;
(b) data on the writer's node + an index entry per key at ``owners(key)``; (c) runs of
``--segment-blocks`` blocks placed at ``owners(first block's key)``; (d) data on the writer's
node + a prefix-rooted index: a family's entries at ``owners(root)``, the root being the first
block after the longest match in a hot-prefix table learned online and replicated on every node;
hot families get ``index_replicas`` index owners and their blocks are copied on read; (e) is (d)
plus a copy into the reader's pool when a second session loads a block from another node;
(f) is what ``placement: writer_local`` builds (data on the writer's node, every block's hint at
``owners(first block)``, one call to that owner, the blocks' indexes read over NIXL: no call);
(g) is (f) plus a copy of every block a reader loads from another node; (h) is (f) with the
fleet's hot-prefix table (a root asked often hands what its askers share to a
table every engine holds, and family roots move past it); (i) is (h) plus a local copy of a hot
prefix read from another node; (j) is (h) with the handover (built): when a prefix becomes hot,
the old root's owner hands the hints of the families written under it to their new roots' owners;
(k) is (j) plus a copy in the reader's pool of a block its node loads from another node for the
second time, or of a hot prefix's block at once (built: ``remote_copy_reads``).

Per table (nodes, block size, router), per design: calls per lookup p50/p99 (distinct remote
shards asked; same node 0); shards touched per request; MiB sent off the node per request by
saves and by loads; hot-spot ratios (hottest node over the mean of all nodes) of calls received
(lookups + index messages) and of bytes served to other nodes; keys moved or lost on a leave
(mean, worst node) and moved on a join, in units of 1/N of the keys held; hit rate (hit tokens
over prompt tokens) and its difference in points from (a); MiB a reader copied into its own
pool per request ((d), (e)); index messages and KiB per request (updates, removals, table
broadcasts); stale entries met per request. What eviction does to each
design: ``benchmarks/scale/designs.py``'s docstring and ``docs/scaling.md``.

The last line, for the built design (``PICKED``, (k)) at the largest run: ``scale_sim:
nodes=<N> lookup_calls_p99=<n> save_bytes_off_node_per_request=<bytes> hot_spot=<ratio>
moved_worst_node_x_1_over_n=<ratio> hit_rate_delta=<points>`` (hot_spot: the worse of the calls and bytes ratios).

Run: ``python benchmarks/scale_sim.py`` (10 and 50 nodes, block 128, a few seconds) or
``--full`` (10, 100, 1,000 nodes x block 16, 128 x random, sticky; ``make bench``) or
``--pressure`` (pools full: 0.3 of the distinct tokens, at least one 128k prompt per node).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*

from benchmarks.scale.designs import (  # noqa: E402
    DesignParams,
    HandoverCopyOnSecondRead,
    add_learning_args,
    add_load_args,
    add_owner_pick_args,
    learning_params,
    load_params,
    owner_pick_params,
)
from benchmarks.scale.metrics import Row, format_table  # noqa: E402
from benchmarks.scale.runner import ConfigResult, run_config  # noqa: E402
from benchmarks.scale.workload import ROUTERS, WorkloadSpec  # noqa: E402

PICKED = HandoverCopyOnSecondRead
"""The design built (``placement: writer_local`` with its hot-prefix table, the handover and a
reader's copies at its node's second session of a family, docs/scaling.md): the last line is its
row at the largest run."""


def _out(line: str) -> None:
    print(line, flush=True)


def result_line(nodes: int, row: Row, block_bytes_per_mib: int = 2**20) -> str:
    """The issue's summary line for one design's row."""
    return (f"scale_sim: nodes={nodes} lookup_calls_p99={row.calls_p99:.0f} "
            f"save_bytes_off_node_per_request={row.save_off_mib * block_bytes_per_mib:.0f} "
            f"hot_spot={row.hot_spot:.2f} moved_worst_node_x_1_over_n={row.leave_worst:.2f} "
            f"hit_rate_delta={row.hit_delta_points:+.2f}")


PRESSURE_FRACTION = 0.3
DISTINCT_TOKENS_PER_REQUEST = 6000
"""What the seed-0 workload adds per request (6.3M distinct tokens per 1,000 requests), rounded down."""


def _pressure_requests(nodes: int, floor_tokens: int) -> int:
    """Enough requests that the pools, ``PRESSURE_FRACTION`` of the distinct tokens, are above the
    floor on every node (so the fraction, not the floor, sets the pool: pools fill)."""
    return -(-nodes * floor_tokens // int(PRESSURE_FRACTION * DISTINCT_TOKENS_PER_REQUEST))


def _configs(args: argparse.Namespace) -> list[WorkloadSpec]:
    if args.pressure:
        nodes, blocks, routers = [100, 1000], [128], ["random"]
        nodes = args.nodes or nodes
        return [WorkloadSpec(nodes=count, block_size=block, router=router, seed=args.seed,
                             requests=args.requests or _pressure_requests(count, args.min_pool_tokens))
                for count in nodes for block in args.block_size or blocks for router in args.router or routers]
    if args.full:
        nodes, blocks, routers = [10, 100, 1000], [16, 128], list(ROUTERS)
    else:
        nodes, blocks, routers = [10, 50], [128], ["random"]
    nodes = args.nodes or nodes
    blocks = args.block_size or blocks
    routers = args.router or routers
    requests = args.requests or (1000 if args.full else 300)
    return [WorkloadSpec(nodes=count, block_size=block, requests=requests, router=router, seed=args.seed)
            for count in nodes for block in blocks for router in routers]


def _print(result: ConfigResult) -> None:
    spec = result.spec
    _out(f"\n### nodes={spec.nodes} block={spec.block_size} router={spec.router} requests={spec.requests}: "
         f"pool {result.pool_tokens} tokens/node, workload {result.unique_tokens} distinct tokens, "
         f"{result.seconds:.1f} s")
    _out("evictions: " + ", ".join(f"{name} {count}" for name, count in result.evictions.items()))
    for line in format_table(result.rows):
        _out(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="10, 100, 1,000 nodes x both block sizes x both routers")
    parser.add_argument("--nodes", type=int, action="append")
    parser.add_argument("--block-size", type=int, action="append", choices=[16, 128])
    parser.add_argument("--router", action="append", choices=list(ROUTERS))
    parser.add_argument("--requests", type=int, default=0, help="default 300, 1,000 with --full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool-fraction", type=float, default=0.5,
                        help="pool per node = this fraction of the workload's distinct tokens / nodes ...")
    parser.add_argument("--min-pool-tokens", type=int, default=262144, help="... and at least this many tokens")
    parser.add_argument("--segment-blocks", type=int, default=64)
    parser.add_argument("--copy-session", type=int, default=2,
                        help="(k): a node's read of a block at which it keeps a copy (remote_copy_reads)")
    parser.add_argument("--copy-nodes-per-pool", type=int, default=10,
                        help="(k): past the hot prefix, copy a block only while fewer than ceil(nodes / this) "
                             "pools hold it (0: no bound; copy_nodes_per_pool)")
    parser.add_argument("--hot-copies", default="pushed",
                        choices=["registered", "table", "refreshed", "unregistered", "pushed"],
                        help="(k): how a hot prefix's copies are found (DesignParams.hot_copies)")
    parser.add_argument("--peer-probes", type=int, default=0,
                        help="(k), unregistered: peers tried per hot block before the table's pools")
    parser.add_argument("--announce-share", action="store_true",
                        help="(k), --hot-copies pushed: one node in copy_nodes_per_pool (by hash) announces its copies")
    parser.add_argument("--no-relay-announcements", dest="relay_announcements", action="store_false",
                        help="(k), --hot-copies pushed: copies announced to the directory itself, not to a steward "
                             "(the first copied block's owner) that forwards them once a window (the package's "
                             "relay_hot_copies: false; before stop 58)")
    add_learning_args(parser)
    add_load_args(parser)
    add_owner_pick_args(parser)
    parser.add_argument("--no-spread-hot-reads", dest="spread_hot_reads", action="store_false",
                        help="(k): a hot block's reader starts at the table's first pool (before stop 54)")
    parser.add_argument("--popular-readers", type=int, default=DesignParams.popular_readers,
                        help="(k): a block this many other nodes read within --popular-window requests a node is "
                             "copied at a reader's first read (default: the package's POPULAR_READERS, 2; 0: off, "
                             "before stop 55)")
    parser.add_argument("--learn-window", type=float, default=DesignParams.learn_window,
                        help="(h)-(k): requests a node over which a root's asks count towards a hot prefix "
                             "(default: the package's 10 s; 0: one window of 100 requests of the fleet, through "
                             "stop 57)")
    parser.add_argument("--learn-scan-blocks", type=int, default=DesignParams.learn_scan_blocks,
                        help="(h)-(k): blocks past its root a lookup shows the root's owner (default: the "
                             "package's SCAN_BLOCKS; 8,192 tokens through stop 57)")
    parser.add_argument("--popular-window", type=float, default=DesignParams.popular_window,
                        help="(k): requests a node, see --popular-readers")
    parser.add_argument("--unbounded-popular", action="store_true",
                        help="(k): every reader of a popular block copies it, not the copy bound's count")
    parser.add_argument("--popular-places", default=DesignParams.popular_places, choices=["held", "lifetime", "oracle"],
                        help="(k): how long a reader told a block is popular holds a place (lifetime: stop 55)")
    parser.add_argument("--overload-copy", type=float, default=0.0,
                        help="(k): copy at the first read from a node serving more than this x the mean (0: off)")
    parser.add_argument("--spread-pools", type=int, default=DesignParams.spread_pools,
                        help="(k): pools remembered per block among which a reader's start is picked")
    parser.add_argument("--popular-share", type=float, default=1.0,
                        help="(k): readers told a block is popular, at most this share of the copy bound")
    parser.add_argument("--no-spread-reads", dest="spread_reads", action="store_false",
                        help="(k): a reader past the hot prefix starts at the most recent pool named (before stop 55)")
    parser.add_argument("--unbounded-hot-copies", action="store_true",
                        help="(k): copy_nodes_per_pool does not bound a hot prefix's copies")
    parser.add_argument("--hot-copies-past-bound", action="store_true",
                        help="(k): a hot prefix's reader keeps a copy past its row's bound, announced to nobody")
    parser.add_argument("--hot-copies-past-bound-tokens", type=int, default=0,
                        help="(k), --hot-copies-past-bound: only within this many leading tokens (0: all)")
    parser.add_argument("--designs", default="", help="letters of the designs to run, e.g. fhj ((a) always runs); "
                                                      "default all")
    parser.add_argument("--pressure", action="store_true",
                        help=f"pools full: {PRESSURE_FRACTION} of the distinct tokens, at least one longest "
                             "prompt per node, enough requests for that; 100 and 1,000 nodes, block 128, random")
    args = parser.parse_args(argv)
    if args.pressure:
        args.pool_fraction = PRESSURE_FRACTION
        args.min_pool_tokens = WorkloadSpec(nodes=1).max_prompt_tokens
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    params = DesignParams(segment_blocks=args.segment_blocks, copy_session=args.copy_session,
                          copy_nodes_per_pool=args.copy_nodes_per_pool, hot_copies=args.hot_copies,
                          peer_probes=args.peer_probes, announce_share=args.announce_share,
                          spread_hot_reads=args.spread_hot_reads, bound_hot_copies=not args.unbounded_hot_copies,
                          popular_readers=args.popular_readers, popular_window=args.popular_window,
                          learn_window=args.learn_window, relay_announcements=args.relay_announcements,
                          learn_scan_blocks=args.learn_scan_blocks, **learning_params(args), **load_params(args),
                          **owner_pick_params(args),
                          spread_reads=args.spread_reads, bound_popular=not args.unbounded_popular,
                          popular_share=args.popular_share, popular_places=args.popular_places,
                          overload_copy=args.overload_copy,
                          spread_pools=args.spread_pools, hot_copies_past_bound=args.hot_copies_past_bound,
                          hot_copies_past_bound_tokens=args.hot_copies_past_bound_tokens)
    started = time.perf_counter()
    results = []
    for spec in _configs(args):
        result = run_config(spec, params, args.pool_fraction, args.min_pool_tokens, progress=True,
                            designs=args.designs)
        _print(result)
        results.append(result)
    _out(f"\nruntime {time.perf_counter() - started:.0f} s")
    largest = max(results, key=lambda result: (result.spec.nodes, -result.spec.block_size))
    chosen = next((row for row in largest.rows if row.design == PICKED.name), None)
    if chosen is None:
        _out(f"(the built design, {PICKED.name}, was not run: no summary line)")
        return
    _out(f"(largest run: block {largest.spec.block_size}, router {largest.spec.router})")
    _out(result_line(largest.spec.nodes, chosen))


if __name__ == "__main__":
    main()
