"""The directory can die: Ray restarts it and it finds its shards again; one created again by
``ucm-ray up`` is found by running clients; a client that starts with no directory runs with
the cache off and joins when it appears; membership changes are pushed (a long poll), not
polled for."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch

from tests.support.store_helpers import arena, key, read_back, shard_pid
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.fleet import start_fleet, stop_fleet
from ucm_ray.store.types import DIRECTORY_NAME


def directory(cfg):
    return ray.get_actor(DIRECTORY_NAME, namespace=cfg.ray_namespace)


def until(condition, timeout_s: float = 30.0, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)
    return True


def write(client: StoreClient, n: int) -> list[bool]:
    buf, views = arena(n)
    client.register_local(buf)
    return client.put([key(i) for i in range(n)], views)


def test_killed_directory_is_restarted_and_finds_its_shards(fleet):
    cfg = fleet(num_shards=2, transport="shm")
    client = StoreClient(cfg)
    assert all(write(client, 8))
    before = ray.get(directory(cfg).ping.remote(), timeout=30)
    os.kill(before["pid"], signal.SIGKILL)
    assert until(lambda: _answer(cfg) is not None and _answer(cfg)["pid"] != before["pid"]), "not restarted"
    after = _answer(cfg)
    assert after["shards"] == before["shards"] and after["version"] != before["version"]
    assert until(lambda: (client.refresh(), client.membership.version == after["version"])[1]), \
        "the client never saw the restarted directory's membership"
    ok, views = read_back(client, 8)
    assert all(ok) and all(torch.equal(v, b) for v, b in zip(views, arena(8)[1]))


def _answer(cfg) -> dict | None:
    try:
        return ray.get(directory(cfg).ping.remote(), timeout=5)
    except Exception:  # noqa: BLE001 -- restarting
        return None


def test_directory_created_again_is_found_by_running_clients(fleet):
    cfg = fleet(num_shards=2, transport="shm")
    client = StoreClient(cfg)
    ray.kill(directory(cfg), no_restart=True)  # gone for good
    start_fleet(cfg)  # `ucm-ray up` again: a new directory adopts the running shards
    fresh = ray.get(directory(cfg).ping.remote(), timeout=30)
    assert len(fresh["shards"]) == 2
    assert until(lambda: (client.refresh(), client.membership.version == fresh["version"])[1])
    assert all(write(client, 4))


def test_client_without_directory_runs_cache_off_then_joins(fleet_config):
    cfg = fleet_config(num_shards=2, transport="shm")
    client = StoreClient(cfg)  # no directory in this namespace yet: must not raise
    assert client.membership.shards == ()
    assert not any(write(client, 4)) and not any(read_back(client, 4)[0])
    start_fleet(cfg)
    try:
        assert until(lambda: (client.refresh(), len(client.membership.shards) == 2)[1], timeout_s=20)
        assert all(write(client, 4)) and all(read_back(client, 4)[0])
    finally:
        stop_fleet(cfg)


def served_calls(cfg) -> dict[str, int]:
    return ray.get(directory(cfg).ping.remote(), timeout=30)["served"]


def relay_figure(shard, name: str) -> int:
    return ray.get(shard.handle.stats.remote(), timeout=30)[name]


@pytest.mark.parametrize("relay_on, directory_paused", [(False, False), (True, False), (True, True)],
                         ids=["directory", "relayed", "relayed-directory-paused"])
def test_membership_changes_are_pushed_not_polled(fleet, relay_on, directory_paused):
    """Off, the client's long poll is at the directory (the fallback path); on (the default), at
    its node's relay shard, whose own polls are the directory's calls: its first (it holds nothing
    yet, answered at once), then the one that waits. Paused: the directory stopped (a busy or
    paused process) until the relay, not following it ``SYNC_WAIT_S`` after the client's first
    poll, answered that it cannot say, so the client sent one poll to the directory itself."""
    cfg = fleet(num_shards=3, transport="shm", relay_membership=relay_on)
    client = StoreClient(cfg)
    relay = client.membership.shards[0]  # the lowest shard id on the (one) node
    before = ray.get(directory(cfg).ping.remote(), timeout=30)  # its pid, too
    served, cannot_say = before["served"], relay_figure(relay, "relay_cannot_say")
    if directory_paused:
        os.kill(before["pid"], signal.SIGSTOP)
        try:
            said = until(lambda: (client.refresh(), relay_figure(relay, "relay_cannot_say") > cannot_say)[1],
                         timeout_s=20)
        finally:
            os.kill(before["pid"], signal.SIGCONT)
        assert said, "the relay never said it could not answer"
    started = time.monotonic()
    while time.monotonic() - started < 4.0:  # a busy scheduler: refresh on every step
        client.refresh()
        time.sleep(0.01)
    # Every long poll the directory got has its reason, and nothing changed, so each one waits: the
    # client's own (off) or the relay's two, and one of the client's for each time the relay could
    # not say (at most once: that poll waits at the directory for a change). Counted once they
    # reach it (under load one may be under way when the refreshes stop); none polls the membership.
    said_none = relay_figure(relay, "relay_cannot_say") - cannot_say
    assert (said_none == 1) if directory_paused else (said_none <= relay_on), said_none
    expected = (2 if relay_on else 1) + said_none
    assert until(lambda: served_calls(cfg)["wait_for_change"] - served["wait_for_change"] >= expected, timeout_s=10)
    calls = served_calls(cfg)
    assert calls["wait_for_change"] - served["wait_for_change"] == expected
    assert calls["membership"] == served["membership"]
    os.kill(shard_pid(cfg, 1), signal.SIGKILL)
    assert until(lambda: (client.refresh(), len(client.membership.shards) == 2)[1], timeout_s=10), \
        "the shard's death never reached the client"
    relay = client.membership.shards[0]  # the death's version answered the client's poll where it waited
    assert (relay_figure(relay, "relayed_polls") > 0) == (relay_on and not directory_paused)


def test_a_hot_prefix_table_change_alone_leaves_the_pools_the_scheduler_sends_to_its_workers(fleet):
    """A change of the hot-prefix table only (a prefix learned, readers' copies named: up to once a
    second at scale) moves the membership's version but no shard: the client's ``pools()`` must
    stay the same (same version), or every such push makes the scheduler send every pool's
    descriptor to its workers again and re-run its slot supply's full tick (``SchedulerPart.build_connector_meta``)."""
    cfg = fleet(num_shards=3, transport="shm", copy_nodes_per_pool=0)
    client = StoreClient(cfg)
    before = client.pools()
    shards = client.membership.shards
    hot = key(0)
    ray.get(directory(cfg).add_hot_prefix.remote({hot: [shards[0].key]}), timeout=30)
    assert until(lambda: (client.refresh(), hot in client.membership.hot.pools)[1]), "the table never came"
    ray.get(directory(cfg).announce_hot_copies.remote({shards[1].key: [hot]}), timeout=30)
    assert until(lambda: (client.refresh(), len(client.membership.hot.pools[hot]) == 2)[1]), "the copy never came"
    after = client.pools()
    assert after.version == before.version and after is before
    assert client.membership.shards == shards
    # nor does the long poll's answer carry the shard list the client holds already (~1.4 KiB a
    # shard with NIXL: 1.4 MiB to each of 1,000 engines per push at 1,000 shards), only the delta
    held = client.membership
    ray.get(directory(cfg).announce_hot_copies.remote({shards[2].key: [hot]}), timeout=30)
    answer = ray.get(directory(cfg).wait_for_change.remote(held.version, 10.0, known_hot=held.hot.revision,
                                                            shards_held=True))
    assert answer.version != held.version and answer.shards == ()
    # the row grew by one copy: only that pool comes (appended to the row the client holds)
    assert answer.hot_delta.appended == {hot: (shards[2].key,)} and answer.hot_delta.changed == {}
    assert until(lambda: (client.refresh(), len(client.membership.hot.pools[hot]) == 3)[1]), "the copy never came"
    assert client.membership.shards == shards and client.pools() is before


def test_the_hot_prefix_table_names_only_member_pools(fleet):
    """A pool that left (or never was a member) is named by no row of the table, whatever arrives
    after it left: a root owner's hints still naming it when a prefix becomes hot, or a reader's
    announcement of a copy posted before its shard died. A row naming it would keep one of the
    copy bound's places forever (``remove_pool`` ran when it left), so readers would find fewer
    live pools than the bound and copy the block on every node, announcing copies the directory
    then ignores."""
    cfg = fleet(num_shards=3, transport="shm", copy_nodes_per_pool=0)
    d = directory(cfg)
    shards = ray.get(d.membership.remote(), timeout=30).shards
    live, other, gone = (s.key for s in shards)
    ray.get(d.deregister.remote(shards[2].shard_id), timeout=30)
    hot = key(0)
    ray.get(d.add_hot_prefix.remote({hot: [live, gone]}), timeout=30)
    for pool in (gone, ("ucm_ray_shard_nobody", 7), other):
        ray.get(d.announce_hot_copies.remote({pool: [hot]}), timeout=30)
    assert ray.get(d.membership.remote(), timeout=30).hot.pools[hot] == (live, other)


def test_readers_copies_another_push_carried_are_not_pushed_again(fleet):
    """Copies announced within a second of the last copies' push wait for the next (``PushPacer``);
    when another change's push carried them meanwhile, the waiting one has nothing to say and
    must not wake every engine's long poll (1,000 answers and re-posts at 1,000 nodes)."""
    cfg = fleet(num_shards=3, transport="shm", copy_nodes_per_pool=0)
    d = directory(cfg)
    first, second, third = (s.key for s in ray.get(d.membership.remote(), timeout=30).shards)
    hot, other = key(0), key(1)
    ray.get(d.add_hot_prefix.remote({hot: [first]}), timeout=30)
    ray.get(d.announce_hot_copies.remote({second: [hot]}), timeout=30)  # pushed at once
    time.sleep(0.3)
    ray.get(d.announce_hot_copies.remote({third: [hot]}), timeout=30)  # its push waits out the second
    carried = ray.get(d.add_hot_prefix.remote({other: [first]}), timeout=30)  # a push that carries it
    time.sleep(1.5)
    status = ray.get(d.ping.remote(), timeout=30)
    assert status["hot_pools_named"] == 4 and status["version"] == carried


def test_a_dropped_long_poll_answered_after_the_next_one_does_not_stall_the_feed(fleet):
    """review56: ``fetch`` drops an outstanding long poll; the next poll's answer can come first
    (it was posted for an older version: answered at once) and the dropped one's later (the
    membership changed). Its callback then marked the dropped poll as the answered one, so the
    outstanding answer was never looked at again: the feed saw no membership from then on."""
    import dataclasses

    from tests.support.store_helpers import restart_shard
    from ucm_ray.store.engine.feed import MembershipFeed

    cfg = fleet(num_shards=2)
    feed = MembershipFeed(cfg.ray_namespace, 20.0)
    known = feed.fetch()
    assert known is not None and known.version > 1
    assert feed.poll(known) is None  # a long poll, waiting for a change
    assert feed.fetch() is not None  # drops it
    older = dataclasses.replace(known, version=known.version - 1)
    assert feed.poll(older) is None  # posted for an older version: answered at once
    time.sleep(1.0)  # ... its answer is in
    restart_shard(cfg, 0)  # a change: the dropped poll is answered now, after the other
    time.sleep(1.0)
    assert feed.poll(older) is not None


def test_more_engines_waiting_than_rays_default_concurrency_do_not_hold_the_directorys_other_calls(ray_cluster):
    """Every engine holds one long poll at the directory. Past Ray's default ``max_concurrency``
    for an async actor (1,000: 125 nodes of 8 engines) the directory's other calls (a shard's
    registration, a hot-prefix push, an engine's first membership read) queued until polls timed
    out, 30 s later (pushcost17: a push took 30.6 s to get in at 1,200 engines, 60.5 s at 2,000).
    1,100 polls wait here; the directory must still answer at once."""
    import uuid

    from ucm_ray.store.shard.directory import ShardDirectory

    directory = ShardDirectory.options(num_cpus=0, namespace=f"ucm_polls_{uuid.uuid4().hex[:8]}").remote(
        "ucm_polls_nobody")
    version = ray.get(directory.version.remote(), timeout=60)
    polls = [directory.wait_for_change.remote(version, 20.0) for _ in range(999)]
    started = time.monotonic()  # 999 polls and a ping fit Ray's default: see them all arrive
    while ray.get(directory.ping.remote(), timeout=60)["served"].get("wait_for_change", 0) < 999:
        assert time.monotonic() - started < 60, "the long polls never reached the directory"
        time.sleep(0.2)
    polls += [directory.wait_for_change.remote(version, 20.0) for _ in range(101)]
    time.sleep(2.0)  # the last polls on their way in (were they late, the check below would pass anyway)
    try:
        assert ray.get(directory.membership.remote(), timeout=8).version == version
    finally:
        ray.get(polls, timeout=60)  # each answers after its 20 s
        ray.kill(directory)
