"""CacheShard: the Ray actor that owns one pool and its index.

It holds state only: the pool (a /dev/shm file that same-node clients map,
also registered with the shard's NIXL agent for other nodes) and a
``BlockIndex``. It never touches block bytes itself: clients copy them
through a transport, then tell the shard to commit. The actor is async with a
single event loop, so index calls are naturally serialised.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import asdict
from typing import Any, Sequence

import ray

from ucm_ray.config import UcmRayConfig
from ucm_ray.metrics import ShardMetrics
from ucm_ray.store.index import BlockIndex, Key, Slot
from ucm_ray.transport.base import PoolDescriptor
from ucm_ray.transport.shm import SharedPool

log = logging.getLogger(__name__)


@ray.remote
class CacheShard:
    def __init__(self, shard_id: str, config: dict[str, Any]) -> None:
        cfg = UcmRayConfig.from_dict(config)
        self._id = shard_id
        self._node_id = ray.get_runtime_context().get_node_id()
        path = os.path.join(cfg.shm_dir, f"ucmray-{cfg.ray_namespace}-{shard_id}-{uuid.uuid4().hex[:8]}")
        self._pool = SharedPool(path, cfg.pool_bytes, create=True)
        self._index = BlockIndex(cfg.pool_bytes, lease_s=cfg.lease_s,
                                 reserve_timeout_s=cfg.reserve_timeout_s)
        self._nixl = None
        try:
            if cfg.transport != "shm":
                from ucm_ray.transport.nixl import NixlPoolExporter

                self._nixl = NixlPoolExporter(self._pool.tensor, f"ucmray-{shard_id}-{uuid.uuid4().hex[:6]}")
        except BaseException:
            self._pool.close()  # never leak a /dev/shm segment from a shard that did not start
            raise
        self._metrics = ShardMetrics(shard_id)
        self._forever = asyncio.Event()
        self._publisher: asyncio.Task | None = None
        log.info("shard %s: %d-byte pool at %s on node %s", shard_id, cfg.pool_bytes, path,
                 self._node_id[:8])

    async def describe(self) -> PoolDescriptor:
        if self._publisher is None:  # the first call runs inside the actor's event loop
            self._publisher = asyncio.create_task(self._publish_metrics())
        return PoolDescriptor(
            shard_id=self._id,
            node_id=self._node_id,
            pool_bytes=self._pool.size,
            shm_path=self._pool.path,
            nixl_agent=self._nixl.agent_name if self._nixl else None,
            nixl_metadata=self._nixl.metadata() if self._nixl else None,
            pool_base_addr=self._pool.tensor.data_ptr(),
        )

    async def contains(self, keys: Sequence[Key]) -> list[bool]:
        return self._index.contains(keys)

    async def acquire(self, keys: Sequence[Key]) -> tuple[int, list[Slot | None]]:
        return self._index.acquire(keys)

    async def release(self, leases: Sequence[int]) -> list[bool]:
        return [self._index.release(lease) for lease in leases]

    async def reserve(self, items: Sequence[tuple[Key, int]]) -> tuple[int, list[int | None]]:
        return self._index.reserve(items)

    async def commit(self, token: int, keys: Sequence[Key], abort: Sequence[Key] = (),
                     checksums: Sequence[int | None] | None = None) -> list[bool]:
        """Publish ``keys`` and free ``abort`` (their bytes did not land) in one call."""
        if abort:
            self._index.abort(token, abort)
        return self._index.commit(token, keys, checksums)

    async def remove(self, keys: Sequence[Key]) -> int:
        return self._index.remove(keys)

    async def stats(self) -> dict[str, Any]:
        s = self._index.stats()
        self._metrics.publish(s)
        return {"shard_id": self._id, "node_id": self._node_id, "pid": os.getpid(), **asdict(s)}

    async def _publish_metrics(self, period_s: float = 5.0) -> None:
        while True:
            self._metrics.publish(self._index.stats())
            await asyncio.sleep(period_s)

    async def wait_until_death(self) -> None:
        """Never returns: the directory awaits it to learn, from the error, that we died."""
        await self._forever.wait()

    async def shutdown(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None
        self._pool.close()
        self._forever.set()
