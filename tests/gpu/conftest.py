"""GPU tests: they need an NVIDIA GPU and vLLM with CUDA; elsewhere they are skipped, saying so."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run `make gpu-test` on a GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """A failed GPU test's traceback right away, not only in the session's summary: device runs
    are cut by their time limit, and twice a cut run lost the only trace of a failure (stop 59 on
    an H200, stop 63 on an H100: the asynchronous failed-load test)."""
    if not report.failed:
        return
    import sys

    sys.stderr.write(f"\n--- FAILED {report.nodeid} ({report.when}) ---\n{report.longreprtext}\n")
    sys.stderr.flush()


# The fixtures below are named gpu_* so that none shares a name with a root fixture
# (``tests/conftest.py``'s function-scoped ``fleet`` factory): on the H200, a run of several GPU
# modules resolved ``fleet`` to the root one ("ScopeMismatch ... fleet", "'function' object has no
# attribute 'ray_namespace'").


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    """The tiny dense model in bf16 (FlashAttention 3 takes only fp16 or bf16)."""
    from ucm_ray.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", num_layers=4, hidden_size=256,
                               num_heads=4, num_kv_heads=2, dtype="bfloat16"))


@pytest.fixture(scope="module")
def gpu_cluster(request):
    """Ray for one test module, its ``ENV`` (a module-level dict) in this process's environment
    first (engines get it through their runtime_env too). Where this session already runs Ray
    (the root ``ray_cluster``, for integration tests run in the same session), that cluster is
    used and left to its owner: a second ``ray.init`` fails, and a shutdown here would end it
    under the session fixture."""
    import ray

    os.environ.update(request.module.ENV)
    if ray.is_initialized():
        gpus = ray.cluster_resources().get("GPU", 0)
        assert gpus >= 1, f"this session's Ray cluster has {gpus} GPU; the GPU tests need one"
        yield
        return
    name = request.module.__name__.rsplit(".", 1)[-1]
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, namespace=f"ucm_{name}", logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def gpu_fleet(gpu_cluster, request):
    """Two shards of 1 GiB, shared memory only (one node)."""
    from ucm_ray.config import UcmRayConfig
    from ucm_ray.store.shard.fleet import running_fleet

    name = request.module.__name__.rsplit(".", 1)[-1]
    with running_fleet(UcmRayConfig(num_shards=2, pool_bytes=1 << 30, transport="shm",
                                    ray_namespace=f"ucm_{name}_fleet")) as cfg:
        yield cfg
