"""The engine's own prefill rate: the KV bytes per second its steps produce, sent with its lookups.

Why: a shard promotes a disk hit only when reading it is cheaper than recomputing it, and what
recomputing costs is the asking engine's, not the shard's, to know: on an H100 a ~1B model
recomputes 16k tokens in 122 ms where one disk promotes them in 430 ms, on a CPU the same disk
wins. A hand-set fleet-wide rate (``disk_recompute_bytes_s``) is right for one engine kind at best.

What is timed: from the scheduler half's plan of a step (``build_connector_meta``) to vLLM handing
the step's output back (``update_connector_output``): the forward, its sampling and the host work
around them, so a measured rate is, if anything, low (the shard then reads a little more than it
should: the behaviour without an estimate). vLLM runs and hands back steps in the order it
planned them (two in flight under asynchronous scheduling), so answers are matched to plans in
order, but only steps with tokens count: a step without any (nothing to schedule, e.g. while
finished requests' saves land) comes back only when its workers had something to report
(``ModelRunnerOutput.with_kv_conn_output_only``), so an answer with no step of tokens in flight
is such a step's and matches nothing, and no more than ``IN_FLIGHT`` steps are kept waiting for
theirs. Only steps of at least ``MIN_TOKENS`` scheduled tokens are timed: a decode step's time is
mostly fixed costs and says nothing of a prefill's. A step's bytes are its scheduled tokens times
one rank's KV bytes a token (each rank's lookup asks for its own entries, and its forward computes
them at the same time as the other ranks'). The estimate is the median of the last ``WINDOW`` such
steps: one step slowed by a preemption, a compile or a busy host does not move it.

Per step with tokens a deque append and pop (a decode step's makes no tuple); per timed step a
median of ``WINDOW`` floats.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

MIN_TOKENS = 512
"""Scheduled tokens a step needs to be timed (below, fixed costs dominate its time)."""
WINDOW = 16
"""Timed steps the median is taken over."""
_UNTIMED = (0.0, 0)
"""What an untimed step (fewer than ``min_tokens``) holds in the queue: one object for all."""
IN_FLIGHT = 2
"""Steps vLLM plans before it hands the oldest back (its batch queue under asynchronous scheduling;
one under synchronous): an older one waiting still would never be answered."""


@dataclass
class PrefillRate:
    """A running estimate of one engine's prefill rate in KV bytes a second (0.0: none yet)."""

    kv_bytes_per_token: int
    """One rank's KV bytes a token, over every stored group (what a lookup's entries hold)."""
    min_tokens: int = MIN_TOKENS
    window: int = WINDOW
    bytes_per_s: float = 0.0
    """The median of the timed steps' rates; 0.0 until a step was timed (the shard then reads)."""
    _in_flight: deque[tuple[float, int]] = field(default_factory=deque)
    """(planned at, tokens) of the steps with tokens whose output has not come back, oldest first."""
    _rates: deque[float] = field(default_factory=deque)

    @property
    def rates(self) -> list[float]:
        """The timed steps' rates the estimate is the median of, oldest first."""
        return list(self._rates)

    def planned(self, tokens: int, now: float) -> None:
        """A step was planned at ``now`` with ``tokens`` scheduled tokens (a step too small to be
        timed, every decode step, queues one shared object, not a tuple of its own)."""
        if tokens <= 0:
            return  # answered only if its workers report anything: never matched to a plan
        while len(self._in_flight) >= IN_FLIGHT:
            self._in_flight.popleft()
        timed = tokens >= self.min_tokens and self.kv_bytes_per_token > 0
        self._in_flight.append((now, tokens) if timed else _UNTIMED)

    def answered(self, clock: Callable[[], float]) -> None:
        """A step's output came back (now, by ``clock``): the oldest step with tokens in flight, if
        any. The clock is read only for a timed step's: a decode step's answer reads none (the
        scheduler's clock is a call where a test hands in its own; docs/performance-log.md, stop 67)."""
        if not self._in_flight:
            return  # a step without tokens that had something to report
        planned = self._in_flight.popleft()
        if planned is _UNTIMED:
            return
        now = clock()
        started, tokens = planned
        if now <= started:
            return
        rates = self._rates
        rates.append(tokens * self.kv_bytes_per_token / (now - started))
        if len(rates) > self.window:
            rates.popleft()
        self.bytes_per_s = statistics.median(rates)
