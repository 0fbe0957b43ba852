"""How a client reaches its shards, and a control call made as one Ray call per shard.

A shard that errors, times out, or refuses an incarnation is a miss, never an
error the caller sees, and never a source of bytes that were not verified as
landed: its answer reads as None and the shard turns suspect (``Suspects``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
from ray.exceptions import RayError, RayTaskError

from ucm_ray.store.engine.poster import CallPoster, PostedCall
from ucm_ray.store.engine.published_reader import IndexReaders
from ucm_ray.store.engine.suspects import Suspects
from ucm_ray.store.engine.touches import TouchSender
from ucm_ray.store.types import Pending, ShardRecord, WrongIncarnation
from ucm_ray.transport.base import PoolKey

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ShardAccess:
    """What one client's calls to its shards go through, handed to each call it makes
    (``Fanout``, ``Acquire``) instead of being read off the client: its owner id, the call
    timeout, the shards in backoff, the published indexes this process reads without a call,
    the touches that tell shards what was read there, and the thread that posts calls."""

    owner: int
    timeout_s: float
    """How long a call's answer is waited for (``lookup_timeout_s``)."""
    suspects: Suspects
    readers: IndexReaders
    touches: TouchSender
    poster: CallPoster
    clock: Callable[[], float] = field(default=time.monotonic)
    """The time of the calls' deadlines (the host's; a test's own decides when one passes, a
    wait on the host still given at most what is left of it)."""
    disk_tier: bool = False
    """The fleet's shards keep disk tiers: a lookup that read no published index for a shard asks
    on that shard's disk thread (``CacheShard.promote_and_acquire``), as the index would have
    told it to for keys on disk."""

    def answer(self, record: ShardRecord, answer: ray.ObjectRef | Future[Any], deadline: float) -> Any:
        """The answer of a shard call (its ref, or the future of a posted one), or None (the
        shard is then suspect) when it failed, timed out by ``deadline``, or refused our
        incarnation (then the membership is refetched)."""
        timeout = max(0.001, deadline - self.clock())
        try:
            return answer.result(timeout=timeout) if isinstance(answer, Future) else ray.get(answer, timeout=timeout)
        except TimeoutError:  # a future's wait (``ray.get``'s is a RayError)
            self.failed(record.key, "GetTimeoutError")
            return None
        except RayError as e:
            refused = isinstance(e, RayTaskError) and isinstance(e.cause, WrongIncarnation)
            self.failed(record.key, "refused a stale incarnation" if refused else type(e).__name__)
            return None

    def failed(self, pool: PoolKey, why: str) -> None:
        if self.suspects.failed(pool):
            log.warning("shard %s failed (%s): suspect, its keys go to replicas or miss", pool[0], why)

    def close(self) -> None:
        """Post what the engine queued (its last commits), then send the last touches."""
        self.poster.close()
        self.touches.close()


class Fanout(Pending[T]):
    """One call per shard, queued to the client's ``CallPoster``; ``finish`` merges the answers
    (None: that shard failed)."""

    def __init__(self, access: ShardAccess, calls: list[tuple[ShardRecord, Future[PostedCall]]],
                 finish: Callable[[list[Any]], T]) -> None:
        self._access = access
        self._calls = calls
        self._finish = finish
        self._deadline = access.clock() + access.timeout_s
        self._value: T | None = None
        self._done = False

    def poll(self) -> bool:
        """Never waits, and only reads futures (a ``ray.wait`` on a call in flight cost ~85 us
        per poll, every step). A call that could not be posted is answered None by ``result``
        at once."""
        if self._done or not self._calls:
            return True
        if self._access.clock() > self._deadline:
            return True
        return all(posted.done() and (posted.exception() is not None or posted.result().answer.done())
                   for _, posted in self._calls)

    def result(self) -> T:
        if not self._done:
            answers = [self._answer(rec, posted) for rec, posted in self._calls]
            self._value = self._finish(answers)
            self._done = True
        return self._value  # type: ignore[return-value]

    def _answer(self, record: ShardRecord, posted: Future[PostedCall]) -> Any:
        try:
            call = posted.result(timeout=max(0.001, self._deadline - self._access.clock()))
        except Exception as e:  # noqa: BLE001 -- not posted in time, or posting it raised
            self._access.failed(record.key, f"call not posted: {type(e).__name__}")
            return None
        return self._access.answer(record, call.answer, self._deadline)
