"""Fleet-wide settings belong to the fleet: a client learns ``replication`` from the directory.

``ucm-ray up --replication 2`` with the README's connector JSON (no ``replication`` in
``kv_connector_extra_config``) must give two copies, not silently one.
"""

from __future__ import annotations

import dataclasses
import logging

import ray

from tests.support.store_helpers import arena, key, read_back
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.fleet import fleet_status
from ucm_ray.store.types import DIRECTORY_NAME

N = 12


def _entries(cfg) -> list[int]:
    return [s["entries"] for s in fleet_status(cfg)["shards"]]


def test_client_writes_as_many_copies_as_the_fleet_was_started_with(fleet, caplog):
    cfg = fleet(num_shards=2, replication=2, transport="shm", pool_bytes=8 << 20)
    engine_cfg = dataclasses.replace(cfg, replication=1)  # what an engine's own JSON says
    with caplog.at_level(logging.WARNING, logger="ucm_ray.store.engine.ray_store"):
        client = StoreClient(engine_cfg)
        try:
            buf, views = arena(N)
            client.register_local(buf)
            assert all(client.put([key(i) for i in range(N)], views))
            assert _entries(cfg) == [N, N], "every block on both shards"
            assert client.membership.replication == 2
            client.refresh(force=True)
            assert client.pools().replication == 2
        finally:
            client.close()
    warnings = [r for r in caplog.records if "replication" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_directory_carries_the_fleet_config(fleet):
    cfg = fleet(num_shards=2, replication=2, transport="shm", pool_bytes=8 << 20)
    directory = ray.get_actor(DIRECTORY_NAME, namespace=cfg.ray_namespace)
    assert ray.get(directory.fleet_config.remote(), timeout=30) == cfg.to_dict()


def test_one_copy_left_still_serves_reads(fleet):
    cfg = fleet(num_shards=2, replication=2, transport="shm", pool_bytes=8 << 20)
    writer = StoreClient(dataclasses.replace(cfg, replication=1))
    buf, views = arena(N)
    writer.register_local(buf)
    assert all(writer.put([key(i) for i in range(N)], views))
    writer.close()
    first = next(s for s in ray.get(ray.get_actor(DIRECTORY_NAME, namespace=cfg.ray_namespace)
                                    .membership.remote(), timeout=30).shards)
    ray.kill(first.handle, no_restart=True)
    reader = StoreClient(dataclasses.replace(cfg, replication=1))
    try:
        ok, got = read_back(reader, N)
        if not all(ok):  # the directory may not have seen the death yet: a retry goes to the copy
            reader.refresh(force=True)
            ok, got = read_back(reader, N)
        assert all(ok), ok
        assert all(bool((g == v).all()) for g, v in zip(got, views, strict=True))
    finally:
        reader.close()
