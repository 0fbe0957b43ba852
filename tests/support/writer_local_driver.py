"""Driver of the writer-local store test, run in a process of its own against a three-node
``PrivateCluster`` (one shard per node): clients on different nodes write and read through
``StoreClient``; prints one JSON line of what each saw and what each shard holds."""

from __future__ import annotations

import json
import os
import sys

import ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # run as a script: ``tests.support`` from this checkout

from tests.support.store_helpers import ClientProcess  # noqa: E402
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.shard.fleet import fleet_status, start_fleet_per_node, stop_fleet  # noqa: E402

BLOCKS = 48
DIVERGE_AT = 30


def scenario(placement: str, replication: int) -> dict:
    """One fleet (one shard per node) with these settings: what each client saw, what each
    shard held, then what a reader sees once the writer's shard is dead."""
    config = start_fleet_per_node(UcmRayConfig(ray_namespace=f"wlocal_{placement}_{replication}", pool_bytes=32 << 20,
                                               shard_cpus=0, lookup_timeout_s=30, placement=placement,
                                               replication=replication), 1)
    try:
        clients = [ClientProcess.options(resources={f"node_{i}": 0.01}).remote(config.to_dict()) for i in range(3)]
        written = ray.get(clients[1].write.remote(BLOCKS, 5, "doc"))
        status = fleet_status(config)["shards"]
        node_of = {s["shard_id"]: s["node_id"] for s in status}
        result = {
            "written": sum(written),
            "entries_by_node": {node_of[s["shard_id"]]: s["entries"] for s in status},
            "hints_by_node": {node_of[s["shard_id"]]: s["hints"] for s in status},
            "writer_node": ray.get(clients[1].node.remote()),
            "same_node": ray.get(clients[1].read.remote(BLOCKS, 5, "doc")),
            "other_node": ray.get(clients[2].read.remote(BLOCKS, 5, "doc")),
            "diverged": ray.get(clients[0].read.remote(BLOCKS, 5, "doc", diverge_at=DIVERGE_AT)),
        }
        # another writer's blocks, read unpinned from another node, then removed at their shard
        ray.get(clients[0].write.remote(8, 6, "gone"))
        result["removed_mid_copy"] = ray.get(clients[2].validation_after_removal.remote(8, "gone"))
        # the writer's shard dies: its blocks are misses (or replicas' hits), never wrong bytes
        writer_shard = next(s["shard_id"] for s in status if s["node_id"] == result["writer_node"])
        ray.kill(ray.get_actor(writer_shard, namespace=config.ray_namespace))
        result["after_kill"] = ray.get(clients[2].read.remote(BLOCKS, 5, "doc", gone=writer_shard))
        return result
    finally:
        stop_fleet(config)


def main(address: str, scenarios: str) -> None:
    """``scenarios``: comma-separated ``placement:replication`` pairs, run one after another."""
    # the clients' class lives in this checkout's tests/: its workers import it from there too
    ray.init(address=address, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        results = {}
        for name in scenarios.split(","):
            placement, replication = name.split(":")
            results[name] = scenario(placement, int(replication))
        print(json.dumps(results), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
