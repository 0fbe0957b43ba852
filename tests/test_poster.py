"""The client's control calls go out from a thread of its own (``CallPoster``): in the order the
engine queued them, failures reported per call, nothing queued lost when the client closes."""

from __future__ import annotations

import pytest
import ray

from tests.store_helpers import block, key
from ucm_ray.store.blockstore import Location, Publishes
from ucm_ray.store.client import StoreClient
from ucm_ray.store.poster import CallPoster
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
    assert [ray.get(p.result(timeout=30)) for p in posted] == list(range(300))
    assert ray.get(recorder.all.remote()) == list(range(300))
    poster.close()


def test_a_call_that_cannot_be_posted_fails_alone(ray_cluster):
    recorder = Recorder.remote()
    poster = CallPoster()
    unpostable = poster.post(recorder.add, 1, 2)  # Ray checks the method's signature as it posts
    after = poster.post(recorder.add, 7)
    with pytest.raises(TypeError, match="too many positional arguments"):
        unpostable.result(timeout=30)
    assert ray.get(after.result(timeout=30)) == 7
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
                                       timeout_s=10) == set()
    location = Location(pool[0], pool[1], grant.offsets[0], data.numel())
    writer.commit(Publishes.of([(key(1), location, grant.token)]))  # queued, its answer never read
    writer.close()
    reader = StoreClient(cfg)
    assert reader.lookup([key(1)]) == [True]
    reader.close()
