"""Faults that once produced wrong bytes or lost a live shard: restarts, slow writers, pauses,
stale releases, corruption. Real shards on a local Ray cluster, clients in this process."""

from __future__ import annotations

import dataclasses
import mmap
import os
import signal
import time

import pytest
import ray
import torch

from tests.support.store_helpers import arena, block, key, read_back, restart_shard, shard_pid
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.fleet import fleet_status, shard_name
from ucm_ray.store.types import WrongIncarnation


def test_restarted_shard_never_serves_wrong_bytes(fleet):
    cfg = fleet(num_shards=2, transport="shm")
    a = StoreClient(cfg)
    buf, views = arena(60, seed=1)
    a.register_local(buf)
    assert all(a.put([key(i, "old") for i in range(60)], views))  # a maps both pools now
    restart_shard(cfg, 0)
    b = StoreClient(cfg)
    buf_b, views_b = arena(60, seed=2)
    b.register_local(buf_b)
    assert all(b.put([key(i, "new") for i in range(60)], views_b))

    a.refresh(force=True)
    ok, got = read_back(a, 60, "new")
    wrong = [i for i in range(60) if ok[i] and not torch.equal(got[i], block(i, 2))]
    assert not wrong, f"{len(wrong)} blocks read back wrong through the old incarnation's mapping"
    assert all(ok)  # and the new incarnation is reachable
    ok, got = read_back(a, 60, "old")  # the dead incarnation's keys are misses, the rest exact
    assert 0 < sum(ok) < 60 and all(torch.equal(got[i], block(i, 1)) for i in range(60) if ok[i])

    buf_c, views_c = arena(60, seed=3)
    a.register_local(buf_c)
    assert all(a.put([key(i, "mine") for i in range(60)], views_c))
    c = StoreClient(cfg)
    ok, got = read_back(c, 60, "mine")
    assert all(ok)
    assert all(torch.equal(got[i], block(i, 3)) for i in range(60)), "a's saves after the restart were lost"
    for client in (a, b, c):
        client.close()


def test_stale_release_after_restart_does_not_unpin_anothers_entry(fleet):
    cfg = fleet(num_shards=1, local_lookups=False)  # lookups that pin, as between nodes
    a = StoreClient(cfg)
    buf, views = arena(8, seed=1)
    a.register_local(buf)
    assert all(a.put([key(i) for i in range(8)], views))
    old = a.acquire([key(i) for i in range(8)]).result()
    (old_pool,) = old.lease_ids
    restart_shard(cfg, 0)
    b = StoreClient(cfg)
    b.register_local(buf)
    assert all(b.put([key(i) for i in range(8)], views))
    pinned = b.acquire([key(i) for i in range(8)]).result()
    assert all(pinned.locations) and old_pool not in pinned.lease_ids
    assert a.release(old.lease_ids).result() == {old_pool}  # the old incarnation is gone
    new_shard = ray.get_actor(shard_name(0), namespace=cfg.ray_namespace)
    with pytest.raises(WrongIncarnation):  # and the new one refuses its ids
        ray.get(new_shard.release.remote(old_pool[1], a.owner, old.lease_ids[old_pool]), timeout=30)
    a.refresh(force=True)
    assert a.release(old.lease_ids).result() == {old_pool}  # and gone from a's view
    assert a.release(pinned.lease_ids).result() == set(pinned.lease_ids)  # not a's leases: no effect
    assert b.release(pinned.lease_ids).result() == set()  # b's pins were untouched all along
    a.close()
    b.close()


def test_slow_writer_never_overwrites_a_committed_block(fleet):
    from ucm_ray.store.types import Location, Publishes
    from ucm_ray.transport.base import CopyOp, Ranges

    cfg = fleet(num_shards=1, reserve_timeout_s=1.0, transfer_timeout_s=0.5)
    slow, fast, reader = StoreClient(cfg), StoreClient(cfg), StoreClient(cfg)
    size = 4096
    mine, theirs = block(0, seed=1)[:size].clone(), block(0, seed=2)[:size].clone()
    slow.register_local(mine)
    fast.register_local(theirs)
    k = key(0)
    (pool,) = slow.owners([k])[0]

    g1 = slow.reserve(pool, size, 1).result()
    time.sleep(1.3)  # the slow writer's reservation expires while it still "copies"
    g2 = fast.reserve(pool, size, 1).result()
    assert g2.offsets[0] != g1.offsets[0], "an expired writer's slot was handed to another writer"
    copy = {pool: Ranges.of([CopyOp(g2.offsets[0], theirs)])}
    assert fast.connections.transfer(copy, write=True, timeout_s=10).pools == set()
    loc2 = Location(pool[0], pool[1], g2.offsets[0], size)
    assert fast.commit(Publishes.of([(k, loc2, g2.token)])).result() == [True]

    # the late copy lands in its own (quarantined) slot, and its commit is refused
    late = {pool: Ranges.of([CopyOp(g1.offsets[0], mine)])}
    assert slow.connections.transfer(late, write=True, timeout_s=10).pools == set()
    loc1 = Location(pool[0], pool[1], g1.offsets[0], size)
    assert slow.commit(Publishes.of([(k, loc1, g1.token)])).result() == [False]

    out = torch.zeros(size, dtype=torch.uint8)
    reader.register_local(out)
    assert reader.get([k], [out]) == [True]
    assert torch.equal(out, theirs)
    for c in (slow, fast, reader):
        c.close()


def test_renewed_reservation_outlives_its_timeout(fleet):
    from ucm_ray.store.types import Location, Publishes
    from ucm_ray.transport.base import CopyOp, Ranges

    cfg = fleet(num_shards=1, reserve_timeout_s=1.0, transfer_timeout_s=0.5)
    w = StoreClient(cfg)
    data = block(1).clone()
    w.register_local(data)
    (pool,) = w.owners([key(1)])[0]
    g = w.reserve(pool, data.numel(), 1).result()
    for _ in range(3):  # 1.8 s of copying in all, renewed as it goes
        time.sleep(0.6)
        assert w.renew({pool: [g.token]}).result() == set()
    copy = {pool: Ranges.of([CopyOp(g.offsets[0], data)])}
    assert w.connections.transfer(copy, write=True, timeout_s=10).pools == set()
    loc = Location(pool[0], pool[1], g.offsets[0], data.numel())
    assert w.commit(Publishes.of([(key(1), loc, g.token)])).result() == [True]
    time.sleep(1.2)
    assert w.renew({pool: [g.token]}).result() == {(pool, g.token)}  # committed: nothing left to renew
    w.close()


@pytest.mark.parametrize("local_lookups", [False, True])
def test_paused_shard_is_suspect_then_serves_again(fleet, local_lookups):
    cfg = fleet(num_shards=1, lookup_timeout_s=1.0, local_lookups=local_lookups)
    client = StoreClient(cfg)
    buf, views = arena(20)
    client.register_local(buf)
    assert all(client.put([key(i) for i in range(20)], views))
    pid = shard_pid(cfg, 0)
    os.kill(pid, signal.SIGSTOP)
    try:
        paused_until = time.monotonic() + 2.0
        while time.monotonic() < paused_until:
            ok, got = read_back(client, 20)
            if local_lookups:  # its published index and pool need no answer from it: still hits
                assert all(ok) and all(torch.equal(got[i], block(i)) for i in range(20))
            else:
                assert not any(ok)  # a paused shard is a miss, never a hang or an error
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    while True:
        ok, got = read_back(client, 20)
        if all(ok):
            break
        assert time.monotonic() - resumed < 15, "a shard that paused once stays blacklisted"
        time.sleep(0.1)
    assert all(torch.equal(got[i], block(i)) for i in range(20))
    client.close()


def test_checksum_mismatch_is_a_miss_for_every_reader_and_removes_the_entry(fleet):
    cfg = fleet(num_shards=1, transport="shm")
    writer = StoreClient(dataclasses.replace(cfg, checksum=True))
    buf, views = arena(10)
    writer.register_local(buf)
    assert all(writer.put([key(i) for i in range(10)], views))
    bad = 4  # a 128 KiB block: its bytes occur once in the pool
    with open(writer.membership.shards[0].pool.shm_path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
        at = mm.find(block(bad).numpy().tobytes())
        assert at >= 0
        mm[at + 1000] ^= 0xFF
        mm.close()
    reader = StoreClient(dataclasses.replace(cfg, checksum=False))
    ok, got = read_back(reader, 10)
    assert ok == [i != bad for i in range(10)], "a reader without checksum config got corrupt bytes"
    assert all(torch.equal(got[i], block(i)) for i in range(10) if ok[i])
    assert reader.lookup([key(bad)]) == [False]  # the entry is gone for everyone
    assert read_back(reader, 10)[0] == ok
    assert fleet_status(cfg)["shards"][0]["entries"] == 9
    writer.close()
    reader.close()


def test_a_lookup_finds_a_shards_pool_hits_whatever_the_two_nodes_wall_clocks_say(fleet, monkeypatch):
    """The engine's node and the shard's keep wall clocks apart by more than a lookup's timeout
    (an NTP step, a VM resumed, a node without NTP): a lookup that pins through a call to a live
    shard without a disk tier, which holds every key in its pool, answering at once, must still
    hit. Nothing there has a deadline to keep (no disk to read), and a plain miss on a live owner
    is final (no replica is asked, the shard is not suspect, nothing is logged). The engine sends
    its deadline as a time of day (``answer_by``); a shard whose clock reads it as past answers all
    misses."""
    from types import SimpleNamespace

    from ucm_ray.store.engine import acquire as acquire_module

    cfg = fleet(num_shards=1, local_lookups=False, lookup_timeout_s=5.0)  # lookups that pin, as between nodes
    client = StoreClient(cfg)
    buf, views = arena(8, seed=1)
    client.register_local(buf)
    assert all(client.put([key(i) for i in range(8)], views))
    behind = cfg.lookup_timeout_s + 5.0  # the engine's wall clock, against the shard's
    monkeypatch.setattr(acquire_module, "time", SimpleNamespace(time=lambda: time.time() - behind))
    lease = client.acquire([key(i) for i in range(8)]).result()
    found = lease.locations.found()
    client.release(lease.lease_ids).result()
    client.close()
    assert found.all(), f"{int((~found).sum())} of 8 pool hits answered as misses: the clocks are {behind} s apart"
