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

import logging
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.scale.cluster import Cluster
from benchmarks.scale.metrics import DesignStats, RequestTally
from benchmarks.scale.workload import Request


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
    """(d): how far into a prompt blocks are counted for the hot-prefix table."""
    hot_table_blocks: int = 8192
    """(d): the table's capacity (it is on every node)."""
    hot_root_lookups: int = 8
    """(d): a family whose root was looked up this often in a window is hot next window."""
    index_replicas: int = 3
    """(d): index owners of a hot family (top-r of ``owners``)."""
    max_copies: int = 8
    """(d): copies of a block an index lists (replicas beyond are local-only, not registered)."""
    seed: int = 0


class Design(ABC):
    """One placement/index design over its own cluster of pools."""

    name = ""
    data_follows_anchor = True
    """Whether a block's data lives where its index entry's anchor is placed (then a join moves data)."""

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        self.c = cluster
        self.p = params
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

    def run(self, requests: Sequence[Request], progress: int = 0) -> None:
        for i, req in enumerate(requests, 1):
            self.stats.add(self.serve(req))
            self.c.tick()
            if i % self.p.removal_every == 0:
                self.flush()
            if i % self.p.window == 0:
                self.roll_window()
            if progress and i % progress == 0:
                logging.info("%s: %d/%d requests", self.name, i, len(requests))
        self.flush()


def _first_false(flags: np.ndarray) -> int:
    misses = np.flatnonzero(~flags)
    return int(misses[0]) if misses.size else len(flags)


class PlacedDesign(Design):
    """Data and index at the node a key's anchor is placed on; (a) and (c)."""

    @abstractmethod
    def anchors(self, keys: Sequence[bytes]) -> list[bytes]:
        """The key each block is placed by."""

    def homes(self, keys: Sequence[bytes]) -> np.ndarray:
        return self.c.placement.primary(self.anchors(keys))

    def serve(self, req: Request) -> RequestTally:
        t = RequestTally(prompt_tokens=req.tokens)
        keys, node, bb = req.keys, req.node, self.c.block_bytes
        homes = self.homes(keys)
        remote = set(np.unique(homes).tolist()) - {node}
        t.lookup_calls = len(remote)
        t.touched |= remote
        for h in remote:
            self.stats.calls_received[h] += 1
        present: np.ndarray = np.zeros(len(keys), dtype=bool)
        groups = self._groups(homes)
        for home, idx in groups:
            present[idx] = self.c.has(home, [keys[i] for i in idx])
        hit = _first_false(present)
        t.hit_tokens = hit * self.c.block_tokens
        loaded = homes[:hit]
        off = loaded[loaded != node]
        t.load_off_bytes = int(off.size) * bb
        np.add.at(self.stats.bytes_served, off, bb)
        for home, idx in groups:
            todo = [keys[i] for i in idx if i >= hit and not present[i]]
            stored, _ = self.c.store(home, todo)
            if home != node:
                t.save_off_bytes += len(stored) * bb
        return t

    @staticmethod
    def _groups(homes: np.ndarray) -> list[tuple[int, np.ndarray]]:
        order = np.argsort(homes, kind="stable")
        bounds = np.flatnonzero(np.diff(homes[order])) + 1
        return [(int(homes[part[0]]), part) for part in np.split(order, bounds)]

    def entries(self) -> tuple[list[bytes], list[bytes]]:
        keys = [k for held in self.c.stored for k in held]
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
        s = self.p.segment_blocks
        out = [keys[(i // s) * s] for i in range(len(keys))]
        self._anchor.update(zip(keys, out))
        return out

    def homes(self, keys: Sequence[bytes]) -> np.ndarray:
        s = self.p.segment_blocks
        self.anchors(keys)
        return np.repeat(self.c.placement.primary(keys[::s]), s)[:len(keys)]

    def anchors_of_stored(self, keys: list[bytes]) -> list[bytes]:
        return [self._anchor[k] for k in keys]


class WriterDesign(Design):
    """Data in the writer's node's pool; an index key -> nodes holding it, read then validated.
    (b) and (d) differ in where the index entries live and what is replicated."""

    data_follows_anchor = False

    def __init__(self, cluster: Cluster, params: DesignParams) -> None:
        super().__init__(cluster, params)
        self.locs: dict[bytes, list[int]] = {}
        self._evicted: list[tuple[int, bytes]] = []

    def walk(self, req: Request, t: RequestTally) -> tuple[int, list[int]]:
        """The hit: the longest prefix whose blocks a listed copy still holds (a copy on the
        reader's node first, else a random listed one); each block's source node."""
        sources: list[int] = []
        for key in req.keys:
            source = self._valid_copy(key, req.node, t)
            if source is None:
                break
            sources.append(source)
        hit = len(sources)
        t.hit_tokens = hit * self.c.block_tokens
        bb = self.c.block_bytes
        for source in sources:
            if source != req.node:
                t.load_off_bytes += bb
                t.touched.add(source)
                self.stats.bytes_served[source] += bb
        return hit, sources

    def _valid_copy(self, key: bytes, node: int, t: RequestTally) -> int | None:
        listed = self.locs.get(key)
        if not listed:
            return None
        order = [node] if node in listed else []
        order += [listed[i] for i in self.rng.permutation(len(listed)) if listed[i] != node]
        for where in order:
            if self.c.has(where, [key])[0]:
                return where
            t.stale += 1
        return None

    def save_local(self, req: Request, keys: Sequence[bytes]) -> list[bytes]:
        """Store on the requester's node and list the copies; evictions queue removals."""
        stored, evicted = self.c.store(req.node, keys)
        for key in stored:
            self.locs.setdefault(key, []).append(req.node)
        self._evicted.extend((req.node, k) for k in evicted)
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
        t = RequestTally(prompt_tokens=req.tokens)
        homes = self.c.placement.primary(req.keys)
        remote = set(np.unique(homes).tolist()) - {req.node}
        t.lookup_calls = len(remote)
        t.touched |= remote
        for h in remote:
            self.stats.calls_received[h] += 1
        hit, _ = self.walk(req, t)
        stored = self.save_local(req, req.keys[hit:])
        for home, count in Counter(self.c.placement.primary(stored).tolist()).items():
            self.stats.message(home, t, count, req.node)
        return t

    def flush(self) -> None:
        batch = self.take_evicted()
        if not batch:
            return
        t = RequestTally()
        homes = self.c.placement.primary([k for _, k in batch])
        for (node, home), count in Counter(zip((n for n, _ in batch), homes.tolist())).items():
            self.stats.message(home, t, count, node)
        self.stats.index_msgs += t.index_msgs
        self.stats.index_bytes += t.index_bytes

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
        t = RequestTally(prompt_tokens=req.tokens)
        keys = req.keys
        h = 0
        while h < len(keys) and keys[h] in self.hot:
            h += 1
        root = keys[h] if h < len(keys) else None
        index_owners: tuple[int, ...] = ()
        if root is not None:
            index_owners = self._lookup_family(req, t, h, root)
        hit, sources = self.walk(req, t)
        self._replicate_hot(req, t, hit, sources, h, root, index_owners)
        stored = self.save_local(req, keys[hit:])
        self._register(req, t, stored, root, index_owners)
        self._learn(req)
        return t

    def _owners_of(self, root: bytes) -> tuple[int, ...]:
        r = self.p.index_replicas if root in self.hot_roots else 1
        return self.c.placement.top(root, r)

    def _lookup_family(self, req: Request, t: RequestTally, h: int, root: bytes) -> tuple[int, ...]:
        """Ask the root's index owner (0 calls when it is this node); entries a table change left
        under an older root cost a call to that root's owner and move to this root."""
        node = req.node
        self._root_lookups[root] += 1
        index_owners = self._owners_of(root)
        if node not in index_owners:
            asked = index_owners[int(self.rng.integers(len(index_owners)))]
            t.lookup_calls += 1
            t.touched.add(asked)
            self.stats.calls_received[asked] += 1
        older: dict[bytes, int] = Counter(self.under[k] for k in req.keys[h:] if self.under.get(k, root) != root)
        for old_root, count in older.items():
            old_owner = self.c.placement.top(old_root, 1)[0]
            if old_owner != node:
                t.lookup_calls += 1
                t.touched.add(old_owner)
                self.stats.calls_received[old_owner] += 1
            for owner in index_owners:
                self.stats.message(owner, t, count, old_owner)
        for k in req.keys[h:]:
            if k in self.under:
                self.under[k] = root
        return index_owners

    def _replicate_hot(self, req: Request, t: RequestTally, hit: int, sources: list[int], h: int,
                       root: bytes | None, index_owners: tuple[int, ...]) -> None:
        """A reader keeps a local copy of a hot block it loaded from another node (a local save)."""
        hot_family = root is not None and root in self.hot_roots
        remote = [i for i in range(hit) if sources[i] != req.node and (i < h or hot_family)]
        if not remote:
            return
        stored, evicted = self.c.store(req.node, [req.keys[i] for i in remote])
        self._evicted.extend((req.node, k) for k in evicted)
        fresh = [k for k in stored if len(self.locs.get(k, ())) < self.p.max_copies]
        for key in fresh:
            self.locs.setdefault(key, []).append(req.node)
        self._register_entries(req.node, t, fresh, index_owners)

    def _register(self, req: Request, t: RequestTally, stored: list[bytes], root: bytes | None,
                  index_owners: tuple[int, ...]) -> None:
        for key in stored:
            if key not in self.hot and root is not None:
                self.under[key] = root
        self._register_entries(req.node, t, stored, index_owners)

    def _register_entries(self, node: int, t: RequestTally, keys: list[bytes], index_owners: tuple[int, ...]) -> None:
        hot = sum(k in self.hot for k in keys)
        if hot:
            self._broadcast(node, t, hot)
        if len(keys) > hot:
            for owner in index_owners:
                self.stats.message(owner, t, len(keys) - hot, node)

    def _broadcast(self, sender: int, t: RequestTally, entries: int) -> None:
        """A change to the replicated table: one message to every other node."""
        others = self.c.nodes - 1
        self.stats.calls_received += 1
        self.stats.calls_received[sender] -= 1
        t.index_msgs += others
        t.index_bytes += others * entries * 32

    def _learn(self, req: Request) -> None:
        """Count distinct sessions per leading block; at ``hot_sessions`` it joins the table."""
        scan = self.p.hot_scan_tokens // self.c.block_tokens
        promoted = 0
        for key in req.keys[:scan]:
            if key in self.hot:
                continue
            seen = self._seen[key]
            seen.add(req.session)
            if len(seen) >= self.p.hot_sessions and len(self.hot) < self.p.hot_table_blocks:
                self.hot[key] = req.index
                self.under.pop(key, None)
                promoted += 1
        if promoted:
            t = RequestTally()
            self._broadcast(req.node, t, promoted)
            self.stats.index_msgs += t.index_msgs
            self.stats.index_bytes += t.index_bytes

    def roll_window(self) -> None:
        self._seen.clear()
        self.hot_roots = {r for r, n in self._root_lookups.items() if n >= self.p.hot_root_lookups}
        self._root_lookups.clear()

    def flush(self) -> None:
        batch = self.take_evicted()
        t = RequestTally()
        per_pair: Counter[tuple[int, int]] = Counter()
        hot_senders: Counter[int] = Counter()
        for node, key in batch:
            if key in self.hot:
                hot_senders[node] += 1
            elif key in self.under:
                for owner in self._owners_of(self.under[key]):
                    per_pair[(node, owner)] += 1
        for (node, owner), count in per_pair.items():
            self.stats.message(owner, t, count, node)
        for node, count in hot_senders.items():
            self._broadcast(node, t, count)
        self.stats.index_msgs += t.index_msgs
        self.stats.index_bytes += t.index_bytes

    def entries(self) -> tuple[list[bytes], list[bytes]]:
        keys = [k for k in self.under if k in self.locs]
        return keys, [self.under[k] for k in keys]


DESIGNS: tuple[type[Design], ...] = (PerBlock, WriterSharded, PerSegment, PrefixRooted)
