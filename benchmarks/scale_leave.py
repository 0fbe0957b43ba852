"""Issue 40, join/leave: what a leaving node's keys are made of under (k), and what would bring the
index's share of a leave to <= 2/N (a simulation over (k)'s state, not built).

Part 1 runs (k) (``HandoverCopyOnSecondRead``) once and splits each node's leave into what it is
made of, in units of 1/N of the distinct keys held (the unit ``moved_worst_node_x_1_over_n`` uses):

- ``own lost``: blocks the node wrote whose only copy it holds (writer-local data: lost, not moved);
- ``copy lost``: blocks whose only copy left is one it copied (the writer's evicted);
- ``held, copied elsewhere``: blocks it holds that another pool holds too (nothing lost or moved);
- ``index``: the hint entries it owns as family-root owner (re-homed to the root's next owner);
- ``index not lost``: of those, the ones not already counted as its lost data (what the metric adds);
- ``table rows``: hot-prefix table rows naming its pool (dropped from the row, nothing moved).

Part 2 takes (k)'s index entries grouped by family (and by what each variant would group them by)
and places the groups at random owners (rendezvous over many anchors is a uniform random choice)
at several fills of the index: the run's own entries a node, and the fills of pools in steady
state (entries a node = pool blocks a node). It prints the worst node's index share on a leave in
1/N of the entries (mean over trials) and the calls a lookup takes, per variant:

- ``family``: (k), all of a family's hints at ``owners(root)``: 1 call;
- ``spread r``: a family's hints over ``r`` anchors (the root and a hash of the key): r calls;
- ``sub-root K``: every K blocks past the hot prefix a new anchor (``scale_split.py``);
- ``branch roots``: the blocks a prompt wrote past what it found (its branch) anchored at the
  first of them, unless it wrote its family from the root (a new family); the root's owner
  answers how far its hints reach, the next call goes to that point's owner;
- ``branch roots, chats kept``: as branch roots, but only a block's second and later
  continuations start a branch (a chat's next turn stays with its branch);
- ``bounded`` (a table of its own): a family spread over ceil(size / (cap x fill)) anchors.

Beside the model, each variant's worst node under the run's real rendezvous owners.
Calls: per request, the distinct anchors of the blocks another prompt wrote past its hot prefix.

The fills sample families from the run with replacement: the steady state's families are assumed
to be shaped as the run's are (documents, chats, questions), only more of them.

Run: ``python benchmarks/scale_leave.py --nodes 1000 --requests 4000 --block-size 128 --router random``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.scale.cluster import Cluster  # noqa: E402
from benchmarks.scale.designs import HandoverCopyOnSecondRead, run_built  # noqa: E402
from benchmarks.scale.workload import Request, add_single_run_args, single_run  # noqa: E402

TRIALS = 20
"""Random placements per fill and variant (the worst node's share is averaged over them)."""


def leave_parts(design: HandoverCopyOnSecondRead, cluster: Cluster) -> dict[str, np.ndarray]:
    """Per node, what its leave is made of (counts of keys; see the module's docstring)."""
    nodes = cluster.nodes
    copies: Counter[bytes] = Counter(key for held in cluster.stored for key in held)
    parts = {name: np.zeros(nodes) for name in ("own lost", "copy lost", "held, copied elsewhere", "index",
                                                 "index not lost", "table rows")}
    for node, held in enumerate(cluster.stored):
        for key in held:
            if copies[key] > 1:
                parts["held, copied elsewhere"][node] += 1
            elif design.locs.get(key, [node])[0] == node:
                parts["own lost"][node] += 1
            else:
                parts["copy lost"][node] += 1
    keys, roots = design.entries()
    homes = cluster.placement.primary(roots).tolist() if keys else []
    for key, home in zip(keys, homes):
        parts["index"][home] += 1
        if not (copies.get(key) == 1 and key in cluster.stored[home]):
            parts["index not lost"][home] += 1
    for pools in design.table_pools.values():
        for pool in pools:
            parts["table rows"][pool] += 1
    return parts


def largest_family(design: HandoverCopyOnSecondRead, keys: list[bytes], roots: list[bytes], entry_unit: float) -> str:
    """What the largest family's entries are: how many prompts wrote into it, how many nodes,
    and the blocks its prompts share (its trunk) against those only one prompt wrote (its branches)."""
    root, size = Counter(roots).most_common(1)[0]
    members = [key for key, of in zip(keys, roots) if of == root]
    prompts = {id(design.chain_of[key][0]) for key in members if key in design.chain_of}
    writers = {design.locs[key][0] for key in members if design.locs.get(key)}
    deepest = max((design.chain_of[key][1] for key in members if key in design.chain_of), default=0)
    return (f"largest family: {size} entries ({size / entry_unit:.2f} x 1/N of entries), written by "
            f"{len(prompts)} prompts on {len(writers)} nodes, its deepest block at position {deepest}")


def variant_groups(design: HandoverCopyOnSecondRead, keys: list[bytes], roots: list[bytes],
                   spreads: list[int], everies: list[int], order: dict[int, int]
                   ) -> dict[str, list[tuple[bytes, bytes]]]:
    """Per variant, each entry's (family, anchor): the family it belongs to (sampled together) and
    the anchor whose owner holds its hint."""
    hot_of = {id(chain): design.hot_prefix(chain) for chain, _ in design.chain_of.values()}
    groups: dict[str, list[tuple[bytes, bytes]]] = {"family": list(zip(roots, roots))}
    for spread in spreads:
        groups[f"spread {spread}"] = [
            (root, hashlib.blake2b(root + bytes([hashlib.blake2b(key, digest_size=1).digest()[0] % spread]),
                                   digest_size=16).digest())
            for key, root in zip(keys, roots)]
    for every in everies:
        anchored = []
        for key, root in zip(keys, roots):
            chain, position = design.chain_of.get(key, (None, 0))
            hot = hot_of.get(id(chain), 0) if chain is not None else 0
            if chain is None or position < hot:
                anchored.append((root, root))
            else:
                anchored.append((root, chain[hot + every * ((position - hot) // every)]))
        groups[f"sub-root {every}"] = anchored
    first_new: dict[int, int] = {}
    for chain, position in design.chain_of.values():
        first_new[id(chain)] = min(position, first_new.get(id(chain), position))
    branched = []
    for key, root in zip(keys, roots):
        chain, position = design.chain_of.get(key, (None, 0))
        hot = hot_of.get(id(chain), 0) if chain is not None else 0
        start = first_new.get(id(chain), 0)
        branched.append((root, root if chain is None or position < hot or start <= hot else chain[start]))
    groups["branch roots"] = branched
    groups["branch roots, chats kept"] = kept_branches(design, keys, roots, first_new, hot_of, order)
    return groups


def kept_branches(design: HandoverCopyOnSecondRead, keys: list[bytes], roots: list[bytes],
                  first_new: dict[int, int], hot_of: dict[int, int], order: dict[int, int]
                  ) -> list[tuple[bytes, bytes]]:
    """Branch roots, but a prompt that continues a block nobody continued before (the next turn
    of its own chat, the first question on a document) joins that block's anchor: only the
    second and later continuations of a block start a branch of their own."""
    anchor_of: dict[bytes, bytes] = {}
    continued: set[bytes] = set()
    by_chain: dict[int, list[tuple[int, bytes, bytes]]] = {}
    for key, root in zip(keys, roots):
        chain, position = design.chain_of.get(key, (None, 0))
        if chain is None:
            anchor_of[key] = root
            continue
        by_chain.setdefault(id(chain), []).append((position, key, root))
    chains = {id(chain): chain for chain, _ in design.chain_of.values()}
    for chain_id in sorted(by_chain, key=lambda at: order.get(at, 0)):
        chain, start, hot = chains[chain_id], first_new[chain_id], hot_of.get(chain_id, 0)
        parent = chain[start - 1] if start > hot else None
        if parent is None or parent not in anchor_of:
            branch = None
        elif parent in continued:
            branch = chain[start]
        else:
            branch = anchor_of[parent]
        if parent is not None:
            continued.add(parent)
        for position, key, root in by_chain[chain_id]:
            anchor_of[key] = root if branch is None or position < hot else branch
    return [(root, anchor_of[key]) for key, root in zip(keys, roots)]


def lookup_calls(design: HandoverCopyOnSecondRead, requests: list[Request], anchor_of: dict[bytes, bytes]) -> list[int]:
    """Per request, the owners its lookup would ask: the distinct anchors of the blocks past its
    hot prefix that another prompt wrote (an upper bound: same-node owners count; the blocks a
    request wrote itself were not there at its lookup). At least 1 (the root's owner is asked)."""
    calls = []
    for request in requests:
        hot = design.hot_prefix(request.keys)
        asked = {anchor_of[key] for key in request.keys[hot:]
                 if key in anchor_of and design.chain_of.get(key, (None, 0))[0] is not request.keys}
        calls.append(max(len(asked), 1))
    return calls


def worst_share(families: list[np.ndarray], nodes: int, per_node: float, rng: np.random.Generator) -> float:
    """Families (each an array of its anchors' entry counts) sampled with replacement until the
    index holds ``per_node`` entries a node, each anchor at a uniform random owner: the worst
    node's entries over the mean, averaged over ``TRIALS``."""
    sizes = np.array([float(family.sum()) for family in families])
    wanted = per_node * nodes
    draws = int(wanted / sizes.mean() * 1.2) + 16
    shares = []
    for _ in range(TRIALS):
        picked = rng.integers(len(families), size=draws)
        total = np.cumsum(sizes[picked])
        picked = picked[:int(np.searchsorted(total, wanted)) + 1]
        weights = np.concatenate([families[index] for index in picked])
        load = np.bincount(rng.integers(nodes, size=weights.size), weights=weights, minlength=nodes)
        shares.append(load.max() / load.mean())
    return float(np.mean(shares))


def bounded_table(design: HandoverCopyOnSecondRead, requests: list[Request], roots: list[bytes], nodes: int,
                  fills: list[int], rng: np.random.Generator) -> str:
    """``bounded``: a family larger than a cap (``cap`` x the entries a node) spread over
    ceil(size / cap) of its root's owners by a hash of the key, a lookup asking each: per fill, the
    worst node's share and a request's calls at p99 (its family's final size: an upper bound)."""
    sizes = Counter(roots)
    lines = ["", "| bounded: family spread over ceil(size / (cap x fill)) owners | "
             + " | ".join(f"{fill} a node: worst / calls p99" for fill in fills) + " |",
             "|---|" + "---|" * len(fills)]
    for cap in (0.5, 1.0, 2.0):
        cells = []
        for fill in fills:
            bound = cap * fill
            families = [np.full(int(-(-size // bound)), size / -(-size // bound)) for size in sizes.values()]
            calls = []
            for request in requests:
                hot = design.hot_prefix(request.keys)
                root = request.keys[hot] if hot < len(request.keys) else request.keys[0]
                calls.append(int(-(-sizes.get(root, 1) // bound)))
            cells.append(f"{worst_share(families, nodes, fill, rng):.2f} / {np.percentile(calls, 99):.0f}")
        lines.append(f"| cap {cap} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_single_run_args(parser)
    parser.add_argument("--spread", type=int, action="append", help="r: owners a family's hints spread over")
    parser.add_argument("--every", type=int, action="append", help="K: blocks per sub-root")
    parser.add_argument("--fill", type=int, action="append",
                        help="index entries a node to place at (default: the run's own, 1,024, 2,048, 16,384)")
    args = parser.parse_args(argv)
    spec, requests, pool = single_run(args)
    cluster, design = run_built(spec, requests, pool)
    placement = cluster.placement
    nodes = spec.nodes

    parts = leave_parts(design, cluster)
    held = len({key for stored in cluster.stored for key in stored})
    keys, roots = design.entries()
    unit, entry_unit = held / nodes, len(keys) / nodes
    leave = sum(parts[name] for name in ("own lost", "copy lost", "index not lost"))
    print(f"nodes={nodes} block={spec.block_size} router={spec.router} requests={spec.requests}: "
          f"{held} keys held, {len(keys)} index entries in {len(set(roots))} families, "
          f"{len(design.table)} hot-table blocks; 1/N = {unit:.1f} keys, {entry_unit:.1f} entries")
    worst_leave, worst_index = int(leave.argmax()), int(parts["index"].argmax())
    print("\n| part of a leave (x 1/N of keys) | mean node | worst node by leave | worst node by index |")
    print("|---|---|---|---|")
    for name, counts in parts.items():
        print(f"| {name} | {counts.mean() / unit:.2f} | {counts[worst_leave] / unit:.2f} | "
              f"{counts[worst_index] / unit:.2f} |")
    print(f"| **leave as counted** (own lost + copy lost + index not lost) | {leave.mean() / unit:.2f} | "
          f"{leave[worst_leave] / unit:.2f} | {leave[worst_index] / unit:.2f} |")
    lost = parts["own lost"] + parts["copy lost"]
    print(f"\nworst node, index alone: {parts['index'].max() / entry_unit:.2f} x 1/N of entries; "
          f"lost data alone: {lost.max() / unit:.2f} x 1/N of keys (node {int(lost.argmax())}); "
          f"nodes {worst_leave} (worst leave) and {worst_index} (worst index)")

    print(largest_family(design, keys, roots, entry_unit))

    spreads, everies = args.spread or [2, 4], args.every or [512, 256, 64]
    fills = [round(entry_unit)] + (args.fill or [1024, 2048, 16384])
    order = {id(request.keys): index for index, request in enumerate(requests)}
    groups = variant_groups(design, keys, roots, spreads, everies, order)
    rng = np.random.default_rng(spec.seed)
    print("\n| variant | calls p50 / p99 | largest group (x 1/N, run) | worst node, the run's owners | "
          + " | ".join(f"worst node at {fill} entries a node" for fill in fills) + " |")
    print("|---|---|---|---|" + "---|" * len(fills))
    for name, pairs in groups.items():
        per_family: dict[bytes, Counter[bytes]] = {}
        for family, anchor in pairs:
            per_family.setdefault(family, Counter())[anchor] += 1
        families = [np.array(list(anchors.values()), dtype=float) for anchors in per_family.values()]
        largest = max(max(anchors.values()) for anchors in per_family.values()) / entry_unit
        calls = lookup_calls(design, requests, dict(zip(keys, (anchor for _, anchor in pairs))))
        owned = np.bincount(placement.primary([anchor for _, anchor in pairs]), minlength=nodes)
        cells = [f"{owned.max() / owned.mean():.2f}"]
        cells += [f"{worst_share(families, nodes, fill, rng):.2f}" for fill in fills]
        print(f"| {name} | {np.percentile(calls, 50):.0f} / {np.percentile(calls, 99):.0f} | {largest:.2f} | "
              + " | ".join(cells) + " |")
    print(bounded_table(design, requests, roots, nodes, fills, rng))


if __name__ == "__main__":
    main()
