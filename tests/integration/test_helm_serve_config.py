"""The Helm chart's serveConfigV2 loads and builds the way `serve run` would: Serve's schema, the
builder's checks and Ray Serve LLM's app (which needs a Ray cluster; the chart's other checks are
unit tests in ``tests/unit/test_helm_chart.py``)."""

from __future__ import annotations

import pytest

from tests.support.helm_tools import VALUES, group_values, one, render, serve_app
from ucm_ray.serve import prepare_app


@pytest.mark.parametrize("name", list(VALUES))
def test_serve_config_loads_and_builds(name, ray_cluster, tmp_path):
    from ray.serve.llm import build_openai_app

    objects = render(*VALUES[name])
    values = group_values(name)
    app = serve_app(one(objects, "RayService"), tmp_path)
    serving, tier = prepare_app(app["args"])
    (entry,) = serving["llm_configs"]
    model = values["model"]
    assert entry["model_loading_config"] == {"model_id": model["id"], "model_source": model["source"]}
    assert entry["engine_kwargs"]["tensor_parallel_size"] == model["tensorParallelSize"]
    assert entry["engine_kwargs"]["kv_transfer_config"]["kv_connector"] == "UcmRayConnector"
    assert entry["runtime_env"]["env_vars"]["PYTHONHASHSEED"] == "0"
    assert entry["placement_group_config"]["strategy"] == "STRICT_PACK"
    assert len(entry["placement_group_config"]["bundles"]) == model["tensorParallelSize"]
    scaling = entry["deployment_config"]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (model["autoscaling"]["minReplicas"],
                                                                  model["autoscaling"]["maxReplicas"])
    assert tier.shards_per_node == values["tier"]["shards_per_node"]
    assert tier.config.replication == values["tier"].get("replication", 1)
    assert type(build_openai_app(serving)).__name__ == "Application"
