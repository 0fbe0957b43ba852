"""Prefill/decode through the tier (issue 41), both connector halves in one process: a prefill
engine and a decode engine on one ``LocalBlockStore``, the decode handed the prefill's
``kv_transfer_params`` as a PD proxy hands them, with no pause between the two (a proxy makes
none). The decode must neither outrun the prefill's saves silently nor wait for them forever.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import pytest

from ucm_ray import policy
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.local import LocalBlockStore
from ucm_ray.store.types import Done
from ucm_ray.testing.clock import AdvancingClock
from ucm_ray.testing.harness import Engine, make_engine, prompt
from ucm_ray.vllm.scheduler import HOLD_S

hybrid_harness = pytest.mark.hybrid_harness
"""A hybrid cache through the harness: deselected on vLLM 0.26, which refuses hybrids."""

PROMPT = 2048 + 100
"""A prompt of 16 full blocks of 128 and a partial one: the prefill announces the full ones."""
PD_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
"""What Ray Serve LLM's PD proxy sends the prefill (vLLM's own PD proxies send the same keys)."""
SHARDS = ("local_shard_0", "local_shard_1")
WAIT_S = 30.0
"""``pd_wait_s`` where a test steps a waiting decode and then advances its clock past the wait:
far longer than any run of steps takes on a loaded host (the clock follows the host's time),
so the decode cannot stop waiting before the test means it to."""


def _prefill(engine: Engine, req_id: str, tokens: list[int]) -> dict:
    """Run a PD prefill to its only token; the params vLLM's output hands the proxy."""
    engine.run(engine.add(req_id, tokens, max_tokens=1, kv_transfer_params=dict(PD_PREFILL)))
    return engine.transfer_params[req_id]


def _store_looks(engine: Engine) -> list[str]:
    """Record every call the engine's scheduler half makes to look keys up (published-index
    checks included, though they cost no round trip)."""
    calls: list[str] = []
    store = engine.connector.scheduler_part.lookups._store
    for name in ("acquire", "surely_absent"):
        real = getattr(store, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        setattr(store, name, counted)
    return calls


def test_a_pd_prefill_returns_the_prompt_tokens_it_saves_under_our_own_key(store, model_dir):
    """The prefill's output carries, under ``ucm_ray`` (so vLLM's MultiConnector cannot clash),
    the block-aligned prompt tokens it saves and its namespace; a request that no decode
    continues gets no params. Its blocks are held until saved, and its prompt is saved whole in
    the very step after its token: its write slots were asked for at its lookup (a request's
    are asked for at its first token, so a fresh engine's first save waits a step for them)."""
    a = make_engine(store.client(), model_dir)
    part = a.connector.scheduler_part
    saved_per_step: list[int] = []
    a.before_worker = lambda engine, meta: saved_per_step.append(sum(len(job.block_ids)
                                                                     for job in meta.saves.values()))
    params = _prefill(a, "P", prompt(PROMPT, seed=41))
    assert params == {"ucm_ray": {"tokens": 2048, "namespace": part.namespaces[0].hex()}}
    assert "P" in a.sched.requests, "vLLM freed the prefill's blocks before they were saved"
    prompt_steps = len(saved_per_step)
    a.step()
    assert saved_per_step[:prompt_steps] == [0] * prompt_steps and saved_per_step[prompt_steps] == 16
    a.run(a.add("plain", prompt(PROMPT, seed=42), max_tokens=1))
    assert "plain" not in a.transfer_params
    a.settle()
    assert a.stats()["saved_blocks"] == 2 * 16 and "P" not in a.sched.requests


def test_a_decode_asks_again_while_the_prefills_saves_are_pending_then_hits_them(store, model_dir):
    """The decode arrives while the prefill's saves are still to be made (the prefill's next
    step makes them): its lookup answers "ask again", at a backoff rather than a store look per
    scheduler step; once the prefill's saves are committed, its hit is what the policy makes of
    the announced tokens, and every loaded byte is right."""
    p = prompt(PROMPT, seed=43)
    a = make_engine(store.client(), model_dir)
    params = _prefill(a, "P", p)
    b = make_engine(store.client(), model_dir, config=UcmRayConfig(pd_wait_s=WAIT_S))
    looks = _store_looks(b)
    decode = b.add("D", p, max_tokens=3, kv_transfer_params=params)
    steps = 30
    for _ in range(steps):
        b.step()
    assert "D" not in b.first, "the decode ran before its prefill's saves were there"
    assert len(looks) <= steps // 2, f"{len(looks)} store looks in {steps} steps: no backoff"
    a.settle()  # the prefill's next steps save and commit its prompt
    b.run(decode)
    expected = policy.dense_external_hit(PROMPT, 0, 2048, b.connector.scheduler_part.recompute)
    assert b.first["D"] == (expected, PROMPT - expected)
    assert b.loaded_blocks["D"] == 16 and b.wrong_blocks == 0 and b.failed_loads == 0
    stats = b.stats()
    assert stats["handoffs"] == 1 and stats.get("handoff_timeouts", 0) == 0
    assert stats["handoff_wait_seconds_count"] == 1


def test_a_decode_whose_prefill_never_saved_recomputes_after_pd_wait_s_and_counts_it(store, model_dir):
    """The prefill's saves are dropped (no shard granted a slot while its blocks were held),
    and counted so: the decode waits for them, then, once ``pd_wait_s`` passed, takes what is there (nothing)
    and computes the prompt itself, counted as one timeout rather than a silent recompute."""
    p = prompt(PROMPT, seed=44)
    for shard in SHARDS:
        store.set_answering(shard, False)
    a = make_engine(store.client(), model_dir)
    params = _prefill(a, "P", p)
    a.clock.advance(HOLD_S)
    a.settle()  # the prefill's blocks given back unsaved
    # counted, though no save plan ever reached them (the first save waits for its slots)
    assert a.stats().get("saved_blocks", 0) == 0 and a.stats().get("saves_dropped", 0) == 16
    assert "P" not in a.sched.requests
    for shard in SHARDS:
        store.set_answering(shard, True)
    b = make_engine(store.client(), model_dir, config=UcmRayConfig(pd_wait_s=WAIT_S))
    decode = b.add("D", p, max_tokens=3, kv_transfer_params=params)
    for _ in range(10):
        b.step()
    assert "D" not in b.first, "the decode did not wait for its prefill's saves"
    b.clock.advance(WAIT_S)
    b.run(decode)
    assert b.first["D"] == (0, PROMPT) and b.wrong_blocks == 0
    stats = b.stats()
    assert stats["handoffs"] == 1 and stats["handoff_timeouts"] == 1
    assert stats["handoff_wait_seconds"] >= WAIT_S


def test_a_handoff_from_another_namespace_is_ignored_and_counted(store, model_dir, caplog):
    """A prefill whose keys can never match the decode's (here: another namespace label) hands
    off nothing: the decode does not wait for it, says so once in its log, and counts each."""
    p = prompt(PROMPT, seed=45)
    a = make_engine(store.client(), model_dir, config=UcmRayConfig(namespace="elsewhere"))
    params = _prefill(a, "P", p)
    b = make_engine(store.client(), model_dir)
    with caplog.at_level(logging.WARNING, logger="ucm_ray"):
        for req_id in ("D1", "D2"):
            b.run(b.add(req_id, p, max_tokens=2, kv_transfer_params=params))
            assert b.deferred.get(req_id, 0) == 0, "the decode waited for another namespace's saves"
    stats = b.stats()
    assert stats["handoff_namespace_mismatches"] == 2 and stats.get("handoffs", 0) == 0
    assert len([r for r in caplog.records if "handoff" in r.getMessage()]) == 1


# --- faults: the decode's output is what computing its prompt gives, and nothing stays held ---


TIMEOUT_S = 1.0
"""The shards' and engines' grant timeout in the fault tests: what a vanished writer holds
lapses after it (and its quarantine, as long again), which the tests advance the shards' clock
past."""
FAULT_CONFIG = dict(reserve_timeout_s=TIMEOUT_S, transfer_timeout_s=TIMEOUT_S / 2)


@pytest.fixture
def short_store() -> Iterator[tuple[LocalBlockStore, AdvancingClock]]:
    """The ``store`` fixture's shards, with write grants that lapse after ``TIMEOUT_S``, and their
    clock (the host's time until a test advances it)."""
    clock = AdvancingClock()
    local = LocalBlockStore(num_shards=2, pool_bytes=64 << 20, reserve_timeout_s=TIMEOUT_S, clock=clock)
    yield local, clock
    local.shutdown()


def _shm_files(store: LocalBlockStore) -> list[str]:
    """The shared-memory files of the store's live shards (pools and their published indexes)."""
    return [path for pool in store.pools().descriptors.values() for path in (pool.shm_path, pool.index_path)]


def _held(store: LocalBlockStore) -> dict[str, int]:
    """What the shards still hold for readers and writers: pins, granted and quarantined bytes."""
    held = {"pins": 0, "pending_bytes": 0, "quarantined_bytes": 0}
    for shard in SHARDS:
        stats = store.index(shard).stats()
        for name in held:
            held[name] += getattr(stats, name)
    return held


def _assert_nothing_held(store: LocalBlockStore, clock: AdvancingClock, files: list[str]) -> None:
    """Once the engines are gone: every pin and grant on the shards goes, at the latest when a
    grant's timeout and its quarantine passed (the shards' clock is advanced past both, not
    waited out: a timed wait failed on a host slower than its margin), and the store's shutdown
    leaves none of its files in /dev/shm."""
    for _ in range(2):  # a lapsed grant is quarantined when a shard next looks, for a timeout from then
        clock.advance(TIMEOUT_S + 0.1)
        held = _held(store)
    assert not any(held.values()), f"still held on the shards: {held}"
    files += _shm_files(store)
    store.shutdown()
    assert not [path for path in files if os.path.exists(path)], "the store left files in /dev/shm"


def _drop_commits(engine: Engine) -> Callable[[], None]:
    """The prefill's commits never reach a shard (lost on the way; a shard that does not answer
    in time makes the same misses): nothing it saved becomes visible. Returns the undo."""
    store = engine.connector.scheduler_part._store
    real = store.commit
    store.commit = lambda publish, free={}: Done([False] * len(publish))  # type: ignore[method-assign]
    return lambda: setattr(store, "commit", real)


@pytest.mark.parametrize("fault", ["prefill killed", "commits lost"])
def test_a_decode_whose_prefills_saves_never_land_computes_its_prompt_and_nothing_stays_held(
        short_store, model_dir, fault):
    """The prefill answered (its params announce 16 blocks), then its saves never landed: its
    process died before the step that saves them, or its commits were lost. The decode waits
    at most ``pd_wait_s``, then computes the whole prompt (no byte loaded, none wrong), counted
    as a timeout; the prefill's write grants lapse on the shards and nothing else is held."""
    store, shards_clock = short_store
    files = _shm_files(store)
    p = prompt(PROMPT, seed=46)
    config = UcmRayConfig(pd_wait_s=WAIT_S, **FAULT_CONFIG)
    a = make_engine(store.client(), model_dir, config=config)
    params = _prefill(a, "P", p)
    assert params["ucm_ray"]["tokens"] == 2048
    if fault == "commits lost":
        restore = _drop_commits(a)
        a.settle()
        assert a.stats()["saved_blocks"] == 16, "the prefill's worker did not save its blocks"
        restore()
        a.shutdown()
    else:  # never stepped again, nor shut down: a killed process gives nothing back
        assert _held(store)["pending_bytes"] > 0, "the killed prefill holds no write grant to lapse"
    b = make_engine(store.client(), model_dir, config=config)
    decode = b.add("D", p, max_tokens=3, kv_transfer_params=params)
    for _ in range(10):
        b.step()
    assert "D" not in b.first, "the decode did not wait for its prefill's saves"
    b.clock.advance(WAIT_S)
    b.run(decode)
    assert b.first["D"] == (0, PROMPT) and b.loaded_blocks.get("D", 0) == 0 and b.wrong_blocks == 0
    stats = b.stats()
    assert stats["handoffs"] == 1 and stats["handoff_timeouts"] == 1
    b.settle()
    b.shutdown()
    _assert_nothing_held(store, shards_clock, files)


@pytest.mark.parametrize("after", ["nothing", "another prefill"])
def test_a_shard_restarted_mid_handoff_is_a_miss_or_the_new_incarnations_bytes(short_store, model_dir, after):
    """The decode is already waiting (its pools mapped) when the prefill commits; then the shard
    holding the prefill's later blocks restarts empty before the decode's next lookup. With
    nothing saved again, the decode waits out ``pd_wait_s`` and loads the prefix the other shard
    still holds (the policy's hit of it); with another prefill of the same prompt saving into
    the new incarnation meanwhile, it loads the whole announced hit. Never a byte from the old
    incarnation (``wrong_blocks`` 0), and nothing held afterwards."""
    store, shards_clock = short_store
    files = _shm_files(store)
    p = prompt(PROMPT, seed=47)
    config = UcmRayConfig(pd_wait_s=WAIT_S, **FAULT_CONFIG)
    a = make_engine(store.client(), model_dir, config=config)
    params = _prefill(a, "P", p)
    b = make_engine(store.client(), model_dir, config=config)
    decode = b.add("D", p, max_tokens=3, kv_transfer_params=params)
    for _ in range(5):
        b.step()
    assert "D" not in b.first
    a.settle()  # committed
    pools, owners = store.placement(a.block_keys(p))
    primaries = [pools[index][0] for index in owners[:, 0].tolist()]
    restarted = next(shard for shard in SHARDS if shard != primaries[0])  # the decode keeps a prefix
    files += _shm_files(store)
    store.restart(restarted)
    kept = primaries.index(restarted) * 128
    assert 0 < kept < 2048
    recompute = b.connector.scheduler_part.recompute
    if after == "another prefill":
        c = make_engine(store.client(), model_dir, config=config)
        _prefill(c, "P2", p)
        c.settle()
        c.shutdown()
        expected = policy.dense_external_hit(PROMPT, 0, 2048, recompute)
    else:
        for _ in range(5):
            b.step()
        assert "D" not in b.first, "the decode stopped waiting before pd_wait_s"
        b.clock.advance(WAIT_S)
        expected = policy.dense_external_hit(PROMPT, 0, kept, recompute)
    b.run(decode)
    assert b.first["D"] == (expected, PROMPT - expected)
    assert b.loaded_blocks["D"] == -(-expected // 128) and b.wrong_blocks == 0 and b.failed_loads == 0
    assert b.stats().get("handoff_timeouts", 0) == (after == "nothing")
    a.shutdown()
    b.settle()
    b.shutdown()
    _assert_nothing_held(store, shards_clock, files)


def test_a_prefill_whose_decode_never_comes_leaves_ordinary_cache_and_holds_nothing(short_store, model_dir):
    """No decode ever continues the prefill: its blocks go back to vLLM once saved, its saves
    are ordinary cache (a later plain request on another engine with the same prefix hits
    them), and once the engines are gone no pin or grant is left on the shards."""
    store, shards_clock = short_store
    files = _shm_files(store)
    p = prompt(PROMPT, seed=48)
    config = UcmRayConfig(**FAULT_CONFIG)
    a = make_engine(store.client(), model_dir, config=config)
    _prefill(a, "P", p)
    a.settle()
    pool = a.sched.kv_cache_manager.block_pool
    assert "P" not in a.sched.requests and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    a.clock.advance(10 * HOLD_S)  # long after: nothing of the request comes back to hold anything
    a.settle()
    assert a.stats()["saved_blocks"] == 16 and a.stats().get("saves_dropped", 0) == 0
    c = make_engine(store.client(), model_dir, config=config)
    longer = p[:2048] + prompt(300, seed=49)
    assert c.serve("C", longer) == (2048, 300)
    assert c.loaded_blocks["C"] == 16 and c.wrong_blocks == 0
    c.settle()
    for engine in (a, c):
        engine.shutdown()
    _assert_nothing_held(store, shards_clock, files)


# --- a hybrid model: the decode resumes from the state the prefill saved, or computes ---------


LCM = 2048
# (prompt tokens, the prefill's max_num_batched_tokens, k, the LCM boundaries where the prefill's
# chunks end (its states: the seed's rule), the decode's hit)
HYBRID_PD_ROWS = [
    (8192, 8192, 0, (6144, 8192), 6144),  # vLLM runs it as 6144 + 2048; the decode's cap is 6144
    (8193, 8192, 0, (8192,), 0),  # cap 6144, no state there: the seed's degradation to 0
    (8194, 8192, 0, (8192,), 8192),
    (8197, 8192, 3, (8192,), 8192),  # MTP: the cap leaves 5 tokens
    (8200, 2048, 0, (2048, 4096, 6144, 8192), 8192),  # a chunk per LCM block: a state at each
]


@hybrid_harness
@pytest.mark.parametrize("n, chunk, k, states, hit", HYBRID_PD_ROWS)
def test_a_hybrid_decode_resumes_from_the_state_its_prefill_saved_or_computes(store, model_dir, n, chunk, k,
                                                                              states, hit):
    """The decode waits for its prefill's saves, then its hit is the policy's: the furthest LCM
    boundary within its cap (``hybrid_max_hit_blocks``) where the prefill's chunks ended, and so
    saved a state. Where no such state exists it computes the prompt, at once: a state that
    will never be saved is nothing to wait for (no timeout). Every loaded byte is right."""
    p = prompt(n, seed=n + chunk + k)
    a = make_engine(store.client(), model_dir, block_size=LCM, hybrid=True, num_spec=k, max_batched=chunk)
    params = _prefill(a, "P", p)
    assert params["ucm_ray"]["tokens"] == max(states) and params["ucm_ray"]["states"] == list(states)
    b = make_engine(store.client(), model_dir, block_size=LCM, hybrid=True, num_spec=k, max_batched=8192,
                    config=UcmRayConfig(pd_wait_s=WAIT_S))
    recompute = b.connector.scheduler_part.recompute
    cap = policy.hybrid_max_hit_blocks(n, recompute, LCM)
    assert hit == LCM * policy.hybrid_hit_blocks(cap, [(i + 1) * LCM in states for i in range(cap)])
    decode = b.add("D", p, max_tokens=3, kv_transfer_params=params)
    for _ in range(5):
        b.step()
    a.settle()
    b.run(decode)
    assert (b.first["D"][0], b.prefill_computed["D"]) == (hit, n - hit)
    assert b.wrong_blocks == 0 and b.failed_loads == 0
    stats = b.stats()
    assert stats["handoffs"] == 1 and stats.get("handoff_timeouts", 0) == 0
