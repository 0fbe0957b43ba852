"""The Helm chart's serveConfigV2 loads and builds the way `serve run` would: Serve's schema, the
builder's checks and Ray Serve LLM's app (which needs a Ray cluster; the chart's other checks are
unit tests in ``tests/unit/test_helm_chart.py``)."""

from __future__ import annotations

import pytest

from tests.support.helm_tools import VALUES, group_values, one, render, serve_app
from ucm_ray.serve import prepare_app
from ucm_ray.serve.check import PD_BUILDER
from ucm_ray.serve.pd import prepare_pd_app


@pytest.mark.parametrize("name", list(VALUES))
def test_serve_config_loads_and_builds(name, ray_cluster, tmp_path):
    from ray.serve.llm import build_openai_app

    objects = render(*VALUES[name])
    values = group_values(name)
    app = serve_app(one(objects, "RayService"), tmp_path)
    model = values["model"]
    if app["import_path"] == PD_BUILDER:  # serve.mode pd: the same checks on each role, and Ray's PD app
        from ray.serve.llm import build_pd_openai_app

        serving, tier = prepare_pd_app(app["args"])
        roles = {"prefill_config": model["prefillAutoscaling"], "decode_config": model["autoscaling"]}
        for role, scaling in roles.items():
            _check_entry(serving[role], model, scaling)
        assert tier.shards_per_node == values["tier"]["shards_per_node"]
        assert type(build_pd_openai_app(serving)).__name__ == "Application"
        return
    serving, tier = prepare_app(app["args"])
    (entry,) = serving["llm_configs"]
    _check_entry(entry, model, model["autoscaling"])
    assert tier.shards_per_node == values["tier"]["shards_per_node"]
    assert tier.config.replication == values["tier"].get("replication", 1)
    assert type(build_openai_app(serving)).__name__ == "Application"


def _check_entry(entry: dict, model: dict, scaling: dict) -> None:
    assert entry["model_loading_config"] == {"model_id": model["id"], "model_source": model["source"]}
    assert entry["engine_kwargs"]["tensor_parallel_size"] == model["tensorParallelSize"]
    assert entry["engine_kwargs"]["kv_transfer_config"]["kv_connector"] == "UcmRayConnector"
    assert entry["runtime_env"]["env_vars"]["PYTHONHASHSEED"] == "0"
    assert entry["placement_group_config"]["strategy"] == "STRICT_PACK"
    assert len(entry["placement_group_config"]["bundles"]) == model["tensorParallelSize"]
    rendered = entry["deployment_config"]["autoscaling_config"]
    assert (rendered["min_replicas"], rendered["max_replicas"]) == (scaling["minReplicas"], scaling["maxReplicas"])
