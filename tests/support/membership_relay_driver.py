"""Driver of the multi-node membership relay test, run in a process of its own against a two-node
``PrivateCluster`` (two shards per node): two engines' feeds on each node (``relay_membership``)
follow hot-table pushes; prints one JSON line of what each node's engines got, what each shard
relayed and what the directory answered."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # run as a script: ``tests.support`` from this checkout

from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.engine.feed import MembershipFeed  # noqa: E402
from ucm_ray.store.shard.fleet import start_fleet_per_node, stop_fleet  # noqa: E402
from ucm_ray.store.types import DIRECTORY_NAME  # noqa: E402

PUSHES = 3
ENGINES_PER_NODE = 2


@ray.remote(num_cpus=0)
class NodeEngines:
    """A node's engines: one ``MembershipFeed`` each, polled as the scheduler does every step."""

    def __init__(self, namespace: str) -> None:
        self.node = ray.get_runtime_context().get_node_id()
        self.feeds = [MembershipFeed(namespace, 30.0, relay_node=self.node) for _ in range(ENGINES_PER_NODE)]
        self.held = [feed.fetch() for feed in self.feeds]

    def follow_to(self, version: int, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while any(m.version != version for m in self.held) and time.monotonic() < deadline:
            for i, feed in enumerate(self.feeds):
                got = feed.poll(self.held[i])
                if got is not None:
                    self.held[i] = got
            time.sleep(0.01)
        for i, feed in enumerate(self.feeds):  # the next long polls posted (the next step's)
            feed.poll(self.held[i])
        return {"node": self.node, "versions": [m.version for m in self.held],
                "hot_revisions": [m.hot.revision for m in self.held],
                "relayed": [feed.relayed for feed in self.feeds]}


def main(address: str) -> None:
    ray.init(address=address, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    config = start_fleet_per_node(UcmRayConfig(ray_namespace="relay_nodes", pool_bytes=16 << 20, shard_cpus=0,
                                               transport="shm", lookup_timeout_s=30), 2)
    try:
        directory = ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace)
        shards = ray.get(directory.membership.remote(), timeout=30).shards
        pools = [s.key for s in shards]
        engines = [NodeEngines.options(resources={f"node_{i}": 0.01}).remote(config.ray_namespace)  # type: ignore[attr-defined]
                   for i in range(2)]

        def push(n: int) -> list[dict[str, Any]]:
            version = ray.get(directory.add_hot_prefix.remote({f"hot{n}".encode(): (pools[n % len(pools)],)}),
                              timeout=30)
            return ray.get([e.follow_to.remote(version) for e in engines], timeout=120)

        push(0)  # the relays follow the directory from here on
        time.sleep(1.0)

        def relayed() -> dict[str, int]:
            return {s.shard_id: ray.get(s.handle.stats.remote(), timeout=30)["relayed_polls"] for s in shards}

        served_before = ray.get(directory.ping.remote(), timeout=30)["served"]["wait_for_change"]
        relayed_before = relayed()
        got = [push(n) for n in range(1, PUSHES + 1)]
        time.sleep(1.0)
        state = ray.get(directory.ping.remote(), timeout=30)
        relayed_after = relayed()
        print(json.dumps({
            "version": state["version"], "hot_revision": state["hot_revision"], "last": got[-1],
            "directory_polls": state["served"]["wait_for_change"] - served_before,
            "relayed_polls": {k: relayed_after[k] - relayed_before[k] for k in relayed_after},
            "shard_nodes": {s.shard_id: s.pool.node_id for s in shards},
        }), flush=True)
    finally:
        stop_fleet(config)
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
