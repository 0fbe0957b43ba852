"""ShardDirectory: the named, detached actor that knows which shards are alive.

Membership changes bump a version; clients compare versions and re-place keys
(rendezvous hashing, ``placement.py``) only when it moved. Death detection uses
Ray itself: the directory awaits each shard's never-returning
``wait_until_death`` call, which raises as soon as Ray declares the actor dead.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle

from ucm_ray.transport.base import PoolDescriptor, PoolKey

log = logging.getLogger(__name__)

DIRECTORY_NAME = "ucm_ray_directory"


@dataclass(frozen=True)
class ShardRecord:
    shard_id: str
    handle: ActorHandle
    pool: PoolDescriptor
    """Carries the shard's incarnation: a restarted shard is a new record."""

    @property
    def key(self) -> PoolKey:
        return self.pool.key


@dataclass(frozen=True)
class Membership:
    version: int
    shards: tuple[ShardRecord, ...]

    @property
    def shard_ids(self) -> list[str]:
        return [s.shard_id for s in self.shards]

    @property
    def descriptors(self) -> dict[PoolKey, PoolDescriptor]:
        return {s.key: s.pool for s in self.shards}


@ray.remote
class ShardDirectory:
    def __init__(self) -> None:
        self._shards: dict[str, ShardRecord] = {}
        self._watchers: dict[str, asyncio.Task] = {}
        self._version = 0

    async def register(self, shard_id: str, handle: ActorHandle) -> int:
        """Add (or replace) a shard; returns the new membership version."""
        pool: PoolDescriptor = await handle.describe.remote()
        self._shards[shard_id] = ShardRecord(shard_id, handle, pool)
        old = self._watchers.pop(shard_id, None)
        if old is not None:
            old.cancel()
        self._watchers[shard_id] = asyncio.create_task(self._watch(shard_id, handle))
        self._version += 1
        log.info("shard %s joined (version %d)", shard_id, self._version)
        return self._version

    async def deregister(self, shard_id: str) -> int:
        if self._shards.pop(shard_id, None) is not None:
            task = self._watchers.pop(shard_id, None)
            if task is not None:
                task.cancel()
            self._version += 1
            log.info("shard %s left (version %d)", shard_id, self._version)
        return self._version

    async def version(self) -> int:
        return self._version

    async def membership(self) -> Membership:
        return Membership(self._version, tuple(self._shards[k] for k in sorted(self._shards)))

    async def _watch(self, shard_id: str, handle: ActorHandle) -> None:
        try:
            await handle.wait_until_death.remote()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # RayActorError and friends: the shard is gone
            log.warning("shard %s died: %s", shard_id, type(e).__name__)
        record = self._shards.get(shard_id)
        if record is not None and record.handle._actor_id == handle._actor_id:
            self._watchers.pop(shard_id, None)
            await self.deregister(shard_id)

    async def ping(self) -> dict[str, Any]:
        return {"version": self._version, "shards": sorted(self._shards)}
