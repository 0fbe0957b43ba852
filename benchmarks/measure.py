"""What every benchmark here measures with: the best-of-N timer, engines taking items in turn,
the keys of the entries a benchmark stores, and the local Ray cluster it runs on. One module, so
that the scripts import it rather than each other."""

from __future__ import annotations

import atexit
import hashlib
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_failed = False
"""Whether this benchmark ended with an uncaught exception (``sys.excepthook`` runs before
``atexit``)."""


def _note_failure(*exc_info: Any) -> None:
    global _failed
    _failed = True
    sys.__excepthook__(*exc_info)


def _remove_unless_failed(temp_dir: str) -> None:
    if _failed:
        log.warning("Ray logs of the failed run kept in %s", temp_dir)
    else:
        shutil.rmtree(temp_dir, ignore_errors=True)


def local_ray(prefix: str, **init_kwargs: Any) -> None:
    """``ray.init`` of a local cluster on loopback, in a temp dir of its own (its Ray logs, ~13 MB
    a run) that goes at exit unless the run failed: ``make bench`` left a dozen a run in /tmp.
    The removal is registered before ``ray.init``, so it runs after Ray's own shutdown at exit."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    sys.excepthook = _note_failure
    atexit.register(_remove_unless_failed, temp_dir)
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp_dir, **init_kwargs)


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
