"""The Serve app builder's checks (before anything starts) and the fleet it places: bad
``tier:`` values and a foreign ``kv_transfer_config`` are one line naming the problem; the
GPU example parses and builds; a fleet placed per node is found again by name, and one that
cannot start leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import ray
import yaml

from tests.support import ROOT
from ucm_ray.config import ConfigError, UcmRayConfig
from ucm_ray.serve import prepare_app
from ucm_ray.serve.app import CONNECTOR
from ucm_ray.serve.check import load_serve_config
from ucm_ray.store.shard.fleet import FleetStartError, fleet_actor_names, start_fleet, start_fleet_per_node, stop_fleet

ENGINE = {"model_loading_config": {"model_id": "m", "model_source": "/models/m"},
          "placement_group_config": {"bundles": [{"CPU": 1}]}}


def args(tier=None, **engine_kwargs) -> dict:
    return {"tier": tier if tier is not None else {}, "llm_configs": [{**ENGINE, "engine_kwargs": engine_kwargs}]}


@pytest.mark.parametrize("tier, key", [
    ({"pool_bytes": -1}, "pool_bytes"),
    ({"pool_bytes": "lots"}, "pool_bytes"),
    ({"shards_per_node": 0}, "shards_per_node"),
    ({"shards_per_node": "two"}, "shards_per_node"),
    ({"num_shards": 2, "shards_per_node": 1}, "tier: give num_shards"),
    ({"transport": "tcp"}, "transport"),
    ({"replication": 0}, "replication"),
    ({"pool_size": "1GiB"}, "unknown key(s) pool_size"),
    ("1GiB", "tier: expected a mapping"),
])
def test_bad_tier_is_one_line_naming_the_key(tier, key):
    with pytest.raises(ConfigError) as error:
        prepare_app(args(tier))
    message = str(error.value)
    assert key in message and "\n" not in message


def test_foreign_kv_transfer_config_is_refused():
    foreign = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    with pytest.raises(ConfigError, match=r"names kv_connector 'LMCacheConnectorV1'; this app runs UcmRayConnector"):
        prepare_app(args(kv_transfer_config=foreign))
    with pytest.raises(ConfigError, match=r"kv_load_failure_policy 'fail' is not allowed"):
        prepare_app(args(kv_transfer_config={"kv_connector": CONNECTOR, "kv_load_failure_policy": "fail"}))
    with pytest.raises(ConfigError, match=r"lookup_timeout_s"):
        prepare_app(args(kv_transfer_config={"kv_connector": CONNECTOR,
                                             "kv_connector_extra_config": {"lookup_timeout_s": "soon"}}))


def test_user_kv_transfer_config_wins_over_the_tier():
    mine = {"kv_connector": CONNECTOR, "kv_connector_extra_config": {"lookup_timeout_s": 7}}
    serving, tier = prepare_app(args({"lookup_timeout_s": 3, "pool_bytes": "1GiB"}, kv_transfer_config=mine))
    extra = serving["llm_configs"][0]["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["lookup_timeout_s"] == 7 and extra["pool_bytes"] == 1 << 30
    assert tier.config.lookup_timeout_s == 3


def test_engines_get_the_connector_and_a_fixed_hash_seed():
    serving, tier = prepare_app(args({"ray_namespace": "abc", "replication": 2, "shards_per_node": 2},
                                     block_size=16))
    entry = serving["llm_configs"][0]
    kv = entry["engine_kwargs"]["kv_transfer_config"]
    assert kv["kv_connector"] == CONNECTOR and kv["kv_load_failure_policy"] == "recompute"
    assert UcmRayConfig.from_dict(kv["kv_connector_extra_config"]) == tier.config
    assert tier.config.ray_namespace == "abc" and tier.shards_per_node == 2
    assert entry["engine_kwargs"]["block_size"] == 16 and entry["engine_kwargs"]["enable_prefix_caching"] is True
    assert entry["runtime_env"]["env_vars"]["PYTHONHASHSEED"] == "0"
    mine = {**args(), "llm_configs": [{**ENGINE, "runtime_env": {"env_vars": {"PYTHONHASHSEED": "42"}}}]}
    assert prepare_app(mine)[0]["llm_configs"][0]["runtime_env"]["env_vars"]["PYTHONHASHSEED"] == "42"


def test_engines_keep_vllms_scheduling_and_get_the_v1_model_runner_unless_the_user_set_them():
    """The connector loads asynchronously under vLLM's asynchronous scheduling, so the builder
    leaves scheduling to vLLM's default or the user's; it refuses vLLM's V2 model runner, so the
    builder sets the V1 runner unless the user set one (then the connector decides)."""
    entry = prepare_app(args())[0]["llm_configs"][0]
    assert "async_scheduling" not in entry["engine_kwargs"]
    assert entry["runtime_env"]["env_vars"] == {"VLLM_USE_V2_MODEL_RUNNER": "0", "PYTHONHASHSEED": "0"}
    mine = args(async_scheduling=False)
    mine["llm_configs"][0]["runtime_env"] = {"env_vars": {"VLLM_USE_V2_MODEL_RUNNER": "1"}}
    entry = prepare_app(mine)[0]["llm_configs"][0]
    assert entry["engine_kwargs"]["async_scheduling"] is False
    assert entry["runtime_env"]["env_vars"] == {"VLLM_USE_V2_MODEL_RUNNER": "1", "PYTHONHASHSEED": "0"}


def test_gpu_example_parses_and_builds(ray_cluster):
    from ray.serve.llm import build_openai_app

    config = load_serve_config(ROOT / "deploy/serve/gpu-example.yaml")
    serving, tier = prepare_app(config["applications"][0]["args"])
    assert tier.shards_per_node == 1 and tier.config.pool_bytes == 64 << 30
    entry = serving["llm_configs"][0]
    assert entry["engine_kwargs"]["tensor_parallel_size"] == 2
    assert entry["engine_kwargs"]["kv_transfer_config"]["kv_connector"] == CONNECTOR
    assert entry["deployment_config"]["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 8,
                                                                "target_ongoing_requests": 16}
    app = build_openai_app(serving)
    assert type(app).__name__ == "Application"


def test_ucm_ray_serve_refuses_a_bad_file_in_one_line(tmp_path):
    config = yaml.safe_load((ROOT / "deploy/serve/tiny-cpu.yaml").read_text())
    config["applications"][0]["args"]["tier"]["pool_bytes"] = "-5GiB"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "ucm_ray.cli", "serve", str(bad)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("ucm-ray:")]
    assert len(errors) == 1 and "pool_bytes" in errors[0], done.stderr[-2000:]


def test_per_node_fleet_is_found_again_by_name(ray_cluster):
    cfg = UcmRayConfig(ray_namespace=f"pn{uuid.uuid4().hex[:6]}", pool_bytes=16 << 20, shard_cpus=0, transport="shm")
    try:
        sized = start_fleet_per_node(cfg, 2)
        names = fleet_actor_names(cfg.ray_namespace)
        pids = {n: ray.get(ray.get_actor(n, namespace=cfg.ray_namespace).stats.remote())["pid"]
                for n in names if n.startswith("ucm_ray_shard_")}
        node = ray.get_runtime_context().get_node_id()
        assert sized.num_shards == 2 and sorted(pids) == [f"ucm_ray_shard_{node[:12]}_{k}" for k in range(2)]
        assert start_fleet_per_node(cfg, 2) == sized  # a second app, or the same app restarted
        assert {n: ray.get(ray.get_actor(n, namespace=cfg.ray_namespace).stats.remote())["pid"]
                for n in pids} == pids
        with pytest.raises(ConfigError, match="replication"):
            start_fleet_per_node(UcmRayConfig(**{**cfg.to_dict(), "num_shards": 3, "replication": 3}), 1)
    finally:
        assert stop_fleet(cfg) == 2
    assert fleet_actor_names(cfg.ray_namespace) == []


def test_fleet_that_cannot_start_leaves_nothing_behind(ray_cluster):
    cfg = UcmRayConfig(ray_namespace=f"hs{uuid.uuid4().hex[:6]}", pool_bytes=16 << 20, num_shards=2,
                       shard_cpus=512)  # no node has that many CPUs: the shards never get placed
    with pytest.raises(FleetStartError, match=r"shard ucm_ray_shard_0 did not start: GetTimeoutError"):
        start_fleet(cfg, timeout_s=3)
    assert fleet_actor_names(cfg.ray_namespace) == []
    too_big = UcmRayConfig(ray_namespace=cfg.ray_namespace, pool_bytes=8 << 40, num_shards=2)
    with pytest.raises(ConfigError, match=r"pool_bytes: 2 pools of 8 TiB do not fit"):
        start_fleet(too_big)
    assert fleet_actor_names(cfg.ray_namespace) == []
