"""Wall time spent inside chosen methods, for benchmarks that split a step into its parts.

A benchmark names (object or class, method names, label) and runs the work inside
``timed_calls``; every call of those methods is timed, and the originals are put back
on exit, whatever happened. Instance methods get a wrapper on the instance (removed
afterwards); methods patched on a class apply to every instance until exit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

_NOT_SET = object()

CONNECTOR_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "request_finished_all_groups",
                   "get_kv_connector_stats", "take_events", "handle_preemptions", "bind_connector_metadata",
                   "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
                   "get_transfer_results", "get_block_ids_with_load_errors", "get_kv_connector_kv_cache_events",
                   "build_connector_worker_meta", "clear_connector_metadata")
"""Every hook vLLM calls on a connector, either half (of the versions we support): the time a
step spends in the connector is the time in these."""

Target = tuple[Any, Sequence[str], str]
"""(object or class, its method names, label): each call is recorded as ``label.name``."""


@contextmanager
def timed_calls(targets: Sequence[Target],
                clock: Callable[[], float] = time.perf_counter) -> Iterator[dict[str, list[float]]]:
    """Seconds of every call of the targets' methods while the block runs, per ``label.name``
    (absent methods and None owners are skipped: a hook one vLLM version lacks). ``clock``:
    wall time by default; ``time.thread_time`` counts the calling thread's CPU time alone (on a
    loaded box wall time also counts other processes' turns on the cores)."""
    spent: dict[str, list[float]] = {}
    restore: list[tuple[Any, str, Any]] = []
    try:
        for owner, names, label in targets:
            for name in names:
                if owner is None or not hasattr(owner, name):
                    continue
                before = vars(owner).get(name, _NOT_SET)
                setattr(owner, name, _timed(getattr(owner, name), spent.setdefault(f"{label}.{name}", []), clock))
                restore.append((owner, name, before))  # only what was set is put back
        yield spent
    finally:
        for owner, name, before in reversed(restore):
            if before is _NOT_SET:  # the class's method: drop the instance's wrapper
                delattr(owner, name)
            else:
                setattr(owner, name, before)


def _timed(original: Callable[..., Any], calls: list[float], clock: Callable[[], float]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return original(*args, **kwargs)
        finally:
            calls.append(clock() - started)

    return call
