"""The disk tier on the engine's metrics, as an operator scrapes them: vLLM's own OpenAI server
(its ``/metrics`` on loopback) in front of a one-shard fleet started with ``ucm-ray up`` whose pool
holds six blocks and whose disk tier writes every commit through. Three prompts push the first
one's blocks out of the pool (onto disk); vLLM's own prefix cache is reset (the server's dev
endpoint) and the first prompt asked again: the shard promotes its blocks and the engine loads
them. Scraped: ``vllm:ucm_ray_disk_hit_blocks`` / ``_disk_promoted_entries`` / ``_disk_promoted_bytes``
are those blocks, equal to what ``ucm-ray status --json`` says the shard promoted, and every
engine-side disk metric the Grafana dashboard charts is one vLLM exports.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from tests.e2e.test_e2e_disk_tier import block_bytes
from tests.e2e.test_metrics import (
    BLOCK,
    cli,
    http_json,
    scrape,
    start_server,
    stop_server,
    total,
    wait_server_up,
    wait_until,
)
from tests.support.private_cluster import PrivateCluster, free_port
from tests.support.prometheus import DASHBOARD, as_ray_name, dashboard_exprs, promql_metric_names
from ucm_ray import policy
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

pytestmark = pytest.mark.e2e
BLOCKS = 4
PROMPT = BLOCKS * BLOCK
SUFFIX = 40


def test_disk_hits_on_vllms_metrics_endpoint(tmp_path):
    started = time.monotonic()
    model = str(make_tiny_model(tmp_path / "tiny"))
    cluster = PrivateCluster([{"num_cpus": 3}])
    port = free_port()
    namespace = f"dm{uuid.uuid4().hex[:6]}"
    disk = tmp_path / "disk"
    disk.mkdir()
    fleet_file = tmp_path / "fleet.yaml"
    entry = block_bytes(model)
    # a pool of 6 blocks (and slack for alignment): prompts 2 and 3 (8 blocks) push prompt 1 out
    fleet_file.write_text(f"num_shards: 1\npool_bytes: {6 * entry + (64 << 10)}\nray_namespace: {namespace}\n"
                          f"transport: shm\nshard_cpus: 0\ndisk_dir: {disk}\ndisk_bytes: {64 * entry}\n"
                          "disk_write_policy: through\ndisk_wait_s: 10\nlookup_timeout_s: 60\n")
    tier = {"ray_namespace": namespace, "ray_address": cluster.address, "transport": "shm",
            "lookup_timeout_s": 60, "lease_s": 120}
    kv = {"kv_connector": "UcmRayConnector", "kv_connector_module_path": "ucm_ray.vllm.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": tier}
    server = None
    try:
        up = cli("up", "--address", cluster.address, "--config", str(fleet_file))
        assert up.returncode == 0, up.stderr[-3000:]
        log = tmp_path / "api_server.log"
        server = start_server(model, port, kv, log, "tiny", "--max-model-len", "4096", "--max-num-seqs", "4",
                              env={"VLLM_SERVER_DEV_MODE": "1"})
        base = f"http://127.0.0.1:{port}"
        wait_server_up(server, log, base)
        print(f"disk metrics: server up {time.monotonic() - started:.0f} s in", flush=True)

        def ask(prompt: list[int]) -> None:
            http_json(f"{base}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                 "temperature": 0})

        def shard() -> dict:
            status = cli("status", "--address", cluster.address, "--config", str(fleet_file), "--json")
            assert status.returncode == 0, status.stderr[-3000:]
            return json.loads(status.stdout)["shards"][0]

        p1, p2, p3 = (synthetic_prompt(model, PROMPT + SUFFIX, seed=s) for s in (81, 82, 83))
        for prompt in (p1, p2, p3):  # cold: computed and saved; p2 and p3 push p1 out of the pool
            ask(prompt)
        wait_until(lambda: (lambda s: (not s["disk_behind"] and s["disk_entries"] == 3 * BLOCKS, s))(shard()),
                   "the three prompts written through to disk")
        before = shard()
        assert before["evictions"] >= BLOCKS and before["disk_promoted"] == 0, before
        http_json(f"{base}/reset_prefix_cache", {})  # vLLM's own cache forgets p1: the tier must serve it
        ask(p1)  # its blocks come from the shard's disk
        after = shard()
        assert after["disk_promoted"] == BLOCKS and after["disk_corrupt"] == 0, after

        want = {"disk_hit_blocks": BLOCKS, "disk_promoted_entries": BLOCKS, "disk_promoted_bytes": BLOCKS * entry}

        scraped: list = []

        def settled():
            scraped[:] = scrape(f"{base}/metrics")
            seen = {name: total(scraped, f"vllm:ucm_ray_{name}_total") for name in want}
            return seen == want, seen
        seen = wait_until(settled, "the engine's disk counters on vLLM's /metrics")
        samples = list(scraped)
        hit = policy.dense_external_hit(PROMPT + SUFFIX, 0, PROMPT, policy.recompute_tokens(True))
        assert total(samples, "vllm:ucm_ray_hit_tokens_total") == hit
        assert total(samples, "vllm:ucm_ray_load_blocks_total") == total(samples, "vllm:ucm_ray_loaded_blocks_total")
        assert total(samples, "vllm:ucm_ray_loaded_bytes_total", transport="shm") == BLOCKS * entry
        # every engine-side disk metric the dashboard charts is one this endpoint exports
        charted = set().union(*(promql_metric_names(e) for e in dashboard_exprs(json.loads(DASHBOARD.read_text()))))
        engine_disk = {n for n in charted if n.startswith("ray_vllm_ucm_ray_disk_")}
        exported = {as_ray_name(n) for n, _, _ in samples}
        assert engine_disk and engine_disk <= exported, sorted(engine_disk - exported)
        print(f"disk metrics: {seen}, done {time.monotonic() - started:.0f} s in", flush=True)
    finally:
        if server is not None:
            stop_server(server)
        cli("down", "--address", cluster.address, "--config", str(fleet_file), "--purge-disk")
        cluster.close()
