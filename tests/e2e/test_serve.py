"""The Serve launch as a user runs it: ``ucm-ray serve deploy/serve/tiny-cpu.yaml`` (which
checks the file, then hands it to ``serve run``) against a private Ray cluster, queried with
the ``openai`` client on 127.0.0.1. A document with a question goes to the first model, which
computes it cold (nothing is stored yet: a miss, read as zero hits from vLLM's counter); the
same prompt to the second model: its external hit, read from vLLM's own Prometheus counter as
Ray exports it, is the policy's prediction, and its greedy tokens equal the first model's cold
ones. (An engine without the connector as the reference, a third engine on this 2-core box,
took ~70 s more of the slowest test in CI; the dense e2e tests compare against one.) Ctrl-C
then stops it and no pool file is left once the cluster is gone."""

from __future__ import annotations

import time
import uuid

import pytest
import yaml
from openai import OpenAI

from tests.support import ROOT
from tests.support.private_cluster import PrivateCluster, free_port
from tests.support.serve_run import pools_left, scrape, start_serve, stop_serve, wait_metric, wait_ready
from ucm_ray import policy
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

BLOCK = 128
DOCUMENT, QUESTION = 2000, 40


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def serve_config(model: str, port: int, ray_namespace: str) -> dict:
    """deploy/serve/tiny-cpu.yaml with this test's port, namespace and model."""
    config = yaml.safe_load((ROOT / "deploy/serve/tiny-cpu.yaml").read_text())
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["args"]["tier"]["ray_namespace"] = ray_namespace
    for entry in app["args"]["llm_configs"]:
        entry["model_loading_config"]["model_source"] = model
    return config


def complete(base_url: str, model: str, prompt: list[int]) -> list[int]:
    client = OpenAI(base_url=base_url, api_key="none", timeout=120)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True})
    return list(out.choices[0].token_ids)


def test_serve_app_shares_one_tier_between_two_models(model, tmp_path):
    cluster = PrivateCluster([{"num_cpus": 3}])
    port, namespace = free_port(), f"srv{uuid.uuid4().hex[:6]}"
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(serve_config(model, port, namespace)))
    log = tmp_path / "serve.log"
    started = time.monotonic()
    serve = start_serve(config_file, cluster, log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{base}/v1", {"tiny-a", "tiny-b"}, serve, log, timeout_s=420)
        prompt = synthetic_prompt(model, DOCUMENT, seed=11) + synthetic_prompt(model, QUESTION, seed=12)
        cold = complete(f"{base}/v1", "tiny-a", prompt)
        print(f"serve: first answer {time.monotonic() - started:.0f} s after `ucm-ray serve`", flush=True)
        time.sleep(1.0)  # A's commits reach the shards right after its steps; users' requests are this far apart
        tokens = complete(f"{base}/v1", "tiny-b", prompt)
        metrics = cluster.info["metrics_ports"][0]
        stored = DOCUMENT // BLOCK * BLOCK  # A saved the prompt's full blocks
        expected = policy.dense_external_hit(len(prompt), 0, stored, policy.recompute_tokens(True))
        assert expected == stored
        asked = time.monotonic()
        hits = wait_metric(metrics, "ray_vllm_external_prefix_cache_hits", "tiny-b", expected)
        print(f"serve: tiny-b's hits exported {time.monotonic() - asked:.0f} s after its answer", flush=True)
        assert hits == expected, f"tiny-b's external prefix-cache hits {hits}, policy says {expected}"
        # A's answer was cold. vLLM's Ray counters skip an increment of 0, so A has no hits series
        # at all; its queries series, recorded in the same call, says A's counters are exported and
        # its connector was asked about the whole prompt, so the hits' absence means none.
        queries = wait_metric(metrics, "ray_vllm_external_prefix_cache_queries", "tiny-a", len(prompt))
        assert queries == len(prompt), f"tiny-a's external prefix-cache queries {queries}, expected {len(prompt)}"
        cold_hits = scrape(metrics, "ray_vllm_external_prefix_cache_hits", "tiny-a")
        assert cold_hits in (None, 0), f"tiny-a's external prefix-cache hits {cold_hits}: its prompt was new"
        assert tokens == cold, "tiny-b's tokens from the stored prefix differ from tiny-a's cold ones"
    finally:
        killed, stopped_s = stop_serve(serve)
        print(f"serve: stopped {stopped_s:.0f} s after Ctrl-C", flush=True)
        cluster.close()
    assert not killed, f"`ucm-ray serve` ignored SIGINT: killed after {stopped_s:.0f} s"
    assert pools_left(namespace) == [], "shard pools outlived the app and its cluster"
