"""Start, inspect and stop the shard fleet on a running Ray cluster.

Shards are named, detached actors spread across nodes, so they outlive the
process that started them (a CLI call, a Serve app) and can be found again by
``status`` and ``down``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import ray

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.directory import DIRECTORY_NAME, ShardDirectory
from ucm_ray.store.shard import CacheShard
from ucm_ray.transport.shm import pool_prefix, remove_stale_pools

log = logging.getLogger(__name__)


def shard_name(i: int) -> str:
    return f"ucm_ray_shard_{i}"


def start_fleet(config: UcmRayConfig, *, timeout_s: float = 120.0) -> ray.actor.ActorHandle:
    """Create the directory and ``num_shards`` shards (reusing any that exist); idempotent."""
    ns = config.ray_namespace
    directory = ShardDirectory.options(  # type: ignore[attr-defined]  # ray.remote classes
        name=DIRECTORY_NAME, namespace=ns, lifetime="detached", get_if_exists=True, num_cpus=0).remote()
    shards = []
    for i in range(config.num_shards):
        shards.append((shard_name(i), CacheShard.options(  # type: ignore[attr-defined]
            name=shard_name(i), namespace=ns, lifetime="detached", get_if_exists=True,
            num_cpus=config.shard_cpus, scheduling_strategy="SPREAD",
        ).remote(shard_name(i), config.to_dict())))
    ray.get([directory.register.remote(sid, h) for sid, h in shards], timeout=timeout_s)
    log.info("ucm-ray fleet up: %d shards x %d bytes in Ray namespace %r",
             config.num_shards, config.pool_bytes, ns)
    return directory


@contextlib.contextmanager
def running_fleet(config: UcmRayConfig) -> Iterator[UcmRayConfig]:
    """A fleet for the duration of a block (demo, benchmarks, tests), stopped however it ends."""
    start_fleet(config)
    try:
        yield config
    finally:
        stop_fleet(config)


def fleet_status(config: UcmRayConfig, *, timeout_s: float = 10.0) -> dict[str, Any]:
    directory = ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace)
    membership = ray.get(directory.membership.remote(), timeout=timeout_s)
    stats = []
    for s in membership.shards:
        try:
            stats.append(ray.get(s.handle.stats.remote(), timeout=timeout_s))
        except Exception as e:  # a dying shard is reported, not fatal for status
            stats.append({"shard_id": s.shard_id, "error": type(e).__name__})
    return {"version": membership.version, "shards": stats}


def stop_fleet(config: UcmRayConfig, *, timeout_s: float = 30.0) -> int:
    """Shut shards down cleanly (unlinking their pools), then kill the actors."""
    ns = config.ray_namespace
    stopped = 0
    try:
        directory = ray.get_actor(DIRECTORY_NAME, namespace=ns)
        membership = ray.get(directory.membership.remote(), timeout=timeout_s)
        handles = {s.shard_id: s.handle for s in membership.shards}
    except ValueError:
        directory, handles = None, {}
    for i in range(config.num_shards):
        try:
            handles.setdefault(shard_name(i), ray.get_actor(shard_name(i), namespace=ns))
        except ValueError:
            pass
    for sid, h in handles.items():
        try:
            if directory is not None:
                ray.get(directory.deregister.remote(sid), timeout=timeout_s)
            ray.get(h.shutdown.remote(), timeout=timeout_s)
        except Exception as e:
            log.warning("shard %s did not shut down cleanly: %s", sid, type(e).__name__)
        ray.kill(h)
        stopped += 1
    if directory is not None:
        ray.kill(directory)
    # Shards killed earlier (crashes, kill -9) never unlinked their pools; free this node's.
    remove_stale_pools(pool_prefix(config.shm_dir, ns, "ucm_ray_shard_"))
    return stopped
