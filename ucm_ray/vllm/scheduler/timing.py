"""The scheduler half's host time per step (``schedule_seconds``): what a host-bound forward
waits for besides vLLM's own scheduling."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ucm_ray.vllm.stats import UcmRayStats

Hook = TypeVar("Hook", bound=Callable[..., Any])


class HostTimer:
    """Host time spent in the scheduler hooks since the last step's plan."""

    def __init__(self, stats: UcmRayStats, clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock``: a fine-grained clock of the host's own time (not the deadline clock)."""
        self._stats = stats
        self.clock = clock
        self.host_s = 0.0

    def observe_step(self, scheduled_tokens: int, carries_work: bool, plan_s: float) -> None:
        """``schedule_seconds`` of a step that runs tokens and in which the connector had work:
        its host time since the last step's plan (lookups, allocations, finished requests, the
        last step's results, this plan). A forward that is host-bound waits for all of it. A
        step without work (most decode steps) records nothing: vLLM then has no stats of ours
        to aggregate and export, which cost a decode step more than the hooks themselves."""
        worked = self.host_s > 0.0 or carries_work
        self.host_s += plan_s
        if scheduled_tokens > 0:
            if worked:
                self._stats.observe("schedule_seconds", self.host_s)
            self.host_s = 0.0


class Timed(Protocol):
    timer: HostTimer


def host_timed(hook: Hook) -> Hook:
    """A scheduler hook whose host time counts toward the step's ``schedule_seconds``."""
    @functools.wraps(hook)
    def timed(part: Timed, *args: Any, **kwargs: Any) -> Any:
        timer = part.timer
        started = timer.clock()
        try:
            return hook(part, *args, **kwargs)
        finally:
            timer.host_s += timer.clock() - started
    return timed  # type: ignore[return-value]
