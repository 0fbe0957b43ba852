"""Issue 40, stop 67: the calls' hot spot of (k) under learning and announcement variants, in one run.

Per size and router, one workload; (a) per-block placement (the hit rate's baseline), then (k) as
built and under each ``--variant``: ``asks8`` (a family root asked 8 times within 10 s becomes hot,
``DesignParams.learn_asks``; the package's ``hot_prefix_asks`` is 64), ``poll`` (readers' hot copies
ride on their engine's next long poll, ``DesignParams.announce_on_poll``: no call of their own),
``asks8+poll`` (both). Prints ``scale_sim``'s table and summary line per (k) run. The designs are
independent given the workload (deterministic per seed), so ``--jobs`` runs them in processes.
Figures: docs/scaling.md, stop 67.

Run: ``python benchmarks/scale_hot_learn.py --nodes 1000 --router sticky --jobs 2`` (20 requests a node).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.scale.cluster import Cluster, Placement, shard_ids  # noqa: E402
from benchmarks.scale.designs import DesignParams, HandoverCopyOnSecondRead, PerBlock  # noqa: E402
from benchmarks.scale.metrics import Row, format_table, summarise  # noqa: E402
from benchmarks.scale.runner import movement, pool_tokens_for  # noqa: E402
from benchmarks.scale.workload import BYTES_PER_TOKEN, ROUTERS, Workload, WorkloadSpec  # noqa: E402
from benchmarks.scale_sim import result_line  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "built": {},
    "asks8": {"learn_asks": 8},
    "poll": {"announce_on_poll": True},
    "asks8+poll": {"learn_asks": 8, "announce_on_poll": True},
}
"""(k)'s variants by name: the ``DesignParams`` fields each sets."""


def run_design(spec: WorkloadSpec, variant: str | None) -> tuple[Row, float]:
    """(a) when ``variant`` is None, else (k) under it: its row with no hit baseline, and its wall seconds."""
    requests = Workload(spec).requests()
    unique_tokens = len({key for request in requests for key in request.keys}) * spec.block_size
    pool = pool_tokens_for(unique_tokens, spec.nodes, 0.5, 262144)
    cluster = Cluster(spec.nodes, pool * BYTES_PER_TOKEN, spec.block_bytes, Placement(shard_ids(spec.nodes)))
    params = DesignParams(seed=spec.seed)
    started = time.perf_counter()
    if variant is None:
        design: PerBlock | HandoverCopyOnSecondRead = PerBlock(cluster, params)
        name = "a per-block"
    else:
        design = HandoverCopyOnSecondRead(cluster, replace(params, **VARIANTS[variant]))
        name = f"k {variant}"
    design.run(requests)
    return summarise(name, design.stats, movement(design, cluster), None), time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, action="append")
    parser.add_argument("--router", action="append", choices=list(ROUTERS))
    parser.add_argument("--requests-per-node", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", choices=list(VARIANTS),
                        help="(k) variants after the built one (default: asks8, poll, asks8+poll)")
    parser.add_argument("--jobs", type=int, default=1, help="designs run at once, in processes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for nodes in args.nodes or [100]:
        for router in args.router or list(ROUTERS):
            spec = WorkloadSpec(nodes=nodes, block_size=128, requests=nodes * args.requests_per_node,
                                router=router, seed=args.seed)
            todo: list[str | None] = [None, "built", *(args.variant or ["asks8", "poll", "asks8+poll"])]
            with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                done = list(pool.map(run_design, [spec] * len(todo), todo))
            baseline = done[0][0].hit_rate
            rows = []
            for row, seconds in done:
                logging.info("nodes=%d router=%s %s: %.0f s", nodes, router, row.design, seconds)
                rows.append(replace(row, hit_delta_points=100 * (row.hit_rate - baseline)))
            print(f"\n### nodes={nodes} block=128 router={router} requests={spec.requests}", flush=True)
            for line in format_table(rows):
                print(line, flush=True)
            for row in rows[1:]:
                print(f"{row.design}: hot calls {row.hot_calls:.2f}, hot bytes {row.hot_bytes:.2f}, copied "
                      f"{row.copy_mib:.1f} MiB a request, index {row.index_msgs:.1f} messages a request; "
                      f"{result_line(nodes, row)}", flush=True)


if __name__ == "__main__":
    main()
