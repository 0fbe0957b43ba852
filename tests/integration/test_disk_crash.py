"""``kill -9`` of a shard at injected points of its disk tier's I/O, then ``up`` again: the new
shard adopts what its last manifest listed, every adopted entry is served byte for byte, the rest
are misses, never wrong bytes (the crash point: ``ucm_ray.testing.disk_faults``)."""

from __future__ import annotations

import time

import pytest
import ray

from tests.support.store_helpers import ClientProcess, block, read_back
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.fleet import fleet_status, start_fleet
from ucm_ray.store.types import DIRECTORY_NAME
from ucm_ray.testing.disk_faults import ENV

ROUND = 24  # blocks a round writes: ~0.7 MiB of SIZES


def write_until_killed(cfg, timeout_s: float = 120.0) -> int:
    """Rounds of fresh blocks (tag r<round>) until the shard is gone: how many rounds were sent."""
    writer = ClientProcess.remote(cfg.to_dict())
    directory = ray.get_actor(DIRECTORY_NAME, namespace=cfg.ray_namespace)
    deadline = time.monotonic() + timeout_s
    rounds = 0
    while ray.get(directory.membership.remote(), timeout=30).shard_ids:
        assert time.monotonic() < deadline, "the shard never reached its crash point"
        try:
            ray.get(writer.write.remote(ROUND, 0, f"r{rounds}"), timeout=60)
        except ray.exceptions.RayError:
            pass  # the shard died under this round: its writes failed
        rounds += 1
        time.sleep(0.2)  # manifests are written on a clock: rounds span several of them
    ray.kill(writer)
    return rounds


@pytest.mark.parametrize("point", ["pwritev:150", "write_synced:2"], ids=["mid-demotion", "mid-manifest"])
def test_a_shard_killed_mid_io_adopts_only_whole_entries_after_up(fleet, tmp_path, monkeypatch, point):
    monkeypatch.setenv(ENV, point)
    cfg = fleet(num_shards=1, transport="shm", pool_bytes=32 << 20, disk_dir=str(tmp_path),
                disk_bytes=64 << 20, disk_write_policy="through", disk_wait_s=10.0)
    rounds = write_until_killed(cfg)
    monkeypatch.delenv(ENV)
    start_fleet(cfg)  # `ucm-ray up` again: the shard is back, its pool empty, its disk adopted
    shard = fleet_status(cfg)["shards"][0]
    assert shard["entries"] == 0
    adopted = shard["disk_adopted"]
    assert 0 < adopted < rounds * ROUND, (adopted, rounds)
    client = StoreClient(cfg)
    served = 0
    for r in range(rounds):
        ok, views = read_back(client, ROUND, tag=f"r{r}")
        for i, (hit, view) in enumerate(zip(ok, views)):
            # whatever is served is the block written under that key
            assert not hit or view.equal(block(i)), f"round {r} block {i}: wrong bytes after the restart"
        served += sum(ok)
    client.close()
    shard = fleet_status(cfg)["shards"][0]
    assert shard["disk_corrupt"] == 0 and shard["disk_refused_at_adoption"] == 0
    assert served == adopted, (served, adopted, shard)  # every adopted entry verified and was served
