"""Readers' hot-prefix copies relayed through a steward shard (``store.hot_copy_relay``), over
real shard and directory actors: the steward forwards a window's announcements in one directory
call; a stale incarnation is refused; a steward that dies loses what it had not forwarded (one
window), never a pool naming another's blocks."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from tests.support.store_helpers import key
from ucm_ray.store.types import DIRECTORY_NAME, WrongIncarnation


def _directory(cfg):
    return ray.get_actor(DIRECTORY_NAME, namespace=cfg.ray_namespace)


def _table(cfg) -> dict:
    return ray.get(_directory(cfg).membership.remote(), timeout=30).hot.pools


def _until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_burst_of_announcements_reaches_the_directory_in_a_stewards_forwards(fleet):
    cfg = fleet(num_shards=3, transport="shm", copy_nodes_per_pool=0)
    d = _directory(cfg)
    shards = ray.get(d.membership.remote(), timeout=30).shards
    writer, steward = shards[0], shards[1]
    hot = [key(i, "hot") for i in range(6)]
    ray.get(d.add_hot_prefix.remote({k: [writer.key] for k in hot}), timeout=30)
    served = ray.get(d.ping.remote(), timeout=30)["served"]["announce_hot_copies"]
    # six readers' announcements in a burst: what came before the first forward left goes with it
    # (it leaves at once), the rest are gathered and forwarded together a window later
    ray.get([steward.handle.relay_hot_copies.remote(steward.pool.incarnation, {shards[1 + i % 2].key: [k]})
             for i, k in enumerate(hot)], timeout=30)
    assert _until(lambda: all(len(_table(cfg)[k]) == 2 for k in hot)), _table(cfg)
    assert {k: _table(cfg)[k] for k in hot} == {k: (writer.key, shards[1 + i % 2].key) for i, k in enumerate(hot)}
    calls = ray.get(d.ping.remote(), timeout=30)["served"]["announce_hot_copies"] - served
    stats = ray.get(steward.handle.stats.remote(), timeout=30)
    assert calls == stats["relay_forwards"] in (1, 2), (calls, stats["relay_forwards"])
    assert (stats["relayed_copies"], stats["relay_dropped"], stats["relay_held"]) == (6, 0, 0)


def test_a_steward_refuses_an_announcement_for_another_incarnation(fleet):
    cfg = fleet(num_shards=2, transport="shm", copy_nodes_per_pool=0)
    steward = ray.get(_directory(cfg).membership.remote(), timeout=30).shards[0]
    with pytest.raises(WrongIncarnation):
        try:
            ray.get(steward.handle.relay_hot_copies.remote(steward.pool.incarnation + 1, {steward.key: [key(0)]}),
                    timeout=30)
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None


def test_a_steward_that_dies_loses_its_unforwarded_window_and_nothing_else(fleet):
    """An announcement is forwarded at once and lands; the next waits out the window at the
    steward, which is killed meanwhile: the table names the first copy, not the second (other
    nodes' readers load that block from the writer's pool, as before the copy)."""
    cfg = fleet(num_shards=3, transport="shm", copy_nodes_per_pool=0)
    d = _directory(cfg)
    shards = ray.get(d.membership.remote(), timeout=30).shards
    writer, steward, reader = shards
    handle, incarnation = steward.handle, steward.pool.incarnation
    for attempt in range(5):  # a slow box can let the window pass before the kill: new keys
        first, second = key(2 * attempt, "hot"), key(2 * attempt + 1, "hot")
        ray.get(d.add_hot_prefix.remote({first: [writer.key], second: [writer.key]}), timeout=30)
        ray.get(handle.relay_hot_copies.remote(incarnation, {reader.key: [first]}), timeout=30)
        held_since = time.monotonic()
        ray.get(handle.relay_hot_copies.remote(incarnation, {reader.key: [second]}), timeout=30)
        assert _until(lambda: len(_table(cfg)[first]) == 2)  # noqa: B023 -- read now
        stats = ray.get(handle.stats.remote(), timeout=30)
        if stats["relay_held"] == 1 and time.monotonic() - held_since < 0.6:
            os.kill(stats["pid"], signal.SIGKILL)
            break
    else:
        pytest.fail("the second announcement was always forwarded before the kill")
    assert _until(lambda: steward.shard_id not in ray.get(d.membership.remote(), timeout=30).shard_ids)
    time.sleep(1.5)  # past the window the second would have been forwarded in
    table = _table(cfg)
    assert table[first] == (writer.key, reader.key)
    assert table[second] == (writer.key,)
