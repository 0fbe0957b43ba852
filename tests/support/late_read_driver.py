"""Set-up of ``tests/e2e/test_late_read_engine.py``, run in a process of its own against a
``PrivateCluster`` of two nodes: a fleet with one shard per node; engine A (the connector on) on
node 1 serves a document, whose blocks stay on node 1's shard. Prints one JSON line: that
shard's id and process id, and the prompt another engine should load. Then waits for its stdin to
close, resumes the shard (SIGCONT, where the test stopped it) and stops the fleet."""

from __future__ import annotations

import json
import os
import signal
import sys

import ray

from ucm_ray.config import UcmRayConfig
from ucm_ray.demo import ENGINE_ENV, kv_transfer_config
from ucm_ray.store.shard.fleet import fleet_status, start_fleet_per_node, stop_fleet
from ucm_ray.testing.engines import ProbedEngine
from ucm_ray.tiny_model import synthetic_prompt

NAMESPACE = "lateread"


def main(address: str, model: str, document_tokens: int) -> None:
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    config = start_fleet_per_node(UcmRayConfig(ray_namespace=NAMESPACE, pool_bytes=64 << 20, shard_cpus=0,
                                               lookup_timeout_s=60, lease_s=120), 1)
    pid = None
    try:
        kv = kv_transfer_config({"ray_namespace": NAMESPACE, "lookup_timeout_s": 60, "lease_s": 120})
        writer = ray.remote(num_cpus=0, resources={"node_1": 0.01}, runtime_env={"env_vars": ENGINE_ENV})(
            ProbedEngine).remote(model, kv)
        prompt = synthetic_prompt(model, document_tokens, seed=21) + synthetic_prompt(model, 40, seed=22)
        reference = ray.get(writer.generate.remote(prompt, 8))  # its commits are flushed before it returns
        ray.kill(writer)
        node = ray.get(ray.remote(num_cpus=0, resources={"node_1": 0.01})(
            lambda: ray.get_runtime_context().get_node_id()).remote())
        shards = fleet_status(config)["shards"]
        shard = next(s for s in shards if s["node_id"] == node)
        actor = ray.get_actor(shard["shard_id"], namespace=NAMESPACE)
        pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        print(json.dumps({"shard_id": shard["shard_id"], "node_id": node, "pid": pid, "prompt": prompt,
                          "reference": reference["tokens"], "entries": {s["shard_id"]: s["entries"] for s in shards}}),
              flush=True)
        sys.stdin.read()  # until the test is done with the fleet
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        stop_fleet(config)
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
