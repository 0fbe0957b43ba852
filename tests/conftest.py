"""Shared fixtures: a private local Ray cluster per test session, bound to loopback."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.support.temp_dirs import count_report, make_temp_dir

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    count_report(report)


@pytest.fixture(scope="session", autouse=True)
def vllm_leftovers():
    """Remove the files vLLM's processes left behind during this session (``tests.leftovers``)."""
    from tests.support.leftovers import remove_unused, vllm_files

    before = vllm_files()
    yield
    remove_unused(vllm_files() - before)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray head with its own temp dir; shut down (never `ray stop`) at the end."""
    import ray

    tmp = make_temp_dir()
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tmp.path, _node_ip_address="127.0.0.1",
             namespace="ucm_ray_tests", logging_level="WARNING")
    yield ray
    ray.shutdown()
    tmp.release()


@pytest.fixture
def fleet_config(ray_cluster):
    """A config with its own Ray namespace so fleets of different tests never meet."""
    from ucm_ray.config import UcmRayConfig

    def make(**kw):
        kw.setdefault("ray_namespace", f"t{uuid.uuid4().hex[:8]}")
        kw.setdefault("pool_bytes", 64 << 20)
        kw.setdefault("num_shards", 3)
        kw.setdefault("lookup_timeout_s", 20.0)
        return UcmRayConfig(**kw)

    return make


@pytest.fixture
def fleet(fleet_config):
    """Start a shard fleet; stop it (and unlink its pools) after the test."""
    from ucm_ray.store.shard.fleet import start_fleet, stop_fleet

    started = []

    def make(**kw):
        cfg = fleet_config(**kw)
        start_fleet(cfg)
        started.append(cfg)
        return cfg

    yield make
    for cfg in started:
        stop_fleet(cfg)
