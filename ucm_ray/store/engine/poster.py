"""Control calls posted from a thread of the client's own, so that the caller only queues them.

Submitting a Ray actor call costs its caller 0.1-1 ms (its arguments serialized, the core
worker's bookkeeping; a commit of 4 shards' grants took 1.6-4.3 ms of a save on the 2-core
box), and a connector's scheduler posts its commits, slot asks, renewals, releases and
removals from vLLM's hooks, on the engine's thread, while the GPU waits for the step being
planned. Their answers are read steps later anyway: the hooks queue them, and one thread posts
them, in the order queued (calls to one shard keep the order they were made in), mostly while
the engine's thread waits for the device (which releases the GIL).

The thread also asks Ray for each call's answer as a future (``ObjectRef.future()``, ~45 us of
host time a call), which Ray fulfils, deserialized, from its own thread: the engine's thread
only checks and reads futures. On an H200 engine decoding batches of 8 prompts, the first poll
of each answer (its future made) and its ``ray.get`` were part of the ~0.3 ms a step that the
connector's hooks cost the host.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import ray


@dataclass(frozen=True)
class PostedCall:
    """A call the thread posted: its answer as a future that Ray fulfils (the value, or the error
    the call raised) once it is in, and its object ref, held so the answer stays referenced in
    Ray until it is read."""

    ref: ray.ObjectRef
    answer: Future[Any]


class CallPoster:
    """``post`` queues a call to an actor's method; its future holds the ``PostedCall`` once the
    thread posted it (or the exception posting raised). Only the client's owner posts (the
    engine's scheduler thread)."""

    def __init__(self) -> None:
        # (number, future, method or None for a marker, args); None stops the thread
        self._queue: queue.SimpleQueue[tuple[int, Future[Any], Any, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._numbers = itertools.count(1)
        self._queued_through = 0  # the number of the last call queued
        self._posted_through = 0  # ... and of the last one the thread posted
        self._closed = False
        # started now, not at the first call: starting a thread waits for it to run
        self._thread = threading.Thread(target=self._run, name="ucm-ray-calls", daemon=True)
        self._thread.start()

    def post(self, method: Any, *args: Any) -> Future[PostedCall]:
        """``method.remote(*args)``, posted by the thread (``method``: an actor handle's method)."""
        posted: Future[PostedCall] = Future()
        if self._closed:
            posted.set_exception(RuntimeError("the store client is closed"))
            return posted
        self._queued_through = number = next(self._numbers)
        self._queue.put((number, posted, method, args))
        return posted

    def drain(self, timeout_s: float) -> None:
        """Return once every call queued so far is posted: a call made directly after it (a
        lookup, whose answer the step waits for) then reaches a shard after them, as in program
        order (a lookup that overtook this client's commit of the same key missed it)."""
        if self._posted_through >= self._queued_through or self._closed:
            return
        marker: Future[Any] = Future()
        self._queue.put((next(self._numbers), marker, None, ()))
        try:
            marker.result(timeout=timeout_s)
        except TimeoutError:
            pass  # the lookup goes anyway: at worst it misses what was just committed

    def close(self) -> None:
        """Post what is queued, then stop the thread; later calls fail at once."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            number, posted, method, args = item
            try:
                if method is None:
                    posted.set_result(None)
                else:
                    ref = method.remote(*args)
                    posted.set_result(PostedCall(ref, ref.future()))
            except Exception as e:  # noqa: BLE001 -- the caller reads it as that shard's failure
                posted.set_exception(e)
            self._posted_through = number
