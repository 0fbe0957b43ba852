"""A node's engines follow the directory through their node's relay shard (``relay_membership``):
they get every pushed version and hot-table change as the directory would have sent it, the
directory answers one poll per relay instead of one per engine, and a relay that dies (or a
directory that restarts) leaves them following the directory, never on an old membership; a
relay whose follower meets an unexpected error says it cannot answer and follows again, and one
passed over after a pause is asked again later."""

from __future__ import annotations

import os
import signal
import threading
import time

import ray

from tests.support.private_cluster import pinned_nodes, run_driver
from tests.support.store_helpers import shard_pid
from ucm_ray.store import membership_relay as relay_module
from ucm_ray.store.engine import feed as feed_module
from ucm_ray.store.engine.feed import MembershipFeed
from ucm_ray.store.membership_relay import MembershipRelay, RelayedMembership
from ucm_ray.store.types import DIRECTORY_NAME, Membership

ENGINES = 4


def directory(cfg):
    return ray.get_actor(DIRECTORY_NAME, namespace=cfg.ray_namespace)


def served(cfg) -> int:
    return ray.get(directory(cfg).ping.remote(), timeout=30)["served"]["wait_for_change"]


def relayed(cfg, shard_id: str) -> int:
    return ray.get(ray.get_actor(shard_id, namespace=cfg.ray_namespace).stats.remote(), timeout=30)["relayed_polls"]


class Engines:
    """``ENGINES`` engines' feeds on this node, each holding its membership as ``RayBlockStore`` does."""

    def __init__(self, cfg, relay: bool = True) -> None:
        node = ray.get_runtime_context().get_node_id() if relay else None
        self.feeds = [MembershipFeed(cfg.ray_namespace, 20.0, relay_node=node) for _ in range(ENGINES)]
        self.held = [feed.fetch() for feed in self.feeds]
        assert all(m is not None for m in self.held)

    def follow_to(self, version: int, timeout_s: float = 60.0) -> list[Membership]:
        """Poll (as the scheduler does every step) until every engine holds ``version``; an engine
        that holds it posts its next poll at ``park``."""
        deadline = time.monotonic() + timeout_s
        while any(m.version != version for m in self.held):
            assert time.monotonic() < deadline, [m.version for m in self.held]
            for i, feed in enumerate(self.feeds):
                if self.held[i].version == version:
                    continue
                got = feed.poll(self.held[i])
                if got is not None:
                    assert got.version != self.held[i].version
                    self.held[i] = got
            time.sleep(0.01)
        return self.held

    def park(self) -> None:
        """Post every engine's next long poll (their scheduler's next step)."""
        for i, feed in enumerate(self.feeds):
            assert feed.poll(self.held[i]) is None


def push(cfg, pools: list, n: int) -> int:
    """A hot-table change: ``n`` rows naming ``pools`` (as a root's owner hands them over)."""
    return ray.get(directory(cfg).add_hot_prefix.remote({f"hot{n}-{i}".encode(): tuple(pools) for i in range(3)}),
                   timeout=30)


def test_a_nodes_engines_get_every_push_through_one_relay_poll(fleet):
    cfg = fleet(num_shards=2, transport="shm")
    engines = Engines(cfg)
    members = engines.held[0]
    pools = [s.key for s in members.shards]
    relay_id = members.shards[0].shard_id  # the lowest shard id on this (the only) node
    engines.follow_to(push(cfg, pools[:1], 0))  # the relay follows the directory from here on
    engines.park()
    time.sleep(0.5)
    before, relayed_before = served(cfg), relayed(cfg, relay_id)
    pushes = 3
    for n in range(1, pushes + 1):
        held = engines.follow_to(push(cfg, pools[n % 2:n % 2 + 1] + pools[:1], n))
        whole = ray.get(directory(cfg).membership.remote(), timeout=30)
        for membership in held:  # the delta applied: the directory's table, the shards kept
            assert membership.hot == whole.hot and membership.hot.revision == whole.hot.revision
            assert [s.key for s in membership.shards] == pools
        engines.park()
    time.sleep(0.5)
    # the relay re-posts once per push; the engines never asked the directory
    assert served(cfg) - before <= pushes + 1, (served(cfg) - before, pushes)
    assert relayed(cfg, relay_id) - relayed_before >= ENGINES * pushes
    assert all(feed.relayed >= pushes and feed.hot_deltas >= pushes for feed in engines.feeds)


def test_without_the_switch_every_engine_polls_the_directory(fleet):
    cfg = fleet(num_shards=2, transport="shm")
    engines = Engines(cfg, relay=False)
    pools = [s.key for s in engines.held[0].shards]
    engines.follow_to(push(cfg, pools, 0))
    engines.park()
    time.sleep(0.5)
    before = served(cfg)
    engines.follow_to(push(cfg, pools[:1], 1))
    engines.park()
    time.sleep(0.5)
    assert served(cfg) - before >= ENGINES
    assert all(feed.relayed == 0 for feed in engines.feeds)


def test_a_killed_relay_leaves_its_engines_following_the_directory_and_the_next_relay(fleet):
    cfg = fleet(num_shards=3, transport="shm")
    engines = Engines(cfg)
    pools = [s.key for s in engines.held[0].shards]
    engines.follow_to(push(cfg, pools, 0))
    engines.park()
    os.kill(shard_pid(cfg, 0), signal.SIGKILL)  # the relay, with every engine's poll waiting on it
    deadline = time.monotonic() + 30
    while len(ray.get(directory(cfg).ping.remote(), timeout=30)["shards"]) != 2:
        assert time.monotonic() < deadline, "the directory never saw the relay die"
        time.sleep(0.1)
    left = ray.get(directory(cfg).version.remote(), timeout=30)
    held = engines.follow_to(left)
    assert all(len(m.shards) == 2 for m in held)
    engines.park()
    later = engines.follow_to(push(cfg, pools[1:2], 1))
    whole = ray.get(directory(cfg).membership.remote(), timeout=30)
    assert all(m.hot == whole.hot for m in later)
    # the next shard on the node relays now: a later push reaches the engines through it
    next_relay = whole.shards[0].shard_id
    engines.park()
    time.sleep(0.5)
    before = relayed(cfg, next_relay)
    engines.follow_to(push(cfg, pools[2:3], 2))
    assert relayed(cfg, next_relay) - before >= ENGINES


def test_a_relay_shut_down_with_polls_waiting_returns_at_once_and_its_engines_move_on(fleet):
    """``shutdown`` (what ``stop_fleet`` sends a shard before killing it) of the relay while every
    engine's poll waits in its relay group: it returns without waiting for them, the directory drops
    the shard and its engines get that version (the relay's own poll brings it) well within a long
    poll, then follow the next relay on the node, the stopped one not yet killed."""
    cfg = fleet(num_shards=3, transport="shm")
    engines = Engines(cfg)
    pools = [s.key for s in engines.held[0].shards]
    relay_id = engines.held[0].shards[0].shard_id
    engines.follow_to(push(cfg, pools, 0))
    engines.park()
    time.sleep(0.5)
    handle = ray.get_actor(relay_id, namespace=cfg.ray_namespace)
    try:
        started = time.monotonic()
        ray.get(handle.shutdown.remote(), timeout=30)
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 15
        while relay_id in ray.get(directory(cfg).membership.remote(), timeout=30).shard_ids:
            assert time.monotonic() < deadline, "the directory never saw the relay stop"
            time.sleep(0.1)
        held = engines.follow_to(ray.get(directory(cfg).version.remote(), timeout=30), timeout_s=10)
        assert all(relay_id not in m.shard_ids for m in held)
        assert time.monotonic() - started < 15  # not a long poll's 30 s, nor the overdue 40 s
        engines.park()
        time.sleep(0.5)
        next_relay = held[0].shards[0].shard_id
        before = relayed(cfg, next_relay)
        later = engines.follow_to(push(cfg, pools[1:2], 1), timeout_s=10)
        whole = ray.get(directory(cfg).membership.remote(), timeout=30)
        assert all(m.hot == whole.hot for m in later)
        assert relayed(cfg, next_relay) - before >= ENGINES
    finally:
        ray.kill(handle)


def test_a_restarted_directory_reaches_engines_behind_a_relay(fleet):
    cfg = fleet(num_shards=2, transport="shm")
    engines = Engines(cfg)
    pools = [s.key for s in engines.held[0].shards]
    engines.follow_to(push(cfg, pools, 0))
    engines.park()
    old = ray.get(directory(cfg).ping.remote(), timeout=30)
    os.kill(old["pid"], signal.SIGKILL)  # Ray restarts it at a random version, its table empty
    deadline = time.monotonic() + 60
    fresh = None
    while fresh is None or fresh["pid"] == old["pid"] or len(fresh["shards"]) != 2:
        assert time.monotonic() < deadline, "the directory was not restarted"
        try:
            fresh = ray.get(directory(cfg).ping.remote(), timeout=5)
        except Exception:  # noqa: BLE001 -- restarting
            time.sleep(0.2)
    held = engines.follow_to(fresh["version"])
    assert all(len(m.hot) == 0 and len(m.shards) == 2 for m in held)
    later = engines.follow_to(push(cfg, pools[:1], 1))
    whole = ray.get(directory(cfg).membership.remote(), timeout=30)
    assert all(m.hot == whole.hot for m in later)


def test_a_frozen_relay_is_passed_over_after_its_poll_is_overdue(fleet, monkeypatch):
    monkeypatch.setattr(feed_module, "RELAY_POLL_S", 1.0)  # the relay answers by then; overdue 10 s later
    cfg = fleet(num_shards=2, transport="shm")
    engines = Engines(cfg)
    pools = [s.key for s in engines.held[0].shards]
    engines.follow_to(push(cfg, pools, 0))
    engines.park()
    pid = shard_pid(cfg, 0)
    os.kill(pid, signal.SIGSTOP)  # alive to the directory, answering nothing
    try:
        started = time.monotonic()
        held = engines.follow_to(push(cfg, pools[1:], 1), timeout_s=40)
        assert time.monotonic() - started < feed_module.RELAY_POLL_S + feed_module.RELAY_GRACE_S + 15
        whole = ray.get(directory(cfg).membership.remote(), timeout=30)
        assert all(m.hot == whole.hot for m in held)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_each_nodes_engines_follow_their_own_nodes_relay():
    """Two raylets, two shards each, two engines each: each node's engines poll the lowest shard id
    of their own node, and the directory answers one poll per node a push."""
    result, _ = run_driver("membership_relay_driver.py", [], pinned_nodes(2), 300)
    pushes = 3
    assert all(set(node["versions"]) == {result["version"]} for node in result["last"])
    assert all(set(node["hot_revisions"]) == {result["hot_revision"]} for node in result["last"])
    assert all(min(node["relayed"]) >= pushes for node in result["last"])
    by_node: dict[str, list[str]] = {}
    for shard_id, node in sorted(result["shard_nodes"].items()):
        by_node.setdefault(node, []).append(shard_id)
    assert len(by_node) == 2
    for shard_ids in by_node.values():
        relay, other = shard_ids  # by shard id: the lowest relays
        assert result["relayed_polls"][relay] >= 2 * pushes, result  # the node's two engines, every push
        assert result["relayed_polls"][other] == 0, result
    assert result["directory_polls"] <= 2 * (pushes + 1), result  # one per relay a push


def relay_holds(cfg, relay_id: str, version: int, timeout_s: float = 10.0) -> None:
    """Until relay ``relay_id`` follows the directory at ``version`` (an engine posting there
    behind it is sent to the directory for a round)."""
    handle = ray.get_actor(relay_id, namespace=cfg.ray_namespace)
    deadline = time.monotonic() + timeout_s
    while (held := ray.get(handle.relay_wait_for_change.remote(0, 0.0), timeout=30)) is None or \
            held.version != version:
        assert time.monotonic() < deadline, "the relay never followed the directory to that version"
        time.sleep(0.05)


def test_a_relay_passed_over_after_a_pause_is_asked_again_later(fleet, monkeypatch):
    """The node's one shard paused past the grace (a long GC pause) is passed over: its engines
    follow the directory; ``RELAY_READMIT_S`` later, at their next poll, they are back on it
    (before, they stayed on the directory for that shard's lifetime)."""
    monkeypatch.setattr(feed_module, "RELAY_POLL_S", 1.0)
    monkeypatch.setattr(feed_module, "RELAY_GRACE_S", 1.0)  # a relay's poll overdue 2 s after it was posted
    monkeypatch.setattr(feed_module, "RELAY_READMIT_S", 5.0)
    cfg = fleet(num_shards=1, transport="shm")
    engines = Engines(cfg)
    pools = [s.key for s in engines.held[0].shards]
    relay_id = engines.held[0].shards[0].shard_id
    engines.follow_to(push(cfg, pools, 0))
    engines.park()
    pid = shard_pid(cfg, 0)
    os.kill(pid, signal.SIGSTOP)
    try:
        engines.follow_to(push(cfg, pools, 1), timeout_s=20)  # passed over: the directory answers
        engines.park()
        direct = [feed.relayed for feed in engines.feeds]
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(feed_module.RELAY_READMIT_S + 1)
    version = push(cfg, pools, 2)
    engines.follow_to(version, timeout_s=20)  # from the directory's poll; the next goes to the relay
    relay_holds(cfg, relay_id, version)
    engines.park()
    time.sleep(0.5)
    before = relayed(cfg, relay_id)
    engines.follow_to(push(cfg, pools, 3), timeout_s=20)
    assert relayed(cfg, relay_id) - before >= ENGINES
    assert all(feed.relayed > was for feed, was in zip(engines.feeds, direct))


class FailsOnce:
    """``RelayedMembership.take`` raising once, when armed: a defect the relay's follower meets
    (an answer it cannot take), of no kind it expects."""

    def __init__(self) -> None:
        self.armed = False
        self.raised = threading.Event()
        self._take = RelayedMembership.take

    def __call__(self, state: RelayedMembership, answer: Membership, posted_version: int) -> bool:
        if self.armed and not self.raised.is_set():
            self.raised.set()
            raise RuntimeError("an answer the relay cannot take")
        return self._take(state, answer, posted_version)


def test_a_relay_whose_follower_meets_an_unexpected_error_cannot_say_then_follows_again(fleet, monkeypatch):
    """A relay (this process's, on the fleet's directory) whose follower raises what it does not
    expect: an engine's poll is answered None within ``SYNC_WAIT_S`` (it asks the directory), not
    after its long poll with the old membership (the follower had died: every engine on the node
    got pushes only once the relay fell silent, ~30-60 s late), and it follows the next pushes."""
    fails = FailsOnce()
    monkeypatch.setattr(RelayedMembership, "take", lambda state, answer, posted: fails(state, answer, posted))
    cfg = fleet(num_shards=1, transport="shm")
    pools = [s.key for s in ray.get(directory(cfg).membership.remote(), timeout=30).shards]
    relay = MembershipRelay(cfg.ray_namespace)
    try:
        held = relay.wait_for_change(0, 10.0)
        assert held is not None
        fails.armed = True
        pushed = push(cfg, pools, 0)
        assert fails.raised.wait(10)
        started = time.monotonic()
        answer = relay.wait_for_change(held.version, 10.0)
        assert time.monotonic() - started < relay_module.SYNC_WAIT_S + 1
        assert answer is None or answer.version == pushed, (answer, held.version, pushed)
        deadline = time.monotonic() + relay_module.RETRY_S + 10
        while (answer := relay.wait_for_change(held.version, 1.0)) is None:  # following again
            assert time.monotonic() < deadline, "the relay never followed the directory again"
        assert answer.version == pushed
        later = push(cfg, pools, 1)
        answer = relay.wait_for_change(pushed, 10.0)
        assert answer is not None and answer.version == later
    finally:
        relay.stop()


class FailsWhileArmed:
    """``RelayedMembership.take`` raising while armed, counting its raises (each a follower's try)."""

    def __init__(self) -> None:
        self.armed = True
        self.raised = 0
        self._take = RelayedMembership.take

    def __call__(self, state: RelayedMembership, answer: Membership, posted_version: int) -> bool:
        if self.armed:
            self.raised += 1
            raise RuntimeError("an answer the relay cannot take")
        return self._take(state, answer, posted_version)


def test_a_relay_follows_again_after_more_failures_in_a_row_than_a_float_doubles(fleet, monkeypatch):
    """The follower's wait was ``RETRY_S * 2 ** failures``: at the 1,024th failure in a row (~8.5 h
    of a directory gone, or of an answer it cannot take, at ``RETRY_MAX_S``) the int did not
    convert to a float, and the OverflowError ended the follower for good: its engines were told
    'cannot say' for the relay's lifetime (review65b). Here the tries come without a wait."""
    fails = FailsWhileArmed()
    monkeypatch.setattr(RelayedMembership, "take", lambda state, answer, posted: fails(state, answer, posted))
    monkeypatch.setattr(relay_module, "RETRY_S", 0.0)
    cfg = fleet(num_shards=1, transport="shm")
    relay = MembershipRelay(cfg.ray_namespace)
    try:
        assert relay.wait_for_change(0, 0.0) is None  # starts the follower
        deadline = time.monotonic() + 120
        while fails.raised < 1100:
            assert time.monotonic() < deadline, f"the follower stopped trying after {fails.raised} failures"
            time.sleep(0.1)
        fails.armed = False
        deadline = time.monotonic() + 30
        while relay.wait_for_change(0, 1.0) is None:
            assert time.monotonic() < deadline, "the relay never followed the directory again"
    finally:
        relay.stop()
