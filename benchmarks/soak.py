"""Soak: the Serve app under concurrent load while the tier is hurt, outputs checked throughout.

A local Ray cluster runs the app of ``deploy/serve/tiny-cpu.yaml`` (two engines sharing one
tier, replication 2 over 3 shards, small local KV caches so that most prefix hits come from the
tier) and a reference app without the connector. 16 client threads send a bounded mix of
documents and questions (heavy prefix sharing) through the OpenAI API; every answer is compared
with the reference's. Midway one shard is ``kill -9``ed and started again, and the directory
process is killed once (Ray restarts it). Prints requests done, failures, wrong answers, the
tier's hit rate before and after, memory per shard, leftover pool files, and last
``soak: failed=<n> wrong=<n> hit_rate_after_vs_before=<x>``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import glob
import logging
import os
import random
import shutil
import signal
import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("bench.soak")
ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "ucm_ray_soak"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def app_args(model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tier app's args (tiny-cpu.yaml's, with replication 2 and small local caches) and the
    reference app's (same engines, no connector)."""
    config = yaml.safe_load((ROOT / "deploy/serve/tiny-cpu.yaml").read_text())
    args = config["applications"][0]["args"]
    args["tier"].update(ray_namespace=NAMESPACE, shards_per_node=3, replication=2, pool_bytes="256MiB")
    for entry in args["llm_configs"]:
        entry["model_loading_config"]["model_source"] = model
        # ~6 documents' worth of local KV: the rest of the mix must come from the tier
        entry["engine_kwargs"].update(num_gpu_blocks_override=48, max_model_len=4096, max_num_batched_tokens=4096)
    reference = copy.deepcopy(args["llm_configs"][0])
    reference["model_loading_config"]["model_id"] = "tiny-ref"
    return args, {"llm_configs": [reference], "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}}


def scrape(port: int) -> dict[str, float]:
    """Sums of the vLLM prefix-cache counters Ray exports, over both tier engines."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("external_prefix_cache_hits", "prefix_cache_queries", "prefix_cache_hits"):
            if line.startswith(f"ray_vllm_{name}") and 'model_name="tiny-ref"' not in line:
                key = line.split("{", 1)[0].removesuffix("_total").removeprefix("ray_vllm_")
                if key == name:
                    sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


class Clients:
    """``threads`` clients sending requests from ``mix`` until ``count`` are done; tallies results."""

    def __init__(self, base: str, mix: list[list[int]], expected: list[list[int]], threads: int) -> None:
        from openai import OpenAI

        self._client = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)
        self._mix, self._expected, self._threads = mix, expected, threads
        self.done = self.failed = self.wrong = 0
        self._lock = threading.Lock()

    def one(self, rng: random.Random) -> None:
        i = rng.randrange(len(self._mix))
        model = rng.choice(["tiny-a", "tiny-b"])
        try:
            out = self._client.completions.create(model=model, prompt=self._mix[i], max_tokens=8, temperature=0,
                                                  extra_body={"return_token_ids": True})
            ok = list(out.choices[0].token_ids) == self._expected[i]
            with self._lock:
                self.done += 1
                self.wrong += 0 if ok else 1
        except Exception as e:  # noqa: BLE001 -- a failed request is what the soak counts
            log.warning("request failed: %s: %s", type(e).__name__, str(e)[:200])
            with self._lock:
                self.failed += 1

    def run(self, count: int, seed: int) -> None:
        with concurrent.futures.ThreadPoolExecutor(self._threads) as pool:
            rngs = [random.Random(seed * 1000 + k) for k in range(count)]
            for n, _ in enumerate(pool.map(self.one, rngs), 1):
                if n % 16 == 0:
                    log.info("%d/%d requests (failed %d, wrong %d)", n, count, self.failed, self.wrong)


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
    queries = after.get("prefix_cache_queries", 0) - before.get("prefix_cache_queries", 0)
    hits = after.get("external_prefix_cache_hits", 0) - before.get("external_prefix_cache_hits", 0)
    return hits / queries if queries else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64, help="requests per phase (before / after the faults)")
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
                      RAY_metrics_report_interval_ms="1000")
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    from ucm_ray.config import UcmRayConfig
    from ucm_ray.serve import build_app
    from ucm_ray.serve.app import Tier
    from ucm_ray.store.shard.fleet import fleet_status, start_fleet_per_node, stop_fleet
    from ucm_ray.store.types import DIRECTORY_NAME
    from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

    model = str(make_tiny_model(ROOT / ".models" / "tiny"))
    tier_args, reference_args = app_args(model)
    metrics_port, http_port = free_port(), free_port()
    ray_temp_dir = tempfile.mkdtemp(prefix="ucms-", dir="/tmp")
    ray.init(num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             log_to_driver=False, _metrics_export_port=metrics_port,
             _temp_dir=ray_temp_dir)
    tier = Tier.from_dict(tier_args["tier"])
    config = UcmRayConfig.from_dict({**tier.config.to_dict(), "num_shards": 3})
    try:
        log.info("[1/5] starting the tier app (2 engines) and the reference app on 127.0.0.1:%d", http_port)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(build_app(tier_args), name="soak", route_prefix="/", blocking=False)
        serve.run(build_openai_app(reference_args), name="reference", route_prefix="/ref", blocking=False)
        base = f"http://127.0.0.1:{http_port}"
        documents = [synthetic_prompt(model, 1024, seed=300 + d) for d in range(8)]
        mix = [doc + synthetic_prompt(model, 24, seed=400 + 10 * d + q) for d, doc in enumerate(documents)
               for q in range(3)]
        log.info("[2/5] %d prompts through the reference app", len(mix))
        from openai import OpenAI

        ref = OpenAI(base_url=f"{base}/ref/v1", api_key="none", timeout=300)
        expected = [list(ref.completions.create(model="tiny-ref", prompt=p, max_tokens=8, temperature=0,
                                                extra_body={"return_token_ids": True}).choices[0].token_ids)
                    for p in mix]
        clients = Clients(base, mix, expected, args.clients)
        start = scrape(metrics_port)
        log.info("[3/5] %d requests from %d clients, tier healthy", args.requests, args.clients)
        clients.run(args.requests, seed=1)
        time.sleep(3)  # Ray's metrics export interval
        middle = scrape(metrics_port)
        log.info("[4/5] faults: kill -9 a shard and start it again, kill the directory; then %d requests",
                 args.requests)
        status = fleet_status(config)
        victim = status["shards"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        directory_pid = ray.get(ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE).ping.remote())["pid"]
        faults = threading.Thread(target=clients.run, args=(args.requests, 2))
        faults.start()
        time.sleep(2)
        start_fleet_per_node(tier.config, tier.shards_per_node or 1)  # the shard again, new incarnation
        os.kill(directory_pid, signal.SIGKILL)
        faults.join()
        time.sleep(3)
        end = scrape(metrics_port)
        log.info("[5/5] figures")
        before, after = hit_rate(start, middle), hit_rate(middle, end)
        shards = fleet_status(config)["shards"]
        print(f"requests done {clients.done}, failed {clients.failed}, wrong {clients.wrong}")
        print(f"tier hit rate (external hits / prefix queries): before {before:.3f}, after {after:.3f}")
        for s in shards:
            print(f"shard {s.get('shard_id')}: {s.get('used_bytes', 0) / 2**20:.1f} MiB used of "
                  f"{s.get('capacity_bytes', 0) / 2**20:.0f}, {s.get('entries', 0)} entries")
    finally:
        serve.shutdown()
        stop_fleet(config)
        ray.shutdown()
    shutil.rmtree(ray_temp_dir, ignore_errors=True)  # its Ray logs (~13 MB): kept when the run failed
    time.sleep(2)
    left = glob.glob(f"/dev/shm/ucmray-{NAMESPACE}-*")
    print(f"leftover pool files: {len(left)}")
    ratio = after / before if before else 0.0
    print(f"soak: failed={clients.failed} wrong={clients.wrong} hit_rate_after_vs_before={ratio:.3f}")


if __name__ == "__main__":
    main()
