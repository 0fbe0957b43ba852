"""An engine's feed passes over its node's relay while the relay keeps failing (``MembershipFeed``):
the wait before asking it again doubles up to ``RELAY_READMIT_MAX_S`` and stays there, however
many times in a row it fails."""

from __future__ import annotations

import time

from ucm_ray.store.engine.feed import RELAY_READMIT_MAX_S, MembershipFeed
from ucm_ray.store.types import Membership, ShardRecord
from ucm_ray.transport.base import PoolDescriptor


def test_a_relay_that_keeps_failing_is_passed_over_for_at_most_the_longest_wait_for_good():
    """Each pass-over doubled ``RELAY_READMIT_S`` as ``2 ** times`` in ints, then a float: the
    1,025th in a row (~11 days of a relay failing every call, say one of an older package that
    refuses the poll's arguments) raised OverflowError out of ``poll``, into the scheduler's step
    (review65b). The sequence is driven here through ``_pass_over``: it takes days in real time."""
    relay = ShardRecord("s0", None, PoolDescriptor("s0", "node-a", 1 << 20, None, None, None, 0,  # type: ignore[arg-type]
                                                   incarnation=1))
    feed = MembershipFeed("ns", 1.0, relay_node="node-a")
    assert feed._relay_for(Membership(7, (relay,))) == relay
    for _ in range(1100):
        feed._pass_over(relay, "call failed")
        assert feed._relay_for(Membership(7, (relay,))) is None  # passed over: the directory is asked
    wait_s = feed._passed_over[relay.key].until - time.monotonic()
    assert RELAY_READMIT_MAX_S - 5 < wait_s <= RELAY_READMIT_MAX_S
