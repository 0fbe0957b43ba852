"""Issue 40, goal 2: what splitting a family's hints over sub-roots does to a leave's index moves
and to a lookup's calls (a simulation over (k)'s state, not built).

Runs (k) (``HandoverCopyOnSecondRead``) once per configuration, then re-homes its index entries as
if every ``K`` blocks past a prompt's hot prefix began a sub-root (the chained key at the start of
the block's bucket, so continuations that part within a bucket go to different owners). Prints,
per ``K``: the worst node's re-homed entries on a leave in 1/N of the entries, and a lookup's calls
at p50/p99 for the workload's prompts and for the longest prompt the workload allows (every
bucket its blocks past the hot prefix span is one owner to ask; same node 0 is not counted, so
this is an upper bound).

Run: ``python benchmarks/scale_split.py --nodes 1000 --requests 4000 --block-size 128 --router random``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.scale.designs import run_built  # noqa: E402
from benchmarks.scale.workload import add_single_run_args, single_run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_single_run_args(parser)
    parser.add_argument("--every", type=int, action="append", help="K: blocks per sub-root (default 64..1024)")
    args = parser.parse_args(argv)
    spec, requests, pool = single_run(args)
    cluster, design = run_built(spec, requests, pool)
    placement = cluster.placement
    keys, roots = design.entries()
    longest = -(-spec.max_prompt_tokens // spec.block_size)
    print(f"nodes={spec.nodes} block={spec.block_size} router={spec.router} requests={spec.requests}: "
          f"{len(keys)} entries in {len(set(roots))} families, longest prompt {longest} blocks")
    print("| blocks per sub-root | index re-homed, worst node (x 1/N) | largest sub-family (x 1/N) "
          "| calls p50 / p99 (workload) | calls, longest prompt |")
    print("|---|---|---|---|---|")
    hot_of = {id(chain): design.hot_prefix(chain) for chain, _ in design.chain_of.values()}
    lengths = [len(request.keys) - design.hot_prefix(request.keys) for request in requests]
    for every in args.every or [0, 64, 128, 256, 512, 1024]:
        anchors = []
        for key, root in zip(keys, roots):
            chain, position = design.chain_of.get(key, (None, 0))
            hot = hot_of.get(id(chain), 0) if chain is not None else 0
            if chain is None or not every or position < hot:
                anchors.append(root)
                continue
            anchors.append(chain[hot + every * ((position - hot) // every)])
        homes = placement.primary(anchors)
        rehomed = np.bincount(homes, minlength=spec.nodes)
        unit = len(keys) / spec.nodes
        largest = max(Counter(anchors).values()) / unit
        calls = [max(1, -(-blocks // every)) if every else 1 for blocks in lengths if blocks > 0]
        worst_calls = -(-longest // every) if every else 1
        print(f"| {every or 'none (k)'} | {rehomed.max() / unit:.2f} | {largest:.2f} | "
              f"{np.percentile(calls, 50):.0f} / {np.percentile(calls, 99):.0f} | {worst_calls} |")


if __name__ == "__main__":
    main()
