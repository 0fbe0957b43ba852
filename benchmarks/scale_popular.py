"""Issue 40, stop 66: popular rules side by side, in one run (``shard.remote_reads``).

Per size and router, one workload; (a) per-block placement (the hit rate's baseline), then (k)
under each ``--rule`` (other nodes within seconds: ``POPULAR_READERS`` / ``POPULAR_WINDOW_S``;
default stop 65's 2 within 10 s, 1 within 50 s, 2 within 50 s), every other setting the
package's. Prints ``scale_sim``'s table and summary line per (k) run, and the bytes a reader
copied into its own pool per request (the replication the rule adds). The designs are
independent given the workload (deterministic per seed), so ``--jobs`` runs them in processes.
Figures: docs/scaling.md, stop 66.

Run: ``python benchmarks/scale_popular.py --nodes 100 --router random`` (20 requests a node).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.scale.cluster import Cluster, Placement, shard_ids  # noqa: E402
from benchmarks.scale.designs import (  # noqa: E402
    SECONDS_PER_REQUEST,
    DesignParams,
    HandoverCopyOnSecondRead,
    PerBlock,
)
from benchmarks.scale.metrics import Row, format_table, summarise  # noqa: E402
from benchmarks.scale.runner import movement, pool_tokens_for  # noqa: E402
from benchmarks.scale.workload import BYTES_PER_TOKEN, ROUTERS, Workload, WorkloadSpec  # noqa: E402
from benchmarks.scale_sim import result_line  # noqa: E402

RULES = ("2/10", "1/50", "2/50")
"""Stop 65's rule (two other nodes within 10 s), stop 66's first (one within 50 s) and the one
built after comparing the two (two within 50 s): ``readers/seconds``."""


def parse_rule(rule: str) -> tuple[int, float]:
    """``readers/seconds`` -> (other reader nodes, window in seconds)."""
    readers, seconds = rule.split("/")
    return int(readers), float(seconds)


def run_design(spec: WorkloadSpec, pool_fraction: float, min_pool_tokens: int,
               rule: str | None) -> tuple[Row, float]:
    """One design over the workload: (a) when ``rule`` is None, else (k) under it; its row with no
    hit baseline, and its wall seconds."""
    requests = Workload(spec).requests()
    unique_tokens = len({key for request in requests for key in request.keys}) * spec.block_size
    pool = pool_tokens_for(unique_tokens, spec.nodes, pool_fraction, min_pool_tokens)
    cluster = Cluster(spec.nodes, pool * BYTES_PER_TOKEN, spec.block_bytes, Placement(shard_ids(spec.nodes)))
    params = DesignParams(seed=spec.seed)
    started = time.perf_counter()
    if rule is None:
        design: PerBlock | HandoverCopyOnSecondRead = PerBlock(cluster, params)
        name = "a per-block"
    else:
        readers, seconds = parse_rule(rule)
        design = HandoverCopyOnSecondRead(cluster, replace(params, popular_readers=readers,
                                                           popular_window=seconds / SECONDS_PER_REQUEST))
        name = f"k {readers} reader(s), {seconds:g} s"
    design.run(requests)
    return summarise(name, design.stats, movement(design, cluster), None), time.perf_counter() - started


def run(spec: WorkloadSpec, rules: list[str], jobs: int) -> list[Row]:
    """(a), then (k) under each rule, over one workload; hit deltas against (a)."""
    todo: list[str | None] = [None, *rules]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(run_design, [spec] * len(todo), [0.5] * len(todo), [262144] * len(todo), todo))
    baseline = done[0][0].hit_rate
    rows = []
    for row, seconds in done:
        logging.info("nodes=%d router=%s %s: %.0f s", spec.nodes, spec.router, row.design, seconds)
        rows.append(replace(row, hit_delta_points=100 * (row.hit_rate - baseline)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, action="append")
    parser.add_argument("--router", action="append", choices=list(ROUTERS))
    parser.add_argument("--requests-per-node", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rule", action="append", help=f"readers/seconds (default {', '.join(RULES)})")
    parser.add_argument("--jobs", type=int, default=1, help="designs run at once, in processes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for nodes in args.nodes or [100]:
        for router in args.router or list(ROUTERS):
            spec = WorkloadSpec(nodes=nodes, block_size=128, requests=nodes * args.requests_per_node,
                                router=router, seed=args.seed)
            rows = run(spec, args.rule or list(RULES), args.jobs)
            print(f"\n### nodes={nodes} block=128 router={router} requests={spec.requests}", flush=True)
            for line in format_table(rows):
                print(line, flush=True)
            for row in rows[1:]:
                print(f"{row.design}: copied {row.copy_mib:.1f} MiB a request, hot bytes {row.hot_bytes:.2f}, "
                      f"hot calls {row.hot_calls:.2f}, wasted index reads {row.stale_per_req:.2f} a request; "
                      f"{result_line(nodes, row)}", flush=True)


if __name__ == "__main__":
    main()
