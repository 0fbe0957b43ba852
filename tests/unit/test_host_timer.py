"""The scheduler half's host time per step (``schedule_seconds``): what a forward waits for, and
what it does not (idle steps while saves land)."""

from __future__ import annotations

import pytest

from ucm_ray.vllm.scheduler.timing import HostTimer, host_timed
from ucm_ray.vllm.stats import UcmRayStats


class _SteppedClock:
    """A host clock that moves only when a hook says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Part:
    """A scheduler half with one timed hook that takes ``seconds`` of host time."""

    def __init__(self) -> None:
        self.clock = _SteppedClock()
        self.stats = UcmRayStats()
        self.timer = HostTimer(self.stats, clock=self.clock)

    @host_timed
    def hook(self, seconds: float) -> None:
        self.clock.now += seconds


def test_idle_steps_host_time_is_not_charged_to_the_next_request():
    """vLLM keeps stepping with nothing to run while finished requests' saves land; the hooks'
    time in those steps delays no forward. Before, it was summed into the next step that ran
    tokens: a cold request after a flush was charged ~10 ms it never waited for."""
    part = _Part()
    for _ in range(50):  # idle steps, each polling for 0.2 ms
        part.hook(0.0002)
        part.timer.observe_step(0, carries_work=True, plan_s=0.0)
    part.hook(0.001)  # the cold request's lookup and allocation
    part.timer.observe_step(4096, carries_work=True, plan_s=0.0005)
    totals = part.stats.totals
    assert totals["schedule_seconds_count"] == 1
    assert totals["schedule_seconds"] == pytest.approx(0.0015)
    assert totals["idle_schedule_us"] == 10_000


def test_steps_where_a_request_waits_for_its_lookup_count_toward_its_first_forward():
    """A request whose lookup is in flight is put back ("ask again"): those steps' host time is on
    its way to the first forward, so it stays in the step that runs it."""
    part = _Part()
    for _ in range(3):
        part.hook(0.001)
        part.timer.request_waits = True  # what the lookup hook sets when it answers None
        part.timer.observe_step(0, carries_work=True, plan_s=0.0)
    part.timer.observe_step(4096, carries_work=True, plan_s=0.0005)
    totals = part.stats.totals
    assert totals["schedule_seconds"] == pytest.approx(0.0035)
    assert "idle_schedule_us" not in totals
    part.timer.observe_step(0, carries_work=False, plan_s=0.0001)  # the flag held one step only
    assert part.timer.host_s == 0.0 and part.timer.idle_s == pytest.approx(0.0001)
