"""Start, inspect and stop the shard fleet on a running Ray cluster.

Shards are named, detached actors, so they outlive the process that started
them (a CLI call, a Serve app) and are found again by name: a second start
(another app, a restarted app, ``ucm-ray up`` again) reuses them, and
``status`` / ``down`` find them through the directory or, if it is gone, by
listing the named actors of the fleet's Ray namespace.

Two placements: ``num_shards`` spread over the cluster (``start_fleet``), or
``shards_per_node`` on every node that can host one now (``start_fleet_per_node``,
what the Serve app builder uses: same-node engines then read their shard through
shared memory). A node that joins later gets its shards the next time the fleet
is started (e.g. the Serve app is redeployed); until then its engines use other
nodes' shards over NIXL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.shard.capacity import check_pool_fits
from ucm_ray.store.shard.directory import SHARD_PREFIX, ShardDirectory
from ucm_ray.store.shard.disk.store import purge as purge_disk
from ucm_ray.store.shard.shard import CacheShard
from ucm_ray.store.types import DIRECTORY_NAME
from ucm_ray.testing.disk_faults import shard_env
from ucm_ray.transport.shm import pool_prefix, remove_stale_pools

log = logging.getLogger(__name__)


class FleetStartError(RuntimeError):
    """A shard could not start (the message says which and why); nothing was left running."""


def shard_name(i: int) -> str:
    return f"{SHARD_PREFIX}{i}"


def node_shard_name(node_id: str, k: int) -> str:
    """Shards placed per node are named after their node, so a restart finds the same ones."""
    return f"{SHARD_PREFIX}{node_id[:12]}_{k}"


def shard_nodes(shard_cpus: float) -> list[str]:
    """Alive nodes that can host a shard now: they have CPUs at all (a node started with
    ``--num-cpus 0``, like KubeRay's head, is kept free of work) and at least ``shard_cpus``."""
    return sorted(n["NodeID"] for n in ray.nodes()
                  if n["Alive"] and n["Resources"].get("CPU", 0) > 0
                  and n["Resources"].get("CPU", 0) >= shard_cpus)


def start_fleet(config: UcmRayConfig, *, timeout_s: float = 120.0) -> ray.actor.ActorHandle:
    """The directory and ``num_shards`` shards spread over the cluster (reusing any that exist)."""
    return _start(config, [(shard_name(i), "SPREAD", None) for i in range(config.num_shards)], timeout_s)


def start_fleet_per_node(config: UcmRayConfig, shards_per_node: int, *,
                         timeout_s: float = 120.0) -> UcmRayConfig:
    """``shards_per_node`` shards on every node that can host one; returns ``config`` with
    ``num_shards`` set to the fleet's size (a ``ConfigError`` if, e.g., replication exceeds it)."""
    nodes = shard_nodes(config.shard_cpus)
    if not nodes:
        raise FleetStartError(f"no alive Ray node has {config.shard_cpus:g} CPU for a shard "
                              "(shard_cpus); lower it or add nodes")
    sized = dataclasses.replace(config, num_shards=len(nodes) * shards_per_node)
    placement = [(node_shard_name(node, k), NodeAffinitySchedulingStrategy(node, soft=False), node)
                 for node in nodes for k in range(shards_per_node)]
    _start(sized, placement, timeout_s)
    return sized


def _start(config: UcmRayConfig, placement: Sequence[tuple[str, Any, str | None]],
           timeout_s: float) -> ray.actor.ActorHandle:
    """Create what is missing (``placement``: name, scheduling strategy, node if pinned).
    Pools that will land on this node are checked against its free shared memory first (one
    line, nothing started); if a new shard still fails to start, every actor this call created
    is stopped (nothing half-started is left) and one line names the shard and the cause."""
    ns = config.ray_namespace
    existing = set(fleet_actor_names(ns))
    here = ray.get_runtime_context().get_node_id()
    single_node = len([n for n in ray.nodes() if n["Alive"]]) == 1
    check_pool_fits(config.shm_dir, config.pool_bytes,
                    sum(1 for name, _, node in placement
                        if name not in existing and (node == here or (node is None and single_node))),
                    config.disk_bytes)
    directory = ShardDirectory.options(  # type: ignore[attr-defined]  # ray.remote classes
        name=DIRECTORY_NAME, namespace=ns, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=-1).remote(ns, config.to_dict())  # stateless: a restart finds the shards again
    hook = shard_env()  # a test's disk fault (ucm_ray.testing.disk_faults); empty otherwise
    extra: dict[str, Any] = {"runtime_env": {"env_vars": hook}} if hook else {}
    shards = [(name, CacheShard.options(  # type: ignore[attr-defined]
        name=name, namespace=ns, lifetime="detached", get_if_exists=True,
        num_cpus=config.shard_cpus, scheduling_strategy=strategy, **extra,
    ).remote(name, config.to_dict())) for name, strategy, _ in placement]
    try:
        for name, handle in shards:
            try:
                ray.get(directory.register.remote(name, handle), timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 -- whatever it was, one line that names the shard
                raise FleetStartError(f"shard {name} did not start: {_root_cause(e)}") from None
    except FleetStartError:
        created = [(n, h) for n, h in shards if n not in existing]
        for name, handle in created:  # briefly: a shard that never started cannot answer
            with contextlib.suppress(Exception):
                ray.get(directory.deregister.remote(name), timeout=5.0)
            _shutdown(name, handle, 5.0)
        if DIRECTORY_NAME not in existing:
            ray.kill(directory)
        raise
    log.info("ucm-ray fleet up: %d shards x %d bytes in Ray namespace %r",
             len(shards), config.pool_bytes, ns)
    return directory


def _root_cause(error: BaseException) -> str:
    """The innermost error's one line, not Ray's wrapped traceback."""
    cause = getattr(error, "cause", None) or error.__cause__
    while cause is not None and (getattr(cause, "cause", None) or cause.__cause__) is not None:
        cause = getattr(cause, "cause", None) or cause.__cause__
    inner = cause or error
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[-1] if text else ''}"


def fleet_actor_names(ray_namespace: str) -> list[str]:
    """Names of the directory and every shard actor Ray knows in this namespace."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == ray_namespace
                  and (a["name"] == DIRECTORY_NAME or a["name"].startswith(SHARD_PREFIX)))


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
        except Exception as e:  # noqa: BLE001 -- a dying shard is reported, not fatal for status
            stats.append({"shard_id": s.shard_id, "error": type(e).__name__})
    return {"version": membership.version, "shards": stats}


def stop_fleet(config: UcmRayConfig, *, timeout_s: float = 30.0) -> int:
    """Shut every shard down cleanly (unlinking its pool), then kill the actors: those the
    directory lists and those Ray lists by name (the directory may be gone)."""
    ns = config.ray_namespace
    try:
        directory = ray.get_actor(DIRECTORY_NAME, namespace=ns)
        membership = ray.get(directory.membership.remote(), timeout=timeout_s)
        handles = {s.shard_id: s.handle for s in membership.shards}
    except (ValueError, ray.exceptions.RayError):
        directory, handles = None, {}
    for name in fleet_actor_names(ns):
        if name != DIRECTORY_NAME:
            with contextlib.suppress(ValueError):
                handles.setdefault(name, ray.get_actor(name, namespace=ns))
    for sid, handle in handles.items():
        if directory is not None:
            with contextlib.suppress(Exception):
                ray.get(directory.deregister.remote(sid), timeout=timeout_s)
        _shutdown(sid, handle, timeout_s)
    if directory is not None:
        ray.kill(directory)
    # Shards killed earlier (crashes, kill -9) never unlinked their pools; free them on every node.
    remove_stale_pools_everywhere(config, timeout_s=timeout_s)
    return len(handles)


@ray.remote(num_cpus=0, max_retries=0)
def _remove_stale_pools_here(prefix: str) -> tuple[str, int]:
    """Runs on one node: its pool files of this fleet (this cluster, this user) go."""
    return ray.get_runtime_context().get_node_id(), remove_stale_pools(prefix)


@ray.remote(num_cpus=0, max_retries=0)
def _purge_disk_here(roots: tuple[str, ...]) -> tuple[str, int]:
    """Runs on one node: the disk tier files of this fleet's shards under ``roots`` go."""
    return ray.get_runtime_context().get_node_id(), purge_disk(roots, SHARD_PREFIX)


def purge_disk_everywhere(config: UcmRayConfig, *, timeout_s: float = 30.0) -> int:
    """``ucm-ray down --purge-disk``, after the shards stopped: every alive node deletes the disk
    tier files its shards left under ``disk_dir`` (a stopped shard keeps them so that its next
    start adopts their entries). Returns how many shards' files went."""
    refs = [_purge_disk_here.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(config.disk_roots)
            for n in ray.nodes() if n["Alive"]]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref in pending:
        ray.cancel(ref, force=True)
    if pending:
        log.warning("disk purge: %d node(s) did not answer in %.0f s; their disk tier files stay",
                    len(pending), timeout_s)
    return sum(ray.get(ref)[1] for ref in ready)


def remove_stale_pools_everywhere(config: UcmRayConfig, *, timeout_s: float = 30.0) -> dict[str, int]:
    """Remove this fleet's leftover pool files on every alive node (one small task pinned to
    each; a node that does not answer in ``timeout_s`` is logged and skipped), then on this
    one. Returns, per node id that ran its task, how many files it removed."""
    prefix = pool_prefix(config.shm_dir, config.ray_namespace, SHARD_PREFIX)
    refs = [_remove_stale_pools_here.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(prefix)
            for n in ray.nodes() if n["Alive"]]
    done: dict[str, int] = {}
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref in ready:
        try:
            node_id, removed = ray.get(ref)
        except Exception as e:  # noqa: BLE001 -- one node's clean-up failing must not stop the others'
            log.warning("stale-pool cleanup failed on a node: %s", _root_cause(e))
            continue
        done[node_id] = removed
    for ref in pending:
        ray.cancel(ref, force=True)
    if pending:
        log.warning("stale-pool cleanup: %d node(s) did not answer in %.0f s; their leftover pools "
                    "(%s*) stay until the next `down` there", len(pending), timeout_s, prefix)
    remove_stale_pools(prefix)  # this process's node, even when its raylet could not run the task
    return done


def _shutdown(name: str, handle: ray.actor.ActorHandle, timeout_s: float) -> None:
    try:
        ray.get(handle.shutdown.remote(), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 -- stopping goes on: the actor is killed next whatever failed
        log.warning("shard %s did not shut down cleanly: %s", name, type(e).__name__)
    ray.kill(handle)
