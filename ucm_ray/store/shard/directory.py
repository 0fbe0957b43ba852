"""ShardDirectory: the named, detached actor that knows which shards are alive.

Membership changes bump a version; clients hold one long-poll call (``wait_for_change``)
that returns as soon as the version moves (or after a while, to be re-posted), so changes are
pushed, not polled for. Death detection uses Ray itself: the directory awaits each shard's
never-returning ``wait_until_death`` call, which raises as soon as Ray declares the actor dead.

The directory holds no state that cannot be rebuilt: Ray restarts it when its process dies
(``max_restarts``), and a new start finds the shards by listing the named actors of its Ray
namespace. Its version starts at a random value, so the membership of one directory start is
never mistaken for another's (a client that saw version 7 of a dead directory must not take
version 7 of its successor as "unchanged").

Engines' (or their relays') long polls carry the bytes they read per pool since their last one: the
directory sums them into a decayed figure per pool (``store.pool_load``) and, when it moved, pushes
the most loaded pools' figures with a new version, paced with the readers' copies of hot prefixes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import ray
from ray.actor import ActorHandle

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.hot_copy_relay import HotCopies
from ucm_ray.store.hot_prefixes import NO_HOT_PREFIXES, HotPrefixDelta, HotPrefixTable, PushPacer
from ucm_ray.store.placement import copy_bound
from ucm_ray.store.placement import owners as place
from ucm_ray.store.pool_load import PoolLoad
from ucm_ray.store.shard.hints import HintPools
from ucm_ray.store.types import Membership, ShardRecord, random_id
from ucm_ray.transport.base import PoolDescriptor, PoolKey

log = logging.getLogger(__name__)

SHARD_PREFIX = "ucm_ray_shard_"
LONG_POLL_S = 30.0
"""How long a ``wait_for_change`` call waits when nothing changes (then it is re-posted)."""
MAX_CALLS_AT_ONCE = 1 << 16
"""The directory's calls in progress at most (Ray's ``max_concurrency``). Every engine holds one
long poll there: at Ray's default for an async actor (1,000, i.e. 125 nodes of 8 engines) the
directory's other calls (registrations, hot-prefix pushes, a new engine's membership read) queued
until polls timed out, ``LONG_POLL_S`` later (docs/scaling.md, stop 63: a push took 30.6 s to get
in at 1,200 waiting polls). A waiting poll is a suspended coroutine, so many cost little."""


@ray.remote(max_concurrency=MAX_CALLS_AT_ONCE)
class ShardDirectory:
    def __init__(self, ray_namespace: str, fleet_config: dict[str, Any] | None = None) -> None:
        self._namespace = ray_namespace  # where its shards are named (not always the creator's job's)
        # The settings the fleet was started with (UcmRayConfig.to_dict()): fleet-wide ones,
        # like replication, are the fleet's, not each engine's. Ray restarts the directory
        # with the same arguments, so a restart keeps them.
        self._config = dict(fleet_config) if fleet_config else {}
        replication = self._config.get("replication")
        self._replication = replication if isinstance(replication, int) and replication >= 1 else None
        placement = self._config.get("placement")
        self._placement = placement if isinstance(placement, str) else None
        self._shards: dict[str, ShardRecord] = {}
        self._watchers: dict[str, asyncio.Task] = {}
        self._version = random_id() >> 16  # room to count up, and unlike any other start's
        self._shards_version = self._version
        """The version at which the shard list last changed (a later one moved the hot table only)."""
        self._listed: tuple[ShardRecord, ...] | None = None
        """The shard list of now, sorted once per change (every engine's long poll answer has it)."""
        self._changed = asyncio.Event()
        self._found: asyncio.Task | None = None
        self._served = {"membership": 0, "wait_for_change": 0, "announce_hot_copies": 0}
        nodes_per_pool = self._config.get("copy_nodes_per_pool")
        self._nodes_per_pool: int = (nodes_per_pool if isinstance(nodes_per_pool, int)
                                     else UcmRayConfig().copy_nodes_per_pool)
        self._hot = HotPrefixTable(start=random_id() >> 16)
        """Hot prefixes the shards learned (``store.hot_prefixes``), pushed with the membership."""
        self._pacer = PushPacer()
        """Paces the pushes that may wait: readers' copies of hot prefixes, the pools' load figure."""
        self._pushed_revision = self._hot.revision
        """The hot table's revision the last version carried (a paced push past it says nothing new)."""
        self._load = PoolLoad()
        """The engines' reads per pool, decayed (``store.pool_load``)."""
        self._load_figures = self._load.publish(())
        """The figures the last version carried."""

    async def register(self, shard_id: str, handle: ActorHandle) -> int:
        """Add (or replace) a shard; returns the new membership version."""
        await self._rediscovered()
        await self._add(shard_id, handle)
        return self._version

    async def deregister(self, shard_id: str) -> int:
        await self._rediscovered()
        record = self._shards.pop(shard_id, None)
        if record is not None:
            task = self._watchers.pop(shard_id, None)
            if task is not None:
                task.cancel()
            self._hot.remove_pool(record.key)
            self._load.remove(record.key)
            self._bump(f"shard {shard_id} left", shards=True)
        return self._version

    async def version(self) -> int:
        return self._version

    async def fleet_config(self) -> dict[str, Any]:
        """The ``UcmRayConfig`` dict the fleet was started with (empty when not given)."""
        return dict(self._config)

    async def membership(self) -> Membership:
        await self._rediscovered()
        self._served["membership"] += 1
        return self._snapshot()

    async def wait_for_change(self, known_version: int, timeout_s: float = LONG_POLL_S,
                              known_hot: int = -1, shards_held: bool = False,
                              pool_reads: Mapping[PoolKey, int] | None = None) -> Membership:
        """The membership as soon as it differs from ``known_version`` (at once if it does
        already), else after ``timeout_s``: the caller re-posts the call either way.
        ``known_hot``: the hot-prefix table revision the caller holds (-1: none); the answer then
        carries what changed since (``Membership.hot_delta``), not the whole table. ``shards_held``:
        the caller puts back the shard list it holds, so when no shard joined or left since
        ``known_version`` the answer carries none (``Membership.shards_held``; an engine of an
        older package, which does not, gets the list). ``pool_reads``: the bytes the caller (an
        engine, or a relay for its node's engines) read per pool since its last poll: summed into
        the pools' load figure, pushed with a later version once it moved (``Membership.pool_load``)."""
        await self._rediscovered()
        self._served["wait_for_change"] += 1
        if pool_reads:
            self._load.report(pool_reads)
            if self._load.moved:
                self._pace()
        if self._version == known_version:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                pass
        membership = self._snapshot()
        if shards_held and known_version and self._shards_version <= known_version <= self._version:
            membership = dataclasses.replace(membership, shards=(), shards_held=True)
        push = self._hot.since(known_hot) if known_hot >= 0 else None
        if isinstance(push, HotPrefixDelta):
            return dataclasses.replace(membership, hot=NO_HOT_PREFIXES, hot_delta=push)
        return membership

    async def announce_hot_copies(self, copies: HotCopies) -> int:
        """Readers' pools keep copies of these hot-prefix blocks (``{pool: keys}``: one reader's
        announcement, or a steward's forward of a window's, ``store.hot_copy_relay``): the table
        names each pool for each of its blocks (up to the copy bound, ``copy_nodes_per_pool``; as a
        row's copies double, ``copies_due``), and every engine gets the changed rows with the next
        version (paced, ``PushPacer``), so readers of a hot prefix spread over its copies instead of
        all reading the pools that held it when it became hot. A pool that is not a member (it left
        since) is ignored: it holds nothing."""
        await self._rediscovered()
        self._served["announce_hot_copies"] += 1
        members = self._members()
        nodes = len({record.pool.node_id for record in self._shards.values()})
        bound = copy_bound(nodes, self._nodes_per_pool)
        changed = False
        for pool, keys in copies.items():
            if (pool[0], pool[1]) in members:
                changed = self._hot.add_copies(pool, keys, bound) or changed
        if changed:
            self._pace()
        return self._version

    def _pace(self) -> None:
        """A change that may wait (readers' copies, the load figure) is pushed at the pacer's time."""
        delay = self._pacer.due()
        if delay is not None:
            asyncio.get_running_loop().call_later(delay, self._paced_push)

    def _paced_push(self) -> None:
        self._pacer.pushed()
        copies = self._hot.revision != self._pushed_revision
        if not copies and not self._load.moved:
            return  # another change's version carried them meanwhile
        self._bump(f"readers' copies of hot prefixes ({self._hot.pools_named} pools named)" if copies
                   else "the pools' load figure")

    async def add_hot_prefix(self, entries: dict[bytes, HintPools],
                             handover: dict[bytes, dict[bytes, HintPools]] | None = None) -> int:
        """A shard found these blocks shared by the many askers of a family root it owns: every
        engine gets them with the next membership version (when anything changed). ``handover``:
        per new family root, the hints of the families written under the old one, passed on to
        the new root's owners (posted: a lost one is a miss once, as without a handover)."""
        await self._rediscovered()
        members = self._members()  # a hint can name a pool that left since: it holds nothing
        entries = {key: tuple(p for p in pools if (p[0], p[1]) in members) for key, pools in entries.items()}
        if self._hot.add(entries):
            self._bump(f"{len(entries)} hot-prefix block(s) ({len(self._hot)} in the table)")
        if handover:
            self._hand_over(handover)
        return self._version

    def _hand_over(self, handover: dict[bytes, dict[bytes, HintPools]]) -> None:
        """One ``adopt_hints`` per owner of the new roots (rendezvous over the membership engines
        hold, as their hint posts and lookups place a root)."""
        shards = self._list()
        if not shards:
            return
        roots = list(handover)
        rows = place(roots, [s.shard_id for s in shards], self._replication or 1)
        per_owner: dict[int, dict[bytes, HintPools]] = {}
        for root, row in zip(roots, rows.tolist()):
            for owner in row:
                per_owner.setdefault(owner, {}).update(handover[root])
        for owner, hints in per_owner.items():
            shards[owner].handle.adopt_hints.remote(shards[owner].pool.incarnation, hints)

    async def ping(self) -> dict[str, Any]:
        await self._rediscovered()
        return {"version": self._version, "shards": sorted(self._shards), "pid": os.getpid(),
                "served": dict(self._served), "hot_blocks": len(self._hot),
                "hot_revision": self._hot.revision, "hot_pools_named": self._hot.pools_named,
                "hot_copies_waiting": self._hot.copies_waiting, "load_pools": self._load.pools,
                "load_figures": len(self._load_figures.at)}

    # --- internals -----------------------------------------------------------------------

    def _members(self) -> set[tuple[str, int]]:
        """The pools of the shards listed now: the only ones the hot-prefix table may name (a
        departed pool named would hold one of a row's ``copy_bound`` places forever)."""
        return {record.key for record in self._shards.values()}

    def _list(self) -> tuple[ShardRecord, ...]:
        if self._listed is None:
            self._listed = tuple(self._shards[k] for k in sorted(self._shards))
        return self._listed

    def _snapshot(self) -> Membership:
        return Membership(self._version, self._list(), self._replication,
                          self._placement, self._hot.snapshot(), pool_load=self._load_figures)

    def _bump(self, why: str, *, shards: bool = False) -> None:
        """A new version (``shards``: the shard list changed, not only the hot-prefix table)."""
        self._version += 1
        self._pushed_revision = self._hot.revision
        if shards:
            self._shards_version = self._version
            self._listed = None
        self._load_figures = self._load.publish(self._list())
        self._changed.set()  # wakes every waiting long poll
        self._changed = asyncio.Event()
        log.info("%s (version %d)", why, self._version)

    async def _add(self, shard_id: str, handle: ActorHandle) -> None:
        pool: PoolDescriptor = await handle.describe.remote()
        replaced = self._shards.get(shard_id)
        if replaced is not None and replaced.key != pool.key:
            self._hot.remove_pool(replaced.key)  # a restart registered before its death was seen
        self._shards[shard_id] = ShardRecord(shard_id, handle, pool)
        old = self._watchers.pop(shard_id, None)
        if old is not None:
            old.cancel()
        self._watchers[shard_id] = asyncio.create_task(self._watch(shard_id, handle))
        self._bump(f"shard {shard_id} joined", shards=True)

    async def _rediscovered(self) -> None:
        """On this start's first call: adopt the shards already running in our namespace (a
        restarted directory, or one created again by ``ucm-ray up``)."""
        if self._found is None:
            self._found = asyncio.create_task(self._find_shards())
        await asyncio.shield(self._found)

    async def _find_shards(self) -> None:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == self._namespace and a["name"].startswith(SHARD_PREFIX)]
        for name in names:
            try:
                await asyncio.wait_for(self._add(name, ray.get_actor(name, namespace=self._namespace)), timeout=10)
            except Exception as e:  # noqa: BLE001 -- dead or unresponsive: it re-registers when it starts
                log.warning("shard %s not adopted: %s", name, type(e).__name__)
        if names:
            log.info("directory started with %d running shard(s)", len(self._shards))

    async def _watch(self, shard_id: str, handle: ActorHandle) -> None:
        try:
            await handle.wait_until_death.remote()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- RayActorError and friends: the shard is gone
            log.warning("shard %s died: %s", shard_id, type(e).__name__)
        record = self._shards.get(shard_id)
        if record is not None and record.handle._actor_id == handle._actor_id:
            self._watchers.pop(shard_id, None)
            await self.deregister(shard_id)
