"""Issue 40, goal 1: what the hottest node's calls are made of under (k) as built.

Runs (k) (``HandoverCopyOnSecondRead``, the defaults) once, counting each call a node receives by
kind: a lookup (to its family root's owner), a writer's hints (registration), a handover, a hot
copy announced to the directory, a table push (every node gets one). Prints the hottest node's
calls over the mean, split; the families whose lookups and hints it answers, largest first; and
the floor: the same calls thrown on uniformly random nodes (what any spreading can at best reach
at this many calls a node).

Run: ``python benchmarks/scale_hot_calls.py --nodes 1000 --requests 4000 --router random``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections import Counter, defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.scale.cluster import Cluster, Placement, shard_ids  # noqa: E402
from benchmarks.scale.designs import (  # noqa: E402
    DIRECTORY_NODE,
    DesignParams,
    HandoverCopyOnSecondRead,
    add_learning_args,
    learning_params,
)
from benchmarks.scale.metrics import DesignStats, RequestTally  # noqa: E402
from benchmarks.scale.workload import BYTES_PER_TOKEN, Request, add_single_run_args, single_run  # noqa: E402
from ucm_ray.store.placement import owners  # noqa: E402

KINDS = ("lookup", "register", "handover", "announce", "push")


class SplitCalls(HandoverCopyOnSecondRead):
    """(k), each call received counted by kind, and lookups and hints per family root."""

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.by_kind = {kind: np.zeros(cluster.nodes) for kind in KINDS}
        self.by_family: dict[int, Counter[tuple[str, bytes]]] = defaultdict(Counter)
        self._phase = "register"
        self._request: Request | None = None
        stats, split = self.stats, self

        class _Stats(DesignStats):
            def message(self, node: int, tally: RequestTally, entries: int, sender: int) -> None:
                if node != sender and entries > 0:
                    split.by_kind[split._phase][node] += 1
                    if split._phase == "register" and split._request is not None:
                        split.by_family[node]["register", split._root or split._request.keys[0]] += 1
                super().message(node, tally, entries, sender)

        self.stats = _Stats(stats.nodes)
        self.copy_pushes: list[list[tuple[list[int], list[int]]]] = []
        """Per push of readers' copies, each grown row's pools before and after it."""

    def serve(self, req: Request) -> RequestTally:
        self._request, self._phase = req, "register"
        return super().serve(req)

    def _learn(self, root: bytes, family, node: int) -> None:  # type: ignore[no-untyped-def]
        owner = int(self.cluster.placement.primary([root])[0])
        self.by_kind["lookup"][owner] += 1
        assert self._request is not None
        self.by_family[owner]["lookup:" + self._request.kind, root] += 1
        super()._learn(root, family, node)

    def _keep_hot_copies(self, req: Request, tally: RequestTally, keys: list[bytes]) -> None:
        self._phase = "announce"
        super()._keep_hot_copies(req, tally, keys)
        self._phase = "register"

    def _forward_relayed(self) -> None:
        self._phase = "announce"
        super()._forward_relayed()
        self._phase = "register"

    def _push_announced(self) -> None:
        before = {key: len(pools) for key, pools in self.table_pools.items()}
        super()._push_announced()
        grown = [(pools[:before.get(key, 0)], list(pools)) for key, pools in self.table_pools.items()
                 if len(pools) != before.get(key, 0)]
        if grown:
            self.copy_pushes.append(grown)

    def _broadcast(self, sender: int, tally: RequestTally, entries: int) -> None:
        self.by_kind["push"] += 1
        self.by_kind["push"][sender] -= 1
        super()._broadcast(sender, tally, entries)

    def roll_window(self) -> None:
        self._phase, self._request = "handover", None
        super().roll_window()
        self._phase = "register"


def reader_picks(pushes: list[list[tuple[list[int], list[int]]]], nodes: int, picks: int) -> tuple[int, int]:
    """If each engine were told only the ``picks`` pools of a hot row that rendezvous (the
    package's ``owners``, its node's digest as the key) picks for its node: the push messages that
    would change some engine's view, and the pools new to the views (not built, stop 60)."""
    ids = shard_ids(nodes)
    readers = [hashlib.blake2b(f"reader-{node}".encode(), digest_size=16).digest() for node in range(nodes)]
    views: dict[tuple[int, ...], np.ndarray] = {}

    def view(pools: list[int]) -> np.ndarray:
        known = views.get(tuple(pools))
        if known is None:
            if len(pools) <= picks:
                known = np.tile(np.array(sorted(pools), dtype=np.int64), (nodes, 1))
            else:
                chosen = owners(readers, [ids[pool] for pool in pools], picks)
                known = np.sort(np.asarray(pools, dtype=np.int64)[chosen], axis=1)
            views[tuple(pools)] = known
        return known

    messages = new_pools = 0
    for push in pushes:
        told = np.zeros(nodes, dtype=bool)
        for before, after in push:
            old, new = view(before), view(after)
            if old.shape != new.shape:
                told[:] = True
                new_pools += nodes * (new.shape[1] - old.shape[1])
                continue
            moved = (old != new).any(axis=1)
            told |= moved
            new_pools += sum(len(set(new[i].tolist()) - set(old[i].tolist())) for i in np.flatnonzero(moved))
        messages += int(told.sum())
    return messages, new_pools


def uniform_floor(calls: np.ndarray, trials: int = 20, seed: int = 0) -> float:
    """Hottest over mean when the same number of calls land on uniformly random nodes (median of trials)."""
    rng = np.random.default_rng(seed)
    total = int(calls.sum())
    ratios = [np.bincount(rng.integers(0, len(calls), total), minlength=len(calls)).max() / (total / len(calls))
              for _ in range(trials)]
    return float(np.median(ratios))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_single_run_args(parser)
    parser.add_argument("--learn-window", type=float, default=DesignParams.learn_window,
                        help="DesignParams.learn_window, requests a node (0: one window of 100 of the fleet)")
    parser.add_argument("--learn-scan-blocks", type=int, default=DesignParams.learn_scan_blocks,
                        help="DesignParams.learn_scan_blocks (the package's SCAN_BLOCKS)")
    parser.add_argument("--announce-share", action="store_true", help="DesignParams.announce_share")
    parser.add_argument("--hot-copies", default=DesignParams.hot_copies, help="DesignParams.hot_copies")
    add_learning_args(parser)
    parser.add_argument("--announced-pools", type=int, default=0, help="DesignParams.announced_pools")
    parser.add_argument("--no-relay", dest="relay", action="store_false",
                        help="not DesignParams.relay_announcements (the package's relay_hot_copies: false)")
    parser.add_argument("--relay-stewards", type=int, default=0, help="DesignParams.relay_stewards")
    parser.add_argument("--relay-every", type=int, default=1, help="DesignParams.relay_every")
    parser.add_argument("--relay-fanout", type=int, default=1, help="DesignParams.relay_fanout")
    parser.add_argument("--announce-on-poll", action="store_true", help="DesignParams.announce_on_poll")
    parser.add_argument("--reader-picks", type=int, default=0,
                        help="also count the copies' pushes if each engine were told only this many pools a row")
    parser.add_argument("--peer-probes", type=int, default=0, help="DesignParams.peer_probes")
    args = parser.parse_args(argv)
    spec, requests, pool = single_run(args)
    cluster = Cluster(spec.nodes, pool * BYTES_PER_TOKEN, spec.block_bytes, Placement(shard_ids(spec.nodes)))
    design = SplitCalls(cluster, DesignParams(seed=spec.seed, learn_window=args.learn_window,
                                              learn_scan_blocks=args.learn_scan_blocks,
                                              announce_share=args.announce_share,
                                              hot_copies=args.hot_copies, peer_probes=args.peer_probes,
                                              announced_pools=args.announced_pools,
                                              relay_announcements=args.relay,
                                              relay_stewards=args.relay_stewards, relay_every=args.relay_every,
                                              relay_fanout=args.relay_fanout, announce_on_poll=args.announce_on_poll,
                                              **learning_params(args)))
    design.run(requests)
    calls = design.stats.calls_received
    mean = calls.mean()
    top = int(calls.argmax())
    split = ", ".join(f"{kind} {design.by_kind[kind][top] / mean:.2f}" for kind in KINDS)
    means = ", ".join(f"{kind} {design.by_kind[kind].mean():.2f}" for kind in KINDS)
    print(f"nodes={spec.nodes} router={spec.router} requests={spec.requests} block={spec.block_size}: "
          f"mean calls a node {mean:.2f} ({means}); hottest node {top} {calls[top] / mean:.2f}x the mean "
          f"({split}); uniform floor {uniform_floor(calls):.2f}, without pushes "
          f"{uniform_floor(calls - design.by_kind['push']):.2f}")
    row = design.stats
    hit = row.hit_tokens / row.prompt_tokens
    served = row.bytes_served
    print(f"hit {100 * hit:.2f}% bytes hot {served.max() / served.mean():.2f} calls p99 "
          f"{np.percentile(row.lookup_calls, 99):.0f} idx msgs a request {row.index_msgs / len(requests):.1f}; "
          f"copies' pushes to each engine: {design.pools_pushed_whole} pools as whole rows, "
          f"{design.pools_pushed_appended} appended")
    if args.reader_picks:
        messages, picked = reader_picks(design.copy_pushes, spec.nodes, args.reader_picks)
        print(f"copies' pushes: {len(design.copy_pushes) * (spec.nodes - 1)} messages, "
              f"{design.pools_pushed_appended * (spec.nodes - 1)} pools appended; each engine told its "
              f"{args.reader_picks} rendezvous picks a row: {messages} messages, {picked} pools")
    order = np.argsort(calls)[::-1][:5]
    unpushed = calls - design.by_kind["push"]
    print(f"without pushes: mean calls a node {unpushed.mean():.2f}, hottest node {int(unpushed.argmax())} "
          f"{unpushed.max() / unpushed.mean():.2f}x the mean ({unpushed.max():.0f} calls)")
    print("top nodes x mean:", " ".join(f"{int(n)}:{calls[n] / mean:.1f}" for n in order),
          f"; the directory's (node {DIRECTORY_NODE}) {calls[DIRECTORY_NODE] / mean:.2f}x "
          f"({design.by_kind['announce'][DIRECTORY_NODE]:.0f} announcements or forwards)")
    for node in order[:3]:
        families = design.by_family[int(node)].most_common(6)
        print(f"node {int(node)}:", "; ".join(f"{kind} {root.hex()[:8]} {count}" for (kind, root), count in families))


if __name__ == "__main__":
    main()
