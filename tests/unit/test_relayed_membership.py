"""What a relay answers an engine (``RelayedMembership``): never an older version than the engine
holds, the hot table as a delta that applies to the engine's revision or whole, the shard list
left out only when the engine's is the current one."""

from __future__ import annotations

import dataclasses

from ucm_ray.store.hot_prefixes import HotPrefixDelta, HotPrefixTable, delta_between
from ucm_ray.store.membership_relay import RelayedMembership
from ucm_ray.store.types import Membership

POOL = ("s0", 1)


def directory_answer(version: int, table: HotPrefixTable, known_hot: int, shards=("a", "b"),
                     shards_held: bool = False) -> Membership:
    """A directory answer as ``wait_for_change`` builds it (shard records stand in as strings)."""
    push = table.since(known_hot) if known_hot >= 0 else table.snapshot()
    membership = Membership(version, () if shards_held else shards, hot=table.snapshot(),  # type: ignore[arg-type]
                            shards_held=shards_held)
    if isinstance(push, HotPrefixDelta):
        membership = dataclasses.replace(membership, hot=Membership(0, ()).hot, hot_delta=push)
    return membership


def engine_table(relay: RelayedMembership, version: int, held_hot, shards_held: bool = True):
    answer = relay.answer(version, held_hot.revision, shards_held)
    assert answer is not None
    if answer.hot_delta is not None:
        applied = answer.hot_delta.apply(held_hot)
        assert applied is not None
        return answer, applied
    return answer, answer.hot


def test_a_relay_answers_as_the_directory_would_and_never_older_than_the_engine() -> None:
    table = HotPrefixTable(start=100)
    relay = RelayedMembership()
    assert relay.answer(5, -1, True) is None  # not following: the engine asks the directory
    table.add({b"k1": [POOL]})
    assert relay.take(directory_answer(10, table, -1), 0)
    first = table.snapshot()
    table.add({b"k2": [POOL]})
    assert relay.take(directory_answer(11, table, first.revision, shards_held=True), 10)
    assert relay.version == 11 and relay.answer(12, first.revision, True) is None  # behind the engine

    answer, hot = engine_table(relay, 10, first)  # the engine at the relay's last base: that delta
    assert answer.version == 11 and answer.shards_held and hot == table.snapshot()
    answer, hot = engine_table(relay, 11, table.snapshot())  # at the current revision: an empty delta
    assert answer.hot_delta is not None and answer.hot_delta.base == answer.hot_delta.revision

    stale = relay.answer(3, 7, True)  # another revision, a version before the shard list changed
    assert stale is not None and stale.hot_delta is None and stale.hot == table.snapshot()
    assert not stale.shards_held and stale.shards == ("a", "b")


def test_an_answer_that_does_not_apply_leaves_the_relay_not_following() -> None:
    table = HotPrefixTable(start=100)
    relay = RelayedMembership()
    table.add({b"k1": [POOL]})
    assert relay.take(directory_answer(10, table, -1), 0)
    other = HotPrefixTable(start=500)
    other.add({b"x": [POOL]})
    other.add({b"y": [POOL]})
    assert not relay.take(directory_answer(11, other, 501), 10)  # a delta from a revision it never held
    assert not relay.following and relay.poll_args() == (0, -1)
    assert relay.answer(10, 101, True) is None


def test_a_shard_list_change_is_sent_to_engines_that_hold_the_old_one() -> None:
    table = HotPrefixTable(start=100)
    relay = RelayedMembership()
    assert relay.take(directory_answer(10, table, -1), 0)
    assert relay.take(directory_answer(11, table, table.revision, shards=("a",)), 10)  # "b" left
    answer = relay.answer(10, table.revision, True)
    assert answer is not None and answer.shards == ("a",) and not answer.shards_held
    held = relay.answer(11, table.revision, True)
    assert held is not None and held.shards_held and held.shards == ()


def test_an_engine_pushes_behind_the_relay_gets_a_delta_that_applies() -> None:
    table = HotPrefixTable(start=100)
    relay = RelayedMembership()
    table.add({b"k1": [POOL], b"k2": [POOL]})
    assert relay.take(directory_answer(10, table, -1), 0)
    engine_held = table.snapshot()
    for version, step in enumerate([lambda: table.add({b"k3": [POOL]}),
                                    lambda: table.add_copies(("s1", 1), [b"k1"], 0),  # a row grows
                                    lambda: table.remove_pool(POOL)], start=11):  # rows change otherwise
        known = table.revision
        step()
        assert relay.take(directory_answer(version, table, known, shards_held=True), version - 1)
    answer, hot = engine_table(relay, 10, engine_held)  # three pushes behind
    assert answer.hot_delta is not None and answer.hot_delta.base == engine_held.revision
    assert hot == table.snapshot()


def test_delta_between_two_tables_turns_one_into_the_other() -> None:
    table = HotPrefixTable(start=7)
    table.add({b"a": [POOL], b"b": [POOL], b"c": [("s2", 1)]})
    old = table.snapshot()
    table.add_copies(("s1", 1), [b"a"], 0)  # grown
    table.add({b"b": [("s3", 1)], b"d": [POOL]})  # replaced, new
    table.remove_pool(("s2", 1))  # c's row empty
    delta = delta_between(old, table.snapshot())
    assert delta.apply(old) == table.snapshot()
    assert b"a" in delta.appended and b"b" in delta.changed
