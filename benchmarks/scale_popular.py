"""Issue 40, stop 66: the popular rule before and after, in one run (``shard.remote_reads``).

Per size and router, one workload; (a) per-block placement (the hit rate's baseline), then (k)
with stop 65's popular rule (``POPULAR_READERS`` 2 within ``POPULAR_WINDOW_S`` 10 s: 2 requests a
node) and with the package's (1 within 50 s), every other setting the package's. Prints
``scale_sim``'s table and summary line per (k) run, and the bytes a reader copied into its own
pool per request (the replication the rule adds). Figures: docs/scaling.md, stop 66.

Run: ``python benchmarks/scale_popular.py --nodes 100 --router random`` (20 requests a node).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.scale.cluster import Cluster, Placement, shard_ids  # noqa: E402
from benchmarks.scale.designs import DesignParams, HandoverCopyOnSecondRead, PerBlock  # noqa: E402
from benchmarks.scale.metrics import Row, format_table, summarise  # noqa: E402
from benchmarks.scale.runner import movement, pool_tokens_for  # noqa: E402
from benchmarks.scale.workload import BYTES_PER_TOKEN, ROUTERS, Workload, WorkloadSpec  # noqa: E402
from benchmarks.scale_sim import result_line  # noqa: E402

BEFORE = {"popular_readers": 2, "popular_window": 2.0}
"""Stop 65's rule: two other nodes within 10 s (2 requests a node at 5 s a request)."""


def run(spec: WorkloadSpec, pool_fraction: float, min_pool_tokens: int) -> list[Row]:
    """(a), (k) before, (k) as built, over one workload."""
    requests = Workload(spec).requests()
    unique_tokens = len({key for request in requests for key in request.keys}) * spec.block_size
    pool = pool_tokens_for(unique_tokens, spec.nodes, pool_fraction, min_pool_tokens)
    placement = Placement(shard_ids(spec.nodes))
    rows: list[Row] = []
    baseline: float | None = None
    built = DesignParams(seed=spec.seed)
    for name, design_class, params in (("a per-block", PerBlock, built),
                                       ("k before (2 readers, 10 s)", HandoverCopyOnSecondRead,
                                        replace(built, **BEFORE)),
                                       ("k built (1 reader, 50 s)", HandoverCopyOnSecondRead, built)):
        started = time.perf_counter()
        cluster = Cluster(spec.nodes, pool * BYTES_PER_TOKEN, spec.block_bytes, placement)
        design = design_class(cluster, params)
        design.run(requests)
        row = summarise(name, design.stats, movement(design, cluster), baseline)
        baseline = row.hit_rate if baseline is None else baseline
        rows.append(row)
        logging.info("nodes=%d router=%s %s: %.0f s, evictions %d", spec.nodes, spec.router, name,
                     time.perf_counter() - started, cluster.evictions())
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, action="append")
    parser.add_argument("--router", action="append", choices=list(ROUTERS))
    parser.add_argument("--requests-per-node", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for nodes in args.nodes or [100]:
        for router in args.router or list(ROUTERS):
            spec = WorkloadSpec(nodes=nodes, block_size=128, requests=nodes * args.requests_per_node,
                                router=router, seed=args.seed)
            rows = run(spec, 0.5, 262144)
            print(f"\n### nodes={nodes} block=128 router={router} requests={spec.requests}", flush=True)
            for line in format_table(rows):
                print(line, flush=True)
            for row in rows[1:]:
                print(f"{row.design}: copied {row.copy_mib:.1f} MiB a request; {result_line(nodes, row)}",
                      flush=True)


if __name__ == "__main__":
    main()
