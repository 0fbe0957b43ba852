"""A wait doubled at each failure in a row, up to a bound: a relay's retries of the directory
(``membership_relay``) and an engine's pass-overs of its node's relay (``engine.feed``)."""

from __future__ import annotations

DOUBLINGS_MAX = 60
"""Doublings that count: any wait doubled this often is past its bound. ``2 ** failures`` unbounded
turns into an OverflowError at 1,024 failures in a row (an int past ~1.8e308 has no float): it
ended a relay's follower for good after ~8.5 h of failed tries, and raised out of an engine's
``poll``, into the scheduler's step, at a relay's 1,025th pass-over in a row (review65b)."""


def doubled(first_s: float, failures: int, most_s: float) -> float:
    """``first_s`` doubled ``failures`` times, at most ``most_s``."""
    return min(first_s * 2.0 ** min(failures, DOUBLINGS_MAX), most_s)
