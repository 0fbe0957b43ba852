"""Driver of the `down cleans every node` test, run in a process of its own against a
``PrivateCluster``: starts a one-shard fleet, leaves a stale pool file (as a shard killed
with ``kill -9`` would) for a shard of each other node, runs ``stop_fleet`` and prints one
JSON line: the nodes whose cleanup task ran (and what each removed), the driver's node and
which of the planted files are left."""

from __future__ import annotations

import json
import os
import sys

import ray

import ucm_ray.store.shard.fleet as fleet
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.shard.directory import SHARD_PREFIX
from ucm_ray.transport.shm import pool_prefix


def main(address: str) -> None:
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    config = UcmRayConfig(ray_namespace="downall", pool_bytes=4 << 20, num_shards=1, shard_cpus=0,
                          transport="shm")
    ran: dict[str, int] = {}
    real = getattr(fleet, "remove_stale_pools_everywhere", None)  # None: a `down` of this node only

    def spy(*args, **kwargs):
        assert real is not None
        result = real(*args, **kwargs)
        ran.update(result)
        return result

    if real is not None:
        fleet.remove_stale_pools_everywhere = spy
    here = ray.get_runtime_context().get_node_id()
    planted = []
    try:
        fleet.start_fleet(config)
        for n in ray.nodes():
            if n["Alive"] and n["NodeID"] != here:
                path = pool_prefix(config.shm_dir, config.ray_namespace,
                                   fleet.node_shard_name(n["NodeID"], 0)) + "-deadbeef"
                assert path.startswith(pool_prefix(config.shm_dir, config.ray_namespace, SHARD_PREFIX))
                with open(path, "wb") as f:
                    f.write(b"\0" * 4096)
                planted.append(path)
        stopped = fleet.stop_fleet(config)
        print(json.dumps({"ran": ran, "here": here, "planted": planted, "stopped": stopped,
                          "left": [p for p in planted if os.path.exists(p)]}), flush=True)
    finally:
        for p in planted:
            if os.path.exists(p):
                os.unlink(p)
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
