"""The client's control calls go out from a thread of its own (``CallPoster``): in the order the
engine queued them, failures reported per call, nothing queued lost when the client closes."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
import ray

from tests.support.store_helpers import block, key, lookups_missing_own_commits, written_slots
from ucm_ray.store.engine.calls import ShardAccess
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.engine.poster import CallPoster
from ucm_ray.store.types import Location, Publishes
from ucm_ray.testing.clock import AdvancingClock
from ucm_ray.transport.base import CopyOp, Ranges


@ray.remote(num_cpus=0)
class Recorder:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def add(self, n: int) -> int:
        self.seen.append(n)
        return n

    def all(self) -> list[int]:
        return self.seen


def test_calls_reach_the_actor_in_the_order_queued(ray_cluster):
    recorder = Recorder.remote()
    poster = CallPoster()
    posted = [poster.post(recorder.add, n) for n in range(300)]
    assert [p.result(timeout=30).answer.result(timeout=30) for p in posted] == list(range(300))
    assert ray.get(recorder.all.remote()) == list(range(300))
    poster.close()


def test_a_call_that_cannot_be_posted_fails_alone(ray_cluster):
    recorder = Recorder.remote()
    poster = CallPoster()
    unpostable = poster.post(recorder.add, 1, 2)  # Ray checks the method's signature as it posts
    after = poster.post(recorder.add, 7)
    with pytest.raises(TypeError, match="too many positional arguments"):
        unpostable.result(timeout=30)
    assert after.result(timeout=30).answer.result(timeout=30) == 7
    poster.close()


def test_a_commit_queued_just_before_close_is_still_made(fleet):
    cfg = fleet(num_shards=1)
    writer = StoreClient(cfg)
    data = block(1).clone()
    writer.register_local(data)
    (pool,) = writer.owners([key(1)])[0]
    grant = writer.reserve(pool, data.numel(), 1).result()
    assert grant is not None
    assert writer.connections.transfer({pool: Ranges.of([CopyOp(grant.offsets[0], data)])}, write=True,
                                       timeout_s=10).pools == set()
    location = Location(pool[0], pool[1], grant.offsets[0], data.numel())
    writer.commit(Publishes.of([(key(1), location, grant.token)]))  # queued, its answer never read
    writer.close()
    reader = StoreClient(cfg)
    assert reader.lookup([key(1)]) == [True]
    reader.close()


def test_a_call_queued_after_close_fails_at_once(ray_cluster):
    recorder = Recorder.remote()
    poster = CallPoster()
    poster.close()
    late = poster.post(recorder.add, 1)
    assert late.done() and isinstance(late.exception(), RuntimeError)


@ray.remote(num_cpus=0)
class Gate:
    """A shard call that answers only once the test opens the gate (an async actor: ``open``
    runs while ``answer`` waits)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()

    async def answer(self, value: float) -> float:
        await self._open.wait()
        return value

    async def open(self) -> None:
        self._open.set()


def frozen_access(client: StoreClient) -> tuple[ShardAccess, AdvancingClock]:
    """The client's ``ShardAccess`` on a frozen clock: a call's deadline passes only when the test
    advances it, not when a loaded host is slow."""
    clock = AdvancingClock()
    clock.freeze()
    return replace(client.access, clock=clock), clock


def returns_within(call, seconds: float):
    """``call()``'s value, failing (not hanging) when it has not returned within ``seconds`` of
    the host's time: a bound for a call that must not wait for an answer that never comes."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still waiting after {seconds} s"
    return out[0]


def test_a_fanout_with_one_call_unposted_still_polls_the_others_without_waiting(fleet):
    """Poll is False while a call is still answering (held by a gate, not a sleep), True once it
    answered; ``result`` then takes the answers without waiting: with the deadline already past
    (the test's clock advanced), a wait would have made it None."""
    from ucm_ray.store.engine.calls import Fanout

    client = StoreClient(fleet(num_shards=1))
    access, clock = frozen_access(client)
    record = client.membership.shards[0]
    gate = Gate.remote()
    unposted = access.poster.post(gate.answer, 1, 2)  # a signature Ray refuses as it posts
    in_flight = access.poster.post(gate.answer, 2.0)
    fanout = Fanout(access, [(record, unposted), (record, in_flight)], lambda answers: answers)
    for _ in range(50):
        assert not fanout.poll(), "poll said done while a call was still answering"
        time.sleep(0.01)
    ray.get(gate.open.remote())
    while not fanout.poll():
        time.sleep(0.01)
    clock.advance(access.timeout_s + 1.0)
    assert fanout.result() == [None, 2.0]
    client.close()


@ray.remote(num_cpus=0)
class Failing:
    def answer(self) -> None:
        raise ValueError("refused")


def test_a_fanout_answers_none_for_a_call_that_raised_or_outlived_its_deadline(fleet):
    """Each posted call's answer is a future that the poster's thread made: one that raised, or
    one still running at the deadline, is that shard's failure (the shard turns suspect), and
    ``result`` does not wait past the deadline. The deadline is on a frozen clock: it passes when
    the test advances it (a loaded host that was slow to start the actor made ``raised`` a
    timeout, and the timed bound on ``late`` failed)."""
    from ucm_ray.store.engine.calls import Fanout

    client = StoreClient(fleet(num_shards=1, lookup_timeout_s=60.0))
    access, clock = frozen_access(client)
    record = client.membership.shards[0]
    raised = Fanout(access, [(record, access.poster.post(Failing.remote().answer))], lambda answers: answers)
    assert raised.result() == [None]
    assert access.suspects.suspect(record)
    late = Fanout(access, [(record, access.poster.post(Gate.remote().answer, 5.0))], lambda answers: answers)
    assert not late.poll()
    clock.advance(access.timeout_s + 1.0)  # the gate never opens: the call outlives its deadline
    assert returns_within(late.result, 30.0) == [None]
    assert late.poll()  # answered: never polled as pending again
    client.close()


def test_a_lookup_right_after_a_commit_of_the_same_client_finds_the_key(fleet):
    """The commit is queued to the poster, the lookup (pinned: a shard call) posted at once: it
    must still reach the shard after the commit (it overtook it in 156 of 200 tries before)."""
    cfg = fleet(num_shards=1)
    client = StoreClient(cfg)
    count, size = 50, 4096
    pool, grant = written_slots(client, count, size)
    missed = lookups_missing_own_commits(client, pool, grant, size)
    assert missed == 0, f"{missed} of {count} lookups overtook this client's own commit"
    client.close()
