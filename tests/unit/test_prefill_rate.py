"""The engine's prefill rate (``vllm.scheduler.prefill_rate``): what its steps took, from vLLM's real
scheduler (the two-halves harness, a stand-in forward of a set duration), and the estimate's rules
on step records shaped as vLLM hands them (in order, two in flight under asynchronous scheduling)."""

from __future__ import annotations

import pytest

from ucm_ray.store.local import LocalBlockStore
from ucm_ray.testing.harness import make_engine, prompt, write_model_dir
from ucm_ray.vllm.scheduler.prefill_rate import MIN_TOKENS, WINDOW, PrefillRate

KV_PER_TOKEN = 32 << 10  # the GPU benchmark's ~1B model: bf16, 32 KiB of KV a token
STEP_S = 0.05


@pytest.fixture
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("model")))


def forward_takes(seconds: float):
    """A ``before_worker`` hook: the step's forward takes ``seconds`` on the engine's clock."""
    return lambda engine, meta: engine.clock.advance(seconds)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_engine_times_its_prefill_steps_not_its_decode_steps(model_dir, async_scheduling):
    store = LocalBlockStore(num_shards=1, pool_bytes=64 << 20)
    try:
        _time_a_prompt(store, model_dir, async_scheduling)
    finally:
        store.shutdown()  # its pool and index in /dev/shm


def _time_a_prompt(store: LocalBlockStore, model_dir: str, async_scheduling: bool) -> None:
    engine = make_engine(store.client(), model_dir, max_batched=1024, async_scheduling=async_scheduling)
    engine.clock.freeze()  # only the stand-in forward's time counts
    engine.before_worker = forward_takes(STEP_S)
    rate = engine.connector.scheduler_part.prefill_rate
    assert rate.bytes_per_s == 0.0  # nothing timed yet: the shard reads what it holds
    per_token = rate.kv_bytes_per_token
    assert per_token == 2 * 16 * 2 * 4  # 2 layers of 1 head of 16, K and V, float32
    engine.serve("A", prompt(2048), max_tokens=8)  # two 1,024-token prefill steps, then decode steps
    engine.settle()
    if async_scheduling:
        # The harness runs the next step before it hands the last one back (vLLM's batch queue of
        # two): a step is timed over both forwards, a rate half as high at worst (the safe side).
        # Bounds within float rounding: a step's time is a difference of two clock readings, and
        # ``(t + 0.05 + 0.05) - t`` is a hair over 0.1 for some frozen instants ``t``.
        slowest, fastest = 1024 * per_token / (2 * STEP_S), 1024 * per_token / STEP_S
        assert slowest * (1 - 1e-9) <= rate.bytes_per_s <= fastest * (1 + 1e-9)
    else:
        assert rate.bytes_per_s == pytest.approx(1024 * per_token / STEP_S)  # decode steps not timed
    assert len(rate.rates) == 2


def test_the_median_of_recent_steps_ignores_one_slow_step_and_follows_a_change():
    rate = PrefillRate(KV_PER_TOKEN)
    t = 0.0

    def step(tokens: int, seconds: float) -> None:
        nonlocal t
        rate.planned(tokens, t)
        t += seconds
        rate.answered(lambda: t)

    step(16384, 0.122)  # the H100 crossover's 16k-token prefill of a ~1B model: 4.4 GB/s of KV
    assert rate.bytes_per_s == pytest.approx(16384 * KV_PER_TOKEN / 0.122)
    step(MIN_TOKENS - 1, 1.0)  # too small to mean anything
    step(1, 0.01)  # a decode step
    assert len(rate.rates) == 1
    for _ in range(4):
        step(16384, 0.122)
    step(16384, 5.0)  # a compile, a preemption, a busy host
    assert rate.bytes_per_s == pytest.approx(16384 * KV_PER_TOKEN / 0.122)
    for _ in range(WINDOW):  # the engine got slower (longer prompts, more load): followed
        step(4096, 0.244)
    assert rate.bytes_per_s == pytest.approx(4096 * KV_PER_TOKEN / 0.244)
    assert len(rate.rates) == WINDOW


def test_two_steps_in_flight_are_matched_in_order():
    """Under asynchronous scheduling vLLM plans step N+1 before step N's output comes back."""
    rate = PrefillRate(KV_PER_TOKEN)
    rate.planned(4096, 0.0)
    rate.planned(1, 0.05)  # a decode step planned while the prefill runs
    rate.answered(lambda: 0.10)  # the prefill's output: 4096 tokens in 0.1 s
    rate.planned(2048, 0.11)
    rate.answered(lambda: 0.12)  # the decode step's: not timed
    rate.answered(lambda: 0.21)  # 2048 tokens in 0.1 s
    assert sorted(rate.rates) == pytest.approx([2048 * KV_PER_TOKEN / 0.1, 4096 * KV_PER_TOKEN / 0.1])


def test_an_answer_that_never_comes_only_makes_later_steps_look_slower():
    """If vLLM ever skipped a step's output, each later answer is matched to an older plan: a
    longer time, a lower rate, so the shard reads more (as without an estimate), never less."""
    rate = PrefillRate(KV_PER_TOKEN)
    rate.planned(4096, 0.0)  # its answer is lost
    rate.planned(4096, 0.1)
    rate.answered(lambda: 0.2)  # matched to the first plan: 0.2 s, not 0.1 s
    assert rate.bytes_per_s == pytest.approx(4096 * KV_PER_TOKEN / 0.2)


def test_steps_without_a_forward_that_report_nothing_shift_no_timing():
    """vLLM hands a step without tokens back only when its workers had something to report
    (``ModelRunnerOutput.with_kv_conn_output_only``: nothing, and ``update_connector_output`` is
    never called for it). Such steps run whenever nothing can be scheduled, e.g. while finished
    requests' saves land: counting them made every later prefill's answer match an older plan."""
    rate = PrefillRate(KV_PER_TOKEN)
    t = 0.0
    for _ in range(100):  # idle steps while saves land: no tokens, nothing to report
        rate.planned(0, t)
        t += 0.002
    rate.planned(4096, t)
    rate.answered(lambda: t + 0.1)
    assert rate.bytes_per_s == pytest.approx(4096 * KV_PER_TOKEN / 0.1)
    rate.planned(0, t + 0.2)  # one that reports (a save landed): its answer has no step of tokens to match
    rate.answered(lambda: t + 0.21)
    rate.planned(4096, t + 0.3)
    rate.answered(lambda: t + 0.4)
    assert rate.bytes_per_s == pytest.approx(4096 * KV_PER_TOKEN / 0.1)


def test_the_harness_hands_back_what_vllms_runner_does_for_a_step_without_tokens(model_dir):
    """The harness's engine, as vLLM's model runner: a step without tokens whose workers have
    nothing to report comes back empty, and the connector's ``update_connector_output`` is not
    called for it (its prefill rate is then matched step for step)."""
    store = LocalBlockStore(num_shards=1, pool_bytes=64 << 20)
    try:
        engine = make_engine(store.client(), model_dir, max_batched=1024)
        engine.clock.freeze()
        engine.before_worker = forward_takes(STEP_S)
        answers = []
        part = engine.connector.scheduler_part
        update = part.update_connector_output
        part.update_connector_output = lambda output: (answers.append(output), update(output))[-1]
        engine.serve("A", prompt(2048), max_tokens=2)
        engine.settle()
        answered = len(answers)
        engine.step()  # nothing to schedule, nothing to report
        assert len(answers) == answered
        engine.serve("B", prompt(2048, seed=7), max_tokens=2)
        assert part.prefill_rate.bytes_per_s == pytest.approx(1024 * part.prefill_rate.kv_bytes_per_token / STEP_S)
    finally:
        store.shutdown()  # its pool and index in /dev/shm


def test_a_decode_steps_answer_reads_no_clock():
    """Most steps' answers are an untimed step's: the clock (a call where a test hands in its own)
    is read only for a timed one's."""
    rate = PrefillRate(KV_PER_TOKEN)
    reads: list[float] = []

    def clock() -> float:
        reads.append(0.5)
        return 0.5

    rate.planned(1, 0.0)  # a decode step
    rate.answered(clock)
    assert not reads
    rate.planned(4096, 0.25)
    rate.answered(clock)
    assert reads == [0.5] and rate.bytes_per_s == pytest.approx(4096 * KV_PER_TOKEN / 0.25)
