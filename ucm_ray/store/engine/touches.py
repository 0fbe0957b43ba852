"""What same-node readers found in shards' published indexes, told to the shards in the background.

A lookup in a published index makes no call, but the shard must still learn of
it: read entries become recently used (so eviction takes them last, as a pinned
lookup's would) and count in the shard's lookups and hits (``ucm-ray status``,
its metrics). A thread of the reader's process sends what accumulated, one call
per shard at most every ``FLUSH_S``, so no lookup and no engine step waits on it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayError

from ucm_ray.transport.base import PoolKey

log = logging.getLogger(__name__)

FLUSH_S = 0.05
"""How long touches gather before they are sent: a lookup burst (a batch of prompts) is one call."""


@dataclass
class _Queued:
    handle: ray.actor.ActorHandle
    hits: list[bytes] = field(default_factory=list)
    asked: int = 0


class TouchSender:
    """Queues touches per pool; a daemon thread posts them (``CacheShard.touch``) and reads the
    answers later, so a shard that died meanwhile is never reported by Ray as an unhandled error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self._queued: dict[PoolKey, _Queued] = {}
        self._posted: list[ray.ObjectRef] = []
        self._wake = threading.Event()
        self._closed = threading.Event()
        # started now, not at the first touch: starting a thread waits for it to run, which cost
        # a fresh engine's first store hit a GIL hand-over or two
        self._thread = threading.Thread(target=self._run, name="ucm-ray-touches", daemon=True)
        self._thread.start()

    def add(self, pool: PoolKey, handle: ray.actor.ActorHandle, hits: list[bytes], asked: int) -> None:
        """``asked`` keys of ``pool`` were looked up in its published index, ``hits`` found."""
        with self._lock:
            queued = self._queued.setdefault(pool, _Queued(handle))
            queued.hits.extend(hits)
            queued.asked += asked
        self._wake.set()

    def close(self) -> None:
        """Send what is queued and stop the thread."""
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._send()

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait()
            self._wake.clear()
            self._closed.wait(FLUSH_S)  # gather a burst into one call per shard
            self._send()

    def _send(self) -> None:
        """Never raises: a touch that cannot be sent or answered loses only recency and counts
        (and the thread must live on, or the queue would grow with every lookup)."""
        with self._lock:  # held only to take the queue: lookups never wait on Ray here
            queued, self._queued = self._queued, {}
        with self._sending:  # the thread and ``close`` may both send
            try:
                for (_, incarnation), touch in queued.items():
                    self._posted.append(touch.handle.touch.remote(incarnation, touch.hits, touch.asked))
                if self._posted:
                    done, self._posted = ray.wait(self._posted, num_returns=len(self._posted), timeout=0)
                    for ref in done:
                        try:
                            ray.get(ref)
                        except RayError:
                            pass  # a shard that died or restarted
            except Exception as e:  # noqa: BLE001 -- Ray going away (shutdown)
                log.debug("touches not sent: %s: %s", type(e).__name__, e)
                self._posted = []
