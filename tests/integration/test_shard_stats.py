"""What ``ucm-ray status`` shows: lookups are the blocks readers ask for, hits those found.

The connector reads through ``acquire``; ``contains`` is a presence probe (``put`` skips keys
already stored, on every replica) and must not count as a lookup, or a fleet that only ever
serves hits shows a hit rate far below 1.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import ray

from tests.support.store_helpers import ClientProcess, key, read_back
from ucm_ray.cli import _summary
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.fleet import fleet_status


def _totals(cfg) -> tuple[int, int]:
    shards = fleet_status(cfg)["shards"]
    return sum(s["lookups"] for s in shards), sum(s["hits"] for s in shards)


def _totals_soon(cfg, expected: tuple[int, int], timeout_s: float = 10.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while (got := _totals(cfg)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def _per_shard(cfg) -> dict[str, tuple[int, int]]:
    return {s["shard_id"]: (s["lookups"], s["hits"]) for s in fleet_status(cfg)["shards"]}


def _counted(cfg, expected: dict[str, tuple[int, int]], timeout_s: float = 10.0) -> dict[str, tuple[int, int]]:
    """Each shard's (lookups, hits) once every shard has counted at least ``expected``'s hits."""
    deadline = time.monotonic() + timeout_s
    got = _per_shard(cfg)
    while any(got[sid][1] < hits for sid, (_, hits) in expected.items()) and time.monotonic() < deadline:
        time.sleep(0.05)
        got = _per_shard(cfg)
    return got


@pytest.mark.parametrize("local_lookups", [True, False])
def test_status_counts_the_blocks_readers_ask_for_and_find(fleet, local_lookups):
    cfg = fleet(num_shards=2, replication=2, transport="shm", pool_bytes=8 << 20, local_lookups=local_lookups)
    assert all(ray.get(ClientProcess.remote(cfg.to_dict()).write.remote(20), timeout=120))
    assert _totals(cfg) == (0, 0), "writes asked no reader's question"
    client = StoreClient(cfg)
    ok, _ = read_back(client, 20)  # acquire + copy + release: the connector's read path
    assert all(ok)
    # Same-node lookups read the shards' published indexes and tell the shards in the background.
    assert _totals_soon(cfg, (20, 20)) == (20, 20)
    lease = client.acquire([key(i, "absent") for i in range(5)] + [key(0)]).result()
    assert [loc is not None for loc in lease.locations] == [False] * 5 + [True]
    client.release(lease.lease_ids).result()
    assert _totals_soon(cfg, (26, 21)) == (26, 21)
    before = _per_shard(cfg)
    assert client.lookup([key(i) for i in range(20)]) == [True] * 20  # a probe, not a read
    # Waited on the counting, not on a guess of how late it may be: a read after the probe, on
    # every shard. A shard runs one process's calls in the order they were posted, and this
    # client's touches are posted in the order they were queued, so once a shard has counted the
    # read, anything the probe had counted there is in too.
    lease = client.acquire([key(i) for i in range(20)]).result()
    read = Counter(loc.shard_id for loc in lease.locations)
    client.release(lease.lease_ids).result()
    assert set(read) == set(before), read  # the read asks every shard
    expected = {sid: (lookups + read[sid], hits + read[sid]) for sid, (lookups, hits) in before.items()}
    assert _counted(cfg, expected) == expected
    assert _totals(cfg) == (46, 41)
    lines = _summary(fleet_status(cfg)).splitlines()[1:]
    assert len(lines) == 2 and all("hit rate" in line for line in lines)
    client.close()
