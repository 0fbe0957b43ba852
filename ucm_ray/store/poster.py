"""Control calls posted from a thread of the client's own, so that the caller only queues them.

Submitting a Ray actor call costs its caller 0.1-1 ms (its arguments serialized, the core
worker's bookkeeping; a commit of 4 shards' grants took 1.6-4.3 ms of a save on the 2-core
box), and a connector's scheduler posts its commits, slot asks, renewals, releases and
removals from vLLM's hooks, on the engine's thread, while the GPU waits for the step being
planned. Their answers are read steps later anyway: the hooks queue them, and one thread posts
them, in the order queued (calls to one shard keep the order they were made in), mostly while
the engine's thread waits for the device (which releases the GIL).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any

import ray


class CallPoster:
    """``post`` queues a call to an actor's method; its future holds the call's object ref once
    the thread posted it (or the exception posting raised)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[ray.ObjectRef], Any, tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        # started now, not at the first call: starting a thread waits for it to run
        self._thread = threading.Thread(target=self._run, name="ucm-ray-calls", daemon=True)
        self._thread.start()

    def post(self, method: Any, *args: Any) -> Future[ray.ObjectRef]:
        """``method.remote(*args)``, posted by the thread (``method``: an actor handle's method)."""
        posted: Future[ray.ObjectRef] = Future()
        self._queue.put((posted, method, args))
        return posted

    def close(self) -> None:
        """Post what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            posted, method, args = item
            try:
                posted.set_result(method.remote(*args))
            except Exception as e:  # noqa: BLE001 -- the caller reads it as that shard's failure
                posted.set_exception(e)
