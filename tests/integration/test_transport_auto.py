"""``transport: auto`` on a node without NIXL: shards start, serve shared memory, and say so.

Issue 8 found that ``ucm-ray up`` with the default ``transport: auto`` failed on a single node when
NIXL was not installed (each shard built a NIXL exporter), although only shared memory is needed
there. Here NIXL is made unimportable in the shard and client processes themselves: their
runtime env puts a directory first on ``PYTHONPATH`` whose ``nixl``, ``nixl_cu12`` and
``nixl_cu13`` packages raise ``ModuleNotFoundError`` on import, as an absent package does. The
fleet is started by the real ``start_fleet`` from inside a task with that env (actors inherit
their creator's env vars, detached ones too), so nothing of ours is mocked; the warning is read
from the shard process's own stderr log, where a user would find it.
"""

from __future__ import annotations

import glob
import os

import pytest
import ray

from tests.support.store_helpers import ClientProcess, block, key, read_back
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.fleet import shard_name, start_fleet, stop_fleet
from ucm_ray.transport.shm import pool_prefix

NIXL_NAMES = ("nixl", "nixl_cu12", "nixl_cu13")


@pytest.fixture(scope="module")
def no_nixl(tmp_path_factory) -> dict:
    """A runtime env in which no NIXL package can be imported."""
    stubs = tmp_path_factory.mktemp("no_nixl")
    for name in NIXL_NAMES:
        (stubs / name).mkdir()
        (stubs / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named {name!r} (NIXL is not installed here)\", name={name!r})\n")
    path = os.pathsep.join(p for p in (str(stubs), os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


@ray.remote(num_cpus=0)
def _up(config: dict) -> None:
    """``ucm-ray up`` (start_fleet), run in a process whose env its actors inherit."""
    from ucm_ray.config import UcmRayConfig

    start_fleet(UcmRayConfig.from_dict(config), timeout_s=60)


def _facts(handle) -> dict:
    """In an actor's own process: can NIXL be used there, and what it logged to stderr so far."""
    def probe(_actor):
        import os as os_
        import sys as sys_

        from ucm_ray.transport.nixl import nixl_available

        sys_.stderr.flush()
        with open(os_.readlink("/proc/self/fd/2")) as log:  # Ray sends a worker's stderr to its log file
            return {"nixl": nixl_available(), "log": log.read()}

    return ray.get(handle.__ray_call__.remote(probe), timeout=30)


def _pools(cfg) -> list[str]:
    return glob.glob(pool_prefix(cfg.shm_dir, cfg.ray_namespace) + "*")


def test_auto_without_nixl_serves_shared_memory_with_a_warning(fleet_config, no_nixl):
    cfg = fleet_config(num_shards=2, transport="auto")
    try:
        ray.get(_up.options(runtime_env=no_nixl).remote(cfg.to_dict()), timeout=120)
        for i in range(cfg.num_shards):
            shard = ray.get_actor(shard_name(i), namespace=cfg.ray_namespace)
            facts = _facts(shard)
            assert facts["nixl"] is False  # the shard's own process really has no NIXL
            assert f"shard {shard_name(i)}: NIXL unavailable" in facts["log"]
            assert "serving same-node clients over shared memory only" in facts["log"]
            assert "needs the NIXL Python package" in facts["log"]  # the cause, named
            assert ray.get(shard.describe.remote(), timeout=30).nixl_agent is None
        # A client without NIXL (auto) writes over shared memory; the driver reads the bytes back.
        writer = ClientProcess.options(runtime_env=no_nixl).remote(cfg.to_dict())
        assert all(ray.get(writer.write.remote(40, 3), timeout=60))
        assert ray.get(writer.transports.remote(), timeout=30) == ["shm"]
        assert _facts(writer)["nixl"] is False
        ray.kill(writer)
        reader = StoreClient(cfg)
        ok, views = read_back(reader, 40)
        assert all(ok)
        assert all(bytes(v.numpy()) == bytes(block(i, 3).numpy()) for i, v in enumerate(views))
        assert {reader.transport_kind(s) for s in reader.membership.shard_ids} == {"shm"}
        assert reader.lookup([key(0)]) == [True]
        reader.close()
    finally:
        stop_fleet(cfg)
    assert _pools(cfg) == []


def test_nixl_forced_without_nixl_fails_at_start_naming_the_package(fleet_config, no_nixl):
    cfg = fleet_config(num_shards=1, transport="nixl")
    try:
        with pytest.raises(ray.exceptions.RayError, match="needs the NIXL Python package"):
            ray.get(_up.options(runtime_env=no_nixl).remote(cfg.to_dict()), timeout=120)
    finally:
        stop_fleet(cfg)
    assert _pools(cfg) == []  # the shard that could not start left no /dev/shm segment
