"""vLLM's asynchronous scheduling (its default on GPUs) with the tier: every hit loads
asynchronously there, so a failed load is exact; vLLM's V2 model runner is refused.

The harness runs vLLM's own ``AsyncScheduler`` behind its engine core's batch queue of two (a
step is scheduled and run before the step before it is taken back), and its stand-in model
samples ``POISONED_TOKEN`` for a request whose attention read a block holding other bytes
(``check_reads``): a request's tokens show whether vLLM kept a token computed from a failed load.
"""

from __future__ import annotations

from typing import TypeVar

import pytest
from vllm.config import DeviceConfig, VllmConfig

from tests.support.store_helpers import corrupt_stored_blocks
from ucm_ray.store.types import Pending
from ucm_ray.testing.harness import POISONED_TOKEN, TOKEN, make_engine, prompt
from ucm_ray.vllm.compat import check_model_runner, loads_land_before_scheduling

T = TypeVar("T")
BLOCKS = 16
CORRUPT = [10]
"""The stored block that fails its checksum: vLLM keeps the hit's first 10 blocks."""


def _stored(store, model_dir, tokens: list[int]):
    """Engine A computes ``tokens`` and saves them with checksums; the entry of block 10 is
    then flipped."""
    a = make_engine(store.client(), model_dir, extra={"checksum": True})
    a.serve("A", tokens)
    a.settle()
    assert corrupt_stored_blocks(store, a, tokens, CORRUPT) == 1
    return a


def _tokens(engine, req_id: str, tokens: list[int], max_tokens: int) -> list[int]:
    request = engine.add(req_id, tokens, max_tokens=max_tokens)
    engine.run(request)
    for _ in range(3):  # the batch queue's last output
        engine.step()
    return list(request.output_token_ids)


def test_under_async_scheduling_a_failed_load_keeps_no_token_of_its_bytes(store, model_dir):
    """Engine B schedules asynchronously: its hit loads before the request is scheduled, the
    failed block reaches vLLM first, and vLLM computes from it on. Every token is the model's,
    and the blocks before the failed one stay loaded."""
    p = prompt(BLOCKS * 128)
    _stored(store, model_dir, p)
    b = make_engine(store.client(), model_dir, async_scheduling=True)
    b.check_reads = True
    assert b.connector.scheduler_part.geometry.async_loads
    assert _tokens(b, "B", p, max_tokens=6) == [TOKEN] * 6
    assert b.failed_loads == 1 and b.stats()["checksum_mismatches"] == 1 and b.wrong_blocks == 0
    # the blocks before the failed one were loaded and kept: vLLM computed from block 10 on
    assert b.first["B"][0] == CORRUPT[0] * 128 and b.prefill_computed["B"] == (BLOCKS - CORRUPT[0]) * 128


def test_synchronous_loads_under_async_scheduling_keep_a_token_of_the_failed_bytes(store, model_dir):
    """Why the connector loads asynchronously there: the same engine whose connector is told
    scheduling is synchronous loads layer by layer in the step that computes; the failure is
    reported after the next step ran on the failed bytes, and vLLM keeps that step's token
    (vllm-project/vllm#49250). The harness sees it (the check can fail)."""
    p = prompt(BLOCKS * 128)
    _stored(store, model_dir, p)
    b = make_engine(store.client(), model_dir, async_scheduling=True, told_async=False)
    b.check_reads = True
    assert not b.connector.scheduler_part.geometry.async_loads
    out = _tokens(b, "B", p, max_tokens=6)
    assert b.failed_loads == 1 and b.wrong_blocks == 0
    assert POISONED_TOKEN in out, out


def test_synchronous_scheduling_keeps_layerwise_loads_and_a_failed_load_is_exact(store, model_dir):
    """Synchronous scheduling on the V1 runner: loads stay synchronous (layer by layer with the
    forward), and vLLM drops the failed step's token itself."""
    p = prompt(BLOCKS * 128)
    _stored(store, model_dir, p)
    b = make_engine(store.client(), model_dir)
    b.check_reads = True
    assert not b.connector.scheduler_part.geometry.async_loads
    assert _tokens(b, "B", p, max_tokens=6) == [TOKEN] * 6
    assert b.failed_loads == 1 and b.wrong_blocks == 0


def test_async_scheduling_hits_load_whole_and_give_the_policys_tokens(store, model_dir):
    """No failure: the hit is the policy's (2048 - 2 recomputed), loaded before the request is
    scheduled, and the tokens are the model's."""
    p = prompt(BLOCKS * 128)
    a = make_engine(store.client(), model_dir)
    a.serve("A", p)
    a.settle()
    b = make_engine(store.client(), model_dir, async_scheduling=True)
    b.check_reads = True
    assert _tokens(b, "B", p, max_tokens=4) == [TOKEN] * 4
    assert b.first["B"] == (BLOCKS * 128 - 2, 2)
    assert b.failed_loads == 0 and b.wrong_blocks == 0 and b.loaded_blocks["B"] == BLOCKS


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_asynchronous_scheduling_loads_asynchronously(async_scheduling):
    """vLLM's asynchronous scheduling needs loads that land before the request is scheduled;
    synchronous scheduling keeps layer-by-layer loads."""
    vllm_config = VllmConfig(device_config=DeviceConfig("cpu"))
    vllm_config.scheduler_config.async_scheduling = async_scheduling  # vLLM turns it off on CPU
    assert loads_land_before_scheduling(vllm_config) is async_scheduling


def test_vllms_v2_model_runner_is_refused_at_start_up(monkeypatch):
    """A failed load under vLLM's V2 runner is not shown exact yet (``compat.check_model_runner``):
    refused, naming the switch, first thing in both roles. vLLM reads the switch whenever it asks
    which runner runs and refuses to build a V2 config without Triton (this CPU box has none), so
    it is turned after the config is built, as vLLM 0.26 picks V2 by itself on Hopper. (On the GPU:
    ``tests/gpu/test_full_cuda_graphs.py``.)"""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    vllm_config = VllmConfig(device_config=DeviceConfig("cpu"))
    check_model_runner(vllm_config)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert vllm_config.use_v2_model_runner
    with pytest.raises(ValueError, match="V2 model runner.*wrong tokens; set VLLM_USE_V2_MODEL_RUNNER=0"):
        check_model_runner(vllm_config)



class _LateCommit(Pending[T]):
    """A commit answered only once it was looked at ``polls`` times (a shard's round trip)."""

    def __init__(self, answer: Pending[T], polls: int = 3) -> None:
        self._answer, self._polls = answer, polls

    def poll(self) -> bool:
        self._polls -= 1
        return self._polls < 0 and self._answer.poll()

    def result(self) -> T:
        return self._answer.result()


def test_an_engine_that_ran_out_of_requests_still_settles_under_async_scheduling(store, model_dir):
    """The harness: vLLM's batch queue schedules no step without requests, so a commit still
    unanswered when the last request's blocks were freed was never collected and ``settle``
    waited out its timeout (``batch_steps.py --async-scheduling`` could not start on a real
    fleet). Settling plans steps without requests there too, as the synchronous engine does."""
    client = store.client()
    commit = client.commit
    client.commit = lambda *args, **kwargs: _LateCommit(commit(*args, **kwargs))  # type: ignore[method-assign]
    engine = make_engine(client, model_dir, async_scheduling=True)
    engine.serve("A", prompt(BLOCKS * 128), max_tokens=2)
    engine.settle(timeout_s=5.0)
    assert engine.connector.scheduler_part.settled() and engine.stats()["saved_blocks"] == BLOCKS


def test_a_steps_output_carries_only_its_own_failed_blocks_when_vllm_takes_it_back(store, model_dir):
    """review56: the worker handed vLLM its own (empty) set of failed block ids in a step without
    failures and filled that same set in the next step, which ran before vLLM took the first
    step's output back (the batch queue): the earlier step's output then carried the later
    step's failures. Each output, when vLLM takes it back, holds what its step reported."""
    p = prompt(BLOCKS * 128)
    _stored(store, model_dir, p)
    b = make_engine(store.client(), model_dir, async_scheduling=True)
    execute, apply = b._execute, b._apply

    def failed_blocks(runner_output) -> set[int]:
        kv_output = runner_output.kv_connector_output
        return set(kv_output.invalid_block_ids) if kv_output is not None else set()

    reported: list[set[int]] = []  # per step run, oldest first: vLLM takes outputs back in order
    taken_back: list[tuple[set[int], set[int]]] = []

    def execute_noting(out):
        runner_output = execute(out)
        reported.append(failed_blocks(runner_output))
        return runner_output

    def apply_checking(out, runner_output) -> None:
        taken_back.append((reported.pop(0), failed_blocks(runner_output)))
        apply(out, runner_output)

    b._execute, b._apply = execute_noting, apply_checking  # type: ignore[method-assign]
    b.add("warm", prompt(4 * 128, seed=7), max_tokens=8)  # steps in flight before B's load
    for _ in range(3):
        b.step()
    assert _tokens(b, "B", p, max_tokens=4) == [TOKEN] * 4
    assert b.failed_loads == 1 and any(ids for ids, _ in taken_back)
    assert [ids for ids, _ in taken_back] == [ids for _, ids in taken_back]
