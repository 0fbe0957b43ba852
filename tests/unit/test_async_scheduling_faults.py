"""Review of issue 43 (asynchronous scheduling): the faults and situations the synchronous
tests cover, played with vLLM's ``AsyncScheduler`` and its batch queue of two
(``make_engine(..., async_scheduling=True)``) and ``check_reads`` (a token computed from a block
holding other bytes is ``POISONED_TOKEN``). Every hit of a dense model loads asynchronously there.
"""

from __future__ import annotations

import time

import pytest
from vllm.v1.request import RequestStatus

from tests.support.faulty_pools import BrokenPosts, hung_loads
from tests.support.store_helpers import corrupt_stored_blocks
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.local import LocalBlockStore
from ucm_ray.store.types import Locations
from ucm_ray.testing.clock import AdvancingClock
from ucm_ray.testing.harness import POISONED_TOKEN, TOKEN, Engine, make_engine, prompt

SHARDS = ("local_shard_0", "local_shard_1")


def _async(store, model_dir, **kwargs) -> Engine:
    engine = make_engine(store.client(), model_dir, async_scheduling=True, **kwargs)
    engine.check_reads = True
    assert engine.connector.scheduler_part.geometry.async_loads
    return engine


def _written(store, model_dir, tokens: list[int], **kwargs) -> Engine:
    a = make_engine(store.client(), model_dir, **kwargs)
    a.serve("A", tokens)
    a.settle()
    return a


def _drain(engine: Engine, *reqs, timeout_s: float = 60.0) -> None:
    """Run the requests to their end, then the batch queue's last outputs, then settle."""
    engine.run(*reqs, timeout_s=timeout_s)
    for _ in range(3):
        engine.step()
    engine.settle()


def _pins(store: LocalBlockStore) -> int:
    return sum(store.index(shard).stats().pins for shard in SHARDS)


def _outputs(*reqs) -> list[int]:
    return [t for r in reqs for t in r.output_token_ids]


def test_async_hits_are_saved_again_right_after_a_failed_block(store, model_dir):
    """B's hit fails at block 10 (checksum): vLLM recomputes 10..15; B must save them again, so a
    third engine reads the whole prompt back, every byte right."""
    p = prompt(16 * 128)
    a = _written(store, model_dir, p, extra={"checksum": True})
    assert corrupt_stored_blocks(store, a, p, [10]) == 1
    b = _async(store, model_dir)
    r = b.add("B", p, max_tokens=4)
    _drain(b, r)
    assert _outputs(r) == [TOKEN] * 4 and b.wrong_blocks == 0 and b.failed_loads == 1
    c = make_engine(store.client(), model_dir)
    c.check_reads = True
    assert c.serve("C", p, max_tokens=3)[0] == 16 * 128 - 2
    assert c.wrong_blocks == 0 and c.failed_loads == 0
    assert _pins(store) == 0


def test_preemption_under_async_scheduling(store, model_dir):
    """Out of KV blocks, vLLM preempts a request; it comes back with a store hit, loaded
    asynchronously; every token the model's."""
    eng = _async(store, model_dir, num_blocks=24)
    x = eng.add("X", prompt(1280, seed=3), max_tokens=400)
    y = eng.add("Y", prompt(1280, seed=4), max_tokens=400)
    _drain(eng, x, y)
    preempted = [r for r in (x, y) if r.num_preemptions > 0]
    assert preempted, "the scenario must preempt a request"
    for r in preempted:
        assert eng.loaded_blocks.get(r.request_id, 0) > 0
    assert POISONED_TOKEN not in _outputs(x, y)
    assert eng.wrong_blocks == 0 and _pins(store) == 0


def test_a_request_aborted_while_its_async_load_is_in_flight(store, model_dir):
    """The request is aborted in the step its load is dispatched in: vLLM holds its blocks until
    the worker reports it received; nothing raises, nothing stays pinned, the next request's
    tokens are the model's."""
    p = prompt(16 * 128)
    _written(store, model_dir, p)
    b = _async(store, model_dir)
    r = b.add("B", p, max_tokens=4)
    deadline = time.monotonic() + 30
    while "B" not in b.loaded_blocks:
        assert time.monotonic() < deadline
        b.step()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    b.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    for _ in range(5):
        b.step()
    b.settle()
    assert _pins(store) == 0
    s = b.add("S", p + [5] * 100, max_tokens=4)
    _drain(b, s)
    assert _outputs(s) == [TOKEN] * 4 and b.wrong_blocks == 0 and _pins(store) == 0


def test_a_request_aborted_after_its_load_landed_before_it_ran(store, model_dir):
    """Aborted between the worker's report (finished receiving) and its first scheduled step."""
    p = prompt(16 * 128)
    _written(store, model_dir, p)
    b = _async(store, model_dir)
    r = b.add("B", p, max_tokens=4)
    deadline = time.monotonic() + 30
    while "B" not in b.sched.finished_recving_kv_req_ids:
        assert time.monotonic() < deadline
        b.step()
    b.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    for _ in range(5):
        b.step()
    b.settle()
    assert r.is_finished() and _pins(store) == 0
    s = b.add("S", p + [5] * 100, max_tokens=4)
    _drain(b, s)
    assert _outputs(s) == [TOKEN] * 4 and b.wrong_blocks == 0 and _pins(store) == 0


def _steps(engine: Engine, req, steps: int) -> None:
    """At most ``steps`` steps, until ``req`` finished."""
    for _ in range(steps):
        if req.is_finished():
            break
        engine.step()


def test_a_hit_whose_first_block_fails_is_not_looked_up_and_loaded_again_forever(store, model_dir):
    """Every copy raises (a pool this worker cannot reach, a bug on the copy thread): every block
    fails, so vLLM cuts the hit to nothing, frees the blocks and asks the connector again, which
    claims the same hit from the same entries: the request loops on lookup and failed load and
    never runs (200 steps: 100 lookups, 1,600 failed blocks; synchronously it recomputes)."""
    p = prompt(16 * 128)
    _written(store, model_dir, p)

    b = _async(store, model_dir, pool_connections=BrokenPosts)
    r = b.add("B", p, max_tokens=4)
    _steps(b, r, 200)
    stats = b.stats()
    assert (r.is_finished(), stats["lookups"], stats["load_failures"]) == (True, 1, 16)
    for _ in range(3):
        b.step()
    assert _outputs(r) == [TOKEN] * 4 and b.wrong_blocks == 0 and b.prefill_computed["B"] == 16 * 128


def test_a_hung_pool_under_async_scheduling_does_not_loop(store, model_dir):
    """As above with a pool that never answers (each try waits ``transfer_timeout_s``). The
    worker's clock is frozen: the step's deadline passes when the hung pool used it up, not when
    the host is slow. Each load is posted 0.3 s late, as a loaded host's copy thread was (CI):
    with the host's clock and a 0.2 s timeout the step missed its deadline before any load was
    posted, no pool was waited for and none named (``store.suspected`` empty)."""
    p = prompt(16 * 128)
    _written(store, model_dir, p)

    clock = AdvancingClock()
    clock.freeze()
    b = _async(store, model_dir, pool_connections=hung_loads(clock, late_s=0.3), worker_clock=clock)
    r = b.add("B", p + prompt(1024, seed=77), max_tokens=4)
    _steps(b, r, 40)
    stats = b.stats()
    assert store.suspected
    assert (r.is_finished(), stats["lookups"], stats["load_failures"]) == (True, 1, 16)


def test_a_cold_request_decoding_past_a_block_reads_right_under_async_scheduling(store, model_dir):
    """The harness itself: a block that a step fills before the scheduler knows its last token
    (sampled by the step before, whose output comes back after) holds the block's value once the
    token is known. It held ``PARTIAL`` before, and every later token was ``POISONED_TOKEN``
    with no store hit at all."""
    b = _async(store, model_dir)
    r = b.add("B", prompt(1661, seed=99), max_tokens=8)  # decode fills block 12 at 1664 tokens
    _drain(b, r)
    assert _outputs(r) == [TOKEN] * 8 and b.stats().get("hit_tokens", 0) == 0


def test_many_requests_hitting_at_once(store, model_dir):
    """Six requests, three prompts (two each), every one stored: all load (or hit vLLM's cache)
    asynchronously in the same steps; every token the model's."""
    prompts = [prompt(12 * 128, seed=s) for s in (1, 2, 3)]
    a = make_engine(store.client(), model_dir)
    for i, p in enumerate(prompts):
        a.serve(f"A{i}", p)
    a.settle()
    b = _async(store, model_dir, num_blocks=160)
    reqs = [b.add(f"B{i}", prompts[i % 3] + [i + 11] * (i * 30 + 5), max_tokens=5) for i in range(6)]
    _drain(b, *reqs)
    assert _outputs(*reqs) == [TOKEN] * 30 and b.wrong_blocks == 0 and _pins(store) == 0


def test_many_requests_hitting_at_once_one_block_bad(store, model_dir):
    """As above, the stored block 5 of the first prompt failing its checksum."""
    prompts = [prompt(12 * 128, seed=s) for s in (1, 2, 3)]
    a = make_engine(store.client(), model_dir, extra={"checksum": True})
    for i, p in enumerate(prompts):
        a.serve(f"A{i}", p)
    a.settle()
    assert corrupt_stored_blocks(store, a, prompts[0], [5]) == 1
    b = _async(store, model_dir, num_blocks=160)
    reqs = [b.add(f"B{i}", prompts[i % 3] + [i + 11] * (i * 30 + 5), max_tokens=5) for i in range(6)]
    _drain(b, *reqs)
    assert _outputs(*reqs) == [TOKEN] * 30 and b.wrong_blocks == 0 and _pins(store) == 0


def test_chunked_prefill_of_a_long_hit(store, model_dir):
    """A 40-block hit and 3,000 new tokens, 512 tokens a step."""
    p = prompt(40 * 128, seed=9)
    _written(store, model_dir, p)
    b = _async(store, model_dir, max_batched=512, num_blocks=160)
    r = b.add("B", p + prompt(3000, seed=10), max_tokens=4)
    _drain(b, r)
    assert _outputs(r) == [TOKEN] * 4 and b.wrong_blocks == 0
    assert b.first["B"][0] == 40 * 128 and _pins(store) == 0


def test_chunked_prefill_of_a_long_hit_with_a_bad_block(store, model_dir):
    p = prompt(40 * 128, seed=9)
    a = _written(store, model_dir, p, extra={"checksum": True})
    assert corrupt_stored_blocks(store, a, p, [20]) == 1
    b = _async(store, model_dir, max_batched=512, num_blocks=160)
    r = b.add("B", p + prompt(3000, seed=10), max_tokens=4)
    _drain(b, r)
    assert _outputs(r) == [TOKEN] * 4 and b.wrong_blocks == 0 and b.failed_loads == 1
    assert b.first["B"][0] == 20 * 128 and _pins(store) == 0


class EveryPoolElsewhere(LocalBlockStore):
    """A client of the shared store whose pools all stand on another node (test_remote_copies)."""

    def __init__(self, shared: LocalBlockStore) -> None:
        self.__dict__.update(shared.client().__dict__)

    def remote_rows(self, locations: Locations) -> list[int]:
        return list(range(len(locations.pool)))


def test_copies_kept_of_an_async_loaded_hit(store, model_dir):
    """``remote_copy_reads``: the async-loaded blocks are copied into this node's pools; a
    third engine reads them back right."""
    document = prompt(16 * 128, seed=21)
    _written(store, model_dir, document)
    reader = make_engine(EveryPoolElsewhere(store), model_dir, extra={"remote_copy_reads": 1},
                         async_scheduling=True)
    reader.check_reads = True
    r = reader.add("B", document + [5] * 40, max_tokens=4)
    _drain(reader, r)
    assert _outputs(r) == [TOKEN] * 4 and reader.wrong_blocks == 0
    assert reader.stats()["copies_kept"] == 16
    c = make_engine(store.client(), model_dir)
    c.check_reads = True
    assert c.serve("C", document + [6] * 40)[0] == 16 * 128
    assert c.wrong_blocks == 0 and c.failed_loads == 0 and _pins(store) == 0


def test_copies_kept_of_an_async_load_with_a_bad_block(store, model_dir):
    """One stored block fails its checksum: none of the loaded blocks is copied."""
    document = prompt(16 * 128, seed=21)
    a = _written(store, model_dir, document, extra={"checksum": True})
    assert corrupt_stored_blocks(store, a, document, [7]) == 1
    reader = make_engine(EveryPoolElsewhere(store), model_dir, extra={"remote_copy_reads": 1},
                         async_scheduling=True)
    reader.check_reads = True
    r = reader.add("B", document + [5] * 40, max_tokens=4)
    _drain(reader, r)
    assert _outputs(r) == [TOKEN] * 4 and reader.wrong_blocks == 0 and reader.failed_loads == 1
    assert reader.stats().get("copies_kept", 0) == 0
    c = make_engine(store.client(), model_dir)
    c.check_reads = True
    c.serve("C", document + [6] * 40)
    assert c.wrong_blocks == 0 and c.failed_loads == 0 and _pins(store) == 0


def test_speculation_under_async_scheduling(store, model_dir):
    p = prompt(16 * 128)
    _written(store, model_dir, p, num_spec=3)
    b = _async(store, model_dir, num_spec=3)
    r = b.add("B", p, max_tokens=6)
    _drain(b, r)
    assert POISONED_TOKEN not in _outputs(r) and b.wrong_blocks == 0 and _pins(store) == 0


@pytest.mark.parametrize("saved_first", [True, False], ids=["saved", "decode_first"])
def test_pd_decode_under_async_scheduling(store, model_dir, saved_first):
    """A PD prefill (synchronous) hands its params to a decode engine scheduling asynchronously:
    after the prefill's saves landed, or before (the decode waits, then hits them)."""
    p = prompt(2048 + 100, seed=46 if saved_first else 47)
    config = UcmRayConfig(pd_wait_s=30.0)
    a = make_engine(store.client(), model_dir, config=config)
    a.run(a.add("P", p, max_tokens=1,
                kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False}))
    params = a.transfer_params["P"]
    if saved_first:
        a.settle()
    b = _async(store, model_dir, config=config)
    d = b.add("D", p, max_tokens=3, kv_transfer_params=params)
    if not saved_first:
        for _ in range(5):
            b.step()
        a.settle()
    _drain(b, d)
    assert _outputs(d) == [TOKEN] * 3 and b.wrong_blocks == 0
    assert b.first["D"][0] >= 2048 - 2 and _pins(store) == 0


def test_sync_baseline_saves_again_after_a_failed_block(store, model_dir):
    """The same as ``test_async_hits_are_saved_again_right_after_a_failed_block``, synchronous."""
    p = prompt(16 * 128)
    a = _written(store, model_dir, p, extra={"checksum": True})
    assert corrupt_stored_blocks(store, a, p, [10]) == 1
    b = make_engine(store.client(), model_dir)
    b.check_reads = True
    r = b.add("B", p, max_tokens=4)
    _drain(b, r)
    assert _outputs(r) == [TOKEN] * 4 and b.wrong_blocks == 0 and b.failed_loads == 1
    c = make_engine(store.client(), model_dir)
    c.check_reads = True
    assert c.serve("C", p, max_tokens=3)[0] == 16 * 128 - 2


@pytest.mark.parametrize("bad", [0, 15])
def test_a_failed_first_or_last_block_of_an_async_hit(store, model_dir, bad):
    """Block 0 fails its checksum (the hit is cut to nothing: vLLM frees the blocks and asks
    again; the entry is removed by then, so the retry misses) or block 15 (the one the hit ends
    inside): every token the model's, nothing pinned."""
    p = prompt(16 * 128)
    a = _written(store, model_dir, p, extra={"checksum": True})
    assert corrupt_stored_blocks(store, a, p, [bad]) == 1
    b = _async(store, model_dir)
    r = b.add("B", p, max_tokens=4)
    _drain(b, r, timeout_s=20)
    assert _outputs(r) == [TOKEN] * 4 and b.wrong_blocks == 0 and b.failed_loads == 1
    assert b.stats()["lookups"] <= 2 and _pins(store) == 0


def test_an_async_loaded_hit_saves_only_its_new_blocks_and_they_read_back_right(store, model_dir):
    """B hits 16 stored blocks and computes 300 more tokens (2 new full blocks): it saves those 2
    only (the loaded ones are not saved again), and C reads all 18 back, every byte right."""
    p = prompt(16 * 128)
    _written(store, model_dir, p)
    longer = p + prompt(300, seed=5)
    b = _async(store, model_dir)
    r = b.add("B", longer, max_tokens=4)
    _drain(b, r)
    assert _outputs(r) == [TOKEN] * 4 and b.wrong_blocks == 0
    assert b.stats()["saved_blocks"] == 2
    c = make_engine(store.client(), model_dir)
    c.check_reads = True
    assert c.serve("C", longer + [9] * 10, max_tokens=3)[0] == 18 * 128
    assert c.wrong_blocks == 0 and c.failed_loads == 0 and _pins(store) == 0


def test_blocks_filled_while_decoding_under_async_scheduling_read_back_right(store, model_dir):
    """B decodes 400 tokens under asynchronous scheduling; the blocks its decode filled are
    saved, and C reads the prompt and those tokens back, every byte right."""
    p = prompt(1000, seed=31)
    b = _async(store, model_dir)
    r = b.add("B", p, max_tokens=400)
    _drain(b, r)
    assert _outputs(r) == [TOKEN] * 400 and b.wrong_blocks == 0
    c = make_engine(store.client(), model_dir)
    c.check_reads = True
    got = c.serve("C", p + [TOKEN] * 399 + [3] * 20, max_tokens=3)[0]
    assert got >= 10 * 128 and c.wrong_blocks == 0 and c.failed_loads == 0 and _pins(store) == 0
