"""Prefill/decode through the tier, launched as a user does: ``ucm-ray serve
deploy/serve/tiny-cpu-pd.yaml`` against a private Ray cluster, queried with the ``openai`` client.
A ~2,000-token prompt on a cold tier goes through Ray's PD proxy: the prefill engine computes
it (one token) and saves its blocks; the decode engine, handed the prefill's params with no
pause between the two, waits for those blocks and loads them. Its cached prompt tokens, read
from vLLM's own ``usage.prompt_tokens_details.cached_tokens``, are the hit policy's prediction,
and its greedy tokens equal an engine's without the connector. Ctrl-C then stops it and no
pool file is left once the cluster is gone."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from openai import OpenAI

from tests.support import ROOT
from tests.support.private_cluster import PrivateCluster, cluster_env, free_port
from tests.support.serve_run import pools_left, scrape, start_serve, stop_serve, wait_metric, wait_ready
from ucm_ray import policy
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt

pytestmark = pytest.mark.e2e
log = logging.getLogger(__name__)

BLOCK = 128
DOCUMENT, QUESTION = 2000, 40
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def pd_config(model: str, port: int, ray_namespace: str) -> dict:
    """deploy/serve/tiny-cpu-pd.yaml with this test's port, namespace and model."""
    config = yaml.safe_load((ROOT / "deploy/serve/tiny-cpu-pd.yaml").read_text())
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["args"]["tier"]["ray_namespace"] = ray_namespace
    for role in ("prefill_config", "decode_config"):
        app["args"][role]["model_loading_config"]["model_source"] = model
    return config


def start_reference(model: str, prompt: list[int], prompt_file: Path) -> subprocess.Popen:
    """An engine without the connector, computing the greedy tokens while the app starts."""
    prompt_file.write_text(json.dumps(prompt))
    return subprocess.Popen([sys.executable, "-m", "tests.support.reference_engine", model, str(prompt_file),
                             str(MAX_TOKENS)], cwd=ROOT, env=cluster_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)


def test_pd_app_decode_loads_the_prefills_blocks_without_a_pause(model, tmp_path):
    cluster = PrivateCluster([{"num_cpus": 2}])
    port, namespace = free_port(), f"pd{uuid.uuid4().hex[:6]}"
    config_file = tmp_path / "serve-pd.yaml"
    config_file.write_text(yaml.safe_dump(pd_config(model, port, namespace)))
    serve_log = tmp_path / "serve.log"
    prompt = synthetic_prompt(model, DOCUMENT, seed=21) + synthetic_prompt(model, QUESTION, seed=22)
    reference = start_reference(model, prompt, tmp_path / "prompt.json")
    started = time.monotonic()
    serve = start_serve(config_file, cluster, serve_log)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_ready(base, {"tiny"}, serve, serve_log, timeout_s=420)
        listed = time.monotonic()
        # Ray's ingress lists the model before the engines are up: the request waits for them
        out = OpenAI(base_url=base, api_key="none", timeout=120).completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True})
        log.info("model listed %.0f s after `ucm-ray serve`, answered %.0f s later", listed - started,
                 time.monotonic() - listed)
        stored = len(prompt) // BLOCK * BLOCK  # the prefill saved the prompt's full blocks
        expected = policy.dense_external_hit(len(prompt), 0, stored, policy.recompute_tokens(True))
        assert expected == stored
        details = out.usage.prompt_tokens_details if out.usage else None
        cached = details.cached_tokens if details else None
        log.info("decode's cached prompt tokens %s, policy's prediction %d", cached, expected)
        assert cached == expected, f"the decode's cached prompt tokens {cached}, the policy says {expected}"
        # Ray's PD proxy carried the prefill's announcement to the decode (our counter, read from
        # Ray's export of the decode engine's stats), and the decode did not give up waiting
        metrics = cluster.info["metrics_ports"][0]
        handoffs = wait_metric(metrics, "ray_vllm_ucm_ray_handoffs", "tiny", 1)
        assert handoffs == 1, f"decode requests with a prefill's announcement: {handoffs}, expected 1"
        timeouts = scrape(metrics, "ray_vllm_ucm_ray_handoff_timeouts", "tiny")
        assert timeouts in (None, 0), f"the decode waited pd_wait_s in vain {timeouts} time(s)"
        stdout, _ = reference.communicate(timeout=300)
        assert reference.returncode == 0, "the reference engine failed"
        assert list(out.choices[0].token_ids) == json.loads(stdout.splitlines()[-1]), \
            "the PD app's greedy tokens differ from an engine's without the connector"
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
        killed, stopped_s = stop_serve(serve)
        log.info("stopped %.0f s after Ctrl-C", stopped_s)
        cluster.close()
    assert not killed, f"`ucm-ray serve` ignored SIGINT: killed after {stopped_s:.0f} s"
    assert pools_left(namespace) == [], "shard pools outlived the app and its cluster"
