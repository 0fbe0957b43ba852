"""A node's relay of the directory's long poll: one poll per node at the directory, not one per engine.

Every engine follows the directory with one long poll (``ShardDirectory.wait_for_change``), and a
push answers every waiting poll: ~0.5 ms of the directory's one event loop each, so 1,000 nodes of
8 engines at a push a second is more than one actor can do (docs/scaling.md, stop 63). With
``relay_membership`` an engine instead polls its node's relay, a shard of its node (the lowest
shard id there in the membership it holds, so the node's engines agree), which follows the
directory with one long poll of its own and answers its engines from what it holds
(``RelayedMembership``): the directory answers one poll per node.

What a relay answers is what the directory would have: the same version, the shard list left out
only when unchanged since the engine's version, and the hot-prefix table as a delta that applies
to the engine's revision (the one the relay got, an empty one, or one built from the tables it
held, ``HOT_TABLES_HELD``) or else whole. It never answers with a version older than the
engine's: a relay behind the engine, not following the directory (not yet, or its poll failed) or
not heard from the directory within ``SILENT_S`` answers None, and the engine asks the directory
itself for that round (``MembershipFeed``), as it does when the relay's call fails. Whatever stops
the relay following (the directory missing or restarting, or a defect: an answer it cannot take)
leaves it holding nothing, so it answers None, and it tries again after a backoff; a follower
that died of an unexpected error had left its engines waiting out their long polls for a
membership it no longer followed (review, stop 65).

An engine's poll carries the bytes it read per pool since its last one (``store.pool_load``): the
relay sums them and sends the sum with its own next poll, which it posts ``REPORTS_GATHER_S`` after
an answer once its engines report, so their reports of the period just pushed reach the directory
before its next push, not one push later.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping

import ray
from ray.exceptions import GetTimeoutError, RayError

from ucm_ray.store.backoff import doubled
from ucm_ray.store.hot_prefixes import NO_HOT_PREFIXES, HotPrefixDelta, HotPrefixes, delta_between
from ucm_ray.store.pool_load import PoolReads
from ucm_ray.store.types import DIRECTORY_NAME, Membership
from ucm_ray.transport.base import PoolKey

log = logging.getLogger(__name__)

LONG_POLL_S = 30.0
"""A relay's long poll at the directory (the directory answers it by then, changed or not)."""
SILENT_S = LONG_POLL_S + 10.0
"""A relay whose poll has not been answered for this long is not following: its engines ask the
directory (a membership never stale for longer than this behind a stuck relay)."""
SYNC_WAIT_S = 2.0
"""How long an engine's poll waits for a relay not following the directory (just started, or its
poll failed) to follow it, before it answers None."""
HOT_TABLES_HELD = 8
"""Hot tables of the last revisions a relay keeps (references to the tables it got: rows shared)
to build a delta for an engine behind by more than one push (the directory would send one)."""
RETRY_S = 2.0
"""A relay whose poll failed asks the directory again after this long (looked up by name), doubled
at each failure in a row up to ``RETRY_MAX_S``: a restarting directory is followed again within
seconds, and a failure that repeats (a defect) is not retried, nor logged, twice a second."""
RETRY_MAX_S = LONG_POLL_S
"""The longest wait between a relay's tries: its engines ask the directory themselves meanwhile."""
REPORTS_GATHER_S = 0.2
"""Once its engines report reads, a relay posts its poll this long after an answer: its engines,
answered at once, re-post within it with their reads of the period the answer ended, which then
reach the directory for its next push (at most one a ``COPIES_PUSH_S``, 1 s). A change meanwhile
reaches the node's engines at most this much later."""


class RelayedMembership:
    """The directory's membership as a relay holds it, and what it answers an engine's long poll.
    Not thread-safe: ``MembershipRelay`` holds its lock around every call."""

    def __init__(self) -> None:
        self._held: Membership | None = None
        """The last answer taken, with the whole shard list and hot table (None: not following)."""
        self._shards_version = 0
        """A version at or before which the shard list last changed (the answer's own version
        when it carried the list: the directory may have changed it earlier, never later)."""
        self._delta: HotPrefixDelta | None = None
        """The last non-empty hot-table delta taken: to the held table's revision."""
        self._tables: OrderedDict[int, HotPrefixes] = OrderedDict()
        """The last ``HOT_TABLES_HELD`` tables held, by revision (the held one last)."""
        self._built: dict[int, HotPrefixDelta] = {}
        """Deltas built to the held table, by base revision (an engine at that revision asks at each push)."""

    @property
    def following(self) -> bool:
        return self._held is not None

    @property
    def version(self) -> int:
        return self._held.version if self._held is not None else 0

    def poll_args(self) -> tuple[int, int]:
        """(known_version, known_hot) for the relay's own long poll at the directory."""
        if self._held is None:
            return 0, -1
        return self._held.version, self._held.hot.revision

    def take(self, answer: Membership, posted_version: int) -> bool:
        """The directory's answer to a poll posted with ``posted_version``; False when it does not
        apply to what is held (a delta for another revision): nothing held any more, the next poll
        asks for everything."""
        whole = answer.completed(self._held, posted_version)
        if whole is None:
            return self.forget()
        delta = answer.hot_delta
        if delta is not None and delta.base == delta.revision:  # empty: the last one still leads here
            delta = self._delta
        if not answer.shards_held:
            self._shards_version = answer.version
        self._held, self._delta, hot = whole, delta, whole.hot
        if hot.revision not in self._tables:
            self._built.clear()
            self._tables[hot.revision] = hot
            while len(self._tables) > HOT_TABLES_HELD:
                self._tables.popitem(last=False)
        return True

    def forget(self) -> bool:
        self._held, self._delta, self._shards_version = None, None, 0
        self._tables.clear()
        self._built.clear()
        return False

    def answer(self, known_version: int, known_hot: int, shards_held: bool) -> Membership | None:
        """What the directory would answer an engine holding ``known_version`` and hot revision
        ``known_hot``, or None when this relay cannot say (not following, or behind the engine)."""
        held = self._held
        if held is None or held.version < known_version:
            return None
        answer = held
        if shards_held and known_version and self._shards_version <= known_version <= held.version:
            answer = dataclasses.replace(answer, shards=(), shards_held=True)
        if known_hot < 0:
            return answer
        revision = held.hot.revision
        if known_hot == revision:
            return dataclasses.replace(answer, hot=NO_HOT_PREFIXES, hot_delta=HotPrefixDelta(revision, revision, {}))
        delta = self._delta_from(known_hot, held.hot)
        if delta is None:
            return answer  # the whole table, as the directory sends an engine it cannot diff
        return dataclasses.replace(answer, hot=NO_HOT_PREFIXES, hot_delta=delta)

    def _delta_from(self, base: int, hot: HotPrefixes) -> HotPrefixDelta | None:
        """To ``hot`` (the held table) from revision ``base``: the delta the relay got, or one built
        from the table it held at ``base``; None when it held none."""
        if self._delta is not None and base == self._delta.base:
            return self._delta
        delta = self._built.get(base)
        if delta is None and base in self._tables:
            delta = self._built[base] = delta_between(self._tables[base], hot)
        return delta


class MembershipRelay:
    """A shard's relay: a thread follows the directory (started by the first engine's poll), and
    engines' long polls wait, each in a thread of the shard's relay group, for the version to move."""

    def __init__(self, ray_namespace: str) -> None:
        self._namespace = ray_namespace
        self._state = RelayedMembership()
        self._moved = threading.Condition()
        self._heard = 0.0
        """When the directory last answered this relay's poll (``time.monotonic``)."""
        self._follower: threading.Thread | None = None
        self._stopped = threading.Event()
        self._reads = PoolReads()
        """The node's engines' reads per pool since the relay's last poll."""
        self._reported = False
        """Whether an engine reported reads (the relay then gathers before each poll)."""
        self._ended = False
        """The follower returned (stopped, or killed by a BaseException): nothing will be held again."""
        self.served = 0
        """Engines' long polls answered with a membership (stats)."""
        self.cannot_say = 0
        """Engines' long polls answered None (stats): each sends that engine's next poll to the directory."""

    def wait_for_change(self, known_version: int, timeout_s: float = LONG_POLL_S, known_hot: int = -1,
                        shards_held: bool = False,
                        pool_reads: Mapping[PoolKey, int] | None = None) -> Membership | None:
        """``ShardDirectory.wait_for_change``'s answer from what this relay holds, or None: ask the
        directory (this relay is not following it, or is behind the caller). ``pool_reads``: the
        engine's reads per pool since its last poll, sent on with the relay's next poll."""
        if pool_reads:
            self._reads.add(pool_reads)
            self._reported = True
        self._start()
        now = time.monotonic()
        deadline, sync_by = now + timeout_s, now + min(timeout_s, SYNC_WAIT_S)
        with self._moved:
            while True:
                if self._state.following:
                    if self._state.version != known_version:
                        break
                    left = deadline - time.monotonic()
                elif self._ended:  # no follower will ever hold one: not worth waiting for
                    break
                else:
                    left = sync_by - time.monotonic()
                if left <= 0:
                    break
                self._moved.wait(left)
            answer = None if time.monotonic() - self._heard > SILENT_S else \
                self._state.answer(known_version, known_hot, shards_held)
            if answer is None:
                self.cannot_say += 1
            else:
                self.served += 1
            return answer

    def stop(self) -> None:
        self._stopped.set()

    def _start(self) -> None:
        with self._moved:
            if self._follower is not None:
                return
            self._follower = threading.Thread(target=self._follow, name="ucm-ray-membership-relay", daemon=True)
        self._follower.start()

    def _follow(self) -> None:
        """Follows the directory until stopped. A failed try (``_lose``) and then a wait,
        ``RETRY_S`` doubled at each failure in a row; any exception, not only the directory's
        expected ones: a follower that dies leaves no one to take the directory's answers."""
        directory = None
        failures = 0
        try:
            while not self._stopped.is_set():
                try:
                    if directory is None:
                        directory = ray.get_actor(DIRECTORY_NAME, namespace=self._namespace)
                    self._take_next(directory)
                except Exception as e:  # noqa: BLE001 -- see the docstring
                    directory = None
                    self._lose(e)
                    self._stopped.wait(doubled(RETRY_S, failures, RETRY_MAX_S))
                    failures += 1
                    continue
                failures = 0
        finally:  # stopped, or a BaseException: its engines are answered None at once from now on
            with self._moved:
                self._ended = True
                self._state.forget()
                self._moved.notify_all()

    def _take_next(self, directory: ray.actor.ActorHandle) -> None:
        """One long poll at the directory, its answer taken (engines waiting for it woken)."""
        if self._reported:
            self._stopped.wait(REPORTS_GATHER_S)
        with self._moved:
            version, hot = self._state.poll_args()
        reads = self._reads.drain()
        answer = ray.get(directory.wait_for_change.remote(version, LONG_POLL_S, known_hot=hot, shards_held=True,
                                                          pool_reads=reads),
                         timeout=SILENT_S)
        with self._moved:
            self._heard = time.monotonic()
            if not self._state.take(answer, version):
                log.warning("membership relay: an answer that does not apply to what it held; asking for all")
            self._moved.notify_all()

    def _lose(self, error: Exception) -> None:
        """What is held is dropped: engines waiting are answered None (they ask the directory)."""
        if isinstance(error, (RayError, GetTimeoutError, ValueError)):  # ValueError: no directory by that name
            log.warning("membership relay: the directory did not answer (%s); its engines ask it themselves "
                        "until it does", type(error).__name__)
        else:
            log.error("membership relay: following the directory failed; its engines ask it themselves "
                      "until the relay follows again", exc_info=error)
        with self._moved:
            self._state.forget()
            self._moved.notify_all()
