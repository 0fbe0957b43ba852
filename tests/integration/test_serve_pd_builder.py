"""The PD app builder's checks (before anything starts): both engines get the connector as
``kv_both``; prefill and decode configs that would store under different namespaces are one
line naming the setting and both values; Ray's own PD schema still runs over the result; and
``ucm-ray serve`` checks PD files with the same code."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from tests.support import ROOT
from ucm_ray.config import ConfigError
from ucm_ray.serve import prepare_pd_app
from ucm_ray.serve.app import CONNECTOR
from ucm_ray.serve.check import check_serve_config, load_serve_config

ENGINE = {"model_loading_config": {"model_id": "m", "model_source": "/models/m"},
          "engine_kwargs": {"dtype": "float32", "block_size": 16},
          "placement_group_config": {"bundles": [{"CPU": 1}]}}


def pd_args(prefill=None, decode=None, tier=None) -> dict:
    return {"tier": tier or {}, "prefill_config": prefill or copy.deepcopy(ENGINE),
            "decode_config": decode or copy.deepcopy(ENGINE)}


def with_kwargs(**engine_kwargs) -> dict:
    engine = copy.deepcopy(ENGINE)
    engine["engine_kwargs"].update(engine_kwargs)
    return engine


def test_both_engines_get_the_connector_as_kv_both():
    serving, tier = prepare_pd_app(pd_args(tier={"ray_namespace": "pd", "pd_wait_s": 3}))
    for role in ("prefill_config", "decode_config"):
        entry = serving[role]
        kv = entry["engine_kwargs"]["kv_transfer_config"]
        assert kv["kv_connector"] == CONNECTOR and kv["kv_role"] == "kv_both", role
        assert kv["kv_connector_extra_config"]["pd_wait_s"] == 3 and tier.config.pd_wait_s == 3
        assert entry["runtime_env"]["env_vars"]["PYTHONHASHSEED"] == "0"
        assert entry["engine_kwargs"]["enable_prefix_caching"] is True


@pytest.mark.parametrize("field, prefill, decode, shown", [
    ("dtype", {"dtype": "float32"}, {"dtype": "bfloat16"}, "'float32' for the prefill, 'bfloat16' for the decode"),
    ("block_size", {}, {"block_size": 32}, "16 for the prefill, 32 for the decode"),
    ("tensor_parallel_size", {"tensor_parallel_size": 2}, {}, "2 for the prefill, 1 for the decode"),
    ("kv_cache_dtype", {}, {"kv_cache_dtype": "fp8"}, "'auto' for the prefill, 'fp8' for the decode"),
    ("revision", {"revision": "v1"}, {"revision": "v2"}, "'v1' for the prefill, 'v2' for the decode"),
    ("draft model", {"speculative_config": {"model": "/models/draft", "num_speculative_tokens": 2}}, {},
     "'/models/draft' for the prefill, '' for the decode"),
    ("tier namespace", {"kv_transfer_config": {"kv_connector": CONNECTOR,
                                               "kv_connector_extra_config": {"namespace": "other"}}}, {},
     "'other' for the prefill, 'ucm' for the decode"),
])
def test_different_namespaces_are_one_line_naming_the_field(field, prefill, decode, shown):
    with pytest.raises(ValueError) as error:
        prepare_pd_app(pd_args(with_kwargs(**prefill), with_kwargs(**decode)))
    message = str(error.value)
    assert "\n" not in message and f"{field} is {shown}" in message, message


def test_same_weights_from_two_paths_share_with_a_model_id():
    decode = copy.deepcopy(ENGINE)
    decode["model_loading_config"]["model_source"] = "/mnt/other/m"
    with pytest.raises(ConfigError, match=r"model is '/models/m' for the prefill, '/mnt/other/m' for the decode"):
        prepare_pd_app(pd_args(decode=decode))
    serving, _ = prepare_pd_app(pd_args(decode=decode, tier={"model_id": "org/m"}))
    assert serving["decode_config"]["model_loading_config"]["model_source"] == "/mnt/other/m"


def test_ray_schema_and_missing_roles_are_one_line():
    with pytest.raises(ConfigError, match=r"^decode_config: missing"):
        prepare_pd_app({"tier": {}, "prefill_config": ENGINE})
    decode = copy.deepcopy(ENGINE)
    decode["model_loading_config"]["model_id"] = "other"  # Ray's own rule: one model id for both
    with pytest.raises(ConfigError) as error:
        prepare_pd_app(pd_args(decode=decode))
    assert "P/D model id mismatch" in str(error.value) and "\n" not in str(error.value)


def test_ucm_ray_serve_checks_pd_files(tmp_path):
    config = {"applications": [{"name": "pd", "route_prefix": "/", "import_path": "ucm_ray.serve:build_pd_app",
                                "args": pd_args()}], "http_options": {"port": 8123}}
    good = tmp_path / "pd.yaml"
    good.write_text(yaml.safe_dump(config))
    assert check_serve_config(good) == "http://127.0.0.1:8123"
    config["applications"][0]["args"]["decode_config"]["engine_kwargs"]["dtype"] = "float16"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "ucm_ray.cli", "serve", str(bad)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("ucm-ray:")]
    assert len(errors) == 1 and "dtype is 'float32' for the prefill, 'float16' for the decode" in errors[0], \
        done.stderr[-2000:]


def test_gpu_pd_example_parses_and_builds(ray_cluster):
    from ray.serve.llm import build_pd_openai_app

    config = load_serve_config(ROOT / "deploy/serve/gpu-pd-example.yaml")
    serving, tier = prepare_pd_app(config["applications"][0]["args"])
    assert tier.shards_per_node == 1 and tier.config.pool_bytes == 64 << 30
    replicas = {}
    for role in ("prefill_config", "decode_config"):
        entry = serving[role]
        assert entry["engine_kwargs"]["tensor_parallel_size"] == 2
        assert entry["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_both"
        autoscaling = entry["deployment_config"]["autoscaling_config"]
        replicas[role] = (autoscaling["min_replicas"], autoscaling["max_replicas"])
    assert replicas == {"prefill_config": (2, 6), "decode_config": (2, 8)}
    app = build_pd_openai_app(serving)
    assert type(app).__name__ == "Application"


def test_tiny_cpu_pd_file_passes_the_check():
    assert check_serve_config(ROOT / "deploy/serve/tiny-cpu-pd.yaml") == "http://127.0.0.1:8000"
