"""Driver of the relayed-announcements test, run in a process of its own against a three-node
``PrivateCluster`` (one shard per node): readers on two nodes keep copies of a hot prefix's
blocks written on the third, one copying request at a time, first with ``relay_hot_copies`` off
(each announced to the directory), then on (each to the steward, the owner of the block copied);
prints one JSON line: the directory's ``announce_hot_copies`` calls and the pools the table
names in each phase."""

from __future__ import annotations

import json
import os
import sys
import time

import ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # run as a script: ``tests.support`` from this checkout

from tests.support.store_helpers import ClientProcess, key  # noqa: E402
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.placement import owners  # noqa: E402
from ucm_ray.store.shard.fleet import fleet_status, start_fleet_per_node, stop_fleet  # noqa: E402
from ucm_ray.store.types import DIRECTORY_NAME  # noqa: E402

COPIES = 6
"""Blocks of the hot prefix each reader copies, one request each."""


def _announcements(directory) -> int:
    return ray.get(directory.ping.remote())["served"]["announce_hot_copies"]


def phase(config: UcmRayConfig, relay: bool, tag: str, directory, writer_pool, steward: int) -> dict:
    """One phase: ``COPIES`` hot blocks (each stewarded by shard ``steward``), written on node 1,
    copied by readers on nodes 0 and 2."""
    settings = {**config.to_dict(), "relay_hot_copies": relay}
    ids = ray.get(directory.membership.remote()).shard_ids
    candidates = [key(i, tag) for i in range(64 * COPIES)]
    hot = [k for k, row in zip(candidates, owners(candidates, ids, 1).tolist()) if row[0] == steward][:COPIES]
    clients = [ClientProcess.options(resources={f"node_{i}": 0.01}).remote(settings) for i in range(3)]
    written = sum(ray.get(clients[1].write_keys.remote(hot, 3)))
    ray.get(directory.add_hot_prefix.remote({k: [writer_pool] for k in hot}))
    ray.get([c.hot_pools.remote(hot, 1) for c in clients])
    before = _announcements(directory)
    started = time.monotonic()  # each reader's copies one request at a time, both readers at once
    copied = ray.get([clients[node].copy_keys.remote([k], 3) for k in hot for node in (0, 2)])
    elapsed = time.monotonic() - started
    named = ray.get(clients[1].hot_pools.remote(hot, 3))["pools"]
    time.sleep(1.5)  # anything still on its way lands
    for client in clients:
        ray.kill(client)
    return {"written": written, "copied": sum(copied), "named": named, "seconds": elapsed,
            "directory_calls": _announcements(directory) - before}


def main(address: str) -> None:
    ray.init(address=address, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    config = start_fleet_per_node(UcmRayConfig(ray_namespace="relay", pool_bytes=32 << 20, shard_cpus=0,
                                               lookup_timeout_s=30, copy_nodes_per_pool=1), 1)
    try:
        directory = ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace)
        status = fleet_status(config)["shards"]
        writer_node = ray.get(ClientProcess.options(resources={"node_1": 0.01}).remote(config.to_dict()).node.remote())
        writer = next(s for s in status if s["node_id"] == writer_node)["shard_id"]
        shards = ray.get(directory.membership.remote()).shards
        writer_pool = next(s.key for s in shards if s.shard_id == writer)
        steward = next(i for i, s in enumerate(shards) if s.shard_id != writer)
        result = {"off": phase(config, False, "direct", directory, writer_pool, steward),
                  "on": phase(config, True, "relayed", directory, writer_pool, steward)}
        stats = {s["shard_id"]: s for s in fleet_status(config)["shards"]}
        result["steward"] = {name: stats[shards[steward].shard_id][name]
                             for name in ("relayed_copies", "relay_forwards", "relay_dropped")}
        print(json.dumps(result), flush=True)
    finally:
        stop_fleet(config)
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
