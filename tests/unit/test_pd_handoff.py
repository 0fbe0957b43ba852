"""Prefill/decode through the tier (issue 41), both connector halves in one process: a prefill
engine and a decode engine on one ``LocalBlockStore``, the decode handed the prefill's
``kv_transfer_params`` as a PD proxy hands them, with no pause between the two (a proxy makes
none). The decode must neither outrun the prefill's saves silently nor wait for them forever.
"""

from __future__ import annotations

import logging

from ucm_ray import policy
from ucm_ray.config import UcmRayConfig
from ucm_ray.testing.harness import Engine, make_engine, prompt
from ucm_ray.vllm.scheduler import HOLD_S

PROMPT = 2048 + 100
"""A prompt of 16 full blocks of 128 and a partial one: the prefill announces the full ones."""
PD_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
"""What Ray Serve LLM's PD proxy sends the prefill (vLLM's own PD proxies send the same keys)."""
SHARDS = ("local_shard_0", "local_shard_1")


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
    b = make_engine(store.client(), model_dir)
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
    """The prefill's saves are dropped (no shard granted a slot while its blocks were held):
    the decode waits for them, then, once ``pd_wait_s`` passed, takes what is there (nothing)
    and computes the prompt itself, counted as one timeout rather than a silent recompute."""
    p = prompt(PROMPT, seed=44)
    for shard in SHARDS:
        store.set_answering(shard, False)
    a = make_engine(store.client(), model_dir)
    params = _prefill(a, "P", p)
    a.clock.advance(HOLD_S)
    a.settle()  # the prefill's blocks given back unsaved
    assert a.stats().get("saved_blocks", 0) == 0 and "P" not in a.sched.requests
    for shard in SHARDS:
        store.set_answering(shard, True)
    b = make_engine(store.client(), model_dir, config=UcmRayConfig(pd_wait_s=0.5))
    decode = b.add("D", p, max_tokens=3, kv_transfer_params=params)
    for _ in range(10):
        b.step()
    assert "D" not in b.first, "the decode did not wait for its prefill's saves"
    b.clock.advance(0.5)
    b.run(decode)
    assert b.first["D"] == (0, PROMPT) and b.wrong_blocks == 0
    stats = b.stats()
    assert stats["handoffs"] == 1 and stats["handoff_timeouts"] == 1
    assert stats["handoff_wait_seconds"] >= 0.5


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
