"""Driver of the multi-node test, run in a process of its own against a ``PrivateCluster``
of three nodes: a fleet with one shard per node, engine A (the connector on) on node 2 serves
a document, engine B on node 1 serves the same document with another question, and a
reference engine without the connector serves B's prompts. Then A and B hand a new prompt off as
a PD proxy does: A prefills it (one token, its saves not yet run when B is asked), B decodes it.
Then node 2's shard is killed and B, its own prefix cache emptied, serves the document with a
third question. The engines follow the directory through their node's relay shard
(``relay_membership``): the polls each live shard answered as a relay, once the kill's version
reached the reader, are in the JSON. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ray

from ucm_ray.config import UcmRayConfig
from ucm_ray.demo import ENGINE_ENV, kv_transfer_config
from ucm_ray.store.shard.fleet import fleet_status, start_fleet_per_node, stop_fleet
from ucm_ray.store.types import DIRECTORY_NAME
from ucm_ray.testing.engines import ProbedEngine
from ucm_ray.tiny_model import synthetic_prompt


def engine_on(resource: str, model: str, kv: dict[str, Any] | None) -> Any:
    remote = ray.remote(num_cpus=0, resources={resource: 0.01}, runtime_env={"env_vars": ENGINE_ENV})(ProbedEngine)
    return remote.remote(model, kv)


def kill_shard(config: UcmRayConfig, shard_id: str) -> None:
    """Kill a shard and wait until the directory has dropped it."""
    ray.kill(ray.get_actor(shard_id, namespace=config.ray_namespace))
    directory = ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace)
    deadline = time.monotonic() + 30
    while shard_id in ray.get(directory.membership.remote(), timeout=10).shard_ids:
        assert time.monotonic() < deadline, "the directory never noticed the kill"
        time.sleep(0.1)


def node_of(resource: str) -> str:
    return ray.get(ray.remote(num_cpus=0, resources={resource: 0.01})(
        lambda: ray.get_runtime_context().get_node_id()).remote())


def relayed_polls_after_the_kill(config: UcmRayConfig, reader_node: str) -> dict[str, int]:
    """Per live shard's node, the engines' long polls it answered as its node's relay: the kill's
    version answers the reader's poll parked at its node's relay (waits up to 20 s for it)."""
    deadline = time.monotonic() + 20
    while True:
        relayed = {s["node_id"]: s["relayed_polls"] for s in fleet_status(config)["shards"]}
        if relayed.get(reader_node, 0) > 0 or time.monotonic() > deadline:
            return relayed
        time.sleep(0.2)


def reads_reported(config: UcmRayConfig, reader: Any, reference: Any, model: str, pool: tuple) -> dict[str, Any]:
    """The reader's loads from other nodes (``pick_by_load``) reach the directory: a push answers the
    reader's poll, its next step re-posts it with the bytes it loaded per pool (a generate), a
    second push answers its relay's poll, whose next one carries them; the directory then pushes
    the figure. Pushes are probe rows of the hot table naming ``pool``."""
    directory = ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace)
    ray.get(directory.add_hot_prefix.remote({b"ucm-ray-e2e-probe-0": (pool,)}), timeout=30)
    read_again(reader, reference, synthetic_prompt(model, 200, seed=31))
    ray.get(directory.add_hot_prefix.remote({b"ucm-ray-e2e-probe-1": (pool,)}), timeout=30)
    deadline = time.monotonic() + 20
    while True:
        state = ray.get(directory.ping.remote(), timeout=30)
        if state["load_figures"] or time.monotonic() > deadline:
            figures = ray.get(directory.membership.remote(), timeout=30)
            named = figures.pool_load.by_pool(figures.shards)
            return {"pools_reported": state["load_pools"],
                    "figures": {s.pool.node_id: named[s.key] for s in figures.shards if s.key in named}}
        time.sleep(0.2)


def pd_handoff(prefill: Any, decode: Any, reference: Any, prompt: list[int]) -> dict[str, Any]:
    """A PD proxy's two calls: the prefill (one token) returns before the step that saves its
    prompt, which it runs only once the decode was sent (as a serving engine would, at once);
    the decode's lookup may come first and ask again. What the decode's counters and vLLM's
    count of cached tokens say, beside the reference's tokens."""
    started = time.monotonic()
    before = ray.get(decode.connector_totals.remote())
    params = ray.get(prefill.generate_pd.remote(prompt, 1, {"do_remote_decode": True}, flush=False))
    pending = decode.generate_pd.remote(prompt, 8, params["kv_transfer_params"])
    ray.get(prefill.flush.remote())
    out = ray.get(pending)
    after = ray.get(decode.connector_totals.remote())
    delta = {part: {key: value - before[part].get(key, 0) for key, value in after[part].items()}
             for part in ("scheduler", "worker")}
    return {"announced": params["kv_transfer_params"]["ucm_ray"]["tokens"], "num_tokens": len(prompt),
            "tokens": out["tokens"], "cached": out["cached"],
            "reference": ray.get(reference.generate.remote(prompt, 8))["tokens"],
            "seconds": time.monotonic() - started, **delta}


def read_again(reader: Any, reference: Any, prompt: list[int]) -> dict[str, Any]:
    """The reader serves ``prompt`` with its own prefix cache emptied first (so its hit comes from
    the store): its tokens beside the reference's, and its connector's counters over the call."""
    ray.get(reader.reset_prefix_cache.remote())
    before = ray.get(reader.connector_totals.remote())
    out = ray.get(reader.generate.remote(prompt, 8))
    after = ray.get(reader.connector_totals.remote())
    delta = {part: {key: value - before[part].get(key, 0) for key, value in after[part].items()}
             for part in ("scheduler", "worker")}
    return {"tokens": out["tokens"], "cached": out["cached"],
            "reference": ray.get(reference.generate.remote(prompt, 8))["tokens"], **delta}


def main(address: str, model: str, document_tokens: int) -> None:
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    config = start_fleet_per_node(UcmRayConfig(ray_namespace="multinode", pool_bytes=128 << 20, shard_cpus=0,
                                               lookup_timeout_s=60, lease_s=120), 1)
    try:
        # copy_nodes_per_pool 1: three nodes may each hold a copy (the default, 10, copies only
        # past 10 nodes: below that copies cost hits where pools evict, docs/scaling.md)
        kv = kv_transfer_config({"ray_namespace": config.ray_namespace, "lookup_timeout_s": 60, "lease_s": 120,
                                 "copy_nodes_per_pool": 1, "relay_membership": True})
        writer, reader, reference = (engine_on("node_2", model, kv), engine_on("node_1", model, kv),
                                     engine_on("node_0", model, None))
        document = synthetic_prompt(model, document_tokens, seed=21)
        first = document + synthetic_prompt(model, 40, seed=22)
        second = document + synthetic_prompt(model, 40, seed=23)
        third = document + synthetic_prompt(model, 40, seed=24)
        ray.get(writer.generate.remote(first, 8))  # its commits are flushed before it returns
        answer = ray.get(reader.generate.remote(second, 8))
        expected = ray.get(reference.generate.remote(second, 8))
        totals = ray.get(reader.connector_totals.remote())
        handoff_prompt = synthetic_prompt(model, document_tokens + 40, seed=25)
        handoff = pd_handoff(writer, reader, reference, handoff_prompt)
        status = fleet_status(config)["shards"]
        shards = {s["shard_id"]: s["node_id"] for s in status}
        copies = [read_again(reader, reference, document + synthetic_prompt(model, 40, seed=seed))
                  for seed in (26, 27)]
        copied_entries = {s["node_id"]: s["entries"] for s in fleet_status(config)["shards"]}
        writer_node, reader_node = node_of("node_2"), node_of("node_1")
        reader_pool = next(s["shard_id"] for s in status if s["node_id"] == reader_node)
        live = ray.get(ray.get_actor(DIRECTORY_NAME, namespace=config.ray_namespace).membership.remote(), timeout=30)
        load = reads_reported(config, reader, reference, model,
                              next(s.key for s in live.shards if s.shard_id == reader_pool))
        kill_shard(config, next(s for s, node in shards.items() if node == writer_node))
        relayed = relayed_polls_after_the_kill(config, reader_node)
        after = read_again(reader, reference, third)
        after_pd = read_again(reader, reference, handoff_prompt)
        print(json.dumps({"shard_nodes": shards, "writer_node": writer_node, "reader_node": reader_node,
                          "entries": {s["node_id"]: s["entries"] for s in status},
                          "num_tokens": len(second), "tokens": answer["tokens"],
                          "cached": answer["cached"], "reference": expected["tokens"],
                          "hit_tokens": totals["scheduler"].get("hit_tokens", 0),
                          "lookups": totals["scheduler"].get("lookups", 0),
                          "lookup_calls": totals["scheduler"].get("lookup_calls", 0), "worker": totals["worker"],
                          "pd": handoff, "copies": copies, "copied_entries": copied_entries,
                          "after_kill": after, "after_kill_pd": after_pd, "relayed_polls": relayed,
                          "load": load}),
              flush=True)
    finally:
        stop_fleet(config)
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
