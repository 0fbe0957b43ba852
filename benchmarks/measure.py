"""What every benchmark here measures with: the best-of-N timer, engines taking items in turn,
and the keys of the entries a benchmark stores. One module, so that the scripts import it rather
than each other."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any


def best(fn: Callable[[], Any], repeat: int) -> float:
    """Best-of-N seconds: the machine is shared and noisy, the minimum is the signal."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def in_turn(engines: dict[str, Any], items: list, measure: Callable[[Any, Any], Any]) -> dict[str, list]:
    """Per item, every system's engine once, the order rotating from item to item, so the box's
    drift (tens of percent between minutes here) falls on every system alike: each system's
    results in item order."""
    names = list(engines)
    got: dict[str, list] = {name: [] for name in names}
    for i, item in enumerate(items):
        for name in names[i % len(names):] + names[: i % len(names)]:
            got[name].append(measure(engines[name], item))
    return got


def keys_for(tag: str, n: int) -> list[bytes]:
    """``n`` store keys of a benchmark's pass ``tag``: a fresh tag, entries no earlier pass stored."""
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest() for i in range(n)]
