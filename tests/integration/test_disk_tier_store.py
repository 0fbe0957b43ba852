"""The disk tier through the real Ray store: a shard whose pool holds a fifth of what was written
serves every key, evicted ones from disk (promoted on the lookup call), byte for byte; on both
lookup paths: same-node readers of the shard's published index (where a disk-resident key is
listed as "ask the shard") and Ray calls."""

from __future__ import annotations

import dataclasses
import time

import pytest
import ray
import torch

from tests.support.store_helpers import SIZES, ClientProcess, block, key, lookups_missing_own_commits, written_slots
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.disk.tier import PROMOTE_CHUNK
from ucm_ray.store.shard.fleet import fleet_status
from ucm_ray.testing.disk_faults import GATE_ENV


def _gated_disk_fleet(fleet, tmp_path, monkeypatch, **timeouts):
    """A one-shard fleet with a 4 MiB pool in front of a 32 MiB write-through disk whose reads
    wait while the file ``gate`` (returned with the config) exists (``GATE_ENV``)."""
    gate = str(tmp_path / "gate")
    monkeypatch.setenv(GATE_ENV, gate)
    disk = tmp_path / "disk"
    disk.mkdir()
    return gate, fleet(num_shards=1, transport="shm", pool_bytes=4 << 20, disk_dir=str(disk),
                       disk_bytes=32 << 20, disk_write_policy="through", **timeouts)


def _wait_until_demoted(cfg, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(s["disk_behind"] for s in fleet_status(cfg)["shards"]):
        assert time.monotonic() < deadline, "demotion never caught up"
        time.sleep(0.05)


@pytest.mark.parametrize("local_lookups", [True, False], ids=["published-index", "ray-calls"])
def test_a_store_holding_5x_its_pool_serves_evicted_keys_from_disk(fleet, tmp_path, local_lookups):
    n, batch, step = 300, 10, 5
    working_set = sum(SIZES[i % len(SIZES)] for i in range(n))
    cfg = fleet(num_shards=1, pool_bytes=working_set // 5, local_lookups=local_lookups,
                disk_dir=str(tmp_path), disk_bytes=4 * working_set, disk_wait_s=5.0)  # a busy box: no late misses
    writer = ClientProcess.remote(cfg.to_dict())
    client = StoreClient(cfg)
    by_call = StoreClient(dataclasses.replace(cfg, local_lookups=False))
    keys = [key(i) for i in range(n)]
    for _ in range(3):
        # An engine's saves come a step at a time, each far smaller than the pool's clean cold end
        # (1 - low watermark: half of it here, with a disk of 20 pools): 5 blocks are ~8% of it.
        for upto in range(step, n + 1, step):
            stored = ray.get(writer.write.remote(upto), timeout=60)  # rewrites what an earlier call dropped
            assert all(stored), [i for i, o in enumerate(stored) if not o]
            _wait_until_demoted(cfg)
        found = client.lookup(keys)
        # the published index answers as the shard's own call does: a disk hit is a hit
        assert found == by_call.lookup(keys), [i for i, (f, c) in enumerate(zip(found, by_call.lookup(keys))) if f != c]
        if all(found):
            break
    # Not evicted_dirty == 0 here: blocks of 777 B to 128 KiB fragment a 2 MiB pool, and a large
    # block's room can need more evictions than the clean cold end holds (uniform blocks: the unit
    # tests). Keys lost that way were rewritten by the next call, as an engine would recompute them.
    assert all(found), [i for i, f in enumerate(found) if not f]
    shard = fleet_status(cfg)["shards"][0]
    assert shard["evictions"] > 0 and shard["disk_demoted"] > 0
    assert shard["used_bytes"] <= shard["capacity_bytes"] and shard["disk_used_bytes"] <= cfg.disk_bytes
    lost_before = shard["evicted_dirty"]
    failed: list[int] = []
    buf = torch.zeros(max(SIZES) * batch, dtype=torch.uint8)
    client.register_local(buf)
    for start in range(0, n, batch):  # a prompt's worth at a time: promoted, pinned, copied
        ids = range(start, start + batch)
        views, off = [], 0
        for i in ids:
            views.append(buf[off:off + SIZES[i % len(SIZES)]])
            off += views[-1].numel()
        buf.zero_()
        ok = client.get([key(i) for i in ids], views)
        failed += [i for i, o in zip(ids, ok) if not o]
        for i, v, o in zip(ids, views, ok):
            assert not o or torch.equal(v, block(i)), f"block {i} differs"
    shard = fleet_status(cfg)["shards"][0]
    assert shard["disk_promoted"] > 0 and shard["disk_corrupt"] == 0 and shard["disk_promote_late"] == 0
    # A load that failed is a key the shard lost meanwhile, never one it holds: promotions need
    # room, and on a busy host the demotion thread can fall behind, so an eviction may take an
    # entry not yet on disk (counted as evicted_dirty).
    assert not any(by_call.lookup([key(i) for i in failed]))
    assert len(failed) <= shard["evicted_dirty"] - lost_before, (failed, shard)
    by_call.close()
    client.close()


@pytest.mark.parametrize("local_lookups", [True, False], ids=["published-index", "ray-calls"])
def test_a_lookup_says_which_keys_its_shard_read_from_disk(fleet, tmp_path, local_lookups):
    """The engine's disk counters (``disk_hit_blocks``, ``disk_promoted_*``) come from this: the
    lease marks the keys the shard promoted for the lookup, no more (pool hits, misses) and no
    fewer (what the shard counts as promoted)."""
    n = 60
    working_set = sum(SIZES[i % len(SIZES)] for i in range(5)) * n // 5
    cfg = fleet(num_shards=1, pool_bytes=working_set // 3, local_lookups=local_lookups, disk_dir=str(tmp_path),
                disk_bytes=4 * working_set, disk_write_policy="through", disk_wait_s=5.0)
    writer = ClientProcess.remote(cfg.to_dict())
    for first in range(0, n, 5):  # an engine's saves, a step at a time (each written through)
        assert all(ray.get(writer.write_keys.remote([key(i) for i in range(first, first + 5)]), timeout=60))
        _wait_until_demoted(cfg)
    client = StoreClient(cfg)
    asked = [key(i) for i in range(10)] + [key(i, "absent") for i in range(3)]
    before = fleet_status(cfg)["shards"][0]
    lease = client.acquire(asked).result()
    after = fleet_status(cfg)["shards"][0]
    read = after["disk_promoted"] - before["disk_promoted"]
    assert read > 0, (before, after)  # the first keys were evicted: only the disk held them
    assert lease.promoted is not None and int(lease.promoted.sum()) == read
    assert lease.locations.found()[lease.promoted].all() and not lease.promoted[10:].any()
    client.release(lease.lease_ids).result()
    again = client.acquire(asked[:10]).result()  # in the pool now: nothing read
    assert again.promoted is None or not again.promoted.any()
    client.release(again.lease_ids).result()
    client.close()


def test_a_promotion_mid_read_leaves_the_shards_saves_and_status_answering(fleet, tmp_path, monkeypatch):
    """A long prompt's disk hit reads for up to ``disk_wait_s``; the shard's other callers (every
    engine's slot asks and commits, status) must not wait behind it. The promotion is held in its
    first read (``UCM_RAY_TEST_DISK_READ_GATE``) while another process saves and the driver asks
    for the fleet's status; then it is let go and its reader gets every block, exact. Before the
    disk thread, the save's slot ask waited behind the held read (it timed out here)."""
    gate, cfg = _gated_disk_fleet(fleet, tmp_path, monkeypatch, disk_wait_s=20.0, lookup_timeout_s=30.0)
    writer = ClientProcess.remote(cfg.to_dict())
    assert all(ray.get(writer.write.remote(60, 0, "a"), timeout=60))
    _wait_until_demoted(cfg)
    for start in range(0, 200, 20):  # 7 MiB more through a 4 MiB pool: every "a" block now on disk only
        assert all(ray.get(writer.write_keys.remote([key(i, "b") for i in range(start, start + 20)]), timeout=60))
        _wait_until_demoted(cfg)
    assert fleet_status(cfg)["shards"][0]["evictions"] > 60
    reader = ClientProcess.remote(cfg.to_dict())
    try:
        read = reader.read.remote(60, 0, "a")
        deadline = time.monotonic() + 30
        while not (tmp_path / "gate.waiting").exists():
            assert time.monotonic() < deadline, "the reader's lookup never reached the shard's disk"
            time.sleep(0.02)
        saved = writer.write.remote(6, 0, "c")
        assert all(ray.get(saved, timeout=10)), "a save waited behind the promotion"
        assert fleet_status(cfg)["shards"][0]["disk_promoted"] == 0  # still held in its first read
    finally:
        open(gate, "w").close()
    got = ray.get(read, timeout=60)
    assert got["found"] == got["got"] == got["exact"] == 60, got
    assert fleet_status(cfg)["shards"][0]["disk_promoted"] >= 60


def test_a_lookup_on_the_disk_thread_finds_what_its_client_committed_just_before(fleet, tmp_path):
    """As ``test_poster``'s lookup right after its own commit, with a disk tier: the lookup goes
    to the shard's disk thread (``promote_and_acquire``, no published index read: pinned), the
    commit to its default thread, here busy with a slow call this client queued first (under
    load: other engines' calls). The lookup must still see the commit (it overtook it, a miss)."""
    cfg = fleet(num_shards=1, transport="shm", disk_dir=str(tmp_path), disk_bytes=256 << 20)
    client = StoreClient(cfg)
    count, size = 8, 4096
    pool, grant = written_slots(client, count, size)
    rec = client._records[pool]
    slow = [key(i, "absent") for i in range(300_000)]  # a default-thread call of some 0.1 s
    missed = lookups_missing_own_commits(client, pool, grant, size,
                                         before=lambda: client.access.poster.post(rec.handle.contains, pool[1], slow))
    assert missed == 0, f"{missed} of {count} lookups overtook this client's own commit"
    client.close()


def test_a_promotion_queued_past_its_askers_deadline_reads_nothing(fleet, tmp_path, monkeypatch):
    """Three long prompts' lookups reach one shard's disk thread at once; the first is held in its
    first read (``UCM_RAY_TEST_DISK_READ_GATE``) until every asker's lookup timed out (misses, the
    shard suspect). Let go, the two queued behind it must read nothing: their askers stopped waiting,
    and each read would be wasted (and evict pool entries for bytes nobody takes). Their budget
    counts from when the engine sent them, not from when the disk thread took them up: before,
    each got a fresh ``disk_wait_s`` there and read its whole prompt after its asker gave up.
    Later readers still get every block they find exact: what was not promoted is a miss."""
    gate, cfg = _gated_disk_fleet(fleet, tmp_path, monkeypatch, disk_wait_s=3.0, lookup_timeout_s=4.0)
    writer = ClientProcess.remote(cfg.to_dict())
    prompts = {tag: [key(i, tag) for i in range(40)] for tag in ("a", "b", "c")}
    for tag in prompts:
        assert all(ray.get(writer.write.remote(40, 0, tag), timeout=60))
        _wait_until_demoted(cfg)
    for start in range(0, 200, 20):  # 7 MiB more through a 4 MiB pool: the three prompts on disk only
        assert all(ray.get(writer.write_keys.remote([key(i, "fill") for i in range(start, start + 20)]), timeout=60))
        _wait_until_demoted(cfg)
    client = StoreClient(cfg)
    lookups = [client.acquire(keys) for keys in prompts.values()]  # posted at once, in this order
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "gate.waiting").exists():
            assert time.monotonic() < deadline, "the first lookup never reached the shard's disk"
            time.sleep(0.02)
        for lookup in lookups:
            while not lookup.poll():  # done only once its asker's deadline passed: the read is held
                time.sleep(0.05)
            assert not lookup.result().locations.found().any()  # timed out: misses
    finally:
        open(gate, "w").close()
    rec = next(iter(client._records.values()))
    ray.get(rec.handle.promote_and_acquire.remote(rec.pool.incarnation, client.owner, []), timeout=60)  # behind them
    # the first promotion's reads that had started (its first chunk at most); none of the others'
    promoted = {tag: int((~client.access.readers.locate(rec.key, keys).on_disk).sum()) for tag, keys in prompts.items()}
    promotion = {k: v for k, v in fleet_status(cfg)["shards"][0].items() if k.startswith("disk_promote")}
    assert sorted(promoted.values())[:2] == [0, 0], (promoted, promotion)
    assert promotion["disk_promoted"] <= PROMOTE_CHUNK and promotion["disk_promote_late"] >= 2 * 40, promotion
    reader = ClientProcess.remote(cfg.to_dict())
    for tag in prompts:
        got = ray.get(reader.read.remote(40, 0, tag), timeout=60)
        assert got["got"] == got["exact"], got  # found or not, never wrong bytes
    client.close()
