"""CacheShard: the Ray actor that owns one pool and its index.

It holds state only: the pool (a /dev/shm file that same-node clients map,
also registered with the shard's NIXL agent for other nodes) and a
``BlockIndex``. It never touches block bytes itself: clients copy them
through a transport, then tell the shard to commit.

A plain (threaded) actor rather than an async one: a lookup fan-out to four
shards measured 2.4 ms against 3.4 ms with async actors on a 2-core host.
Index calls run one at a time in the default concurrency group; the death
watch blocks in a group of its own, and so do its node's engines' long polls
when it is their membership relay (``store.membership_relay``); a lock keeps
the metrics thread's reads consistent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import ray
import torch
from ray.exceptions import RayError

from ucm_ray.config import UcmRayConfig
from ucm_ray.metrics import ShardMetrics
from ucm_ray.store.hot_copy_relay import HotCopies, HotCopyRelay
from ucm_ray.store.hot_prefixes import RECORDED_KEYS, FamilyRecords, HotPrefixLearner, PushPacer
from ucm_ray.store.membership_relay import LONG_POLL_S, MembershipRelay
from ucm_ray.store.published_layout import index_path
from ucm_ray.store.shard.disk import DiskStore
from ucm_ray.store.shard.disk.tier import DiskTier
from ucm_ray.store.shard.hints import FamilyHints, HintPools
from ucm_ray.store.shard.index import BlockIndex, Key
from ucm_ray.store.shard.published_writer import PublishedIndex
from ucm_ray.store.shard.remote_reads import RemoteReads
from ucm_ray.store.types import DIRECTORY_NAME, GrantCommit, Membership, Slot, WrongIncarnation, grant_items, random_id
from ucm_ray.testing.disk_faults import ops_from_env
from ucm_ray.transport.base import PoolDescriptor, PoolKey
from ucm_ray.transport.reaper import PoolReaper
from ucm_ray.transport.shm import SharedPool, pool_prefix, remove_stale_pools

log = logging.getLogger(__name__)

HINTS_MIN_KEYS = 1 << 16
HINT_BLOCK_BYTES = 16 << 10
READ_MARGIN_S = 0.1
"""Kept back from an asker's deadline by a promotion's reads: the commit and pin after them, the
answer's way back, and the clocks of two nodes (``answer_by``) a few milliseconds apart."""
ORDER_WAIT_S = 0.1
"""The least a disk-thread lookup waits for the default group's calls queued before it
(``_after_calls_queued``), its asker's deadline passed or not."""
RELAY_THREADS = 16
"""Engines' long polls a shard holds at once as its node's membership relay (one thread each while
it waits): 8 engines on an 8-GPU node, with room. A poll past them queues until one is answered.
Ray starts a group's threads with the actor, relay or not: 64 made a shard's process 90 threads
instead of 26."""


@ray.remote(concurrency_groups={"watch": 1, "disk": 1, "relay": RELAY_THREADS})
class CacheShard:
    def __init__(self, shard_id: str, config: dict[str, Any]) -> None:
        cfg = UcmRayConfig.from_dict(config)
        self._id = shard_id
        self._incarnation = random_id()
        self._node_id = ray.get_runtime_context().get_node_id()
        prefix = pool_prefix(cfg.shm_dir, cfg.ray_namespace, shard_id) + "-"
        remove_stale_pools(prefix)  # a predecessor of this (uniquely named) shard that crashed here
        path = prefix + uuid.uuid4().hex[:8]
        self._pool = SharedPool(path, cfg.pool_bytes, create=True)
        self._reaper = PoolReaper(path, index_path(path))  # unlinks both however this process ends
        self._published: PublishedIndex | None = None
        self._nixl = None
        self._lock = threading.Lock()
        self._tier: DiskTier | None = None
        try:
            self._published = PublishedIndex(index_path(path), cfg.pool_bytes, self._incarnation, cfg.disk_bytes)
            self._index = BlockIndex(cfg.pool_bytes, lease_s=cfg.lease_s, reserve_timeout_s=cfg.reserve_timeout_s,
                                     published=self._published, prefer_clean=bool(cfg.disk_roots))
            if cfg.disk_roots:
                # Last to open: a DiskInUse (another shard on these files) must leave nothing behind.
                self._tier = DiskTier(self._index, self._pool.tensor,
                                      DiskStore(cfg.disk_roots, shard_id, cfg.disk_bytes, ops=ops_from_env()),
                                      self._lock,
                                      write_through=cfg.disk_write_policy == "through", wait_s=cfg.disk_wait_s,
                                      recompute_bytes_s=cfg.disk_recompute_bytes_s)
            if cfg.transport != "shm":
                from ucm_ray.transport.nixl import NixlPoolExporter, NixlUnavailableError

                try:
                    self._nixl = NixlPoolExporter(self._pool.tensor, f"ucmray-{shard_id}-{uuid.uuid4().hex[:6]}",
                                                  bind_ip=ray.util.get_node_ip_address(),
                                                  index=torch.frombuffer(self._published.memory(), dtype=torch.uint8))
                except NixlUnavailableError as e:
                    if cfg.transport == "nixl":
                        raise
                    # auto: same-node clients need only shared memory; clients on other nodes
                    # get failed transfers (misses), never wrong bytes.
                    log.warning("shard %s: NIXL unavailable (%s); serving same-node clients over "
                                "shared memory only", shard_id, e)
        except BaseException:
            self._pool.close()  # never leak a /dev/shm segment from a shard that did not start
            if self._published is not None:
                self._published.close()
            if self._tier is not None:
                self._tier.close()
            self._reaper.close()
            raise
        # a table about as large as what one pool holds: rendezvous over family roots spreads
        # the fleet's hints over its shards as it spreads blocks (16 KiB: a small model's block)
        self._hints = FamilyHints(max(HINTS_MIN_KEYS, cfg.pool_bytes // HINT_BLOCK_BYTES))
        self._hot = HotPrefixLearner(cfg.hot_prefix_asks)
        self._records = FamilyRecords(RECORDED_KEYS if cfg.hot_prefix_asks else 0)
        self._remote_reads = RemoteReads()
        self._relay = HotCopyRelay()
        self._relay_pacer = PushPacer()
        self._relay_lock = threading.Lock()  # the pacer's: a call schedules, the timer's thread forwards
        self._namespace = cfg.ray_namespace
        self._membership_relay = MembershipRelay(cfg.ray_namespace)
        self._metrics = ShardMetrics(shard_id, self._node_id)
        self._node_ip = ray.util.get_node_ip_address()
        self._stopped = threading.Event()
        self._promoting = threading.Lock()  # held by a ``promote_and_acquire``; shutdown waits for it
        self._me: Any = None  # this actor's own handle (``_after_calls_queued``)
        self._lookup_timeout_s = cfg.lookup_timeout_s
        self._demote_wake = threading.Event()
        threading.Thread(target=self._publish_metrics, name="ucm-ray-metrics", daemon=True).start()
        self._demoter: threading.Thread | None = None
        if self._tier is not None:
            self._demoter = threading.Thread(target=self._demote, name="ucm-ray-demote", daemon=True)
            self._demoter.start()
        log.info("shard %s incarnation %x: %d-byte pool at %s on node %s", shard_id, self._incarnation,
                 cfg.pool_bytes, path, self._node_id[:8])

    def describe(self) -> PoolDescriptor:
        return PoolDescriptor(
            shard_id=self._id,
            node_id=self._node_id,
            pool_bytes=self._pool.size,
            shm_path=self._pool.path,
            nixl_agent=self._nixl.agent_name if self._nixl else None,
            nixl_metadata=self._nixl.metadata() if self._nixl else None,
            pool_base_addr=self._pool.tensor.data_ptr(),
            incarnation=self._incarnation,
            index_path=self._published.path if self._published is not None else None,
            index_base_addr=self._nixl.index_base_addr if self._nixl else 0,
            index_bytes=self._nixl.index_bytes if self._nixl else 0,
        )

    # Every control call names the incarnation it was meant for: a client that still
    # knows a predecessor of this shard is refused instead of pinning, publishing or
    # releasing anything here.

    def ping(self, incarnation: int) -> int:
        """The cheap probe a client sends to a suspect shard."""
        self._check(incarnation)
        return incarnation

    def contains(self, incarnation: int, keys: Sequence[Key]) -> list[bool]:
        """In the pool or on disk: a disk hit is a hit (``acquire`` promotes it)."""
        self._check(incarnation)
        with self._lock:
            found = self._index.contains(keys)
        if self._tier is not None and not all(found):
            found = [f or d for f, d in zip(found, self._tier.on_disk(keys))]
        return found

    def acquire(self, incarnation: int, owner: int, keys: Sequence[Key], recompute_bytes_s: float = 0.0,
                answer_by: float = 0.0) -> tuple[int, list[Slot | None], list[int]]:
        """Pins what the pool holds, after promoting what only the disk holds (head first) where
        reading it is faster than the asker recomputes it (``recompute_bytes_s``, its measured
        prefill rate; 0.0: unknown): the engine's lookup is asynchronous, so the disk read delays
        this answer, never a step. Also says which keys (indices) were read from disk for it: the
        engine counts its disk hits. A reader whose keys may be on disk (the published index
        lists some so, or it read none and the fleet has a disk tier) calls
        ``promote_and_acquire`` instead: the shard's other calls do not wait behind its reads.
        ``answer_by``: when the asker stops waiting (``time.time()``; 0.0: never), see
        ``_acquire``."""
        return self._acquire(incarnation, owner, keys, recompute_bytes_s, self._until(answer_by))

    def _until(self, answer_by: float) -> float | None:
        """The asker's ``answer_by`` on this process's monotonic clock (None: none given). Why the
        asker sends a time of day and not a number of seconds: a call waits in the actor's queue
        (behind other promotions on the disk thread) before it runs, and only the sender saw it
        leave; the wall clock is one clock for every process of a node, and across nodes two
        clocks under NTP differ by milliseconds (``READ_MARGIN_S``). A clock far off only moves
        the bound: never past ``disk_wait_s`` from when the promotion starts (as without one), and
        one ahead of the asker's cuts promotions short (misses, recomputed), never wrong bytes."""
        return time.monotonic() + (answer_by - time.time()) if answer_by else None

    def _acquire(self, incarnation: int, owner: int, keys: Sequence[Key], recompute_bytes_s: float,
                 until: float | None) -> tuple[int, list[Slot | None], list[int]]:
        """``acquire``, for an asker that waits until ``until`` (monotonic; None: no bound but
        ``disk_wait_s``): reads from disk end ``READ_MARGIN_S`` before it, and none starts past
        it (those keys count late). The pool's own hits are pinned whatever the clocks say: a
        node whose wall clock is a lookup timeout ahead of the engine's would otherwise answer
        every hit a miss (review63), and a late call's pins only wait for their lease."""
        self._check(incarnation)
        tier = self._tier
        if tier is None:
            with self._lock:
                return (*self._index.acquire(owner, keys), [])
        left = None if until is None else until - time.monotonic()
        _, promoted, read = tier.promote_pinned(keys, recompute_bytes_s,
                                                None if left is None else left - READ_MARGIN_S)
        try:
            with self._lock:
                lease_id, slots = self._index.acquire(owner, keys)
            return lease_id, slots, [i for i in read if slots[i] is not None]
        finally:
            tier.unpin(promoted)

    @ray.method(concurrency_group="disk")
    def promote_and_acquire(self, incarnation: int, owner: int, keys: Sequence[Key], recompute_bytes_s: float = 0.0,
                            answer_by: float = 0.0) -> tuple[int, list[Slot | None], list[int]]:
        """``acquire`` on the shard's disk thread: a long prompt's promotion reads for up to
        ``disk_wait_s`` while the shard's lookups, slot asks and commits go on (they share the
        index lock with it, held only to pick, pin or commit). One promotion at a time (the
        disk's lock serialises them anyway); shutdown waits for it before closing the pool.
        Promotions queue here one behind another: ``answer_by`` (the asker's deadline, as
        ``acquire``'s) bounds each from when its engine sent it, its wait in the queue included."""
        until = self._until(answer_by)
        self._after_calls_queued(until)  # not under ``_promoting``: shutdown, a default call, waits for it
        with self._promoting:
            if self._stopped.is_set():
                raise WrongIncarnation(f"shard {self._id} is shutting down")
            return self._acquire(incarnation, owner, keys, recompute_bytes_s, until)

    def _after_calls_queued(self, until: float | None) -> None:
        """Returns once the default group ran every call Ray gave it before this one: Ray keeps a
        caller's calls in order within a group, not across groups, and a lookup on the disk
        thread overtook its own client's commit, queued just before it behind other callers'
        calls (a miss; ``CallPoster.drain``). A no-op call of the default group, queued behind
        them; past ``lookup_timeout_s`` or the asker's ``until`` (it gave up) the lookup goes on
        anyway, though never sooner than ``ORDER_WAIT_S``: the no-op normally answers in
        milliseconds, and a shard whose clock runs ahead of the asker's must not skip the order
        it keeps (a lookup past ``until`` only pins pool hits, and those need the commit)."""
        timeout = self._lookup_timeout_s if until is None else \
            min(self._lookup_timeout_s, max(ORDER_WAIT_S, until - time.monotonic()))
        if self._me is None:
            self._me = ray.get_runtime_context().current_actor
        try:
            ray.get(self._me.calls_queued_done.remote(), timeout=timeout)
        except RayError as e:
            log.warning("shard %s: a lookup did not wait for the calls queued before it: %s", self._id,
                        type(e).__name__)

    def calls_queued_done(self) -> None:
        """A no-op of the default group (``_after_calls_queued``)."""

    def touch(self, incarnation: int, keys: Sequence[Key], asked: int) -> None:
        """A same-node reader looked ``asked`` keys up in the published index and found ``keys``:
        counted, and kept recently used (posted off the reader's critical path, never awaited)."""
        self._check(incarnation)
        with self._lock:
            self._index.touch(keys, asked)

    def release(self, incarnation: int, owner: int, lease_ids: Sequence[int]) -> list[bool]:
        self._check(incarnation)
        with self._lock:
            return self._index.release(owner, lease_ids)

    def reserve(self, incarnation: int, owner: int,
                requests: Sequence[tuple[int, int]]) -> list[tuple[int, list[int]]]:
        """Per (size, count) request, a grant (token, offsets): one call for all sizes."""
        self._check(incarnation)
        with self._lock:
            return [self._index.reserve(owner, size, count) for size, count in requests]

    def renew(self, incarnation: int, owner: int, tokens: Sequence[int]) -> list[bool]:
        self._check(incarnation)
        with self._lock:
            return self._index.renew(owner, tokens)

    def commit(self, incarnation: int, owner: int, batches: Sequence[GrantCommit]) -> list[list[bool]]:
        """Per grant's batch, ``BlockIndex.commit``: one call for all grants."""
        self._check(incarnation)
        with self._lock:
            out = [self._index.commit(owner, token, grant_items(keys, offsets, checksums), free)
                   for token, keys, offsets, checksums, free in batches]
        self._demote_wake.set()
        return out

    def remove(self, incarnation: int, items: Sequence[tuple[Key, int]]) -> int:
        self._check(incarnation)
        with self._lock:
            return self._index.remove(items)

    def register_hints(self, incarnation: int, pool: tuple[str, int], keys: Sequence[Key], writer: str = "") -> None:
        """Writer-local placement: ``pool`` (on the writer's node) committed ``keys``, whose family
        root this shard owns (posted after the commit, never awaited); ``writer``: the writer's
        node id, whose copies of popular blocks now hold their places (``RemoteReads.copied``)."""
        self._check(incarnation)
        with self._lock:
            self._hints.register((pool[0], pool[1]), keys)
            if writer:
                self._remote_reads.copied(keys, writer)

    def where(self, incarnation: int, keys: Sequence[Key], family: Sequence[Key] = (),
              reader: str = "", copy_bound: int = 0, nodes: int = 0) -> tuple[list[HintPools], list[int]]:
        """Per key of a family this shard owns, the pools that hold it as their writers said
        (most recent first; a reader pins it there, and a stale hint is a miss there), and how
        many times the asker's node (``reader``; none: not counted) asked for it before while a
        pool held it (``RemoteReads``: its engine keeps a copy of a block it loads from another
        node at the ``remote_copy_reads``-th, or at its first once other nodes made it popular).
        ``family``: the asker's chain from the root on, what the hot-prefix learner counts and a
        handover reads (``FamilyRecords``); ``copy_bound``: the asker's bound on a block's copies
        (``copy_nodes_per_pool``; 0: none), past which no reader is told a block is popular;
        ``nodes``: the asker's count of the fleet's nodes (the learner's distinct askers rule,
        ``hot_prefixes.askers_needed``; 0: the asks rule only)."""
        self._check(incarnation)
        with self._lock:
            answer = self._hints.where(keys)
            held = [bool(pools) for pools in answer]
            earlier = self._remote_reads.ask(keys, reader, held, copy_bound) if reader else [0] * len(keys)
            self._records.record(family, keys)
            hot = self._hot.observe(family, reader, nodes)
            entries = self._hot_entries(hot) if hot else {}
            handover = self._handover(entries) if entries else {}
        if entries:
            self._announce_hot(entries, handover)
        return answer, earlier

    def adopt_hints(self, incarnation: int, entries: dict[Key, HintPools]) -> None:
        """Hints handed over by the owner of an old family root (``_handover``), through the
        directory: their families' root is now one this shard owns."""
        self._check(incarnation)
        with self._lock:
            self._hints.adopt(entries)

    def _hot_entries(self, hot: list[Key]) -> dict[Key, HintPools]:
        """The blocks that became hot with the pools the hints name for them, up to the first
        block no pool is known for (the table is a prefix)."""
        entries: dict[Key, HintPools] = {}
        for key, pools in zip(hot, self._hints.peek(hot)):
            if not pools:
                break
            entries[key] = pools
        return entries

    def _handover(self, hot: dict[Key, HintPools]) -> dict[Key, dict[Key, HintPools]]:
        """Per new family root, the hints of the recorded families that move under it now that
        ``hot`` is a hot prefix (readers will ask the new root's owner: without them, a family
        written before would be a miss for other nodes' readers once)."""
        out: dict[Key, dict[Key, HintPools]] = {}
        for root, keys in self._records.handover(list(hot)).items():
            known = {key: pools for key, pools in zip(keys, self._hints.peek(keys)) if pools}
            if known:
                out[root] = known
        return out

    def _announce_hot(self, entries: dict[Key, HintPools], handover: dict[Key, dict[Key, HintPools]]) -> None:
        """Hands them to the directory, which pushes the table and passes the handover on to
        the new roots' owners (posted, not awaited; outside the lock: finding the directory is a
        call to Ray's control store)."""
        try:
            ray.get_actor(DIRECTORY_NAME, namespace=self._namespace).add_hot_prefix.remote(entries, handover)
        except ValueError:  # no directory (a shard started alone): nobody to tell
            return
        log.info("shard %s: %d block(s) of a family root asked by many became a hot prefix; hints handed over "
                 "to %d new root(s)", self._id, len(entries), len(handover))

    def relay_hot_copies(self, incarnation: int, copies: HotCopies) -> None:
        """As a steward (``store.hot_copy_relay``): readers' pools keep copies of these hot-prefix
        blocks; gathered and forwarded to the directory in one call a window (posted by readers,
        never awaited: what this shard holds when it dies is lost, a window at most)."""
        self._check(incarnation)
        self._relay.gather(copies)
        with self._relay_lock:
            delay = self._relay_pacer.due()
        if delay is not None:
            timer = threading.Timer(delay, self._forward_hot_copies)
            timer.daemon = True
            timer.start()

    def _forward_hot_copies(self) -> None:
        """The window's gathered copies to the directory, one call (posted; no directory: dropped)."""
        with self._relay_lock:
            self._relay_pacer.pushed()
        copies = self._relay.take()
        if not copies or self._stopped.is_set():
            return
        try:
            ray.get_actor(DIRECTORY_NAME, namespace=self._namespace).announce_hot_copies.remote(copies)
        except ValueError:  # no directory (a shard started alone): nobody to tell
            return

    def _check(self, incarnation: int) -> None:
        if incarnation != self._incarnation:
            raise WrongIncarnation(f"shard {self._id} is incarnation {self._incarnation:x}, "
                                   f"not {incarnation:x}")

    def stats(self) -> dict[str, Any]:
        figures = self._figures()
        self._metrics.publish(figures)
        return {"shard_id": self._id, "node_id": self._node_id, "node_ip": self._node_ip, "pid": os.getpid(),
                "incarnation": self._incarnation, **figures}

    def _figures(self) -> dict[str, Any]:
        """The index's figures, and the disk tier's as ``disk_*`` (none without one)."""
        with self._lock:
            figures: dict[str, Any] = asdict(self._index.stats())
            figures.update(self._hints.stats())
            figures.update(self._remote_reads.stats())
            figures["hot_blocks_learned"] = self._hot.learned
            figures["hot_asks"] = self._hot.asks
            figures["relayed_polls"] = self._membership_relay.served
            figures["relay_cannot_say"] = self._membership_relay.cannot_say
            counts = self._relay.counts
            figures.update(relayed_copies=counts.gathered, relay_forwards=counts.forwarded,
                           relay_dropped=counts.dropped, relay_held=len(self._relay))
        tier = self._tier
        if tier is not None:
            disk = {**asdict(tier.disk_stats()), **asdict(tier.stats)}
            figures.update({f"disk_{k}": v for k, v in disk.items()})
            figures["disk_behind"] = tier.behind()
            # what a promotion's chunk is predicted to cost (seconds = fixed + bytes x per byte): the
            # read side of the promote-or-recompute decision
            figures["disk_read_fixed_s"], figures["disk_read_s_per_byte"] = tier.read_cost.fit()
        return figures

    def _demote(self) -> None:
        """Write-back: after commits (or every 0.5 s), demote batches until the pool's cold end
        is clean. Its own thread: no control call waits for it."""
        assert self._tier is not None
        while not self._stopped.is_set():
            self._demote_wake.wait(0.5)
            self._demote_wake.clear()
            self._tier.demote()

    def _publish_metrics(self, period_s: float = 5.0) -> None:
        while not self._stopped.wait(period_s):
            self._metrics.publish(self._figures())

    @ray.method(concurrency_group="relay")
    def relay_wait_for_change(self, known_version: int, timeout_s: float = LONG_POLL_S, known_hot: int = -1,
                              shards_held: bool = False,
                              pool_reads: Mapping[PoolKey, int] | None = None) -> Membership | None:
        """As this node's membership relay: the directory's ``wait_for_change`` answer, or None
        (ask the directory: this shard does not follow it yet, or is behind the caller).
        ``pool_reads``: the engine's bytes read per pool since its last poll (``store.pool_load``),
        sent on with the relay's own poll."""
        return self._membership_relay.wait_for_change(known_version, timeout_s, known_hot, shards_held, pool_reads)

    @ray.method(concurrency_group="watch")
    def wait_until_death(self) -> None:
        """Returns only at shutdown: the directory awaits it to learn, from the error, that we died."""
        self._stopped.wait()

    def shutdown(self) -> None:
        self._stopped.set()
        self._membership_relay.stop()
        with self._promoting:  # a promotion in flight lands first (its bytes go into the pool)
            pass
        if self._demoter is not None:
            self._demote_wake.set()
            self._demoter.join(timeout=30)
        if self._tier is not None:
            self._tier.close()  # a last manifest: a restarted shard adopts what is on disk
            self._tier = None
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None
        self._pool.close()
        if self._published is not None:
            self._published.close()
            self._published = None
        self._reaper.close()
