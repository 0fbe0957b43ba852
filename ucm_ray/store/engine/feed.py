"""The directory's membership as it changes, pushed to a client by a long poll.

One ``wait_for_change`` call is outstanding at a time; it returns as soon as the directory's
version moves, and is re-posted. Nothing blocks the caller (the scheduler checks for an answer
on its hot path) except an explicit ``fetch``. When the directory is missing (never started,
or killed for good) or its call fails (restarting), the client keeps the membership it has (or
none: the cache is off) and looks the directory up again by name every ``RETRY_S``, so a
directory restarted by Ray or created again by ``ucm-ray up`` is found without a restart.

With ``relay_membership`` the long poll goes to the node's relay instead (``store.membership_relay``:
the lowest shard id on this node in the membership held, so the node's engines agree), which
answers as the directory would; a relay that answers None (not following, or behind) sends one
poll to the directory, and one whose call fails is passed over (a dead shard leaves the
membership: the next one on the node relays), as is one that does not answer within
``RELAY_POLL_S + RELAY_GRACE_S`` (a frozen process, which the directory does not see die), until
``RELAY_READMIT_S`` later (``PassedOver``).

Each long poll carries the bytes this engine read per pool since the last one (``store.pool_load``:
what the directory's load figure is summed from), so reporting costs no call of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayError

from ucm_ray.store.backoff import doubled
from ucm_ray.store.pool_load import PoolReads
from ucm_ray.store.types import DIRECTORY_NAME, Membership, ShardRecord
from ucm_ray.transport.base import PoolKey

log = logging.getLogger(__name__)

RETRY_S = 2.0
RELAY_POLL_S = 30.0
"""A relay answers a long poll by then, changed or not (the directory's ``LONG_POLL_S``)."""
RELAY_GRACE_S = 10.0
"""... and a relay that has not answered this long after is passed over."""
RELAY_READMIT_S = 60.0
"""A relay passed over is asked again this long after, doubled at each pass-over since it last
answered, up to ``RELAY_READMIT_MAX_S``. Passed over for good (until its incarnation changed), one
transient failure (a GC pause past the grace, a call lost while its node was busy) sent the node's
engines to the directory for the relay's lifetime; asked again at once, or at the next membership
version (a hot-table push moves it up to once a second), a relay that keeps failing would cost
its engines a failed call, or a frozen one ``RELAY_POLL_S + RELAY_GRACE_S`` of no news, each time."""
RELAY_READMIT_MAX_S = 16 * RELAY_READMIT_S
"""The longest a relay that keeps failing is passed over before it is asked again."""


@dataclass
class PassedOver:
    """A relay passed over: asked again from ``until`` (``time.monotonic``); ``times`` passed over
    since it last answered (each doubles the wait)."""

    until: float
    times: int


class MembershipFeed:
    def __init__(self, ray_namespace: str, timeout_s: float, directory: ray.actor.ActorHandle | None = None,
                 relay_node: str | None = None, reads: PoolReads | None = None) -> None:
        """``relay_node``: this process's node, whose relay the long poll goes to (None: the directory);
        ``reads``: this engine's reads per pool, drained into each poll (None: none reported)."""
        self._namespace = ray_namespace
        self._reads = reads
        self._relay_node = relay_node
        self._relay: ShardRecord | None = None
        """The relay the outstanding long poll went to (None: the directory)."""
        self._passed_over: dict[PoolKey, PassedOver] = {}
        """Relays (shard id, incarnation) whose call failed, or that did not answer in time, since
        they last answered."""
        self._node_shards: tuple[int, list[ShardRecord]] = (0, [])
        """(membership version, this node's shards in it by shard id)."""
        self._direct_once = False
        """The next long poll goes to the directory (the relay said it could not answer)."""
        self._relay_due = 0.0
        """When the relay's outstanding long poll is overdue (``time.monotonic``)."""
        self._timeout_s = timeout_s
        self._directory = directory
        self._pending: ray.ObjectRef | None = None
        self._posted = 0
        """Long polls posted so far: the outstanding one is the last (each numbered in order)."""
        self._answered = 0
        """The highest number of a long poll whose answer arrived (its future's callback, on
        Ray's thread): checking it is one comparison, where asking Ray whether the answer is
        there (``ray.wait``) cost ~85 us, twice per scheduler step, and the future's ``done()``
        takes its lock at every step. A number, not the poll: a poll dropped by ``fetch`` may be
        answered after the next one, and marked as the answered one it hid that answer for good
        (review56)."""
        self._answers = threading.Lock()  # taken by the callbacks only
        self._next_try = 0.0
        self._missing_logged = False
        self._posted_for = 0
        """The version the outstanding long poll was posted with (its answer's ``shards_held`` means it)."""
        self.hot_deltas = 0
        """Long-poll answers whose hot-prefix table came as a delta (``Membership.hot_delta``)."""
        self.relayed = 0
        """Long-poll answers that came from a relay."""

    def fetch(self) -> Membership | None:
        """The membership now (waits up to ``timeout_s``); None when no directory answers. A long
        poll still outstanding is dropped: its answer may be older than this one."""
        self._pending = None
        if not self._find():
            return None
        try:
            return ray.get(self._directory.membership.remote(), timeout=self._timeout_s)  # type: ignore[union-attr]
        except (RayError, GetTimeoutError) as e:
            self._lost(e)
            return None

    def poll(self, known: Membership) -> Membership | None:
        """A membership with another version than ``known``'s if one arrived; never waits. The
        long poll names ``known``'s hot-prefix table revision, so the directory sends only the
        rows changed since (applied here: the membership returned carries the whole table), and
        the shard list only when it changed since ``known``'s version (else ``known``'s is kept); an
        answer whose delta does not apply to ``known``'s table is dropped and the poll re-posted."""
        if self._pending is None and not self._post(known):
            return None
        if self._answered < self._posted:
            if self._relay is not None and time.monotonic() > self._relay_due:
                self._pass_over(self._relay, "no answer")
                self._pending = None  # its late answer is dropped (a later poll's number is higher)
            return None
        ref, self._pending = self._pending, None
        try:
            answer: Membership | None = ray.get(ref)
        except RayError as e:
            if self._relay is not None:
                self._pass_over(self._relay, type(e).__name__)
            else:
                self._lost(e)
            return None
        if self._relay is not None and self._passed_over:
            self._passed_over.pop(self._relay.key, None)  # it answers: a later failure waits RELAY_READMIT_S again
        if answer is None:  # the relay cannot say: one poll to the directory
            self._direct_once = True
            return None
        membership = answer
        self.relayed += self._relay is not None
        whole = membership.completed(known, self._posted_for)
        if whole is None:
            return None  # ``known`` moved since the poll was posted, or its delta is for another table: ask again
        self.hot_deltas += membership.hot_delta is not None
        return whole if whole.version != known.version else None

    def _post(self, known: Membership) -> bool:
        """Posts the long poll, to the node's relay or the directory (False: neither is there)."""
        relay = self._relay_for(known)
        method = getattr(relay.handle, "relay_wait_for_change", None) if relay is not None else None
        if relay is not None and method is None:  # a shard of an older package: it cannot relay
            self._pass_over(relay, "no relay_wait_for_change")
            relay = None
        if relay is None and not self._find():
            return False
        known_hot = known.hot.revision if known.version else -1
        reads = self._reads.drain() if self._reads is not None else None
        report = {"pool_reads": reads} if reads else {}  # a poll without reads is as before
        if relay is not None and method is not None:
            pending = method.remote(known.version, RELAY_POLL_S, known_hot=known_hot, shards_held=True, **report)
            self._relay_due = time.monotonic() + RELAY_POLL_S + RELAY_GRACE_S
        else:
            pending = self._directory.wait_for_change.remote(  # type: ignore[union-attr]
                known.version, known_hot=known_hot, shards_held=True, **report)
            self._direct_once = False
        self._relay = relay
        self._pending = pending
        self._posted_for = known.version
        self._posted += 1
        number = self._posted
        pending.future().add_done_callback(lambda _: self._arrived(number))
        return True

    def _pass_over(self, relay: ShardRecord, why: str) -> None:
        on_node = {shard.key for shard in self._node_shards[1]}
        self._passed_over = {key: passed for key, passed in self._passed_over.items() if key in on_node}
        times = self._passed_over[relay.key].times + 1 if relay.key in self._passed_over else 1
        wait_s = doubled(RELAY_READMIT_S, times - 1, RELAY_READMIT_MAX_S)
        self._passed_over[relay.key] = PassedOver(time.monotonic() + wait_s, times)
        log.warning("membership relay %s failed (%s); following the directory itself, or the node's next relay, "
                    "for %.0f s", relay.shard_id, why, wait_s)

    def _relay_for(self, known: Membership) -> ShardRecord | None:
        """This node's relay in ``known`` (its lowest shard id here not passed over, or whose pass-over
        ended), or None: the long poll goes to the directory."""
        if self._relay_node is None or self._direct_once:
            return None
        if self._node_shards[0] != known.version:  # once a membership, not at every post
            self._node_shards = (known.version, [s for s in known.shards if s.pool.node_id == self._relay_node])
        now = time.monotonic()
        for shard in self._node_shards[1]:  # sorted by shard id
            passed = self._passed_over.get(shard.key)
            if passed is None or passed.until <= now:
                return shard
        return None

    def _arrived(self, number: int) -> None:
        """The answer of long poll ``number`` is in (Ray's thread; the caller's, when it was in
        before the callback was added): ``poll`` sees it at its next look, unless that poll was
        dropped meanwhile (``fetch``, a lost directory) and a later one is outstanding."""
        with self._answers:
            if number > self._answered:
                self._answered = number

    def directory(self) -> ray.actor.ActorHandle | None:
        """The directory's handle, if one was found (looked up again at most every ``RETRY_S``)."""
        return self._directory if self._find() else None

    def _find(self) -> bool:
        if self._directory is not None:
            return True
        if time.monotonic() < self._next_try:
            return False
        self._next_try = time.monotonic() + RETRY_S
        try:
            self._directory = ray.get_actor(DIRECTORY_NAME, namespace=self._namespace)
        except ValueError:
            if not self._missing_logged:
                log.warning("no ucm-ray directory in Ray namespace %r: the cache is off until one starts",
                            self._namespace)
                self._missing_logged = True
            return False
        if self._missing_logged:
            log.info("found the ucm-ray directory in Ray namespace %r", self._namespace)
            self._missing_logged = False
        return True

    def _lost(self, error: Exception) -> None:
        log.warning("shard directory unreachable (%s); keeping the membership we have, looking again in %.0f s",
                    type(error).__name__, RETRY_S)
        self._directory = None
        self._pending = None
        self._next_try = time.monotonic() + RETRY_S
