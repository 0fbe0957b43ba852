"""Waiting in tests for something another process makes true (a late read landing, a process stopping)."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(check: Callable[[], object], seconds: float, interval_s: float = 0.02) -> bool:
    """Whether ``check`` came true within ``seconds`` (polled every ``interval_s``)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True
