"""Both connector halves in one process (vLLM's real Scheduler, our WorkerPart on fake KV, an
in-process store): the seed's tables, byte-checked, and the faults the connector must survive.

``Engine.wrong_blocks`` counts loaded blocks whose bytes differ from what computing them
writes and that were NOT reported to vLLM as failed: the promise is that it stays 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest
from vllm.config import ParallelConfig

from tests.support import ROOT
from tests.support.faulty_pools import BrokenPosts, hung_loads
from tests.support.store_helpers import corrupt_stored_blocks
from ucm_ray.config import UcmRayConfig
from ucm_ray.store.engine.published_reader import IndexReaders
from ucm_ray.store.local import LocalBlockStore
from ucm_ray.store.types import Location, random_id
from ucm_ray.testing import harness
from ucm_ray.testing.clock import AdvancingClock
from ucm_ray.testing.harness import MAX_LAYERS, block_value, make_engine, prompt
from ucm_ray.testing.timing import timed_calls
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm import compat
from ucm_ray.vllm.compat import check_one_compute_stream
from ucm_ray.vllm.metadata import QUIET_STEP, UcmRayConnectorMetadata, UcmRayWorkerMetadata
from ucm_ray.vllm.scheduler import DECODE_SAVE_TOKENS, HOLD_S, Phase
from ucm_ray.vllm.worker import StepState

# Seed table 1: QwQ-32B-like, block 128, k = 3, layerwise (recompute 5), 8192 tokens cached.
# (request B length, external hit tokens returned, tokens vLLM computes)
DENSE_ROWS = [
    (8192, 8187, 5),
    (8193, 8188, 5),
    (8196, 8191, 5),
    (8197, 8192, 5),
    (8200, 8192, 8),
]


def test_dense_seed_table(store, model_dir):
    a = make_engine(store.client(), model_dir, num_spec=3)
    assert a.connector.scheduler_part.recompute == 5
    p = prompt(8200)
    assert a.serve("A", p[:8192]) == (0, 8192)  # cold: everything computed, then saved
    a.settle()
    assert a.stats()["saved_blocks"] == 64
    for n, ext, computed in DENSE_ROWS:
        b = make_engine(store.client(), model_dir, num_spec=3)  # a fresh engine: no local prefix cache
        got = b.serve(f"B{n}", p[:n])
        assert got == (ext, computed), f"request of {n} tokens: got {got}, seed says {(ext, computed)}"
        assert b.loaded_blocks[f"B{n}"] == 64 and b.wrong_blocks == 0 and b.failed_loads == 0
    b = make_engine(store.client(), model_dir, num_spec=3)
    assert b.serve("other", prompt(8192, seed=1)) == (0, 8192)  # different prompt: no hit


def test_non_layerwise_recomputes_one_token(store, model_dir):
    a = make_engine(store.client(), model_dir, layerwise=False)
    p = prompt(1024)
    a.serve("A", p)
    a.settle()
    b = make_engine(store.client(), model_dir, layerwise=False)
    assert b.connector.scheduler_part.recompute == 1
    assert b.serve("B", p) == (1023, 1)
    assert b.wrong_blocks == 0


def test_local_hit_combined_with_external_hit(store, model_dir):
    a = make_engine(store.client(), model_dir)
    p = prompt(4096 + 300)
    a.serve("A", p[:4096])
    a.settle()
    b = make_engine(store.client(), model_dir)
    b.serve("warm", p[:1024 + 50])  # B's own prefix cache now holds 8 blocks (1024 tokens)
    req = b.add("B", p)
    b.run(req)
    assert b.first["B"] == (4096, 300)
    assert b.loaded_blocks["B"] == (4096 - 1024) // 128  # the first 8 blocks came from B's own cache
    assert b.wrong_blocks == 0


# Seed tables 2 and 3: hybrid, LCM block 2048, truncate before lookup, states only at chunk ends.
# vLLM 0.32 itself ends a prefill chunk at the last cacheable boundary before the prompt's end
# (an 8192-token prompt runs as 6144 + 2048), so the seed's single-chunk store state (only the
# chunk-end state at 8192) is made by an 8193-token request A, whose first chunk is [0, 8192).
# (A's length, A's max_num_batched_tokens, k, request B length, external tokens, tokens computed)
HYBRID_ROWS = [
    # table 2, with MTP (k = 3): states at 6144 and 8192
    (8192, 8192, 3, 8192, 6144, 2048),
    (8192, 8192, 3, 8193, 6144, 2049),
    (8192, 8192, 3, 8196, 6144, 2052),
    (8192, 8192, 3, 8197, 8192, 5),
    (8192, 8192, 3, 8200, 8192, 8),
    # table 3, without MTP (k = 0): only the chunk-end state at 8192
    (8193, 8192, 0, 8192, 0, 8192),  # graceful degradation to 0
    (8193, 8192, 0, 8194, 8192, 2),
    (8193, 8192, 0, 8200, 8192, 8),
    # max_num_batched_tokens == lcm: a state at every boundary, so truncation keeps 3 blocks
    (8192, 2048, 0, 8192, 6144, 2048),
]


hybrid_harness = pytest.mark.hybrid_harness
"""A hybrid (multi-group) cache through the harness. vLLM 0.26 has no ``failed_recving``, so the
connector refuses hybrid caches there (``test_a_hybrid_cache_is_refused_where_vllm_cannot_report_a_failed_load``
checks the refusal on every version): ``make test-vllm026`` deselects these, every other version runs them."""


def test_a_hybrid_cache_is_refused_where_vllm_cannot_report_a_failed_load(store, model_dir, monkeypatch):
    """vLLM 0.26 can only report an asynchronous load done: the worker half refuses a hybrid cache
    at start-up (there for real; elsewhere with the capability taken away)."""
    monkeypatch.setattr(compat, "ASYNC_LOAD_FAILURES_REPORTABLE", False)
    with pytest.raises(ValueError, match="cannot be told that an asynchronous load failed"):
        make_engine(store.client(), model_dir, block_size=2048, hybrid=True)


@hybrid_harness
@pytest.mark.parametrize("a_len, a_chunk, k, n, ext, computed", HYBRID_ROWS)
def test_hybrid_seed_tables(store, model_dir, a_len, a_chunk, k, n, ext, computed):
    p = prompt(8200, seed=a_len + a_chunk + k)
    a = make_engine(store.client(), model_dir, block_size=2048, hybrid=True, num_spec=k, max_batched=a_chunk)
    assert a.connector.scheduler_part.recompute == 2 + k
    a.serve("A", p[:a_len])
    a.settle()
    b = make_engine(store.client(), model_dir, block_size=2048, hybrid=True, num_spec=k, max_batched=8192)
    got = b.serve("B", p[:n])
    assert got == (ext, computed), f"A={a_len}/{a_chunk}, k={k}, B={n}: got {got}, seed says {(ext, computed)}"
    assert b.wrong_blocks == 0 and b.failed_loads == 0


def test_preempted_request_resumes_with_a_store_hit(store, model_dir):
    """Out of KV blocks, vLLM preempts a request; when it comes back its prefix is loaded
    from the store instead of recomputed."""
    eng = make_engine(store.client(), model_dir, num_blocks=24)
    x = eng.add("X", prompt(1280, seed=3), max_tokens=400)
    y = eng.add("Y", prompt(1280, seed=4), max_tokens=400)
    eng.run(x, y)
    preempted = [r for r in (x, y) if r.num_preemptions > 0]
    assert preempted, "the scenario must preempt a request"
    for r in preempted:
        assert min(eng.resumed_at[r.request_id]) >= 1280
        assert eng.loaded_blocks.get(r.request_id, 0) > 0
    assert eng.wrong_blocks == 0


# --- faults -------------------------------------------------------------------------------


def test_the_harness_sees_wrong_bytes_when_nothing_catches_them(store, model_dir):
    """The check can fail: corrupted entries without checksums are loaded and counted wrong."""
    a = make_engine(store.client(), model_dir)
    p = prompt(2048)
    a.serve("A", p)
    a.settle()
    assert corrupt_stored_blocks(store, a, p) == 16
    b = make_engine(store.client(), model_dir)
    b.serve("B", p)
    assert b.wrong_blocks > 0


def test_checksum_is_a_property_of_the_entry_and_a_mismatch_removes_it(store, model_dir):
    """Writer in paranoid mode, reader not: the reader still verifies, recomputes, and the
    corrupt entries are gone from the store afterwards."""
    a = make_engine(store.client(), model_dir, extra={"checksum": True})
    p = prompt(2048)
    a.serve("A", p)
    a.settle()
    assert corrupt_stored_blocks(store, a, p) == 16
    b = make_engine(store.client(), model_dir, extra={"checksum": False})
    b.serve("B", p)
    b.settle()
    assert b.wrong_blocks == 0
    assert b.failed_loads == 16 and b.stats()["checksum_mismatches"] == 16
    removed = sum(store.index(s).stats().removals for s in ("local_shard_0", "local_shard_1"))
    assert removed == 16, "corrupt entries must be removed, not left to fail every reader"
    # B recomputed the blocks and saved them again: the next reader gets good bytes.
    c = make_engine(store.client(), model_dir)
    assert c.serve("C", p) == (2046, 2)
    assert c.wrong_blocks == 0 and c.failed_loads == 0


@pytest.mark.parametrize("checksum", [True, False])
def test_the_hits_last_block_lands_before_the_forward_writes_its_recomputed_tokens(store, model_dir, checksum):
    """The hit ends inside its last block, and vLLM writes the K/V of the tokens it recomputes
    there before a layer's hook waits for that layer's load. Had the block landed layer by layer,
    either the load overwrote this engine's values with the other engine's (they may differ in
    the last bits: ``numerics``), or, in checksum mode, the checksum saw this engine's values and
    failed a good entry. (With checksums, the old code failed one way or the other every time.)"""
    a = make_engine(store.client(), model_dir, extra={"checksum": checksum})
    p = prompt(2048)
    a.serve("A", p)
    a.settle()
    b = make_engine(store.client(), model_dir, extra={"checksum": checksum})
    b.numerics = 0.5
    computed_before, _ = b.serve("B", p)
    assert computed_before % 128, "the hit must end inside a block for this test to mean anything"
    b.settle()
    assert b.wrong_blocks == 0 and b.failed_loads == 0
    assert b.stats().get("checksum_mismatches", 0) == 0 and b.stats()["loaded_blocks"] == 16


def test_shard_restarted_while_an_engine_loads_from_it(store, model_dir):
    """The shard dies (and comes back empty) after the lookup pinned its entries, before the
    worker copies: its pool file is gone, the loads from it fail and are reported, vLLM
    recomputes, and the engine saves the recomputed blocks into the new pool."""
    a = make_engine(store.client(), model_dir)
    p = prompt(2048)
    a.serve("A", p)
    a.settle()
    b = make_engine(store.client(), model_dir)
    restarted: list[str] = []

    def restart_before_first_load(engine, meta):
        if meta.loads.get(0) and not restarted:
            restarted.append(store.restart("local_shard_0")[0])

    b.before_worker = restart_before_first_load
    b.serve("B", p + [3] * 300)
    b.settle()
    assert restarted and b.wrong_blocks == 0 and b.failed_loads > 0
    c = make_engine(store.client(), model_dir)
    # B saved the blocks it recomputed again (saves it had planned into the old pool are lost).
    assert c.serve("C", p + [3] * 300)[0] >= 2048
    assert c.wrong_blocks == 0 and c.failed_loads == 0


def test_restarted_shard_never_serves_bytes_through_the_old_mapping(store, model_dir):
    """Engine A's worker mapped shard 0's pool; the shard restarts and another engine fills the
    new pool; A's loads from it must be the new pool's bytes (old code read the old mapping)."""
    a = make_engine(store.client(), model_dir)
    a.serve("A1", prompt(2048, seed=1))
    a.settle()
    store.restart("local_shard_0")
    c = make_engine(store.client(), model_dir)
    p2 = prompt(2048, seed=2)
    c.serve("C", p2)
    c.settle()
    got = a.serve("A2", p2 + [9] * 40)
    assert got[0] == 2048 and a.wrong_blocks == 0 and a.failed_loads == 0
    assert store.index("local_shard_0").stats().entries > 0  # the restarted shard did serve


def test_any_exception_on_the_copy_thread_is_a_failed_load(store, model_dir):
    a = make_engine(store.client(), model_dir)
    p = prompt(2048)
    a.serve("A", p)
    a.settle()

    b = make_engine(store.client(), model_dir, pool_connections=BrokenPosts)
    assert b.serve("B", p)[0] == 2048 - 5 + 3  # hit claimed (2048 - recompute 2) ...
    assert b.wrong_blocks == 0 and b.failed_loads == 16  # ... then every block failed and recomputed


def test_a_hung_pool_delays_a_step_by_one_deadline_not_one_per_layer(store, model_dir):
    """Every layer's load waits for the hung pool, all within the step's one deadline: the
    timeouts the worker gave the pool add up to one ``transfer_timeout_s`` (two layers each
    given the whole timeout would add up to twice it). Counted, not timed: each wait uses its
    timeout up on the worker's frozen clock, so a later layer's timeout is what is left of the
    step's, however slow the host."""
    cfg = UcmRayConfig(transfer_timeout_s=0.5)
    a = make_engine(store.client(), model_dir, config=cfg)
    p = prompt(2048)
    a.serve("A", p)
    a.settle()

    clock = AdvancingClock()
    clock.freeze()
    hung = hung_loads(clock)
    b = make_engine(store.client(), model_dir, config=cfg, pool_connections=hung, worker_clock=clock)
    b.serve("B", p + prompt(1024, seed=77))  # a long new part: the hit is loaded layer by layer
    assert b.wrong_blocks == 0 and b.failed_loads == 16
    assert store.suspected, "a pool whose transfers fail is reported to the store as suspect"
    assert len(hung.waited) >= 2, "each of the two layers waits for its hung load"
    assert 0 < sum(hung.waited) <= cfg.transfer_timeout_s, hung.waited


def test_load_failure_policy_fail_is_refused_at_start_up(store, model_dir):
    with pytest.raises(ValueError, match="kv_load_failure_policy='fail'.*recompute"):
        make_engine(store.client(), model_dir, failure_policy="fail")


@pytest.mark.parametrize("micro_batches", [{"enable_dbo": True}, {"ubatch_size": 2}])
def test_micro_batching_is_refused_at_start_up(micro_batches):
    """vLLM's micro-batches (DBO) run the forward on several streams, each calling a layer's hook:
    the connector orders its loads for one stream, so it refuses instead of racing. (vLLM turns
    DBO off on CPU before a connector starts, so the check is called here as the connector calls
    it, first thing, in both roles.)"""
    check_one_compute_stream(ParallelConfig())  # the default passes
    with pytest.raises(ValueError, match="micro-batching.*turn it off"):
        check_one_compute_stream(ParallelConfig(**micro_batches))


def test_the_scheduler_reports_its_host_time_per_step_that_runs_tokens(store, model_dir):
    """``schedule_seconds``: the connector's host time in its scheduler hooks, once per step that
    runs tokens and gave it work (what a host-bound forward waits for); steps that run nothing
    are not counted."""
    a = make_engine(store.client(), model_dir)
    a.serve("A", prompt(2048), max_tokens=2)  # the prefill (a lookup), then a decode step
    totals = a.stats()
    counted = totals["schedule_seconds_count"]
    # the prefill, and the decode step unless the prompt's save waited there for its slots
    assert 1 <= counted <= 2 and totals["schedule_seconds"] > 0
    a.settle()  # steps with nothing to run: idle time (idle_schedule_us), charged to no request
    assert a.steps > 2 and a.stats()["schedule_seconds_count"] == counted


def test_decode_steps_without_connector_work_hand_vllm_no_stats(store, model_dir):
    """A decode step in which the connector has nothing to do (no lookup, save, load or result)
    records nothing, so vLLM has no connector stats to aggregate, log and export for it: that
    cost every decode step more host time than the connector's own hooks."""
    a = make_engine(store.client(), model_dir)
    a.serve("A", prompt(2048), max_tokens=60)  # 60 steps run tokens, no generated block fills
    # the prefill (a lookup), the steps saving the prompt (those of its blocks whose slots came
    # a step late, the next), the steps taking those saves' results
    assert a.stats()["schedule_seconds_count"] <= 5


def test_each_role_refuses_the_other_halfs_calls_by_name(store, model_dir):
    """The hooks reach their half through a plain attribute (no property call a step); on a
    connector of the other role that attribute refuses any use, naming the call."""
    a = make_engine(store.client(), model_dir)
    try:
        with pytest.raises(AssertionError, match=r"worker-side call \(wait_for_save\)"):
            a.connector.wait_for_save()
        with pytest.raises(AssertionError, match=r"scheduler-side call \(build_connector_meta\)"):
            a.worker.build_connector_meta(None)
        a.serve("A", prompt(512), max_tokens=4)  # the engine's own calls go to its halves
    finally:
        a.shutdown()


def test_a_decode_step_plans_only_the_requests_whose_blocks_filled(store, model_dir):
    """With many requests decoding, the scheduler hook's largest cost was examining each one
    every step. A request whose blocks waited at the last plan is passed over until another of
    its blocks fills (every 16 tokens here, seen twice: hashed, then computed): 8 requests x 64
    steps made 512 plans, 64 now. Every generated block is still saved."""
    a = make_engine(store.client(), model_dir, block_size=16, num_blocks=512)
    part = a.connector.scheduler_part
    requests = [a.add(f"R{i}", prompt(200, seed=40 + i), max_tokens=80) for i in range(8)]
    while any(not r.num_output_tokens for r in requests):
        a.step()
    for _ in range(4):
        a.step()  # the prompts' saves planned
    with timed_calls([(part.saves, ("_plan_saves",), "scheduler")]) as timed:
        for _ in range(64):
            a.step()
    assert len(timed["scheduler._plan_saves"]) <= 8 * (2 * 64 // 16 + 2)
    a.run(*requests)
    a.settle()
    generated = 200 + 80 - 1
    assert a.stats()["saved_blocks"] == 8 * (generated // 16)


def test_a_steps_saves_of_several_requests_are_bound_to_slots_in_one_call(store, model_dir):
    """Prompts whose first tokens came out in the same step have their blocks saved by the next:
    every request's blocks are bound to slots together, one ``bind`` per step with saves (per
    request, a decode batch paid the binding's fixed cost once per request), and every block is
    saved, each into a slot of its own."""
    a = make_engine(store.client(), model_dir, block_size=16, num_blocks=512)
    jobs = a.connector.scheduler_part.saves.jobs
    dispatched: list[int] = []
    a.before_worker = lambda engine, meta: dispatched.append(sum(len(job) for job in meta.saves.values()))
    requests = [a.add(f"R{i}", prompt(256, seed=60 + i), max_tokens=3) for i in range(4)]
    with timed_calls([(jobs, ("bind",), "jobs")]) as timed:
        a.run(*requests)
        a.settle()
    steps_with_saves = sum(1 for n in dispatched if n)
    assert len(timed["jobs.bind"]) == steps_with_saves, (len(timed["jobs.bind"]), dispatched)
    assert max(dispatched) >= 2 * 256 // 16, f"the prompts' saves were not planned in one step: {dispatched}"
    assert a.stats()["saved_blocks"] == 4 * (256 + 3 - 1) // 16
    b = make_engine(store.client(), model_dir, block_size=16, num_blocks=512)
    assert b.serve("B", prompt(256, seed=62))[0] >= 256 - 16  # another engine hits R2's saved prompt


def test_generated_blocks_are_saved_in_batches_and_the_rest_when_the_request_ends(store, model_dir):
    """Blocks a request generates are saved DECODE_SAVE_TOKENS at a time and the remainder once
    it finishes (each save job costs the engine host time), and another engine then finds the
    whole conversation, generated blocks included."""
    a = make_engine(store.client(), model_dir, block_size=16, num_blocks=512)
    p = prompt(200, seed=21)
    request = a.add("A", p, max_tokens=700)
    a.run(request)
    a.settle()
    generated = 200 + 700 - 1  # the last token is sampled, never computed
    stats = a.stats()
    assert stats["saved_blocks"] == generated // 16 and stats.get("saves_dropped", 0) == 0
    # a job each: the prompt's 12 blocks at its first token, 2 batches of 16 generated ones and
    # the other 12 at the end; any of them whose slots came a step late (a loaded machine) is
    # finished by one more job the next step (a job per filled block: 45)
    batches = -(-(generated // 16 - 200 // 16) // (DECODE_SAVE_TOKENS // 16))
    assert 1 + batches <= stats["save_seconds_count"] <= 2 * (1 + batches)
    b = make_engine(store.client(), model_dir, block_size=16, num_blocks=512)
    conversation = p + list(request.output_token_ids)[:-1]
    assert b.serve("B", conversation + [11, 12, 13])[0] == generated // 16 * 16
    assert b.wrong_blocks == 0


def test_requests_that_end_together_announce_their_last_blocks_placed_in_one_call(store, model_dir):
    """Requests finished in one step with generated blocks short of a batch: their blocks are
    announced at the next plan's start (before its tick asks for their slots), their new keys
    placed in one call, not one per request at vLLM's ``request_finished``; each announces
    what ``counts`` says of its own blocks, and every generated block is saved."""
    a = make_engine(store.client(), model_dir, block_size=16, num_blocks=512)
    part = a.connector.scheduler_part
    saves = part.saves
    announced: list[tuple[object, dict]] = []  # (request, the counts it announced)
    placements: list[int] = []  # keys per placement call inside the announcement
    place, expect, announce = part._store.placement, saves.expect, saves.announce_finished
    inside = False

    def placing(keys):
        if inside:
            placements.append(len(keys))
        return place(keys)

    def expecting(tracked, until, start=None, *, later=False):
        wanted = saves.counts(tracked, tracked.expected_until if start is None else start, until)
        got = expect(tracked, until, start, later=later)
        if inside:
            assert later and got == wanted
            announced.append((tracked.request.request_id, got))
        return got

    def announcing():
        nonlocal inside
        inside = True
        try:
            announce()
        finally:
            inside = False

    part._store.placement, saves.expect, saves.announce_finished = placing, expecting, announcing
    requests = [a.add(f"R{i}", prompt(256, seed=80 + i), max_tokens=40) for i in range(4)]
    a.run(*requests)
    a.settle()
    # 39 computed generated tokens: 2 blocks past each prompt's announcement, never a batch
    assert sorted(req_id for req_id, _ in announced) == [f"R{i}" for i in range(4)]
    assert all(sum(counts.values()) == 2 for _, counts in announced)
    assert placements == [4 * 2]
    assert a.stats()["saved_blocks"] == 4 * ((256 + 40 - 1) // 16)


def test_a_prompt_the_free_stock_cannot_hold_is_saved_as_one_job_once_its_slots_came(store, model_dir):
    """A fresh engine keeps a slot or two per pool; a prompt's slots are asked for once its
    first token is out, and its save waits for them (at most PROMPT_SLOT_WAIT_S) rather than
    going as two jobs a step or two apart, each planned, posted and committed on its own (~3 ms
    more of an H200 host's time per 4k prompt)."""
    a = make_engine(store.client(), model_dir, block_size=16, num_blocks=256)
    a.serve("A", prompt(40 * 16 + 1, seed=90), max_tokens=2)
    a.settle()
    stats = a.stats()
    assert stats["saved_blocks"] == 40 and not stats.get("saves_dropped")
    assert stats["save_seconds_count"] == 1, f"the prompt went as {stats['save_seconds_count']} save jobs"


def test_prompts_out_together_that_the_free_stock_holds_one_at_a_time_wait_for_their_slots(store, model_dir):
    """Two prompts whose first tokens come out in the same step, the free stock holding one's
    slots but not both: the first is saved from the stock, the second waits for the slots its
    announcement asked for (``PROMPT_SLOT_WAIT_S``) and goes whole once they are here; none of
    its blocks is skipped (pending, retried step by step, counted as ``saves_skipped``). Since
    every request's saves of a step are bound in one call (stop 58), each request's "does the
    stock hold mine" was asked before the first had taken its slots: the second was planned
    anyway and 6 of its 12 blocks found no slot."""
    a = make_engine(store.client(), model_dir, block_size=16, num_blocks=512)
    a.serve("W", prompt(40 * 16 + 1, seed=90), max_tokens=2)  # leaves the stock at its baseline
    a.settle()
    supply = a.connector.scheduler_part.saves._slots
    free = sorted(supply.free_slots(slot_class) for slot_class in list(supply._free))
    before = a.stats()
    requests = [a.add(f"R{i}", prompt(12 * 16 + 1, seed=91 + i), max_tokens=2) for i in range(2)]
    a.run(*requests)
    a.settle()
    stats = a.stats()
    assert stats["saved_blocks"] - before["saved_blocks"] == 2 * 12 and not stats.get("saves_dropped")
    skipped = stats.get("saves_skipped", 0) - before.get("saves_skipped", 0)
    assert skipped == 0, f"{skipped} block(s) found no slot (free stock per pool before: {free})"


def test_requests_decoding_together_ask_for_slots_once_per_pool_a_step(store, model_dir):
    """Requests that decode together fill their blocks together, and each asks for the slots of
    its next decode batch as they fill: in one step those asks go out as one call per pool (and
    entry size), not one per request (each a control call on the engine's thread: ~0.2 ms of
    host time). The supply's own top-up may add one more. Every generated block is saved."""
    client = store.client()
    a = make_engine(client, model_dir, block_size=16, num_blocks=1024)
    asks: list[tuple[int, object]] = []
    reserve = client.reserve

    def counted(pool, size, count):
        asks.append((a.steps, pool))
        return reserve(pool, size, count)

    client.reserve = counted
    requests = [a.add(f"R{i}", prompt(160, seed=40 + i), max_tokens=300) for i in range(8)]
    a.run(*requests)
    a.settle()
    per_step = Counter(asks)
    assert max(per_step.values()) <= 2, f"slot asks per (step, pool): {sorted(per_step.values())[-5:]}"
    stats = a.stats()
    assert stats["saved_blocks"] == 8 * ((160 + 300 - 1) // 16) and not stats.get("saves_dropped")


def test_requests_running_together_place_what_they_announce_in_one_call_a_step(store, model_dir):
    """Prompts that start together announce their saves in the same step (their first tokens
    come out together), and requests that decode together announce their next decode batches
    in the same step: the keys of all those blocks are placed in one call (one per request was
    most of that step's host time), and the placements stand for the saves that follow, every
    prompt and generated block saved."""
    client = store.client()
    a = make_engine(client, model_dir, block_size=16, num_blocks=1024)
    part = a.connector.scheduler_part
    placements: list[int] = []
    place = client.placement

    def counted(keys):
        placements.append(a.steps)
        return place(keys)

    client.placement = counted
    prompts: Counter[int] = Counter()  # per step, the requests whose prompt was announced
    batches: Counter[int] = Counter()  # per step, the running requests whose decode batch was announced
    step = a.step

    def observed() -> None:
        before = {req_id: (tracked.prompt_expected, tracked.expected_until)
                  for req_id, tracked in part._requests.by_id.items()}
        step()
        for req_id, (announced, until) in before.items():
            tracked = part._requests.get(req_id)
            if tracked is None or tracked.finishing:
                continue
            prompts[a.steps] += tracked.prompt_expected and not announced
            batches[a.steps] += announced and tracked.expected_until > until

    a.step = observed
    requests = [a.add(f"R{i}", prompt(160, seed=40 + i), max_tokens=300) for i in range(8)]
    a.run(*requests)
    a.settle()
    per_step = Counter(placements)
    for kind, announced in (("prompts", prompts), ("decode batches", batches)):
        together = [s for s, n in announced.items() if n >= 2]
        assert together, f"no step announced several requests' {kind}: {announced}"
        assert all(per_step[s] <= 1 for s in together), \
            f"placements in the steps that announced {kind}: {[per_step[s] for s in together]}"
    stats = a.stats()
    assert stats["saved_blocks"] == 8 * ((160 + 300 - 1) // 16) and not stats.get("saves_dropped")
    assert a.wrong_blocks == 0


def test_steps_without_loads_share_one_step_state_that_nothing_writes_into(store, model_dir):
    """Most decode steps load nothing and save no state: the worker gives them one shared step
    state, not a new one each (~2 us of an engine's host time a step). A store hit's steps get
    their own; steps that load, save and fence in between leave the shared one as it was made."""
    p = prompt(512, seed=90)
    a = make_engine(store.client(), model_dir, block_size=16)
    a.serve("A", p, max_tokens=2)
    a.settle()
    b = make_engine(store.client(), model_dir, block_size=16)
    worker = b.worker.worker_part
    shared: list[bool] = []
    step = b.step

    def observed() -> None:
        step()
        shared.append(worker._step is worker._idle_step)

    b.step = observed
    ext, _ = b.serve("B", p, max_tokens=300)  # a hit, then blocks saved as it decodes
    b.settle()
    assert ext > 0 and b.wrong_blocks == 0 and b.stats()["saved_blocks"] > 0
    assert not all(shared) and sum(shared) > 250, f"{sum(shared)} of {len(shared)} steps shared"
    assert worker._idle_step == StepState()


def test_only_steps_with_layer_loads_get_layer_hooks_and_quiet_steps_share_one_empty_metadata(store, model_dir):
    """vLLM calls a layer's hooks (``wait_for_layer_load``, ``save_kv_layer``) only while the
    connector has metadata bound; the worker binds it only for a step whose loads may wait for
    their layer, so a decode step makes none of those calls (two a layer, every step). A step
    with nothing for the workers gets the scheduler's one ``QUIET_STEP``, which nothing writes
    into; a hit still loads layer by layer, every layer waited for."""
    p = prompt(512, seed=91)
    a = make_engine(store.client(), model_dir, block_size=16, num_layers=4)
    a.serve("A", p, max_tokens=2)
    a.settle()
    b = make_engine(store.client(), model_dir, block_size=16, num_layers=4)
    metas: list[UcmRayConnectorMetadata] = []
    build = b.connector.build_connector_meta

    def built(out):
        metas.append(build(out))
        return metas[-1]

    b.connector.build_connector_meta = built  # type: ignore[method-assign]
    with timed_calls([(b.worker, ("wait_for_layer_load", "save_kv_layer"), "worker")]) as timed:
        ext, _ = b.serve("B", p + prompt(40, seed=92), max_tokens=40)
    b.settle()
    assert ext > 0 and b.wrong_blocks == 0 and b.failed_loads == 0
    loading = [meta for meta in metas if meta.loads]
    assert len(loading) == 1 and any(job.blocks.before_forward.sum() < len(job.blocks) for job in loading[0].loads[0])
    # the hit's step waited for each of its 4 layers; no other step called a layer hook
    assert len(timed["worker.wait_for_layer_load"]) == len(timed["worker.save_kv_layer"]) == 4
    quiet = [meta for meta in metas if meta is QUIET_STEP]
    assert len(quiet) > 30 and QUIET_STEP == UcmRayConnectorMetadata(work=False)
    assert not b.worker.has_connector_metadata()


def test_one_decoding_request_asks_for_slots_far_less_often_than_it_fills_blocks(store, model_dir):
    """A request decoding alone fills a block every 16 steps and announces its decode batch 2-3
    times a batch; the supply asks only for what its free stock lacks, and then for as much
    again: not a reserve call per filled block (each ~0.5 ms of the engine's host on this box;
    it was 36 asks for 39 blocks over 2 pools, then 15-16 with every announcement asked for in
    full). The count depends on which pool each block lands on (8-13 over 20 prompts) and, on
    the host's clock, on how long steps take (a loaded CI box once saw 14): so the clock moves
    a fixed 12 ms a step, and three requests in a row must ask at most once per 3 blocks filled.
    Every block is still saved."""
    client = store.client()
    a = make_engine(client, model_dir, block_size=16, num_blocks=512)
    a.clock.freeze()
    a.serve("warm", prompt(160, seed=70), max_tokens=40)  # the prompt's own slots, and a baseline
    a.settle()
    asks: list[int] = []
    reserve = client.reserve

    def counted(pool, size, count):
        asks.append(count)
        return reserve(pool, size, count)

    client.reserve = counted
    for seed in (71, 72, 73):
        request = a.add(f"D{seed}", prompt(160, seed=seed), max_tokens=640)
        while not request.is_finished():
            a.clock.advance(0.012)
            a.step()
        a.settle()
    filled = 3 * ((160 + 640 - 1) // 16 - 160 // 16)
    stats = a.stats()
    assert stats["saved_blocks"] == (160 + 40 - 1) // 16 + 3 * ((160 + 640 - 1) // 16)
    assert not stats.get("saves_dropped")
    assert len(asks) <= filled // 3, f"{len(asks)} slot asks for {filled} blocks filled while decoding: {asks}"


def test_a_shard_that_stops_answering_is_a_miss_and_the_engine_keeps_serving(store, model_dir):
    a = make_engine(store.client(), model_dir)
    p = prompt(2048)
    a.serve("A", p)
    a.settle()
    store.set_answering("local_shard_0", False)
    b = make_engine(store.client(), model_dir)
    ext, computed = b.serve("B", p)
    assert ext < 2048 - 2 and b.wrong_blocks == 0  # shard 0's blocks are misses
    store.set_answering("local_shard_0", True)
    c = make_engine(store.client(), model_dir)
    assert c.serve("C", p)[0] == 2046


# --- write slots --------------------------------------------------------------------------


def _held_slot_bytes(store: LocalBlockStore) -> int:
    return sum(store.index(s).stats().pending_bytes for s in ("local_shard_0", "local_shard_1"))


def test_an_idle_engine_gives_its_unused_slots_back(model_dir):
    """Slots are asked for per prompt chunk; what was not used goes back once the engine idles,
    so an idle engine holds about one entry per pool, not a step's worth of pool memory. The
    shards and the scheduler share one frozen clock: the grants' ages, the idle time and the
    ticks are what the test advanced, however long the host took over the steps between."""
    clock = AdvancingClock()
    clock.freeze()
    store = LocalBlockStore(num_shards=2, pool_bytes=64 << 20, clock=clock)
    try:
        cfg = UcmRayConfig(reserve_timeout_s=3.0, transfer_timeout_s=1.0, lease_s=10.0)  # idle after 1 s
        a = make_engine(store.client(), model_dir, config=cfg, clock=clock)
        a.serve("A", prompt(4096, seed=5), max_tokens=1)  # 32 blocks; slots for 2 chunks were asked
        a.settle()
        entry = 2 * 128 * 2 * 16 * 4 * 2  # K+V x tokens x heads x head size x fp32 x layers
        clock.advance(1.2)
        for _ in range(40):  # idle steps: the remembered demand fades, the surplus goes back
            a.step()
        # quick steps fade it at the next full tick, at most this later
        clock.advance(a.connector.scheduler_part.slots.quiet_tick_s * 1.2)
        a.step()
        a.settle()
        assert _held_slot_bytes(store) <= 2 * 2 * entry
    finally:
        store.shutdown()


def test_blocks_filled_while_decoding_are_saved_too(store, model_dir):
    a = make_engine(store.client(), model_dir)
    p = prompt(1000, seed=6)
    a.serve("A", p, max_tokens=300)  # 1300 tokens: 10 full blocks, 2 of them filled by decoding
    a.settle()
    assert a.stats()["saved_blocks"] == 10 and a.stats().get("saves_dropped", 0) == 0


# --- the FULL-CUDA-graph hazard (the seed's reason to exist) ------------------------------


def test_a_step_that_runs_no_layer_hook_fails_its_layer_loads(store, model_dir):
    """The counterfactual of the seed's rule: with the recompute count forced to 1, a hit leaves a
    1-token step, which a GPU replays as a FULL CUDA graph where no layer hook runs, so the forward
    pass never waits for the layerwise loads. The connector notices (loads posted, never waited
    for) and fails them: vLLM drops that step's token and recomputes. Never a wrong block. (Such
    a step alone in its step now loads at once whenever its hit is 64 tokens or more,
    ``policy.loads_at_once``: turned off here, ``load_at_once_ratio: 0``, to show the hazard the
    seed's rule still guards: a step of many decodes beside such a hit loads layer by layer.)"""
    layer_by_layer = {"load_at_once_ratio": 0}
    a = make_engine(store.client(), model_dir)
    p = prompt(2048)
    a.serve("A", p)
    a.settle()
    b = make_engine(store.client(), model_dir, extra=layer_by_layer)
    b.graph_replay_below = 2  # what vLLM's FULL graphs do with a 1-token step
    b.connector.scheduler_part.recompute = 1  # test-only: the rule the seed fixed
    ext, computed = b.serve("B", p)
    assert ext == 2047  # the hit was claimed with 1 token left ...
    # ... and every block loaded layer by layer was failed, then recomputed (the last block, which
    # lands before the forward pass, was good)
    assert b.failed_loads == 15 and b.wrong_blocks == 0
    assert b.stats()["unwaited_layer_loads"] == 2
    c = make_engine(store.client(), model_dir, extra=layer_by_layer)
    c.graph_replay_below = 2
    assert c.serve("C", p) == (2046, 2)  # the seed's rule: 2 tokens left, a PIECEWISE step with hooks
    assert c.failed_loads == 0 and c.wrong_blocks == 0


def slot_ledger(client: LocalBlockStore) -> tuple[set[tuple[PoolKey, int]], set[tuple[PoolKey, int]]]:
    """The (pool, offset) slots granted to ``client``, and those it has since filled or given back
    (both through its own calls: an in-process store answers a reserve at once)."""
    granted: set[tuple[PoolKey, int]] = set()
    settled: set[tuple[PoolKey, int]] = set()
    reserve, commit = client.reserve, client.commit

    def recording_reserve(pool, size, count):
        pending = reserve(pool, size, count)
        grant = pending.result()
        if grant is not None:
            granted.update((grant.pool, offset) for offset in grant.offsets)
        return pending

    def recording_commit(publish, free={}):  # noqa: B006 -- the store's own default, never mutated
        locations = publish.locations
        settled.update((locations.pools[pool], int(offset)) for pool, offset in zip(locations.pool, locations.offset))
        settled.update((pool, offset) for (pool, _), offsets in free.items() for offset in offsets)
        return commit(publish, free)

    client.reserve, client.commit = recording_reserve, recording_commit  # type: ignore[method-assign]
    return granted, settled


def test_an_idle_engine_never_writes_into_slots_that_may_have_lapsed(model_dir):
    """vLLM runs no step while an engine has no request, so nothing renews its free slots; they
    lapse, are quarantined, then handed to another engine. When the idle engine wakes, it must
    not write into them (found by review: it overwrote another engine's entries). The shards and
    both schedulers share one frozen clock that only the test moves: the slots lapse when B has
    idled 3 s of it, not when a loaded host made B's own steps outlast them (then B kept no free
    slot, and the test showed nothing: seen with every step 0.4 s slower)."""
    clock = AdvancingClock()
    clock.freeze()
    store = LocalBlockStore(num_shards=2, pool_bytes=4 << 20, reserve_timeout_s=1.0, lease_s=1.0, clock=clock)
    try:
        cfg = UcmRayConfig(reserve_timeout_s=1.0, transfer_timeout_s=0.4, lease_s=1.0)
        b_client, c_client = store.client(), store.client()
        b_granted, b_settled = slot_ledger(b_client)
        c_granted, _ = slot_ledger(c_client)
        b = make_engine(b_client, model_dir, config=cfg, clock=clock)
        b.serve("B0", prompt(2048, seed=1), max_tokens=1)  # B keeps a few free slots
        b.settle()
        b_free = b_granted - b_settled
        c = make_engine(c_client, model_dir, config=cfg, clock=clock)
        for i in range(6):  # B idles for 3 s while C keeps the shards busy
            clock.advance(0.5)
            c.serve(f"Cx{i}", prompt(200, seed=40 + i), max_tokens=1)
        pc = prompt(3072, seed=2)
        c.serve("C", pc, max_tokens=1)  # C's slots may be B's lapsed ones
        c.settle()
        # The hazard happened: slots B held free lapsed and were granted to C.
        assert b_free and b_free & c_granted, "none of B's free slots was granted again: the test shows nothing"
        b.serve("B1", prompt(3072, seed=3), max_tokens=1)
        b.settle()
        assert b.stats().get("commits_not_visible", 0) == 0
        d = make_engine(store.client(), model_dir, config=cfg, clock=clock)
        d.serve("D", pc, max_tokens=1)
        assert d.wrong_blocks == 0
    finally:
        store.shutdown()


def test_a_local_hit_on_blocks_another_request_is_loading_is_never_saved(store, model_dir):
    """R1 loads a prefix while its shard restarts (the loads fail); R2, scheduled in the same
    step, hits R1's just-allocated blocks in vLLM's own cache. R2 must not save them: they may
    hold garbage (found by review: a later reader got 9 wrong blocks)."""
    a = make_engine(store.client(), model_dir)
    p = prompt(2048)
    a.serve("A", p)
    a.settle()
    client = store.client()
    pin = client.acquire
    restarted: list[str] = []

    def pin_then_restart(keys, *args):  # shard 0 dies right after R1's lookup found its entries
        lease = pin(keys, *args)
        if not restarted:
            restarted.append(store.restart("local_shard_0")[0])
        return lease

    client.acquire = pin_then_restart  # type: ignore[method-assign]
    b = make_engine(client, model_dir)
    r1, r2 = b.add("R1", p + [3] * 300), b.add("R2", p + [4] * 300)
    b.run(r1, r2)
    b.settle()
    # The hazard happened: R1's loads failed, and R2's prefix came from vLLM's own cache over
    # every block R1 was loading (R2 loaded none of its own).
    assert restarted and b.failed_loads > 0 and "R2" not in b.loaded_blocks
    assert b.first["R2"][0] >= b.loaded_blocks["R1"] * 128 == b.stats()["local_hit_tokens"]
    assert b.wrong_blocks == 0
    c = make_engine(store.client(), model_dir)
    c.serve("C", p)
    assert c.wrong_blocks == 0


def test_a_local_prefix_hit_saves_only_what_was_computed(store, model_dir):
    a = make_engine(store.client(), model_dir)
    p = prompt(2048)
    a.serve("A", p)
    for i in range(5):  # local hits on the 16-block prefix, 2 new blocks each
        a.serve(f"A{i}", p + prompt(256, seed=10 + i))
    a.settle()
    assert a.stats()["saved_blocks"] == 16 + 5 * 2


def test_sliding_window_groups_are_refused_at_start_up(store, model_dir):
    with pytest.raises(ValueError, match="unsupported kv-cache group spec.*SlidingWindowSpec"):
        make_engine(store.client(), model_dir, sliding_window=256)


def test_blocks_whose_request_ends_before_a_slot_came_are_counted_as_dropped(store, model_dir):
    """A shard that grants no slot (here: it does not answer) leaves the request's blocks on it
    unsaved; once the request ended, vLLM keeps its blocks a moment for them (HOLD_S), then they
    are given up, and ``saves_dropped`` says how many."""
    store.set_answering("local_shard_0", False)
    a = make_engine(store.client(), model_dir)
    a.serve("A", prompt(2048))
    a.clock.advance(HOLD_S)
    a.settle()  # steps until vLLM freed the blocks
    dropped = a.stats().get("saves_dropped", 0)
    store.set_answering("local_shard_0", True)
    assert 0 < dropped < 16  # shard 0 owns some of the 16 blocks; shard 1 granted its slots
    assert a.stats().get("saved_blocks", 0) + dropped == 16


def test_a_hit_does_not_evict_other_prompts_to_make_room_for_saves_it_never_makes(model_dir):
    """The store is full with prompts P and Q. A fresh engine that hits P saves nothing of it,
    so it must not reserve slots for P's blocks: in a full pool each such slot evicts an entry
    (Q's, or P's own) for a save that never comes (before: slots for a request's first chunks
    were asked for with its lookup, hits or not)."""
    probe = LocalBlockStore(num_shards=1, pool_bytes=64 << 20)
    try:
        a = make_engine(probe.client(), model_dir)
        a.serve("P", prompt(2048))
        a.settle()
        entry = probe.index("local_shard_0").stats().used_bytes // 16
    finally:
        probe.shutdown()
    # P, Q, and room for the free slots engines keep for decode (A: 8 after its prompts, B and C: 1)
    store = LocalBlockStore(num_shards=1, pool_bytes=(32 + 12) * entry)
    try:
        a = make_engine(store.client(), model_dir)
        for name, seed in (("P", 0), ("Q", 1)):
            a.serve(name, prompt(2048, seed=seed))
        a.settle()
        assert store.index("local_shard_0").stats().entries == 32
        b = make_engine(store.client(), model_dir)
        assert b.serve("P", prompt(2048, seed=0))[0] == 2046
        b.settle()
        c = make_engine(store.client(), model_dir)
        assert c.serve("Q", prompt(2048, seed=1))[0] == 2046, "B's hit on P evicted Q"
    finally:
        store.shutdown()


def test_a_prompt_vllm_already_holds_whole_asks_the_store_nothing(store, model_dir):
    """A repeat of a prompt whose every full block is in vLLM's own prefix cache (a multi-turn
    chat on one engine) can gain nothing from the store: no lookup, no pins, no round trip."""
    a = make_engine(store.client(), model_dir)
    p = prompt(2048 + 5)
    a.serve("A", p)
    a.settle()

    def keys_asked() -> int:
        return sum(store.index(f"local_shard_{i}").stats().lookups for i in range(2))

    asked = keys_asked()
    assert a.serve("again", p) == (2048, 5)  # vLLM's own hit: every full block
    assert keys_asked() == asked, "the store was asked for blocks vLLM already held"
    assert a.stats()["lookups_skipped"] == 1
    assert a.serve("longer", p + [3] * 200) == (2048, 205)  # a block past vLLM's: asked
    assert keys_asked() > asked


def test_a_cold_prompt_asks_the_store_for_its_first_block_only(store, model_dir):
    """A prompt whose first block the store lacks can have no hit (a hit is a prefix): its lookup
    asks for that one key, not every block's (a 16k-token prompt's ~1,000 keys cost ms of host
    time before its first token), and still counts as a lookup that missed every token."""
    a = make_engine(store.client(), model_dir)

    def keys_asked() -> int:
        return sum(store.index(f"local_shard_{i}").stats().lookups for i in range(2))

    p = prompt(4096 + 5, seed=31)
    assert a.serve("cold", p) == (0, 4101)
    assert keys_asked() == 1
    stats = a.stats()
    assert (stats["lookups"], stats["hit_tokens"], stats["miss_tokens"]) == (1, 0, 4101)
    a.settle()
    b = make_engine(store.client(), model_dir)
    assert b.serve("warm", p) == (4096, 5)  # stored now: the full lookup, every full block hit
    assert keys_asked() == 1 + 1 + 32 and b.wrong_blocks == 0


def test_a_lookup_redone_after_the_prefix_was_evicted_claims_no_hit(store, model_dir):
    """A request that waited in the queue past half the pin lease is looked up again; if the
    store lost its first block meanwhile (evicted), the new lookup stops at that block, and the
    earlier lookup's hit must not survive it (vLLM would allocate external tokens nothing loads)."""
    a = make_engine(store.client(), model_dir)
    p = prompt(2048, seed=33)
    a.serve("A", p)
    a.settle()
    b = make_engine(store.client(), model_dir,
                    config=UcmRayConfig(lease_s=0.2, transfer_timeout_s=0.1, reserve_timeout_s=60.0))
    request = b.add("B", p)
    part = b.connector.scheduler_part
    assert part.get_num_new_matched_tokens(request, 0)[0] == 2046  # the hit (read unpinned)
    _evict_everything_and_overwrite(store)
    b.clock.advance(0.15)  # past lease_s / 2 in the queue: the next ask looks the prompt up again
    assert part.get_num_new_matched_tokens(request, 0)[0] == 0
    b.run(request)
    assert b.wrong_blocks == 0 and b.failed_loads == 0


def test_the_connectors_start_up_lines_are_in_the_engines_log(model_dir):
    """vLLM sets up only its own logger: the connector's INFO lines (the recompute rule, the
    worker's layout) must reach the engine's log like vLLM's, not vanish."""
    code = textwrap.dedent(f"""
        from ucm_ray.vllm.compat import configure_engine_logging
        configure_engine_logging()  # what an engine process does first
        from ucm_ray.store.local import LocalBlockStore
        from ucm_ray.testing.harness import make_engine
        store = LocalBlockStore(num_shards=1, pool_bytes=16 << 20)
        make_engine(store.client(), {model_dir!r}, num_spec=2).shutdown()
        store.shutdown()
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    log = run.stdout + run.stderr
    assert "ucm-ray scheduler: groups" in log and "recompute=4" in log, log[-2000:]
    assert "ucm-ray worker rank 0" in log, log[-2000:]


@hybrid_harness
def test_a_hybrid_whose_lcm_block_no_prompt_fills_is_named_at_start_up(store, model_dir, caplog):
    """State blocks as long as the model (vLLM's sizing without align mode) leave the tier
    nothing to do: said once at start-up, not discovered from empty counters."""
    from ucm_ray.testing.harness import MAX_LEN

    with caplog.at_level("WARNING", logger="ucm_ray"):
        make_engine(store.client(), model_dir, hybrid=True, state_block_size=MAX_LEN).shutdown()
    assert f"LCM block is {MAX_LEN} tokens" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ucm_ray"):
        make_engine(store.client(), model_dir, hybrid=True).shutdown()
    assert "LCM block" not in caplog.text


def _evict_everything_and_overwrite(store: LocalBlockStore) -> None:
    """Another writer takes every byte of every pool (evicting all unpinned entries) and fills
    it: an entry read unpinned now holds someone else's bytes."""
    writer = random_id()
    for shard_id, incarnation in store.pools().descriptors:
        index = store.index(shard_id)
        _, offsets = index.reserve(writer, 4096, index.stats().capacity_bytes // 4096)
        assert offsets
        store.pool_of(Location(shard_id, incarnation, 0, 0)).tensor.fill_(0x5A)


def test_an_unpinned_entry_evicted_and_overwritten_before_the_copy_is_a_failed_load(store, model_dir):
    """Lookups on the shard's node read its published index and pin nothing; the entries are
    evicted and their slots rewritten after the lookup, before the worker copies. Validation
    after the copy must fail those loads (vLLM recomputes), never hand the bytes to vLLM."""
    a = make_engine(store.client(), model_dir)
    p = prompt(2048)
    a.serve("A", p)
    a.settle()
    b = make_engine(store.client(), model_dir)
    overwritten: list[bool] = []

    def overwrite_before_first_load(engine, meta):
        if meta.loads.get(0) and not overwritten:
            assert meta.loads[0][0].blocks.locations.generation.all()  # unpinned
            _evict_everything_and_overwrite(store)
            overwritten.append(True)

    b.before_worker = overwrite_before_first_load
    assert b.serve("B", p + [3] * 300)[0] == 2048
    b.settle()
    assert overwritten and b.wrong_blocks == 0
    assert b.failed_loads == 16 and b.stats()["stale_loads"] == 16


def test_a_worker_that_cannot_read_a_pools_index_fails_once_then_gets_pinned_entries(store, model_dir):
    """A worker on another node than its scheduler cannot validate unpinned loads: it fails them
    and says so, and the scheduler pins that pool's entries from then on."""
    a = make_engine(store.client(), model_dir)
    p1, p2 = prompt(2048, seed=1), prompt(2048, seed=2)
    a.serve("A1", p1)
    a.serve("A2", p2)
    a.settle()
    b = make_engine(store.client(), model_dir, index_readers=lambda node_id: IndexReaders("another-node"))
    b.serve("B1", p1 + [3] * 40)
    b.settle()
    assert b.wrong_blocks == 0 and b.failed_loads == 16
    assert b.serve("B2", p2 + [3] * 40)[0] == 2048
    b.settle()
    assert b.failed_loads == 16 and b.stats()["stale_loads"] == 16  # B2's pinned loads all landed
    assert b.stats()["loaded_blocks"] == 16


def test_a_request_passes_through_its_phases_in_order(store, model_dir):
    """The scheduler half's record of a request: looked up, loading where vLLM took a store hit
    (until the step's plan hands its loads to the workers), running, and finishing (its blocks
    held) while blocks it computed are unsaved; forgotten once they are saved. A's hold lasts
    ``HOLD_S`` of its scheduler's clock, frozen here (on a box slow enough that its steps took
    longer, the saves would be dropped, as they should, and B's hit would fall short)."""
    a = make_engine(store.client(), model_dir)
    a.clock.freeze()
    part_a = a.connector.scheduler_part
    p = prompt(2048)
    a.run(a.add("A", p, max_tokens=1))  # its prompt's blocks are saved after its only token
    assert part_a.phase_of("A") is Phase.FINISHING
    a.settle()
    assert part_a.phase_of("A") is None
    b = make_engine(store.client(), model_dir)
    part_b = b.connector.scheduler_part
    request = b.add("B", p + [3] * 40)
    assert part_b.phase_of("B") is None
    assert part_b.get_num_new_matched_tokens(request, 0)[0] == 2048
    assert part_b.phase_of("B") is Phase.LOOKUP
    at_dispatch: list[Phase | None] = []
    dispatch = part_b.loads.dispatch

    def observed(out, meta) -> None:
        at_dispatch.append(part_b.phase_of("B"))
        dispatch(out, meta)

    part_b.loads.dispatch = observed
    while "B" not in b.first:
        b.step()
    assert at_dispatch[-1] is Phase.LOADING and part_b.phase_of("B") is Phase.RUNNING
    b.run(request)
    b.settle()
    assert part_b.phase_of("B") is None and b.wrong_blocks == 0 and b.loaded_blocks["B"] == 16


def test_a_request_that_ends_before_its_slots_came_keeps_its_blocks_until_they_are_saved(store, model_dir):
    """A request of one token computes its whole prompt in its last step. Its write slots came
    late (here: the shards granted none until it ended; on a loaded box a grant can take longer
    than the request). vLLM keeps the finished request's blocks (``request_finished`` says so)
    and frees them once a later step saved them: nothing is dropped. (Before, the blocks were
    freed at the end of the request, and every save without a slot was lost: a flaky miss on
    another engine.)

    The hold lasts ``HOLD_S`` of the scheduler's clock, frozen here: on the host's time, a box
    slow enough that the steps below took longer than that dropped the saves, as it should, and
    failed the test."""
    for shard in ("local_shard_0", "local_shard_1"):
        store.set_answering(shard, False)
    a = make_engine(store.client(), model_dir)
    a.clock.freeze()
    a.run(a.add("A", prompt(2048), max_tokens=1))
    for _ in range(3):  # steps that still find no slot: each block waits, counted once
        a.step()
    assert "A" in a.sched.requests, "vLLM freed the request while its blocks were unsaved"
    for shard in ("local_shard_0", "local_shard_1"):
        store.set_answering(shard, True)
    a.settle()
    assert "A" not in a.sched.requests, "the request's blocks were never given back to vLLM"
    assert a.stats().get("saves_dropped", 0) == 0
    assert a.stats()["saved_blocks"] == 16
    # per block, not per step it waited (the free stock may have come in time for a few)
    assert 0 < a.stats()["saves_skipped"] <= 16
    b = make_engine(store.client(), model_dir)
    assert b.serve("B", prompt(2048))[0] > 0  # another engine hits what was saved


@pytest.mark.parametrize("chunk, slow_s", [(8192, 0.0), (1024, 0.0), (8192, HOLD_S + 0.2)],
                         ids=["one chunk", "two chunks", "one chunk, a slow host"])
def test_no_save_runs_before_a_cold_prompts_first_token(store, model_dir, chunk, slow_s):
    """A cold request's first token waits for no save: neither the steps that compute its
    prompt (with chunked prefill, chunk 2's step would otherwise save chunk 1) copy anything to
    the store, nor ask for its write slots; the steps after the first token copy all of it
    (vLLM keeps the finished request's blocks until then).

    The blocks are held ``HOLD_S`` of the scheduler's clock, frozen here: on the host's time, a
    box slow enough that the steps after the first token came more than that later dropped the
    saves, as it should, and failed the test (``slow_s``: host time between the two)."""
    a = make_engine(store.client(), model_dir, max_batched=chunk)
    a.clock.freeze()
    saved_per_step: list[int] = []

    def record(engine, meta) -> None:
        saves = meta.saves.get(0)
        saved_per_step.append(0 if saves is None else len(saves))

    a.before_worker = record
    a.run(a.add("A", prompt(2048), max_tokens=1))
    first_token = len(saved_per_step)  # steps until the one that ran the prompt's end, and finished it
    time.sleep(slow_s)
    a.settle()
    assert saved_per_step[:first_token] == [0] * first_token == [0] * (2048 // min(chunk, 2048))
    assert sum(saved_per_step[first_token:]) == 16
    assert a.stats()["saved_blocks"] == 16


def test_a_prompt_vllm_holds_whole_asks_for_no_write_slots(store, model_dir):
    """A repeat of a prompt whose every full block is in vLLM's own cache saves nothing, so it
    must not reserve write slots for it either: unused slots go back only once the engine idles,
    and meanwhile each holds shard space (a full pool evicts an entry to make it). Before, the
    slots of a dense prompt were asked for from its first token on, cached or not."""
    a = make_engine(store.client(), model_dir)
    p = prompt(1000, seed=8)
    a.serve("first", p)
    a.settle()
    asked: list[int] = []
    supply = a.connector.scheduler_part.slots
    expect = supply.expect

    def counting(counts, **how):
        asked.append(sum(counts.values()))
        return expect(counts, **how)

    supply.expect = counting
    a.serve("again", p)
    a.settle()
    assert a.first["again"][0] >= 896  # vLLM's own cache held every full block
    assert sum(asked) == 0


def _late_save_results(engine, steps: int) -> None:
    """The scheduler hears of each save job ``steps`` steps after it was posted, as it does of
    saves on a CUDA stream, which land beside the following steps (on CPU the copy thread's
    saves land within their step: the device-side path itself runs in ``tests/gpu``)."""
    build = engine.worker.build_connector_worker_meta
    held: list[tuple[int, dict]] = []

    def late():
        out = build() or UcmRayWorkerMetadata()
        held.append((engine.steps + steps, out.saves))
        out.saves = {}
        for _, saves in [item for item in held if item[0] <= engine.steps]:
            out.saves.update(saves)
        held[:] = [item for item in held if item[0] > engine.steps]
        return None if out.is_empty() else out

    engine.worker.build_connector_worker_meta = late


def test_saves_that_land_late_hold_their_blocks_and_a_step_reusing_one_waits_for_it(store, model_dir):
    """Saves land beside later steps, so the scheduler learns of them late. Meanwhile vLLM may
    free a block a save still reads (preempting its request) and hand it to another request:
    that step names the save in its ``fences`` (its forward waits for the copy), and only for
    blocks still being copied. A finished request keeps its blocks until its saves are known
    to have landed. Nothing wrong is ever stored."""
    a = make_engine(store.client(), model_dir, num_blocks=24)
    _late_save_results(a, 400)
    sp = a.connector.scheduler_part
    fenced: list[set[int]] = []

    def check(engine, meta) -> None:
        assert meta.fences <= set(sp.saves.jobs.in_flight), "a fence named a save whose result was already in"
        posted_now = {job.job_id for job in meta.saves.values()}
        targets = [block for job in meta.loads.get(0, []) for block in job.blocks.block_ids.tolist()]
        for job_id, job in sp.saves.jobs.in_flight.items():  # a load into a block a save still reads waits for it
            if job_id not in posted_now and set(job.block_ids.tolist()) & set(targets):
                assert job_id in meta.fences, "a load target was not fenced"
        fenced.append(set(meta.fences))

    a.before_worker = check
    x = a.add("X", prompt(1280, seed=3), max_tokens=400)
    y = a.add("Y", prompt(1280, seed=4), max_tokens=400)
    a.run(x, y)
    copying = {req_id for job in sp.saves.jobs.in_flight.values() for req_id in job.requests} & {"X", "Y"}
    assert copying, "the requests ended with no save in flight: the scenario tests nothing"
    assert all(req_id in a.sched.requests for req_id in copying), "vLLM freed blocks a save was still reading"
    a.settle()
    assert not a.sched.requests, "finished requests were never given back to vLLM"
    assert any(r.num_preemptions for r in (x, y)), "the scenario must preempt a request"
    assert any(fenced), "no step reused a block that a save was still copying"
    assert sum(map(len, fenced)) < len(fenced) // 10, "steps waited for saves they do not touch"
    assert a.stats().get("save_failures", 0) == 0 and a.stats()["saved_blocks"] > 20
    for seed in (3, 4):
        b = make_engine(store.client(), model_dir, num_blocks=24)
        assert b.serve(f"B{seed}", prompt(1280, seed=seed))[0] > 0
        assert b.wrong_blocks == 0 and b.failed_loads == 0


def _load_modes(engine) -> dict[str, bool]:
    """Filled as the engine's steps run: per request with loads, whether they went whole
    (``complete_in_start``) rather than layer by layer."""
    modes: dict[str, bool] = {}

    def record(_engine, meta) -> None:
        for job in meta.loads.get(0, []):
            modes[job.req_id] = job.complete_in_start

    engine.before_worker = record
    return modes


def test_a_step_computing_little_beside_its_hit_loads_it_at_once_not_layer_by_layer(store, model_dir):
    """A repeated prompt recomputes a few tokens after a long hit: its loads go in one piece
    before the forward (``policy.loads_at_once``: per-layer posts cost more host time than the
    few tokens' compute could hide), while a hit followed by a long new part is still loaded
    layer by layer, behind that part's compute. Both load every byte right."""
    a = make_engine(store.client(), model_dir)
    p = prompt(2048 + 1024, seed=41)
    a.serve("A", p[:2048])
    a.settle()
    seen: dict[str, bool] = {}
    for req_id, tokens in (("repeat", p[:2048 + 5]), ("longer", p)):
        b = make_engine(store.client(), model_dir)
        modes = _load_modes(b)
        hit, computed = b.serve(req_id, tokens)
        seen |= modes
        assert hit == 2048 and computed == len(tokens) - 2048
        assert b.loaded_blocks[req_id] == 16 and b.wrong_blocks == 0 and b.failed_loads == 0
    assert seen == {"repeat": True, "longer": False}


def test_a_repeated_prompt_batched_with_a_long_prefill_is_loaded_layer_by_layer(store, model_dir):
    """Loads posted whole hold the compute stream back for the whole batch until they landed,
    so the choice is the step's: a repeated prompt (5 tokens to compute) scheduled beside a
    fresh 1024-token prompt keeps its loads layer by layer, behind that prompt's compute."""
    a = make_engine(store.client(), model_dir)
    p = prompt(2048 + 5, seed=43)
    a.serve("A", p[:2048])
    a.settle()
    b = make_engine(store.client(), model_dir)
    seen = _load_modes(b)
    repeat, fresh = b.add("repeat", p), b.add("fresh", prompt(1024, seed=44))
    b.step()
    assert b.first == {"repeat": (2048, 5), "fresh": (0, 1024)}  # both in the first step
    b.run(repeat, fresh)
    assert seen == {"repeat": False}
    assert b.loaded_blocks["repeat"] == 16 and b.wrong_blocks == 0 and b.failed_loads == 0


def test_loads_of_a_step_whose_results_were_never_asked_for_are_not_reported_in_the_next(store, model_dir):
    """Loads posted whole are checked once vLLM asks for the step's results. If it never asks
    (the step's execution failed), the next step's ``bind`` lands them, but their failed blocks
    must not reach vLLM as the next step's ``invalid_block_ids``: those ids may be other
    requests' blocks by then. The scheduler still learns the loads are over (pins released)."""
    a = make_engine(store.client(), model_dir)
    p = prompt(2048, seed=45)
    a.serve("A", p)
    a.settle()
    b = make_engine(store.client(), model_dir)
    b.add("B", p)
    out = b.sched.schedule()  # the repeated prompt's loads, posted whole
    assert [job.complete_in_start for job in out.kv_connector_metadata.loads[0]] == [True]
    _evict_everything_and_overwrite(store)  # so every block it copies is stale
    b.worker.bind_connector_metadata(out.kv_connector_metadata)
    b.worker.start_load_kv(None)
    # ... and vLLM asks nothing of this step: the next one binds
    b.worker.bind_connector_metadata(UcmRayConnectorMetadata(loads={0: []}))
    b.worker.start_load_kv(None)
    assert b.worker.get_block_ids_with_load_errors() == set()
    worker_meta = b.worker.build_connector_worker_meta()
    assert worker_meta is not None and len(worker_meta.loads_done) == 1
    assert len(next(iter(worker_meta.load_failures.values()))) == 16  # the scheduler knows they failed


def test_every_layer_of_a_block_holds_its_own_value(store, model_dir):
    """The harness's check of loaded bytes tells layers apart (it told only 8 apart: a load that
    put layer 8's block in layer 0 passed in the 32-layer benchmark); beyond what it can tell
    apart it refuses to build the engine."""
    assert len({block_value(bytes(range(32)), layer) for layer in range(MAX_LAYERS)}) == MAX_LAYERS
    assert block_value(b"\xff" * 32, MAX_LAYERS - 1) + 0.5 < 2 ** 23  # numerics' halves stay exact
    with pytest.raises(ValueError, match="num_layers 65"):
        make_engine(store.client(), model_dir, num_layers=MAX_LAYERS + 1)


def test_an_engines_free_slots_do_not_evict_what_it_just_saved(model_dir):
    """An engine that saved a burst keeps free slots for more (up to ``max_num_seqs`` per pool
    and entry size, as many as recent steps used): counted in entries, not bytes, they could
    take a small pool's room and evict the prefix it had just saved (the data-plane benchmark
    lost its hits so). Held free slots are capped at a share of the pool."""
    entry = 2 * 128 * 16 * 2 * 4  # 2 layers of 128-token blocks, 1 head of 16
    store = LocalBlockStore(num_shards=1, pool_bytes=12 * entry)
    try:
        a = make_engine(store.client(), model_dir)
        p = prompt(8 * 128 + 1, seed=11)
        a.serve("A", p, max_tokens=1)  # 8 full blocks saved; its demand says 8 more may come
        a.settle()
        for _ in range(5):
            a.step()  # ticks: the free stock the demand asks for is granted (a full tick each)
            a.clock.advance(a.connector.scheduler_part.slots.quiet_tick_s * 1.2)
        a.settle()
        b = make_engine(store.client(), model_dir)
        ext, _ = b.serve("B", p)
        assert ext == 8 * 128 - 1, f"B's hit: {ext} tokens of the 8 blocks A saved"
        assert b.wrong_blocks == 0
    finally:
        store.shutdown()


@hybrid_harness
def test_a_shard_joining_while_a_prompt_is_placed_neither_fails_the_step_nor_loses_its_saves(model_dir):
    """Replication 2 over a fleet of one shard (one owner a key); a second shard joins between
    the placement of a hybrid prompt's attention blocks and that of its states, in one plan (on
    Ray, ``pools()`` adopts a pushed membership at any call). Found by review: the two placements'
    rows (one owner, then two) were joined into one array, which raised in vLLM's scheduler."""
    store = LocalBlockStore(num_shards=1, pool_bytes=64 << 20, replication=2)
    try:
        client = store.client()
        a = make_engine(client, model_dir, block_size=2048, hybrid=True)
        p = prompt(8192)
        attention = set(a.block_keys(p))
        place = client.placement
        joined: list[PoolKey] = []

        def join_after_the_attention_blocks(keys):
            placed = place(keys)
            if not joined and len(keys) > 1 and set(keys) <= attention:
                joined.append(store.restart("local_shard_1"))  # an id not in the fleet: a shard joins
            return placed

        client.placement = join_after_the_attention_blocks  # type: ignore[method-assign]
        a.serve("A", p)
        a.settle()
        assert joined and a.wrong_blocks == 0 and a.stats()["save_failures"] == 0
        b = make_engine(store.client(), model_dir, block_size=2048, hybrid=True)
        assert b.serve("B", p + [3] * 300)[0] >= 8192  # A's blocks and states were saved
        assert b.wrong_blocks == 0 and b.failed_loads == 0
    finally:
        store.shutdown()


def test_a_pool_change_in_a_quiet_decode_window_reaches_the_workers_at_the_next_step(store, model_dir):
    """A quiet decode step's plan ends early (nothing new since the last plan: no call to the
    parts that would find nothing, docs/performance-log.md stop 66), but looks at the pools
    first: a shard restarted while a request decodes quietly reaches the workers in the very
    next step's metadata, and the request's decode batch is then saved, the new pool too."""
    engine = make_engine(store.client(), model_dir, block_size=16)
    metas: list[UcmRayConnectorMetadata] = []
    build = engine.connector.build_connector_meta

    def built(out):
        metas.append(build(out))
        return metas[-1]

    engine.connector.build_connector_meta = built  # type: ignore[method-assign]
    request = engine.add("D", prompt(160, seed=80), max_tokens=300)
    for _ in range(40):
        engine.step()
    assert all(meta is QUIET_STEP for meta in metas[-8:])  # a quiet window
    saved = engine.stats()["saved_blocks"]
    restarted = store.restart("local_shard_0")
    engine.step()
    assert metas[-1].pools is not None and restarted in metas[-1].pools
    while not request.is_finished():
        engine.step()
    engine.settle()
    assert engine.wrong_blocks == 0 and engine.stats()["saved_blocks"] - saved == (160 + 300) // 16 - 160 // 16
    assert store.index("local_shard_0").stats().entries > 0


def test_a_finished_send_told_in_a_quiet_decode_window_reaches_vllm_at_once(store, model_dir, monkeypatch):
    """A quiet decode step's result hooks answer without a call where the worker has nothing in
    flight and nothing gathered (docs/performance-log.md, stop 67). A finished request whose last
    blocks were saved is told to the workers in a step that posts nothing else (its metadata's
    ``saved_requests``), leaving the worker idle: its ``finished_sending`` must still reach vLLM in
    that step's output (else vLLM never frees the request's blocks), while another request decodes
    quietly around it."""
    engine = make_engine(store.client(), model_dir, block_size=16)
    worker = engine.worker.worker_part
    told: list[tuple[set[str], bool]] = []  # per step: (finished sending, the worker idle)

    def transfers(connector, finished_req_ids):  # as this vLLM's runner asks
        sending, recving, failed = compat.transfer_results(connector, finished_req_ids)
        told.append((sending, worker.idle))
        return sending, recving, failed

    monkeypatch.setattr(harness, "transfer_results", transfers)
    engine.add("Q", prompt(160, seed=81), max_tokens=300)  # decodes quietly throughout
    short = engine.add("D", prompt(160, seed=82), max_tokens=24)  # its last blocks are kept for their save
    while not short.is_finished():
        engine.step()
    assert "D" in engine.sched.requests  # finished, its blocks kept for their save
    for _ in range(12):
        engine.step()
    assert "D" not in engine.sched.requests  # vLLM freed them
    assert ({"D"}, True) in told  # told in a step that left the worker idle
    assert sum("D" in sending for sending, _ in told) == 1
    assert engine.wrong_blocks == 0
