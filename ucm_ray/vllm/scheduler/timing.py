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
        self.idle_s = 0.0
        self.request_waits = False
        """Set by a lookup that answered "ask again" in this step: a request waits on the store."""

    def observe_step(self, scheduled_tokens: int, carries_work: bool, plan_s: float) -> None:
        """``schedule_seconds`` of a step that runs tokens and in which the connector had work:
        its host time since the last step's plan (lookups, allocations, finished requests, the
        last step's results, this plan). A forward that is host-bound waits for all of it. A
        step without work (most decode steps) records nothing: vLLM then has no stats of ours
        to aggregate and export, which cost a decode step more than the hooks themselves.

        A step that runs no tokens carries its host time to the next step only while a request
        waits for a lookup (that time is on the request's way to its first forward). Otherwise
        it is idle time (vLLM stepping while finished requests' saves land): no forward waits
        for it, so it goes to the ``idle_schedule_us`` counter instead. Charged to the next
        request, it made a cold request look ~10 ms slower than it was (issue 43's 14.6 ms)."""
        worked = self.host_s > 0.0 or carries_work
        self.host_s += plan_s
        waits, self.request_waits = self.request_waits, False
        if scheduled_tokens <= 0:
            if not waits:
                self.idle_s += self.host_s
                self.host_s = 0.0
            return
        if worked:
            self._stats.observe("schedule_seconds", self.host_s)
        if self.idle_s:
            self._stats.add(idle_schedule_us=round(1e6 * self.idle_s))
            self.idle_s = 0.0
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
