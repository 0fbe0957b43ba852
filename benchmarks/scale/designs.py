"""The placement/index designs compared, each driving the cluster's real pools and ``owners``.

What eviction does to each (the pool's LRU evicts the least recently used blocks, tail first):
- (a) per-block and (c) per-segment: the index lives with the data, so an evicted block is gone
  from the index at once; no stale entries, no removal traffic. A prompt's blocks sit in many
  pools, so one pool's eviction cuts a prefix short wherever its block falls.
- (b) writer + sharded index and (d) prefix-rooted: the writer's pool evicts, then sends a removal
  to the index owners (batched every ``removal_every`` requests, not at once: the real shard would
  batch them the same way). Until the batch lands, readers can be pointed at a copy that is gone:
  they find out when validating (counted as ``stale``) and miss from there on unless the entry
  lists another copy. In (d) a hot block's removal goes to every node (the table is replicated).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import random
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.scale.cluster import Cluster, Placement, shard_ids
from benchmarks.scale.metrics import INDEX_ENTRY_BYTES, DesignStats, RequestTally
from benchmarks.scale.workload import BYTES_PER_TOKEN, Request, WorkloadSpec
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.hot_copy_relay import HotCopyRelay, steward_key
from ucm_ray.store.hot_prefixes import (
    ASKERS_MIN,
    ASKERS_SHARE,
    COPIES_GROWTH,
    COPIES_PUSH_S,
    MAX_ASKERS,
    SCAN_BLOCKS,
    WINDOW_S,
    copies_due,
    shared_prefix,
)
from ucm_ray.store.pool_load import DECAY_S, TOP_POOLS
from ucm_ray.store.shard.hints import MAX_POOLS_PER_KEY
from ucm_ray.store.shard.remote_reads import MAX_READERS, POPULAR_READERS, POPULAR_WINDOW_S

DIRECTORY_NODE = 0
"""The node the directory actor runs on (``hot_copies="pushed"``: copies are announced to it)."""


SECONDS_PER_REQUEST = 5.0
"""A node's seconds between requests the simulation's windows per node stand for (``popular_window``
2 a node ~ the package's 10 s, stop 56)."""


def relay_pool(node: int) -> tuple[str, int]:
    """The pool key a node's copies are announced under (a node's one pool in the simulation)."""
    return (f"node-{node}", node)


@dataclass(frozen=True)
class DesignParams:
    segment_blocks: int = 64
    """(c): blocks kept together per segment."""
    removal_every: int = 8
    """(b), (d): requests between batches of eviction removals sent to index owners."""
    hot_sessions: int = 4
    """(d): distinct sessions that make a leading block hot, within a window."""
    window: int = 100
    """(d): requests per learning window (hot blocks, hot families)."""
    hot_scan_tokens: int = 8192
    """(d): how far into a prompt blocks are counted for the hot-prefix table ((h)-(k):
    ``learn_scan_blocks``)."""
    hot_table_blocks: int = 8192
    """(d): the table's capacity (it is on every node)."""
    hot_root_lookups: int = 8
    """(d): a family whose root was looked up this often in a window is hot next window ((h)-(k):
    ``learn_asks``)."""
    index_replicas: int = 3
    """(d): index owners of a hot family (top-r of ``owners``)."""
    max_copies: int = 8
    """(d), (e): copies of a block an index lists (replicas beyond are local-only, not registered)."""
    copy_session: int = 2
    """(k): a node's read of a block at which its reader keeps a copy (``remote_copy_reads``)."""
    copy_nodes_per_pool: int = 10
    """(k): past the hot prefix, a reader keeps a copy only while fewer than ceil(nodes / this)
    pools hold the block (0: no bound; ``copy_nodes_per_pool``, built in stop 53). Copies shrink
    the fleet's distinct capacity; in a small fleet a block held by a pool or two is served
    by each of them to a few nodes only."""
    hot_copies: str = "pushed"
    """(k): how a hot prefix's copies are found. ``registered``: each copy's hint goes to the
    prefix's first block's owner and every reader of the prefix sees every copy (what the
    simulation counted through stop 52: more than the package did); ``table``: the same
    messages, but a reader sees only the pools the table named when the prefix became hot, and
    its own node (the package through stop 52: hot rows are never asked about);
    ``refreshed``: as ``table``, and at every window's end the table's pools become the
    ``MAX_POOLS_PER_KEY`` most recent copies the first block's owner was told of (a new table
    version to every node: not built);
    ``unregistered``: as ``table`` without the messages (the package in stop 53), and a
    reader tries ``peer_probes`` nodes picked by rendezvous on (prefix, reader) before the
    table's pools (a peer that lacks the block costs one index read over NIXL, no call: counted
    as stale);
    ``pushed`` (the package since stop 54): a hot block's copy is announced to the directory (one message per request,
    its copies batched) while the table names fewer pools for it than the copy bound; the
    directory adds the announced pools to the table and pushes only what changed (a delta, one
    message per node) at a window's end, and only once a block's announced pools reach
    ``push_growth`` times those pushed or the copy bound (a doubling: a prefix's pools are pushed
    about log2(bound) times, not every window: the package's ``hot_prefixes.copies_due`` since
    stop 59; through stop 58 the package pushed each change, at most once a second: growth 1).
    """
    push_growth: float = COPIES_GROWTH
    """(k), ``hot_copies="pushed"``: a block's announced pools are pushed once they reach this many
    times the pools the table names for it, or its copy bound (1: every push where a copy was
    announced, through stop 58; ``hot_prefixes.copies_due``)."""
    push_every: int = 0
    """(k), ``hot_copies="pushed"``: windows between the directory's pushes (announcements wait);
    0: the package's ``COPIES_PUSH_S`` at ``SECONDS_PER_REQUEST`` a node (``push_windows``: 2 at
    1,000 nodes, where a window of 100 requests is 0.5 s; 1 through stop 58)."""
    announce_share: bool = False
    """(k), ``hot_copies="pushed"``: only a node whose hash with the prefix falls in one
    ``copy_nodes_per_pool``-th of the nodes announces its copy (the others keep theirs for their
    own node's readers): the announcements a hot prefix costs are bounded by the copy bound, not
    the fleet."""
    spread_hot_reads: bool = True
    """(k): a reader of a hot block not on its node starts at the named pool a hash of its node
    picks (``(node * 0x9E3779B1) % pools``), not at the first one, so the table's pools share
    the readers (the package since stop 54: ``store.engine.family.spread``)."""
    peer_probes: int = 0
    """(k) with ``hot_copies="unregistered"``: peers tried per hot block before the table's pools."""
    bound_hot_copies: bool = True
    """(k): ``copy_nodes_per_pool`` bounds a hot prefix's copies too, counted over the pools the
    table names (as the package does since stop 53; False: a hot prefix is copied at every
    node's first read whatever the fleet's size)."""
    hot_copy_nodes_per_pool: int = 0
    """(k): as ``copy_nodes_per_pool``, for a hot prefix's rows (0: the same bound; stop 61)."""
    hot_copies_past_bound_tokens: int = 0
    """(k), ``hot_copies_past_bound``: only a hot prefix's blocks within this many leading tokens of
    the prompt are copied past the bound (0: all; a system prompt, not the long documents a hot
    row may carry on; stop 61)."""
    hot_copies_past_bound: bool = False
    """(k), ``bound_hot_copies``: a reader of a hot prefix whose row already names the copy bound's
    pools still keeps a copy at its first read, announced to nobody (its own node's readers find it
    in their published index; the row stays at the bound, so no announcement or push more): a hot
    prefix is read from another node about once per node, not at every request of the nodes past
    the bound (stop 61)."""
    popular_readers: int = POPULAR_READERS
    """(k): a block past the hot prefix that this many other nodes read within ``popular_window``
    requests is popular: the next reader keeps a copy at its first read, not its
    ``copy_session``-th (0: off, the package through stop 54; since stop 55 the package's
    ``shard.remote_reads.POPULAR_READERS``: 2, within 10 s through stop 65 and 50 s since stop
    66). The root's owner sees every node's asks, so it can tell."""
    popular_window: float = POPULAR_WINDOW_S / SECONDS_PER_REQUEST
    """(k): requests per node (``popular_window`` x nodes requests of the whole fleet) within
    which distinct readers count towards ``popular_readers``: a popular document's readers come
    together, a chat's turns (one user) come apart. Per node since stop 56: the package's window
    is seconds (``POPULAR_WINDOW_S``), and at a steady request rate per node the fleet's requests
    in it grow with the fleet; a fixed 200 requests (stop 55) was 2 a node at 100 nodes but 0.2
    at 1,000, where documents read 11-18 times in 4,000 requests never became popular and their
    writers served every read (16.4x the mean; 11.0 per node). At 100 nodes random: 10 a node
    cost 1.4 points of hits below per-block (chat histories copied into evicting pools), 2: 0.8
    (stop 55). The package's ``POPULAR_WINDOW_S`` at ``SECONDS_PER_REQUEST`` since stop 66 (2 a
    node, 10 s, through stop 65; 10 a node, 50 s, since: with the load pick the writers of
    documents read a few times a minute were the hottest nodes, docs/scaling.md)."""
    overload_copy: float = 0.0
    """(k): a reader keeps a copy at its first read of a block it loaded from a node that served
    more than this many times the fleet's mean bytes so far (load-aware; a place of the block's,
    as a popular block's; 0: off; not built)."""
    bound_popular: bool = True
    """(k): the root's owner tells at most the copy bound's count of readers that a block is
    popular (each such reader keeps a copy; False: every reader while it is popular)."""
    popular_places: str = "held"
    """(k), ``bound_popular``: how long a reader told a block is popular holds one of its places.
    ``held`` (the package since stop 56: ``shard.remote_reads``): while its copy is believed held:
    given back when no copy was made (the copy bound's named pools reached, the pool refused it;
    in the package: none registered within ``CONFIRM_S``) and when its node reads the block from
    another node again (its copy was evicted); ``lifetime`` (stop 55): for the block's lifetime;
    ``oracle``: only while the node's pool holds the copy (what the root's owner cannot see: a copy
    evicted on a node that never reads the block again; not built)."""
    no_copy_share: float = 0.0
    """(k): the share of nodes (the lowest-numbered) whose engines keep no copies (a hybrid model,
    ``remote_copy_reads: 0``): read and told a block is popular like the others, they copy nothing."""
    popular_share: float = 1.0
    """(k), ``bound_popular``: the readers told a block is popular are at most this share of the
    copy bound, rounded up."""
    spread_pools: int = MAX_POOLS_PER_KEY
    """(k), ``spread_reads``: the most recent pools a root's owner remembers per block (the
    package's ``MAX_POOLS_PER_KEY``) among which a reader's start is picked by its node (more: the
    owner would name each reader 4 of them so picked; not built)."""
    spread_from: int = MAX_POOLS_PER_KEY
    """(k), ``spread_reads``: only a block named by at least this many pools is spread (fewer:
    the most recent first, as before)."""
    spread_reads: bool = True
    """(k): a reader of a block past the hot prefix starts at the pool a hash of its node picks
    among the ``MAX_POOLS_PER_KEY`` most recent the root's owner names (as ``spread_hot_reads``
    for a hot block's), not at the most recent (the package since stop 55: with popular copies
    bounded, the last copy made would serve every later reader)."""
    relay_announcements: bool = True
    """(k), ``hot_copies="pushed"``: a reader announces its hot copies to the owner of the first
    block it copied, salted (``steward_key``: a steward, by rendezvous), not to the directory; each
    steward forwards what it gathered to the directory once a window (one message): the directory's calls are the
    stewards' forwards, not one per copying request (built in stop 58: the package's
    ``relay_hot_copies``, whose ``HotCopyRelay`` and ``steward_key`` this drives; the package
    forwards at most once a second, here once a window)."""
    relay_stewards: int = 0
    """(k), ``relay_announcements``: 0: a copy's steward is the owner of the first block copied's
    ``steward_key`` (a salted digest since stop 60; the block itself before); else one of this many
    fixed stewards (the owners of ``relay-0`` ... by rendezvous), picked by a
    hash of the copying node: the directory hears from at most this many a forward."""
    relay_every: int = 1
    """(k), ``relay_announcements``: windows between a steward's forwards (the announced copies wait)."""
    relay_fanout: int = 1
    """(k), ``relay_announcements`` with ``relay_stewards`` 0: stewards per first copied block, a
    copying node's hash picking one (the owners of its ``steward_key`` salted with 0 ... n-1; 1: the
    package's one steward; not built: stop 60 found the directory takes what the stewards shed)."""
    announce_on_poll: bool = False
    """(k), ``hot_copies="pushed"``: a reader's announcements ride on its next long poll of the
    directory (re-posted at each push: no call of their own), reaching the directory after the next
    push, not through a steward (not built, stop 60)."""
    announced_pools: int = 0
    """(k), ``hot_copies="pushed"``: a hot block's row names at most this many pools (0: the copy
    bound); past it a reader still keeps its copy (its node's readers find it) but announces
    nothing: the directory's announcements are bounded by this per hot row, not the copy bound
    (not built)."""
    learn_window: float = WINDOW_S / SECONDS_PER_REQUEST
    """(h)-(k): requests per node over which a family root's asks are counted towards
    ``learn_asks`` (0: one ``window``, a fixed 100 requests of the fleet, the simulation
    through stop 57). The package counts a root's asks over ``hot_prefixes.WINDOW_S`` (10 s); at a
    steady request rate per node the fleet's requests in it grow with the fleet, as
    ``popular_window``'s do (2 a node ~ 10 s, the same judgement): at 1,000 nodes a document read
    162 times in 4,000 requests was asked ~4 times a window of 100 and never became hot, so its
    root's owner answered every lookup and hint of it (stop 57). The package's since stop 58."""
    learn_asks: int = UcmRayConfig().hot_prefix_asks
    """(h)-(k): a family root asked this often within ``learn_window`` becomes hot (the package's
    ``hot_prefix_asks``; the simulation used 8 through stop 57). With ``learn_askers`` or
    ``learn_askers_share`` set, a root is hot at either count (0: by the askers' alone)."""
    learn_askers: int = ASKERS_MIN
    """(h)-(k): a family root becomes hot once this many distinct nodes asked it within
    ``learn_window`` (and at least ``hot_sessions`` asks came, what ``shared_prefix`` compares),
    as well as at ``learn_asks`` asks: a count that does not grow with each node's request rate
    (stop 58, learn12; the package's ``hot_prefixes.ASKERS_MIN`` since stop 59). 0 (and a share
    of 0): counts asks only."""
    learn_askers_share: float = ASKERS_SHARE
    """(h)-(k): the distinct askers needed are at least this share of the fleet (rounded up):
    ``min(MAX_ASKERS, max(learn_askers, ceil(share * nodes)))`` (the package's
    ``hot_prefixes.askers_needed`` with its defaults)."""
    learn_scan_blocks: int = SCAN_BLOCKS
    """(h)-(k): blocks past its root a lookup shows the root's owner (the package's ``SCAN_BLOCKS``;
    the simulation used 8,192 tokens through stop 57: 64 blocks at block 128, 512 at 16)."""
    load_pick: str = "two"
    """(k): how a reader picks among the pools it is told hold a block (stop 63, loadpick17; built
    as ``two`` for hot rows since stop 65, ``store.pool_load``). ``off``: the order the hints and
    the node's hash give, the first that holds it (the package before stop 65); ``fleet``: the least
    loaded by the fleet's figure pushed to every engine (each engine counts the bytes it read per
    pool and sends them to the directory, which sums them and pushes a figure per pool every
    ``load_push_requests``: stale by up to a push period, ``load_lag_pushes`` more); ``fleet_local``:
    the same figure plus this node's own reads per pool since that push; ``two``: two of the pools
    told, drawn at random per read, the less loaded by the fleet's figure first (power of two
    choices); ``two_local``: ``two`` with the local correction; ``local``: the least read by this
    node itself (no fleet signal; decayed as the fleet's is). Ties and pools that hold no copy: the
    built order. The defaults of the ``load_*`` fields are the package's rule."""
    load_hot_only: bool = True
    """(k), ``load_pick``: only a hot-prefix row's pools are picked among (the package: the table's
    rows, ``family.spread`` then ``pool_load.pick_two``); False: also the pools a root's owner names."""
    load_decay_pushes: float = DECAY_S / COPIES_PUSH_S
    """(k), ``load_pick``: the figure's time constant in push periods (each push multiplies what was
    summed before by exp(-1 / this) and adds the period's bytes; 0: no decay, bytes since the start).
    Default: the package's ``DECAY_S`` at its push pace."""
    load_push_requests: int = -1
    """(k), ``load_pick``: the fleet's requests between load pushes (0: with the hot table's pushes,
    ``push_windows`` windows of ``window`` requests: 5 s at 100 nodes, 1 s at 1,000, at
    ``SECONDS_PER_REQUEST``; -1: the package's pace, a push every ``COPIES_PUSH_S`` while reads
    move the figure: 20 requests at 100 nodes, 200 at 1,000)."""
    load_pair_per_request: bool = True
    """(k), ``load_pick`` ``two``: a request's pair of pools is drawn once (per count of pools
    told), not per block read: its blocks are read from fewer pools."""
    load_keep_previous: bool = False
    """(k), ``load_pick`` ``two``: where the previous block's source is one of the pair, it is tried
    first (a run stays in one pool: the less loaded's copy may stop short, evicted, and trying it
    first for every later block costs a wasted index read each)."""
    load_lag_pushes: int = 1
    """(k), ``load_pick``: pushes more by which the figure lags (the engines' reports riding on the
    long poll re-posted after a push reach the directory for the next one: 1, the package)."""
    load_top_pools: int = TOP_POOLS
    """(k), ``load_pick``: a push carries only the figures of this many most loaded pools (the rest
    read as 0 by the engines; 0: every pool's)."""
    load_change_share: float = 0.0
    """(k), ``load_pick``: a pool's figure is pushed only when it moved by more than this share of
    the figure last pushed for it, or of the fleet's mean figure where that is larger (0: every
    push carries every pool's)."""
    owner_pick: str = ""
    """(k): how a family root's owner orders the pools it names for a block past the hot prefix
    (stop 64, ownerpick18; no push, no new call). "": as built (most recent first; a reader starts
    at the one its node's hash picks once four are named). ``least``: the owner keeps its own
    decayed count of the blocks it directed to each pool (the first pool it named for each block it
    answered) and names the least directed first; ``two``: two of the named pools drawn at random
    (once per answer), the less directed first, then the rest as built. Either way the previous
    block's first pool stays first where it is named (a run stays in one pool), and the reader
    takes the owner's order (no hash of its node). Hot-prefix blocks are the directory's table's,
    never asked of an owner: untouched."""
    owner_pick_decay_s: float = 0.0
    """(k), ``owner_pick``: the directed count's time constant in seconds, at ``SECONDS_PER_REQUEST``
    a node (0: no decay, the count since the start)."""
    owner_pick_from: int = 2
    """(k), ``owner_pick``: only a block named by at least this many pools is reordered (fewer: as
    built, most recent first; its first still counted)."""
    seed: int = 0


class Design(ABC):
    """One placement/index design over its own cluster of pools."""

    name = ""
    data_follows_anchor = True
    """Whether a block's data lives where its index entry's anchor is placed (then a join moves data)."""

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        self.cluster = cluster
        self.params = params
        self.stats = DesignStats(cluster.nodes)
        self.rng = np.random.default_rng(params.seed)

    @abstractmethod
    def serve(self, req: Request) -> RequestTally:
        """Look the prompt up, load its hit, save the rest."""

    @abstractmethod
    def entries(self) -> tuple[list[bytes], list[bytes]]:
        """The index entries now held and, per entry, the key ``owners`` places it by (its anchor)."""

    def flush(self) -> None:
        """Send what is batched (eviction removals); nothing is, where the index is with the data."""
        return None

    def roll_window(self) -> None:
        """A learning window ended; only designs that learn what is hot care."""
        return None

    def _broadcast(self, sender: int, tally: RequestTally, entries: int) -> None:
        """A change to a table every node holds: one message to every other node."""
        others = self.cluster.nodes - 1
        self.stats.calls_received += 1
        self.stats.calls_received[sender] -= 1
        tally.index_msgs += others
        tally.index_bytes += others * entries * INDEX_ENTRY_BYTES

    def run(self, requests: Sequence[Request], progress: int = 0) -> None:
        for served, req in enumerate(requests, 1):
            self.stats.add(self.serve(req))
            self.cluster.tick()
            if served % self.params.removal_every == 0:
                self.flush()
            if served % self.params.window == 0:
                self.roll_window()
            if progress and served % progress == 0:
                logging.info("%s: %d/%d requests", self.name, served, len(requests))
        self.flush()


def add_learning_args(parser: argparse.ArgumentParser) -> None:
    """The package's hot-prefix learning and copy-push rules as flags, defaults the package's
    (every simulation that drives them takes the same ones): ``learning_params`` reads them."""
    parser.add_argument("--learn-asks", type=int, default=DesignParams.learn_asks,
                        help="(h)-(k): a root asked this often in --learn-window becomes hot (default: the "
                             "package's hot_prefix_asks; 8 through stop 57)")
    parser.add_argument("--learn-askers", type=int, default=DesignParams.learn_askers,
                        help="(h)-(k): a root asked by this many distinct nodes in --learn-window becomes hot, "
                             "as one asked --learn-asks times does (--learn-asks 0: by askers alone; 0 with "
                             "--learn-askers-share 0: off, through stop 58; default: the package's ASKERS_MIN)")
    parser.add_argument("--learn-askers-share", type=float, default=DesignParams.learn_askers_share,
                        help="(h)-(k): distinct askers needed: at least this share of the fleet's nodes (rounded "
                             "up; default: the package's ASKERS_SHARE)")
    parser.add_argument("--push-growth", type=float, default=DesignParams.push_growth,
                        help="(k), --hot-copies pushed: a block's announced pools are pushed at this many "
                             "times those the table names or at its copy bound (default: the package's "
                             "COPIES_GROWTH, a doubling; 1: every push, through stop 58)")
    parser.add_argument("--push-every", type=int, default=DesignParams.push_every,
                        help="(k), --hot-copies pushed: windows between pushes (default 0: the package's "
                             "COPIES_PUSH_S, 2 windows at 1,000 nodes; 1 through stop 58)")


def learning_params(args: argparse.Namespace) -> dict[str, Any]:
    """``DesignParams``' fields set by ``add_learning_args``' flags."""
    return {"learn_asks": args.learn_asks, "learn_askers": args.learn_askers,
            "learn_askers_share": args.learn_askers_share, "push_growth": args.push_growth,
            "push_every": args.push_every}


LOAD_PICKS = ("off", "fleet", "fleet_local", "two", "two_local", "local")
"""``DesignParams.load_pick``'s choices."""


def add_load_args(parser: argparse.ArgumentParser) -> None:
    """(k)'s load-aware pick among the pools a reader is told of (``DesignParams.load_pick``, stop 63,
    loadpick17; built for hot rows, stop 65) as flags, the package's rule by default: ``load_params``
    reads them (``--load-pick off``: the pick before stop 65)."""
    built = DesignParams()
    parser.add_argument("--load-pick", default=built.load_pick, choices=list(LOAD_PICKS),
                        help="(k): how a reader picks among the pools told (DesignParams.load_pick; default: as built)")
    parser.add_argument("--load-all-rows", action="store_true",
                        help="(k), --load-pick: also the pools a root's owner names, not only hot rows'")
    parser.add_argument("--load-decay-pushes", type=float, default=built.load_decay_pushes,
                        help="(k), --load-pick: the figure's time constant in push periods (0: no decay)")
    parser.add_argument("--load-push-requests", type=int, default=built.load_push_requests,
                        help="(k), --load-pick: fleet requests between load pushes (0: the hot table's "
                             "pace; -1: the package's, every COPIES_PUSH_S)")
    parser.add_argument("--load-pair-per-read", action="store_true",
                        help="(k), --load-pick two: a pair drawn per block read, not once per request")
    parser.add_argument("--load-keep-previous", action="store_true",
                        help="(k), --load-pick two: the previous block's source first when one of the pair")
    parser.add_argument("--load-lag-pushes", type=int, default=built.load_lag_pushes,
                        help="(k), --load-pick: pushes more by which the figure lags")
    parser.add_argument("--load-top-pools", type=int, default=built.load_top_pools,
                        help="(k), --load-pick: a push carries the figures of this many most loaded pools (0: all)")
    parser.add_argument("--load-change-share", type=float, default=built.load_change_share,
                        help="(k), --load-pick: a pool's figure is pushed when it moved by more than this share")


def load_params(args: argparse.Namespace) -> dict[str, Any]:
    """``DesignParams``' fields set by ``add_load_args``' flags."""
    return {"load_pick": args.load_pick, "load_hot_only": not args.load_all_rows,
            "load_decay_pushes": args.load_decay_pushes, "load_push_requests": args.load_push_requests,
            "load_pair_per_request": not args.load_pair_per_read, "load_keep_previous": args.load_keep_previous,
            "load_lag_pushes": args.load_lag_pushes,
            "load_top_pools": args.load_top_pools, "load_change_share": args.load_change_share}


OWNER_PICKS = ("", "least", "two")
"""``DesignParams.owner_pick``'s choices."""


def add_owner_pick_args(parser: argparse.ArgumentParser) -> None:
    """(k)'s order of a block's pools chosen by its family root's owner from the reads it directed
    (``DesignParams.owner_pick``, stop 64, ownerpick18) as flags, off by default: ``owner_pick_params``
    reads them."""
    parser.add_argument("--owner-pick", default="", choices=list(OWNER_PICKS),
                        help="(k): how the root's owner orders a block's pools (DesignParams.owner_pick; "
                             "default: as built)")
    parser.add_argument("--owner-pick-decay-s", type=float, default=0.0,
                        help="(k), --owner-pick: the directed count's time constant in seconds (0: no decay)")
    parser.add_argument("--owner-pick-from", type=int, default=2,
                        help="(k), --owner-pick: reorder only blocks named by at least this many pools")


def owner_pick_params(args: argparse.Namespace) -> dict[str, Any]:
    """``DesignParams``' fields set by ``add_owner_pick_args``' flags."""
    return {"owner_pick": args.owner_pick, "owner_pick_decay_s": args.owner_pick_decay_s,
            "owner_pick_from": args.owner_pick_from}


def _first_false(flags: np.ndarray) -> int:
    misses = np.flatnonzero(~flags)
    return int(misses[0]) if misses.size else len(flags)


class PlacedDesign(Design):
    """Data and index at the node a key's anchor is placed on; (a) and (c)."""

    @abstractmethod
    def anchors(self, keys: Sequence[bytes]) -> list[bytes]:
        """The key each block is placed by."""

    def homes(self, keys: Sequence[bytes]) -> np.ndarray:
        return self.cluster.placement.primary(self.anchors(keys))

    def serve(self, req: Request) -> RequestTally:
        tally = RequestTally(prompt_tokens=req.tokens)
        keys, node, block_bytes = req.keys, req.node, self.cluster.block_bytes
        homes = self.homes(keys)
        remote = set(np.unique(homes).tolist()) - {node}
        tally.lookup_calls = len(remote)
        tally.touched |= remote
        for remote_node in remote:
            self.stats.calls_received[remote_node] += 1
        present: np.ndarray = np.zeros(len(keys), dtype=bool)
        groups = self._groups(homes)
        for home, positions in groups:
            present[positions] = self.cluster.has(home, [keys[position] for position in positions])
        found = _first_false(present)
        hit = self.cluster.load(keys[:found], homes[:found].tolist())
        tally.hit_tokens = hit * self.cluster.block_tokens
        loaded = homes[:hit]
        served_from = loaded[loaded != node]
        tally.load_off_bytes = int(served_from.size) * block_bytes
        np.add.at(self.stats.bytes_served, served_from, block_bytes)
        for home, positions in groups:
            todo = [keys[position] for position in positions if position >= hit and not present[position]]
            stored, _ = self.cluster.store(home, todo)
            if home != node:
                tally.save_off_bytes += len(stored) * block_bytes
        return tally

    @staticmethod
    def _groups(homes: np.ndarray) -> list[tuple[int, np.ndarray]]:
        order = np.argsort(homes, kind="stable")
        bounds = np.flatnonzero(np.diff(homes[order])) + 1
        return [(int(homes[part[0]]), part) for part in np.split(order, bounds)]

    def entries(self) -> tuple[list[bytes], list[bytes]]:
        keys = [key for held in self.cluster.stored for key in held]
        return keys, self.anchors_of_stored(keys)

    def anchors_of_stored(self, keys: list[bytes]) -> list[bytes]:
        return keys


class PerBlock(PlacedDesign):
    """(a) today: every block at ``owners(its key)``."""

    name = "a per-block"

    def anchors(self, keys: Sequence[bytes]) -> list[bytes]:
        return list(keys)


class PerSegment(PlacedDesign):
    """(c) a run of ``segment_blocks`` blocks at ``owners(key of its first block)``."""

    name = "c per-segment"

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.name = f"c segment {params.segment_blocks}"
        self._anchor: dict[bytes, bytes] = {}

    def anchors(self, keys: Sequence[bytes]) -> list[bytes]:
        seg_blocks = self.params.segment_blocks
        out = [keys[(position // seg_blocks) * seg_blocks] for position in range(len(keys))]
        self._anchor.update(zip(keys, out))
        return out

    def homes(self, keys: Sequence[bytes]) -> np.ndarray:
        seg_blocks = self.params.segment_blocks
        self.anchors(keys)
        return np.repeat(self.cluster.placement.primary(keys[::seg_blocks]), seg_blocks)[:len(keys)]

    def anchors_of_stored(self, keys: list[bytes]) -> list[bytes]:
        return [self._anchor[key] for key in keys]


class WriterDesign(Design):
    """Data in the writer's node's pool; an index key -> nodes holding it, read then validated.
    (b) and (d) differ in where the index entries live and what is replicated."""

    data_follows_anchor = False

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.locs: dict[bytes, list[int]] = {}
        self._evicted: list[tuple[int, bytes]] = []

    def walk(self, req: Request, tally: RequestTally) -> tuple[int, list[int]]:
        """The hit: the longest prefix whose blocks a listed copy still holds (a copy on the
        reader's node first, else a random listed one); each block's source node. Validity is
        read from the pools' mirrors, then each source pool's hits are read in one batch, as the
        real shard reads a prompt: ``contains`` makes the batch's head the most recently used, so
        the tail is evicted first (one read per block, as before, made the tail the most recent;
        the small-size output is the same, the 10-node block-16 tables are not)."""
        sources: list[int] = []
        for key in req.keys:
            source = self._valid_copy(key, req.node, tally)
            if source is None:
                break
            sources.append(source)
        hit = self.cluster.read_hit(req.keys[:len(sources)], sources)
        del sources[hit:]
        tally.hit_tokens = hit * self.cluster.block_tokens
        remote = np.asarray(sources, dtype=np.int64)
        remote = remote[remote != req.node]
        if remote.size:
            tally.load_off_bytes += int(remote.size) * self.cluster.block_bytes
            tally.touched.update(np.unique(remote).tolist())
            np.add.at(self.stats.bytes_served, remote, self.cluster.block_bytes)
        return hit, sources

    def _valid_copy(self, key: bytes, node: int, tally: RequestTally) -> int | None:
        listed = self.locs.get(key)
        if not listed:
            return None
        held = self.cluster.stored
        if len(listed) == 1:  # no draw: a permutation of one takes nothing from the generator
            where = listed[0]
            if key in held[where]:
                return where
            tally.stale += 1
            return None
        order = [node] if node in listed else []
        order += [listed[position] for position in self.rng.permutation(len(listed)) if listed[position] != node]
        for where in order:
            if key in held[where]:
                return where
            tally.stale += 1
        return None

    def save_local(self, req: Request, keys: Sequence[bytes]) -> list[bytes]:
        """Store on the requester's node and list the copies; evictions queue removals."""
        stored, evicted = self.cluster.store(req.node, keys)
        for key in stored:
            self.locs.setdefault(key, []).append(req.node)
        self._evicted.extend((req.node, key) for key in evicted)
        return stored

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """The queued removals, applied to the index now (they land with this batch)."""
        batch, self._evicted = self._evicted, []
        for node, key in batch:
            listed = self.locs.get(key)
            if listed and node in listed:
                listed.remove(node)
                if not listed:
                    del self.locs[key]
        return batch


class WriterSharded(WriterDesign):
    """(b) data on the writer's node, each key's index entry at ``owners(key)``."""

    name = "b writer+sharded idx"

    def serve(self, req: Request) -> RequestTally:
        tally = RequestTally(prompt_tokens=req.tokens)
        homes = self.cluster.placement.primary(req.keys)
        remote = set(np.unique(homes).tolist()) - {req.node}
        tally.lookup_calls = len(remote)
        tally.touched |= remote
        for remote_node in remote:
            self.stats.calls_received[remote_node] += 1
        hit, _ = self.walk(req, tally)
        stored = self.save_local(req, req.keys[hit:])
        for home, count in Counter(self.cluster.placement.primary(stored).tolist()).items():
            self.stats.message(home, tally, count, req.node)
        return tally

    def flush(self) -> None:
        batch = self.take_evicted()
        if not batch:
            return
        tally = RequestTally()
        homes = self.cluster.placement.primary([key for _, key in batch])
        for (node, home), count in Counter(zip((sender for sender, _ in batch), homes.tolist())).items():
            self.stats.message(home, tally, count, node)
        self.stats.index_msgs += tally.index_msgs
        self.stats.index_bytes += tally.index_bytes

    def entries(self) -> tuple[list[bytes], list[bytes]]:
        keys = list(self.locs)
        return keys, keys


class PrefixRooted(WriterDesign):
    """(d) data on the writer's node; a prefix family's entries at the owner of its root, the first
    block after the longest match in a replicated hot-prefix table (learned online)."""

    name = "d prefix-rooted"

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.hot: dict[bytes, int] = {}
        """Hot-prefix table (on every node): key -> the request index it became hot at."""
        self.under: dict[bytes, bytes] = {}
        """Non-hot key -> the root of the family index holding its entry."""
        self._seen: dict[bytes, set[int]] = defaultdict(set)
        self._root_lookups: Counter[bytes] = Counter()
        self.hot_roots: set[bytes] = set()
        self.extra_calls = 0

    def serve(self, req: Request) -> RequestTally:
        tally = RequestTally(prompt_tokens=req.tokens)
        keys = req.keys
        hot_blocks = 0
        while hot_blocks < len(keys) and keys[hot_blocks] in self.hot:
            hot_blocks += 1
        root = keys[hot_blocks] if hot_blocks < len(keys) else None
        index_owners: tuple[int, ...] = ()
        if root is not None:
            index_owners = self._lookup_family(req, tally, hot_blocks, root)
        hit, sources = self.walk(req, tally)
        self._replicate_hot(req, tally, hit, sources, hot_blocks, root, index_owners)
        stored = self.save_local(req, keys[hit:])
        self._register(req, tally, stored, root, index_owners)
        self._learn(req)
        return tally

    def _owners_of(self, root: bytes) -> tuple[int, ...]:
        replicas = self.params.index_replicas if root in self.hot_roots else 1
        return self.cluster.placement.top(root, replicas)

    def _lookup_family(self, req: Request, tally: RequestTally, hot_blocks: int, root: bytes) -> tuple[int, ...]:
        """Ask the root's index owner (0 calls when it is this node); entries a table change left
        under an older root cost a call to that root's owner and move to this root."""
        node = req.node
        self._root_lookups[root] += 1
        index_owners = self._owners_of(root)
        if node not in index_owners:
            asked = index_owners[int(self.rng.integers(len(index_owners)))]
            tally.lookup_calls += 1
            tally.touched.add(asked)
            self.stats.calls_received[asked] += 1
        family = req.keys[hot_blocks:]
        older: dict[bytes, int] = Counter(self.under[key] for key in family if self.under.get(key, root) != root)
        for old_root, count in older.items():
            old_owner = self.cluster.placement.top(old_root, 1)[0]
            if old_owner != node:
                tally.lookup_calls += 1
                tally.touched.add(old_owner)
                self.stats.calls_received[old_owner] += 1
            for owner in index_owners:
                self.stats.message(owner, tally, count, old_owner)
        for key in req.keys[hot_blocks:]:
            if key in self.under:
                self.under[key] = root
        return index_owners

    def _replicate_hot(self, req: Request, tally: RequestTally, hit: int, sources: list[int], hot_blocks: int,
                       root: bytes | None, index_owners: tuple[int, ...]) -> None:
        """A reader keeps a local copy of a block it loaded from another node (a local save: the
        bytes are already on the reader's node) when ``copy_positions`` says so."""
        hot_family = root is not None and root in self.hot_roots
        remote = self.copy_positions(req, hit, sources, hot_blocks, hot_family)
        if not remote:
            return
        stored, evicted = self.cluster.store(req.node, [req.keys[position] for position in remote])
        tally.copy_bytes += len(stored) * self.cluster.block_bytes
        self._evicted.extend((req.node, key) for key in evicted)
        fresh = [key for key in stored if len(self.locs.get(key, ())) < self.params.max_copies]
        for key in fresh:
            self.locs.setdefault(key, []).append(req.node)
        self._register_entries(req.node, tally, fresh, index_owners)

    def copy_positions(self, req: Request, hit: int, sources: list[int], hot_blocks: int,
                       hot_family: bool) -> list[int]:
        """(d): the remote blocks of the hot-prefix table or of a family learned hot."""
        return [position for position in range(hit)
                if sources[position] != req.node and (position < hot_blocks or hot_family)]

    def _register(self, req: Request, tally: RequestTally, stored: list[bytes], root: bytes | None,
                  index_owners: tuple[int, ...]) -> None:
        for key in stored:
            if key not in self.hot and root is not None:
                self.under[key] = root
        self._register_entries(req.node, tally, stored, index_owners)

    def _register_entries(self, node: int, tally: RequestTally, keys: list[bytes],
                          index_owners: tuple[int, ...]) -> None:
        hot = sum(key in self.hot for key in keys)
        if hot:
            self._broadcast(node, tally, hot)
        if len(keys) > hot:
            for owner in index_owners:
                self.stats.message(owner, tally, len(keys) - hot, node)

    def _learn(self, req: Request) -> None:
        """Count distinct sessions per leading block; at ``hot_sessions`` it joins the table."""
        scan = self.params.hot_scan_tokens // self.cluster.block_tokens
        promoted = 0
        for key in req.keys[:scan]:
            if key in self.hot:
                continue
            seen = self._seen[key]
            seen.add(req.session)
            if len(seen) >= self.params.hot_sessions and len(self.hot) < self.params.hot_table_blocks:
                self.hot[key] = req.index
                self.under.pop(key, None)
                promoted += 1
        if promoted:
            tally = RequestTally()
            self._broadcast(req.node, tally, promoted)
            self.stats.index_msgs += tally.index_msgs
            self.stats.index_bytes += tally.index_bytes

    def roll_window(self) -> None:
        self._seen.clear()
        self.hot_roots = {root for root, count in self._root_lookups.items() if count >= self.params.hot_root_lookups}
        self._root_lookups.clear()

    def flush(self) -> None:
        batch = self.take_evicted()
        tally = RequestTally()
        per_pair: Counter[tuple[int, int]] = Counter()
        hot_senders: Counter[int] = Counter()
        for node, key in batch:
            if key in self.hot:
                hot_senders[node] += 1
            elif key in self.under:
                for owner in self._owners_of(self.under[key]):
                    per_pair[(node, owner)] += 1
        for (node, owner), count in per_pair.items():
            self.stats.message(owner, tally, count, node)
        for node, count in hot_senders.items():
            self._broadcast(node, tally, count)
        self.stats.index_msgs += tally.index_msgs
        self.stats.index_bytes += tally.index_bytes

    def entries(self) -> tuple[list[bytes], list[bytes]]:
        keys = [key for key in self.under if key in self.locs]
        return keys, [self.under[key] for key in keys]


class CopyOnSecondRead(PrefixRooted):
    """(e) (d)'s index and table; a block is also copied into the reader's pool (and listed)
    when a second session loads it from another node, so a shared document spreads as soon as two
    users want it instead of after a learned window. A session re-reading its own history (a chat's
    next turn) does not count: that is one user, and copying it would only fill pools. Copies stop
    at ``max_copies`` listed. The copy is a local save of bytes the reader already loaded: no
    extra bytes cross nodes; it costs pool room and one index message per copied run."""

    name = "e rooted+copy 2nd reader"

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.first_reader: dict[bytes, int] = {}
        """Key -> the session that first loaded it from another node."""

    def copy_positions(self, req: Request, hit: int, sources: list[int], hot_blocks: int,
                       hot_family: bool) -> list[int]:
        positions = []
        for position in range(hit):
            if sources[position] == req.node:
                continue
            key = req.keys[position]
            first = self.first_reader.setdefault(key, req.session)
            shared = first != req.session and len(self.locs.get(key, ())) < self.params.max_copies
            if shared or position < hot_blocks or hot_family:
                positions.append(position)
        return positions


class BuiltFirstBlockRoot(WriterDesign):
    """(f) what ``placement: writer_local`` builds today (issue 40), counted as the build counts
    it: data on the writer's node; every block's hint at the owner of its prompt's first block
    (no hot-prefix table, no copies); a lookup that finds the whole prompt on its node makes no
    call, else one call to the root's owner (same node or not: a Ray call). The blocks are then
    read from their pools' published indexes over NIXL (one-sided reads, no call: validated after
    the copy), so other nodes' pools are "touched" but not called. Hints are never removed: a
    block evicted under one is found missing in its pool's index (``stale``)."""

    name = "f built: 1st-block root"

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.root_of: dict[bytes, bytes] = {}
        self._previous: int | None = None
        """The source of the block before, in the walk under way."""

    def serve(self, req: Request) -> RequestTally:
        tally = RequestTally(prompt_tokens=req.tokens)
        keys = req.keys
        root_owner = int(self.cluster.placement.primary(keys[:1])[0])
        local = self.cluster.stored[req.node]
        if not all(key in local for key in keys):
            tally.lookup_calls = 1
            self.stats.calls_received[root_owner] += 1
            if root_owner != req.node:
                tally.touched.add(root_owner)
        hit, sources = self.walk(req, tally)
        copied = self.copy_loaded(req, tally, hit, sources)
        stored = copied + self.save_local(req, keys[hit:])
        for key in stored:
            self.root_of[key] = keys[0]
        if stored:
            self.stats.message(root_owner, tally, len(stored), req.node)
        return tally

    def copy_loaded(self, req: Request, tally: RequestTally, hit: int, sources: list[int]) -> list[bytes]:
        """(f) copies nothing it loaded."""
        return []

    def walk(self, req: Request, tally: RequestTally) -> tuple[int, list[int]]:
        self._previous = None
        return super().walk(req, tally)

    def _valid_copy(self, key: bytes, node: int, tally: RequestTally) -> int | None:
        """A copy on this node, else the previous block's source if it holds the key, else the
        most recently registered one that does (the order the shard's hints answer in, reordered
        as ``store.engine.family`` reorders them)."""
        listed = self.locs.get(key)
        if not listed:
            return None
        order = ([node] if node in listed else []) + ([self._previous] if self._previous in listed else [])
        order += [where for where in reversed(listed) if where != node]
        found = self._first_holding(key, order, tally)
        if found != node:
            self._previous = found
        return found

    def _first_holding(self, key: bytes, order: list[int], tally: RequestTally) -> int | None:
        for where in dict.fromkeys(order):
            if key in self.cluster.stored[where]:
                return where
            tally.stale += 1
        return None

    def flush(self) -> None:
        """No removals: the shard's hint table only ages entries out (``shard.hints``); an
        evicted block stays listed, a stale hint met at the pin."""
        self._evicted = []

    def entries(self) -> tuple[list[bytes], list[bytes]]:
        keys = [key for key in self.root_of if key in self.locs]
        return keys, [self.root_of[key] for key in keys]


class BuiltCopyOnRead(BuiltFirstBlockRoot):
    """(g) (f), and a reader saves on its node every block of its hit that it loaded from another
    node (the connector re-saving a remote hit after loading it), registered as (f) registers:
    the next reader of the prefix finds all of it at its latest writer, one pin. Copies cost pool
    room (evictions) and local pool writes, no network bytes."""

    name = "g built + copy on read"

    def copy_loaded(self, req: Request, tally: RequestTally, hit: int, sources: list[int]) -> list[bytes]:
        remote = [req.keys[position] for position in range(hit) if sources[position] != req.node]
        if not remote:
            return []
        stored = self.save_local(req, remote)
        tally.copy_bytes += len(stored) * self.cluster.block_bytes
        return stored


DESIGNS: tuple[type[Design], ...] = (PerBlock, WriterSharded, PerSegment, PrefixRooted, CopyOnSecondRead,
                                     BuiltFirstBlockRoot, BuiltCopyOnRead)


class BuiltHotRoots(BuiltFirstBlockRoot):
    """(h) (f) with the fleet's hot-prefix table (``placement: writer_local``'s second form): a
    family root whose owner is asked ``learn_asks`` times in a window becomes hot, and the
    blocks its last ``hot_sessions`` askers shared from it on (at most ``learn_scan_blocks``) join
    the table (``store.hot_prefixes.shared_prefix``, the built rule), pushed to every engine at
    the window's end (a new version). A prompt's leading
    blocks that are in the table are its hot prefix, found through the table (the pools that held
    them when they became hot: no call); its family root is the first block after them, whose
    owner alone is called. Hints go to the root each block falls under *when written*: a block
    registered under a root that later became hot is lost to other nodes' readers (the cost of
    learning, counted in the hit rate). With ``copy_hot`` a reader keeps a local copy of the
    hot-prefix blocks it loaded from another node (no hint: its node's readers find it in their
    published index), so a hot prefix is read remotely about once per node."""

    name = "h built: hot prefixes"
    copy_hot = False

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.table: set[bytes] = set()
        """The hot-prefix table, as engines hold it (pushed at a window's end)."""
        self._learned: dict[bytes, None] = {}
        self._asked: Counter[bytes] = Counter()
        self._askers: defaultdict[bytes, set[int]] = defaultdict(set)
        """Per root, the distinct nodes that asked it this learning window (``learn_askers``)."""
        share = math.ceil(params.learn_askers_share * cluster.nodes) if params.learn_askers_share else 0
        needed = max(params.learn_askers, share)
        self._askers_needed = min(MAX_ASKERS, needed) if needed else 0
        self._prefixes: dict[bytes, list[list[bytes]]] = defaultdict(list)
        self.hint_root: dict[bytes, bytes] = {}
        """Key -> the root its hint was registered under (a reader asking another root misses it)."""
        self._hot_blocks = 0
        self._root: bytes | None = None
        self._rolled = 0

    def hot_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of ``keys`` in the table."""
        count = 0
        while count < len(keys) and keys[count] in self.table:
            count += 1
        return count

    def serve(self, req: Request) -> RequestTally:
        tally = RequestTally(prompt_tokens=req.tokens)
        keys = req.keys
        hot = self._hot_blocks = self.hot_prefix(keys)
        root = self._root = keys[hot] if hot < len(keys) else None
        local = self.cluster.stored[req.node]
        if root is not None and not all(key in local for key in keys[hot:]):
            root_owner = int(self.cluster.placement.primary([root])[0])
            tally.lookup_calls = 1
            self.stats.calls_received[root_owner] += 1
            if root_owner != req.node:
                tally.touched.add(root_owner)
            self._learn(root, keys[hot:], req.node)
            self.answer_where(root, keys[hot:], req.node)
        hit, sources = self.walk(req, tally)
        if self.copy_hot:
            remote = [keys[position] for position in range(min(hit, hot)) if sources[position] != req.node]
            copied, _ = self.cluster.store(req.node, remote)
            tally.copy_bytes += len(copied) * self.cluster.block_bytes
            for key in copied:
                self.locs.setdefault(key, []).append(req.node)
        stored = set(self.copy_loaded(req, tally, hit, sources) + self.save_local(req, keys[hit:]))
        per_owner: Counter[int] = Counter()
        for position, key in enumerate(keys):
            if key not in stored:
                continue
            family = keys[0] if position < hot or root is None else root
            self.root_of[key] = self.hint_root[key] = family
            per_owner[int(self.cluster.placement.primary([family])[0])] += 1
        for owner, count in per_owner.items():
            self.stats.message(owner, tally, count, req.node)
        return tally

    def answer_where(self, root: bytes, family: Sequence[bytes], node: int) -> None:
        """The root's owner answers ``node``'s lookup of ``family`` (its pools for each block):
        only designs whose owner orders them care (``owner_pick``)."""
        return None

    def _valid_copy(self, key: bytes, node: int, tally: RequestTally) -> int | None:
        """This node's pool, else (a hot-prefix block) any copy, else the copy the reader's root
        owner was told of."""
        if key in self.cluster.stored[node]:
            return node
        if key not in self.table and self.hint_root.get(key) != self._root:
            return None  # registered under another root: this reader's root owner never heard of it
        return super()._valid_copy(key, node, tally)

    def _learn(self, root: bytes, family: Sequence[bytes], node: int) -> None:
        """At the root's owner: the askers' prefixes; at ``learn_asks`` asks in a window (or
        ``learn_askers`` distinct asking nodes), what the last ``hot_sessions`` of them shared
        becomes hot."""
        scan = self.params.learn_scan_blocks
        self._asked[root] += 1
        self._askers[root].add(node)
        recent = self._prefixes[root]
        recent.append(list(family[:scan]))
        del recent[:-self.params.hot_sessions]
        if len(self.table) >= self.params.hot_table_blocks:
            return
        if self._askers_needed:
            by_askers = len(self._askers[root]) >= self._askers_needed and len(recent) >= self.params.hot_sessions
            by_asks = 0 < self.params.learn_asks <= self._asked[root]
            if not by_askers and not by_asks:
                return
        elif self._asked[root] < self.params.learn_asks:
            return
        self._learned.update(dict.fromkeys(shared_prefix(recent)))

    def roll_window(self) -> None:
        """The window's learned blocks are pushed: one broadcast per new version."""
        fresh = [key for key in self._learned if key not in self.table]
        if fresh:
            tally = RequestTally()
            self._broadcast(int(self.cluster.placement.primary(fresh[:1])[0]), tally, len(fresh))
            self.stats.index_msgs += tally.index_msgs
            self.stats.index_bytes += tally.index_bytes
            self.table.update(fresh)
        self._learned = {}
        self._rolled += 1
        if self._rolled % self.learn_windows() == 0:
            self._asked.clear()
            self._askers.clear()
            self._prefixes.clear()

    def learn_windows(self) -> int:
        """Windows (of ``window`` requests) over which a root's asks are counted (``learn_window``)."""
        per_node = self.params.learn_window
        return max(1, round(per_node * self.cluster.nodes / self.params.window)) if per_node else 1


class BuiltHotRootsCopy(BuiltHotRoots):
    """(i) (h) and a local copy of a hot prefix loaded from another node."""

    name = "i hot prefixes + copies"
    copy_hot = True


class BuiltHotRootsHandover(BuiltHotRoots):
    """(j) (h), and when a prefix becomes hot the old root's owner hands the hints of the families
    it holds that extend past it to their new roots' owners (one message per new root owner):
    a family registered before its prefix became hot is found by other nodes' readers as (f)
    finds it. The owner knows each family's chain from its writer's own lookup (a cold prompt's
    writer asks the root's owner before it writes, showing its chain), so what the model needs is
    the chain of each registered block."""

    name = "j hot prefixes + handover"

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.chain_of: dict[bytes, tuple[list[bytes], int]] = {}
        """Key -> its writer's prompt chain and its position there."""

    def serve(self, req: Request) -> RequestTally:
        tally = super().serve(req)
        for position, key in enumerate(req.keys):
            if key not in self.chain_of and key in self.hint_root:
                self.chain_of[key] = (req.keys, position)
        return tally

    def roll_window(self) -> None:
        before = len(self.table)
        super().roll_window()
        if len(self.table) == before:
            return
        moved: Counter[tuple[int, int]] = Counter()
        primary = self.cluster.placement.primary
        hot_of: dict[int, int] = {}  # per chain (a request's key list, shared by its keys)
        for key, (chain, position) in self.chain_of.items():
            hot = hot_of.get(id(chain))
            if hot is None:
                hot = hot_of[id(chain)] = self.hot_prefix(chain)
            root = chain[0] if position < hot or hot == len(chain) else chain[hot]
            old = self.hint_root[key]
            if old != root:
                self.hint_root[key] = self.root_of[key] = root
                moved[int(primary([old])[0]), int(primary([root])[0])] += 1
        tally = RequestTally()
        for (sender, owner), count in moved.items():
            self.stats.message(owner, tally, count, sender)
        self.stats.index_msgs += tally.index_msgs
        self.stats.index_bytes += tally.index_bytes


LOAD_ENTRY_BYTES = 8
"""One pool's load figure on the wire (``load_pick``): a 4-byte pool number (its place in the
membership every engine holds) and a 4-byte figure (KiB, or a float32)."""


class LoadSignal:
    """``load_pick``: what engines would know of each pool's load. Each engine counts the bytes it
    read from each pool in a push period and sends them (one entry per pool it read from, on its
    long poll) to the directory, which sums them over the fleet, decays the sum
    (``load_decay_pushes``) and pushes a figure per pool to every engine with its hot-table pushes:
    the figure an engine holds is a push period (``load_lag_pushes`` more) old, and, with
    ``load_top_pools`` or ``load_change_share``, only partly pushed. Counts what the reports and the
    pushes would carry."""

    def __init__(self, nodes: int, params: DesignParams) -> None:
        self.params = params
        self.nodes = nodes
        self.decay = math.exp(-1.0 / params.load_decay_pushes) if params.load_decay_pushes else 1.0
        self.summed = np.zeros(nodes)
        """The directory's decayed sum of the engines' reports, per pool."""
        self._served_before = np.zeros(nodes)
        self._history: list[np.ndarray] = []
        self.pushed = np.zeros(nodes)
        """Per pool, the figure last pushed (``load_change_share``)."""
        self.seen: list[float] = [0.0] * nodes
        """Per pool, the figure every engine holds now (a list: read per block)."""
        self.holding = False
        """Whether engines hold any figure (``two`` keeps the built order until they do, as the
        package's ``pool_load.pick_two``)."""
        self.period_reads: list[dict[int, float]] = [{} for _ in range(nodes)]
        """Per reader node, bytes it read per pool since the last push (its next report)."""
        self.own_reads: list[dict[int, float]] = [{} for _ in range(nodes)]
        """``load_pick="local"``: per reader node, bytes it read per pool, decayed as the fleet's."""
        self._draw = random.Random(params.seed)
        self._salt = 0
        self.pushes = 0
        self.entries_pushed = 0
        """Pool figures carried by all pushes (each push goes to every engine)."""
        self.entries_pushed_max = 0
        self.entries_reported = 0
        """(reader, pool) entries in all the engines' reports."""
        self.reports = 0
        """Engines' reports sent (a node that read from another node in a period sends one)."""

    def read(self, node: int, source: int, size: float) -> None:
        """``node`` read ``size`` bytes from ``source``'s pool."""
        reads = self.period_reads[node]
        reads[source] = reads.get(source, 0.0) + size
        if self.params.load_pick == "local":
            own = self.own_reads[node]
            own[source] = own.get(source, 0.0) + size

    def push(self, bytes_served: np.ndarray) -> None:
        """A push period ended: the engines' reports summed, decayed and pushed."""
        self.summed = self.summed * self.decay + (bytes_served - self._served_before)
        self._served_before = bytes_served.copy()
        self._history.append(self.summed.copy())
        del self._history[:-(self.params.load_lag_pushes + 1)]
        figure = self._history[0] if len(self._history) > self.params.load_lag_pushes else np.zeros(self.nodes)
        top, share = self.params.load_top_pools, self.params.load_change_share
        if top and top < self.nodes:
            view = np.zeros(self.nodes)
            picked = np.argpartition(-figure, top)[:top]
            view[picked] = figure[picked]
            entries = top
        elif share:
            threshold = share * np.maximum(self.pushed, figure.mean())
            changed = np.abs(figure - self.pushed) > threshold
            self.pushed[changed] = figure[changed]
            view = self.pushed
            entries = int(changed.sum())
        else:
            view, entries = figure, self.nodes
        self.seen = view.tolist()
        self.holding = bool(view.any())
        self.pushes += 1
        self.entries_pushed += entries
        self.entries_pushed_max = max(self.entries_pushed_max, entries)
        for reads in self.period_reads:
            if reads:
                self.reports += 1
                self.entries_reported += len(reads)
                reads.clear()
        if self.params.load_pick == "local" and self.decay < 1.0:
            for own in self.own_reads:
                for pool in own:
                    own[pool] *= self.decay

    def order(self, node: int, candidates: list[int], previous: int | None = None) -> list[int]:
        """``candidates`` (the pools ``node`` is told of, in the built order) in the order it tries
        them; ``previous``: the previous block's source (``load_keep_previous``)."""
        mode = self.params.load_pick
        if len(candidates) < 2:
            return candidates
        seen = self.seen
        if mode == "local":
            own = self.own_reads[node]
            return sorted(candidates, key=lambda pool: own.get(pool, 0.0))
        if mode.endswith("_local"):
            mine = self.period_reads[node]
            def load(pool: int) -> float:
                return seen[pool] + mine.get(pool, 0.0)
        else:
            def load(pool: int) -> float:
                return seen[pool]
        if mode.startswith("two"):
            if not self.holding:
                return candidates
            first, second = self._pair(node, len(candidates))
            pair = sorted((candidates[first], candidates[second]), key=load)
            if self.params.load_keep_previous and previous == pair[1]:
                pair.reverse()
            return pair + [pool for pool in candidates if pool not in pair]
        return sorted(candidates, key=load)

    def new_request(self) -> None:
        """A request starts: ``load_pair_per_request`` draws its pairs afresh."""
        self._salt = self._draw.getrandbits(62)

    def _pair(self, node: int, count: int) -> tuple[int, int]:
        """Two distinct places among ``count`` pools told: drawn per read, or per request (the same
        pair for the request's blocks told the same number of pools: its reads stay in few pools)."""
        if not self.params.load_pair_per_request:
            first, second = self._draw.sample(range(count), 2)
            return first, second
        first = self._salt % count
        second = (first + 1 + (self._salt // count) % (count - 1)) % count
        return first, second

    def summary(self) -> str:
        """What the signal cost on the wire."""
        pushes = max(self.pushes, 1)
        return (f"load signal ({self.params.load_pick}): {self.pushes} pushes, {self.entries_pushed / pushes:.0f} "
                f"pool figures a push to each engine (max {self.entries_pushed_max}; "
                f"{self.entries_pushed / pushes * LOAD_ENTRY_BYTES:.0f} B), reports {self.reports / pushes:.0f} "
                f"a period of {self.entries_reported / max(self.reports, 1):.1f} pools each "
                f"({self.entries_reported / pushes * LOAD_ENTRY_BYTES:.0f} B a period to the directory)")


class OwnerDirected:
    """``owner_pick``: per root owner, a decayed count of the blocks it directed readers to in each
    pool (the first pool it named for each block it answered), and the order it names a block's
    pools in from it. Sees only its own families' reads: a pool also serves other owners' families."""

    def __init__(self, nodes: int, params: DesignParams) -> None:
        self.params = params
        self.counts: list[dict[int, tuple[float, float]]] = [{} for _ in range(nodes)]
        """Per owner node, per pool: (count, when last added to, in seconds)."""
        self._draw = random.Random(params.seed + 1)
        self.answers = 0
        self.reordered = 0
        """Blocks whose first pool the owner's order changed (against the most recent first)."""

    def _count(self, owner: int, pool: int, now: float) -> float:
        count, at = self.counts[owner].get(pool, (0.0, now))
        tau = self.params.owner_pick_decay_s
        return count * math.exp(-(now - at) / tau) if tau else count

    def answer(self, owner: int, named: Sequence[list[int]], now: float) -> list[list[int]]:
        """Per block, its pools (most recent first, as the owner's hints name them) in the order the
        owner names them; each block's first pool is counted as directed to."""
        self.answers += 1
        salt = self._draw.getrandbits(62)
        previous: int | None = None
        out = []
        for pools in named:
            if not pools:
                out.append(pools)
                continue
            order = pools
            if len(pools) >= self.params.owner_pick_from:
                counts = {pool: self._count(owner, pool, now) for pool in pools}
                if self.params.owner_pick == "two":
                    first = salt % len(pools)
                    second = (first + 1 + (salt // len(pools)) % (len(pools) - 1)) % len(pools)
                    pair = sorted((pools[first], pools[second]), key=counts.__getitem__)
                    order = pair + [pool for pool in pools if pool not in pair]
                else:
                    order = sorted(pools, key=counts.__getitem__)
                if previous in pools:
                    order = [previous] + [pool for pool in order if pool != previous]
                self.reordered += order[0] != pools[0]
            head = order[0]
            self.counts[owner][head] = (self._count(owner, head, now) + 1.0, now)
            previous = head
            out.append(order)
        return out

    def summary(self) -> str:
        """What the owners' orders did and the state they kept."""
        tracked = [len(counts) for counts in self.counts]
        return (f"owner pick ({self.params.owner_pick}): {self.answers} answers, {self.reordered} blocks' first pool "
                f"moved; pools counted per owner: max {max(tracked)}, mean {sum(tracked) / len(tracked):.1f}")


class HandoverCopyOnSecondRead(BuiltHotRootsHandover):
    """(k) (j), and a reader keeps a copy in its own pool of a block it loaded from another node at
    its node's second read of that block (the root's owner counts each node's asks per block:
    ``shard.remote_reads``; ``remote_copy_reads``), or at once for a hot prefix's block (the
    table lists it because many read it), registered as a write is (the connector saving it
    again once the load landed): a document many nodes read is served by at most two reads per
    node from its writer, then from the copies (hints name the most recent first).
    ``copy_nodes_per_pool`` bounds the copies by the fleet's size; ``hot_copies`` says how a hot
    prefix's copies are found."""

    name = "k handover + copy 2nd read"

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self._reads: Counter[tuple[int, bytes]] = Counter()
        self.table_pools: dict[bytes, list[int]] = {}
        """Per hot block, the pools the table named when it became hot (``hot_copies`` != registered)."""
        self._announced: dict[bytes, dict[int, None]] = {}
        """``hot_copies="pushed"``: per hot block, the copies announced to the directory, not pushed yet."""
        self._readers: dict[bytes, dict[int, int]] = {}
        """``popular_readers``: per block, the nodes that read it from another node and when (a
        request index), least recent first, at most ``MAX_READERS`` (as ``shard.remote_reads``)."""
        self.places: dict[bytes, set[int]] = {}
        """``bound_popular``: per block, the nodes told it is popular that hold one of its places."""
        self._told_ever: Counter[bytes] = Counter()
        """``popular_places="lifetime"``: per block, the reads ever told it is popular."""
        self._windows = 0
        self._stewards: list[int] = []
        self._relays: dict[int, HotCopyRelay] = {}
        """``relay_announcements``: per steward (in the order first announced to this window), the
        package's gatherer of the copies announced to it."""
        self._on_poll: dict[bytes, dict[int, None]] = {}
        """``announce_on_poll``: per hot block, copies waiting for their node's next long poll."""
        self._hot_reader = -1
        self._hot_family = b""
        self.pools_pushed_whole = 0
        """Pools the directory's pushes of readers' copies carried to each engine, rows sent whole
        (each change counted as one entry in ``index_bytes``; the package's row is its pools)."""
        self.pools_pushed_appended = 0
        """... rows sent as the pools added (``HotPrefixDelta.appended``, the package since stop 60)."""
        self.hot_copies_unannounced = 0
        """``hot_copies_past_bound``: hot-prefix blocks copied past their row's bound (told to nobody)."""
        self.load = LoadSignal(cluster.nodes, params) if params.load_pick != "off" else None
        """``load_pick``: the pools' load as engines would know it."""
        self.owner_directed = OwnerDirected(cluster.nodes, params) if params.owner_pick else None
        """``owner_pick``: what each root's owner counted of the reads it directed."""
        self._owner_order: dict[bytes, list[int]] = {}
        """``owner_pick``: per block, the pools in the order this request's root owner named them."""
        self._now = 0.0
        self._requests_served = 0

    def push_windows(self) -> int:
        """Windows between the directory's pushes (``push_every``; 0: the package's pace)."""
        if self.params.push_every:
            return self.params.push_every
        window_s = self.params.window * SECONDS_PER_REQUEST / self.cluster.nodes
        return max(1, math.ceil(COPIES_PUSH_S / window_s - 1e-9))

    def copy_bound(self) -> int:
        """Pools a block may be held by before a reader stops copying it (0: unbounded)."""
        divisor = self.params.copy_nodes_per_pool
        return -(-self.cluster.nodes // divisor) if divisor else 0

    def hot_copy_bound(self) -> int:
        """Pools a hot prefix's row may name before its readers stop copying (``hot_copy_nodes_per_pool``)."""
        divisor = self.params.hot_copy_nodes_per_pool or self.params.copy_nodes_per_pool
        return -(-self.cluster.nodes // divisor) if divisor else 0

    def holders(self, key: bytes) -> int:
        """The pools a reader is told hold ``key``: the hints its root's owner keeps (stale ones
        too: they are aged out, not removed), at most ``MAX_POOLS_PER_KEY``, as the shard keeps."""
        return min(len(self.locs.get(key, ())), MAX_POOLS_PER_KEY)

    def serve(self, req: Request) -> RequestTally:
        self._hot_reader, self._hot_family = req.node, req.keys[0]
        self._owner_order = {}
        self._now = req.index * SECONDS_PER_REQUEST / self.cluster.nodes
        if self.load is not None:
            self.load.new_request()
        tally = super().serve(req)
        self._requests_served += 1
        if self.load is not None and self._requests_served % self.load_push_requests() == 0:
            self.load.push(self.stats.bytes_served)
        return tally

    def load_push_requests(self) -> int:
        """The fleet's requests between load pushes (``load_push_requests``; 0: the hot table's pace)."""
        if self.params.load_push_requests < 0:
            return max(1, round(COPIES_PUSH_S * self.cluster.nodes / SECONDS_PER_REQUEST))
        return self.params.load_push_requests or self.push_windows() * self.params.window

    def walk(self, req: Request, tally: RequestTally) -> tuple[int, list[int]]:
        hit, sources = super().walk(req, tally)
        if self.load is not None:
            for source in sources[:hit]:
                if source != req.node:
                    self.load.read(req.node, source, self.cluster.block_bytes)
        return hit, sources

    def _first_holding(self, key: bytes, order: list[int], tally: RequestTally) -> int | None:
        """``load_pick``: the pools told of, in the order the load signal gives, this node's first."""
        if self.load is None or (self.params.load_hot_only and key not in self.table):
            return super()._first_holding(key, order, tally)
        candidates = [node for node in dict.fromkeys(order) if node != self._hot_reader]
        ordered = self.load.order(self._hot_reader, candidates, self._previous)
        if self._hot_reader in order:
            ordered = [self._hot_reader, *ordered]
        return super()._first_holding(key, ordered, tally)

    def run(self, requests: Sequence[Request], progress: int = 0) -> None:
        super().run(requests, progress)
        if self.load is not None and progress:
            logging.info("%s", self.load.summary())
        if self.owner_directed is not None and progress:
            logging.info("%s", self.owner_directed.summary())

    def answer_where(self, root: bytes, family: Sequence[bytes], node: int) -> None:
        """``owner_pick``: the root's owner names each block's pools (those it was told of under
        this root, the most recent ``spread_pools``) in the order its directed counts give; the
        blocks the reader's node holds are not asked."""
        if self.owner_directed is None:
            return
        local = self.cluster.stored[node]
        asked = [key for key in family if key not in local and self.hint_root.get(key) == root and self.locs.get(key)]
        named = [list(dict.fromkeys(reversed(self.locs[key])))[:self.params.spread_pools] for key in asked]
        owner = int(self.cluster.placement.primary([root])[0])
        self._owner_order = dict(zip(asked, self.owner_directed.answer(owner, named, self._now)))

    def copy_loaded(self, req: Request, tally: RequestTally, hit: int, sources: list[int]) -> list[bytes]:
        again, hot_copies, unannounced = [], [], []
        told: list[bytes] = []
        bound, hot_bound = self.copy_bound(), self.hot_copy_bound()
        copies = req.node >= self.params.no_copy_share * self.cluster.nodes
        busy = self.params.overload_copy * self.stats.bytes_served.mean()
        for position in range(hit):
            if sources[position] == req.node:
                continue
            key = req.keys[position]
            if position >= self._hot_blocks:
                self._reads[req.node, key] += 1
                popular = self._popular(key, req) or self._overloaded(sources[position], key, req.node, busy)
                if popular:
                    told.append(key)
                if self._reads[req.node, key] < self.params.copy_session and not popular or not copies:
                    continue
                if bound and self.holders(key) >= bound:
                    continue
            elif self.params.bound_hot_copies and hot_bound and len(self.table_pools.get(key, ())) >= hot_bound:
                limit = self.params.hot_copies_past_bound_tokens // self.cluster.block_tokens
                if self.params.hot_copies_past_bound and copies and (not limit or position < limit):
                    unannounced.append(key)
                continue
            elif self.params.hot_copies in ("unregistered", "pushed"):
                hot_copies.append(key)
                continue
            again.append(key)
        if hot_copies:
            self._keep_hot_copies(req, tally, hot_copies)
        if unannounced:
            kept, _ = self.cluster.store(req.node, unannounced)
            tally.copy_bytes += len(kept) * self.cluster.block_bytes
            self.hot_copies_unannounced += len(kept)
        stored = self.save_local(req, again) if again else []
        tally.copy_bytes += len(stored) * self.cluster.block_bytes
        self._give_back_places(req.node, told, stored)
        return stored

    def _give_back_places(self, node: int, told: list[bytes], stored: list[bytes]) -> None:
        """Places ``node`` was told to take this read and made no copy for (none registered)."""
        if self.params.popular_places == "lifetime":
            return
        kept = set(stored)
        for key in told:
            if key not in kept and key in self.places:
                self.places[key].discard(node)

    def _keep_hot_copies(self, req: Request, tally: RequestTally, keys: list[bytes]) -> None:
        """A hot prefix's copies: kept, told to nobody (unregistered) or to the directory (pushed)."""
        copied, _ = self.cluster.store(req.node, keys)
        tally.copy_bytes += len(copied) * self.cluster.block_bytes
        named = self.params.announced_pools
        if named:
            copied = [key for key in copied if len(self.table_pools.get(key, ())) < named]
        if self.params.hot_copies == "pushed" and copied and self._announces(req.node):
            if self.params.announce_on_poll:
                for key in copied:
                    self._on_poll.setdefault(key, {})[req.node] = None
                return
            if self.params.relay_announcements:
                steward = self._steward(req.node, steward_key(copied))
                self._relays.setdefault(steward, HotCopyRelay()).gather({relay_pool(req.node): copied})
                self.stats.message(steward, tally, len(copied), req.node)
                return
            for key in copied:
                self._announced.setdefault(key, {})[req.node] = None
            self.stats.message(DIRECTORY_NODE, tally, len(copied), req.node)

    def _steward(self, node: int, first: bytes) -> int:
        """Where ``node`` announces a copy whose first block is ``first`` (``relay_stewards``)."""
        count = self.params.relay_stewards
        if not count:
            fanout = self.params.relay_fanout
            if fanout > 1:
                pick = (node * 0x9E3779B1) % 0xFFFFFFFB % fanout
                first = hashlib.blake2b(first + pick.to_bytes(4, "little"), digest_size=16).digest()
            return int(self.cluster.placement.primary([first])[0])
        if not self._stewards:
            self._stewards = [int(owner) for owner in self.cluster.placement.primary(
                [hashlib.blake2b(f"relay-{index}".encode(), digest_size=16).digest() for index in range(count)])]
        return self._stewards[(node * 0x9E3779B1) % 0xFFFFFFFB % count]

    def _forward_relayed(self) -> None:
        """``relay_announcements``: each steward's gathered copies to the directory, one message
        (the package's ``HotCopyRelay``: a pool's keys in the order announced, each once), taken
        in the order the stewards first heard of this window's copies."""
        tally = RequestTally()
        for steward, relay in self._relays.items():
            copies = relay.take()
            for pool, keys in copies.items():
                for key in keys:
                    self._announced.setdefault(key, {})[pool[1]] = None
            if copies:
                self.stats.message(DIRECTORY_NODE, tally, sum(map(len, copies.values())), steward)
        self._relays = {}
        self.stats.index_msgs += tally.index_msgs
        self.stats.index_bytes += tally.index_bytes

    def _popular(self, key: bytes, req: Request) -> bool:
        """Whether ``popular_readers`` other nodes read ``key`` within ``popular_window`` requests a node
        (this read counted for the next)."""
        wanted = self.params.popular_readers
        if not wanted:
            return False
        readers = self._readers.setdefault(key, {})
        since = req.index - self.params.popular_window * self.cluster.nodes
        others = sum(1 for node, at in readers.items() if node != req.node and at > since)
        readers.pop(req.node, None)
        readers[req.node] = req.index
        if len(readers) > MAX_READERS:
            del readers[next(iter(readers))]
        if others < wanted:
            return False
        bound = -(-int(self.copy_bound() * self.params.popular_share * 1000) // 1000)
        if self.params.bound_popular and bound:
            return self._take_place(key, req.node, bound)
        return True

    def _overloaded(self, source: int, key: bytes, node: int, busy: float) -> bool:
        """``overload_copy``: whether ``source`` served more than ``busy`` bytes (that many times
        the fleet's mean), and a place of ``key``'s is free for ``node``."""
        if not busy or self.stats.bytes_served[source] <= busy:
            return False
        bound = self.copy_bound()
        return not (self.params.bound_popular and bound) or self._take_place(key, node, bound)

    def _take_place(self, key: bytes, node: int, bound: int) -> bool:
        """``bound_popular``: whether one of ``key``'s ``bound`` places is free for ``node``
        (then taken), as ``popular_places`` gives them back."""
        if self.params.popular_places == "lifetime":
            if self._told_ever[key] >= bound:
                return False
            self._told_ever[key] += 1
            return True
        places = self.places.setdefault(key, set())
        if self.params.popular_places == "held":
            places.discard(node)  # it reads from another node again: its copy is gone
        else:
            places.intersection_update([holder for holder in places if key in self.cluster.stored[holder]])
        if len(places) >= bound:
            return False
        places.add(node)
        return True

    def _announces(self, node: int) -> bool:
        """Whether ``node`` tells the directory of its copies of this request's hot prefix."""
        share = self.params.copy_nodes_per_pool
        if not self.params.announce_share or share <= 1:
            return True
        salt = int.from_bytes(self._hot_family[:8], "little")
        return ((node * 0x9E3779B1) ^ salt) % 0xFFFFFFFB % share == 0

    def _push_announced(self) -> None:
        """The directory's delta push: the blocks whose announced pools reached ``push_growth``
        times those the table names get them (up to the copy bound), one message to every node."""
        bound = self.hot_copy_bound() or self.cluster.nodes
        if self.params.announced_pools:
            bound = min(bound, self.params.announced_pools)
        changed = 0
        for key, announced in list(self._announced.items()):
            listed = self.table_pools.setdefault(key, [])
            fresh = [node for node in announced if node not in listed]
            if not fresh or not copies_due(len(listed), len(fresh), bound, self.params.push_growth):
                continue
            named = len(listed)
            listed.extend(fresh[:max(0, bound - len(listed))])
            del self._announced[key]
            changed += 1
            self.pools_pushed_whole += len(listed)
            self.pools_pushed_appended += len(listed) - named
        if changed:
            tally = RequestTally()
            self._broadcast(DIRECTORY_NODE, tally, changed)
            self.stats.index_msgs += tally.index_msgs
            self.stats.index_bytes += tally.index_bytes

    def _valid_copy(self, key: bytes, node: int, tally: RequestTally) -> int | None:
        if key not in self.table and self.params.spread_reads and key not in self.cluster.stored[node]:
            return self._spread_copy(key, node, tally)
        if self.params.hot_copies == "registered" or key not in self.table or key in self.cluster.stored[node]:
            return super()._valid_copy(key, node, tally)
        order = []
        if self.params.peer_probes:
            salted = hashlib.blake2b(self._hot_family + node.to_bytes(4, "little"), digest_size=16).digest()
            peers = self.cluster.placement.top(salted, self.params.peer_probes + 1)
            order = [peer for peer in peers if peer != node][:self.params.peer_probes]
        named = [where for where in self.table_pools.get(key, ()) if where != node]
        if self.params.spread_hot_reads and named:
            start = (node * 0x9E3779B1) % len(named)
            named = named[start:] + named[:start]
        order += named
        found = self._first_holding(key, order, tally)
        if found is not None and found != node:
            self._previous = found
        return found

    def _spread_copy(self, key: bytes, node: int, tally: RequestTally) -> int | None:
        """``spread_reads``: past the hot prefix, the previous block's source if it holds the key,
        else the most recent ``MAX_POOLS_PER_KEY`` named from the one a hash of the node picks,
        then older ones."""
        if self.hint_root.get(key) != self._root:
            return None  # registered under another root (``BuiltHotRoots._valid_copy``)
        listed = self.locs.get(key)
        if not listed:
            return None
        newest = list(reversed(listed))
        named, older = newest[:self.params.spread_pools], newest[self.params.spread_pools:]
        told = self._owner_order.get(key)
        if told is not None:
            named = told
        elif len(named) >= self.params.spread_from:
            start = (node * 0x9E3779B1) % len(named)
            named = named[start:] + named[:start]
        order = ([self._previous] if self._previous in listed else []) + named + older
        found = self._first_holding(key, order, tally)
        if found is not None and found != node:
            self._previous = found
        return found

    def roll_window(self) -> None:
        before = set(self.table)
        super().roll_window()
        fresh = self.table.difference(before) if self.params.hot_copies != "refreshed" else self.table
        for key in fresh:
            self.table_pools[key] = list(reversed(self.locs.get(key, [])))[:MAX_POOLS_PER_KEY]
        self._windows += 1
        if self.params.hot_copies == "pushed" and self._windows % self.push_windows() == 0:
            if self._windows % self.params.relay_every == 0:
                self._forward_relayed()
            self._push_announced()
            for key, nodes in self._on_poll.items():  # the long polls re-posted after this push
                self._announced.setdefault(key, {}).update(nodes)
            self._on_poll = {}
        if self.params.hot_copies == "refreshed" and self.table:  # a new table version to every node
            tally = RequestTally()
            self._broadcast(0, tally, len(self.table))
            self.stats.index_msgs += tally.index_msgs
            self.stats.index_bytes += tally.index_bytes


DESIGNS = DESIGNS + (BuiltHotRoots, BuiltHotRootsCopy, BuiltHotRootsHandover, HandoverCopyOnSecondRead)


def run_built(spec: WorkloadSpec, requests: Sequence[Request],
              pool_tokens: int) -> tuple[Cluster, HandoverCopyOnSecondRead]:
    """The built design (k) run over one workload on a fresh cluster: where the diagnostics that
    take its state apart (``scale_split.py``, ``scale_leave.py``) start."""
    cluster = Cluster(spec.nodes, pool_tokens * BYTES_PER_TOKEN, spec.block_bytes, Placement(shard_ids(spec.nodes)))
    design = HandoverCopyOnSecondRead(cluster, DesignParams(seed=spec.seed))
    design.run(requests)
    return cluster, design
