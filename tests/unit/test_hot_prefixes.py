"""Hot prefixes (``store.hot_prefixes``): what a root's owner learns from its askers, the table the
directory keeps and pushes, and where a prompt's family root falls under it."""

from __future__ import annotations

import pickle
from collections import Counter

from ucm_ray.store.engine.family import spread
from ucm_ray.store.hot_prefixes import (
    ASKERS_MIN,
    COPIES_ONE_BY_ONE,
    DROP_LOG,
    MAX_ASKERS,
    MAX_HOT_BLOCKS,
    NO_HOT_PREFIXES,
    REANNOUNCE_S,
    SCAN_BLOCKS,
    SESSIONS,
    WINDOW_S,
    FamilyRecords,
    HotPrefixDelta,
    HotPrefixes,
    HotPrefixLearner,
    HotPrefixTable,
    PushPacer,
    askers_needed,
)
from ucm_ray.testing.clock import AdvancingClock

POOL_A, POOL_B = ("shard-a", 1), ("shard-b", 2)


def chain(tag: str, start: int, blocks: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(start, start + blocks)]


def chat(j: int, system: int = 8, turn: int = 5) -> list[bytes]:
    return chain("system", 0, system) + chain(f"chat{j}", system, turn)


def test_the_blocks_the_last_askers_share_become_hot_at_the_threshold_once():
    learner = HotPrefixLearner(asks=6, clock=AdvancingClock())
    answers = [learner.observe(chat(j)) for j in range(6)]
    assert answers[:5] == [[]] * 5
    assert answers[5] == chain("system", 0, 8)  # chats diverge after the system prompt
    assert learner.learned == 8
    assert [learner.observe(chat(j)) for j in range(6, 20)] == [[]] * 14  # announced: not again


def test_a_root_asked_less_often_than_the_threshold_within_a_window_never_becomes_hot():
    clock = AdvancingClock()
    learner = HotPrefixLearner(asks=4, clock=clock)
    for j in range(12):
        assert learner.observe(chat(j)) == []
        if j % 3 == 2:
            clock.advance(WINDOW_S + 1)  # three asks per window


def test_asks_that_straddle_the_windows_end_are_split_and_every_lookup_shown_is_counted_once():
    """The window starts with the learner and again at the first ask after it ends: the 6 asks
    of a threshold of 6 that straddle an end do not learn (one of stop 67's runs at 64), 6 after
    it do. ``asks`` counts each lookup shown once, the announced root's too (the shard's
    ``hot_asks`` figure)."""
    clock = AdvancingClock()
    clock.freeze()
    learner = HotPrefixLearner(asks=6, clock=clock)
    clock.advance(WINDOW_S - 1)
    assert [learner.observe(chat(j)) for j in range(3)] == [[]] * 3
    clock.advance(2)
    assert [learner.observe(chat(j)) for j in range(3, 8)] == [[]] * 5
    assert learner.observe(chat(8)) == chain("system", 0, 8)
    assert learner.observe(chat(9)) == []
    assert learner.asks == 10


def test_one_prompt_asked_again_and_again_is_hot_whole_and_the_scan_bounds_it():
    learner = HotPrefixLearner(asks=SESSIONS, clock=AdvancingClock())
    document = chain("doc", 0, SCAN_BLOCKS + 100)
    hot = [learner.observe(document) for _ in range(SESSIONS)][-1]
    assert hot == document[:SCAN_BLOCKS]


def test_an_announced_root_is_counted_again_after_the_reannounce_time():
    clock = AdvancingClock()
    learner = HotPrefixLearner(asks=SESSIONS, clock=clock)
    assert [learner.observe(chat(j)) for j in range(SESSIONS)][-1] == chain("system", 0, 8)
    clock.advance(REANNOUNCE_S + 1)
    assert [learner.observe(chat(j)) for j in range(SESSIONS)][-1] == chain("system", 0, 8)


def test_zero_asks_never_learns():
    learner = HotPrefixLearner(asks=0, clock=AdvancingClock())
    assert all(learner.observe(chat(j)) == [] for j in range(50))


def test_a_root_many_nodes_ask_once_each_is_learned_and_one_node_asking_often_only_by_the_asks():
    """Issue 40, stop 59: 64 asks in 10 s are out of reach of a 100-node fleet at a request every
    5 s a node, so the system prompt every node starts with never became hot and its root's owner
    answered every lookup (docs/scaling.md, stop 58: 22.3x the mean calls). Distinct askers do not
    depend on the rate: 2 % of the fleet (20 at 1,000 nodes) asking once each make it hot. One node
    asking often (a sticky router's document) is one asker: learned by the asks only."""
    assert askers_needed(1) == ASKERS_MIN and askers_needed(1000) == 20 and askers_needed(10**6) == MAX_ASKERS
    learner = HotPrefixLearner(asks=64, clock=AdvancingClock())
    answers = [learner.observe(chat(j), asker=f"node-{j}", nodes=1000) for j in range(20)]
    assert answers[:19] == [[]] * 19
    assert answers[19] == chain("system", 0, 8)
    # one node asking a document again and again: 63 asks are not enough, the 64th is
    document = chain("doc", 0, 16)
    assert all(learner.observe(document, asker="node-7", nodes=1000) == [] for _ in range(63))
    assert learner.observe(document, asker="node-7", nodes=1000) == document
    # the askers of one window: a new window counts from nothing
    clock = AdvancingClock()
    learner = HotPrefixLearner(asks=64, clock=clock)
    for j in range(19):
        assert learner.observe(chat(j), asker=f"node-{j}", nodes=1000) == []
    clock.advance(WINDOW_S + 1)
    assert learner.observe(chat(19), asker="node-19", nodes=1000) == []


def test_the_askers_counted_per_root_are_bounded():
    learner = HotPrefixLearner(asks=10**6, clock=AdvancingClock())
    for j in range(500):  # one chat's turns: parts nowhere, lengths differ, never hot
        assert learner.observe(chain("chat", 0, 4 + j % 3), asker=f"node-{j}", nodes=10**6) == []
    assert len(learner._askers[b"chat-0"]) == MAX_ASKERS


def test_the_table_says_when_it_changed_and_forgets_the_oldest_past_its_bound():
    table = HotPrefixTable(max_blocks=4)
    assert table.add({b"a": [POOL_A], b"b": [POOL_A]})
    assert not table.add({b"a": [POOL_A]})  # nothing new: no version for it
    assert table.add({b"a": [POOL_B, POOL_A]})  # the pools moved
    assert table.add({b"c": [POOL_A], b"d": [POOL_A], b"e": [POOL_A]})
    snapshot = table.snapshot()
    assert sorted(snapshot.pools) == [b"b", b"c", b"d", b"e"]  # "a" was refreshed first, still oldest
    assert pickle.loads(pickle.dumps(snapshot)) == snapshot  # it travels in the membership
    assert len(HotPrefixTable().snapshot()) == 0 and MAX_HOT_BLOCKS >= 1024


def test_a_family_root_is_the_first_block_past_the_hot_prefix():
    hot = HotPrefixes({key: (POOL_A,) for key in chain("system", 0, 8)})
    assert hot.leading(chat(1)) == 8
    assert hot.root_position(chat(1)) == 8
    assert hot.root_position(chat(1)[:8]) == 0  # all hot: the first block, as before the table
    assert hot.root_position(chain("other", 0, 5)) == 0
    # only a leading run counts: a hot block after a cold one is not a prefix
    assert hot.leading(chain("other", 0, 1) + chain("system", 1, 7)) == 0


def test_a_handover_moves_each_recorded_family_past_the_hot_prefix_to_its_new_root():
    records = FamilyRecords()
    system = chain("system", 0, 8)
    turn1 = chat(1)  # the system prompt, then chat 1's own 5 blocks
    turn2 = turn1 + chain("chat1b", 13, 3)  # chat 1's next turn: the same new root
    early = chain("system", 0, 4) + chain("early", 4, 6)  # parts from the system prompt at block 4
    records.record(turn1, turn1)
    records.record(turn2, turn2[10:])  # its writer found the first 10 blocks on its node: asked the rest
    records.record(early, early + [b"state-of-early"])  # a hybrid's state key rides with its family
    records.record(system, system)  # a prompt that is only the system prompt: stays where it is
    records.record(chain("other", 0, 6), chain("other", 0, 6))  # another root's family
    moved = records.handover(system)
    assert moved == {turn1[8]: turn2[8:],  # both turns, each key once
                     early[4]: early[4:] + [b"state-of-early"]}
    assert NO_HOT_PREFIXES.root_position(turn2) == 0  # (before the table has them: the first block)
    assert HotPrefixes(dict.fromkeys(system, (POOL_A,))).root_position(turn2) == 8  # the root readers ask


def test_the_records_keep_the_most_recent_lookups_up_to_their_bound():
    records = FamilyRecords(max_keys=20)
    for j in range(5):
        records.record(chat(j), chat(j))  # 13 keys each
    assert len(records) == 13  # one record: the newest
    assert list(records.handover(chain("system", 0, 8))) == [chat(4)[8]]
    assert FamilyRecords().handover([]) == {}
    off = FamilyRecords(max_keys=0)  # hot prefixes off: nothing kept
    off.record(chat(0), chat(0))
    assert len(off) == 0


POOL_C = ("shard-c", 3)


def test_a_copy_is_named_after_the_pools_a_row_had_up_to_the_bound_and_only_for_hot_blocks():
    table = HotPrefixTable()
    system = chain("system", 0, 4)
    table.add({key: (POOL_A,) for key in system})
    assert table.add_copies(POOL_B, system + [b"not-hot"], bound=2)
    assert table.snapshot().pools == {key: (POOL_A, POOL_B) for key in system}
    assert not table.add_copies(POOL_B, system, bound=2)  # named already
    assert not table.add_copies(POOL_C, system, bound=2)  # at the bound
    assert table.add_copies(POOL_C, system[:1], bound=0)  # no bound
    assert table.snapshot().pools[system[0]] == (POOL_A, POOL_B, POOL_C)
    assert table.remove_pool(POOL_A)  # a pool that left is named nowhere
    assert table.snapshot().pools[system[1]] == (POOL_B,)


def test_a_row_names_its_first_copies_one_by_one_then_as_they_double_up_to_the_bound():
    """Issue 40, stop 59: each change of a hot row is pushed to every engine (999 messages at 1,000
    nodes), and a row named each copy announced: up to 100 changes a row to reach the copy bound.
    Past ``COPIES_ONE_BY_ONE`` pools the copies wait until they double the row or fill the bound:
    1, 2, 3, 4, 8, 16, 32, 64, 100 pools, 8 changes, every copy named once the bound is full."""
    table = HotPrefixTable()
    hot = b"hot"
    table.add({hot: (POOL_A,)})
    readers = [(f"reader-{i}", i) for i in range(120)]
    sizes = []
    for pool in readers:
        if table.add_copies(pool, [hot], bound=100):
            sizes.append(len(table.snapshot().pools[hot]))
    assert sizes == [2, 3, 4, 8, 16, 32, 64, 100]
    assert table.snapshot().pools[hot] == (POOL_A,) + tuple(readers[:99])  # in the order announced
    assert table.copies_waiting == 0
    # a copy waiting is forgotten with its pool when the pool leaves, and with its row
    table.add({b"other": tuple(readers[:COPIES_ONE_BY_ONE])})
    assert table.add_copies(POOL_B, [b"other"], bound=0) is False and table.copies_waiting == 1
    assert table.remove_pool(POOL_B) is False and table.copies_waiting == 0
    table.add_copies(POOL_B, [b"other"], bound=0)
    small = HotPrefixTable(max_blocks=1)
    small.add({b"other": tuple(readers[:COPIES_ONE_BY_ONE])})
    small.add_copies(POOL_B, [b"other"], bound=0)
    small.add({b"next": (POOL_A,)})
    assert small.copies_waiting == 0


def test_an_engine_gets_the_rows_changed_since_its_revision_and_applies_them():
    table = HotPrefixTable(max_blocks=6, start=1000)
    first, second = chain("system", 0, 4), chain("other", 0, 4)
    table.add({key: (POOL_A,) for key in first})
    held = table.snapshot()
    assert held.revision == 1001
    table.add_copies(POOL_B, first[:2], bound=0)
    delta = table.since(held.revision)
    assert isinstance(delta, HotPrefixDelta)
    assert delta.appended == {key: (POOL_B,) for key in first[:2]}  # two rows grown, not the table
    assert delta.changed == {}
    assert delta.apply(held) == table.snapshot()
    assert delta.apply(HotPrefixes({}, 7)) is None  # not the revision it applies to
    # past the bound the oldest rows are dropped: the delta says so
    table.add({key: (POOL_C,) for key in second})
    delta = table.since(held.revision)
    assert isinstance(delta, HotPrefixDelta) and set(delta.dropped) == set(first[:2])
    assert delta.apply(held) == table.snapshot()
    assert table.since(table.snapshot().revision) == HotPrefixDelta(1003, 1003, {})  # nothing new
    # an engine that holds nothing, or a revision of another directory start, gets the whole table
    assert table.since(-1) == table.snapshot() == table.since(7) == table.since(5000)


def test_a_row_grown_by_copies_since_an_engines_revision_comes_as_the_pools_added_and_set_otherwise_whole():
    """Issue 40, stop 60: a hot row's copies are named as they double, and each change went to every
    engine as the whole row: its pools pushed summed to twice what it ends with. An engine holding
    any revision since the row was last set gets only the pools named after it; a row set again
    (learned anew, a pool gone) comes whole. Every revision's engine ends with the table."""
    table = HotPrefixTable(start=50)
    hot, other = b"hot", b"other"
    table.add({hot: (POOL_A,), other: (POOL_A,)})
    readers = [(f"reader-{i}", i) for i in range(40)]
    held = {table.revision: table.snapshot()}
    for pool in readers:
        if table.add_copies(pool, [hot], bound=0):
            held[table.revision] = table.snapshot()
    assert len(table.snapshot().pools[hot]) == 32  # 2, 3, 4, 8, 16, 32 pools (the writer's first)
    for revision, engine in held.items():
        delta = table.since(revision)
        if revision == table.revision:
            continue
        assert isinstance(delta, HotPrefixDelta) and delta.changed == {}
        assert delta.appended == {hot: table.snapshot().pools[hot][len(engine.pools[hot]):]}
        assert delta.apply(engine) == table.snapshot()
    first = min(held)
    assert sum(map(len, table.since(first).appended.values())) == 31  # whole: 2 + 3 + 4 + 8 + 16 + 32
    table.remove_pool(readers[0])  # set otherwise: whole to every engine that held it before
    table.add_copies(POOL_B, [other], bound=0)
    delta = table.since(first)
    assert isinstance(delta, HotPrefixDelta)
    assert delta.changed == {hot: table.snapshot().pools[hot]} and delta.appended == {other: (POOL_B,)}
    assert delta.apply(held[first]) == table.snapshot()
    after = table.revision
    assert table.add_copies(POOL_C, [hot], bound=32)  # grown again (the bound filled): appended to the set row
    assert table.since(after).appended == {hot: (readers[31],)}  # the first copy waiting
    missing = HotPrefixDelta(1, 2, {}, (), {b"absent": (POOL_A,)})
    assert missing.apply(HotPrefixes({}, 1)) is None  # not the table it was made against


class OlderPackagesDelta:
    """Pickles as a directory of the package before stop 60 pickled its ``HotPrefixDelta``: the
    same class, its fields' state without ``appended`` (that package had none)."""

    def __init__(self, base: int, revision: int, changed: dict, dropped: tuple = ()) -> None:
        self.state = {"base": base, "revision": revision, "changed": changed, "dropped": dropped}

    def __reduce__(self):
        return object.__new__, (HotPrefixDelta,), self.state


def test_a_delta_from_an_older_packages_directory_applies_as_one_that_appends_nothing():
    """An engine of this package polling a directory of the one before (a fleet upgraded engines
    first): that directory's deltas carry no ``appended``, and applying one must not raise (the
    scheduler refreshes the membership on its hot path) but apply its rows."""
    table = HotPrefixes({b"a": (POOL_A,)}, 7)
    delta = pickle.loads(pickle.dumps(OlderPackagesDelta(7, 8, {b"b": (POOL_B,)}, (b"a",))))
    assert isinstance(delta, HotPrefixDelta)
    assert delta.apply(table) == HotPrefixes({b"b": (POOL_B,)}, 8)
    assert delta.appended == {}


def test_the_drop_log_bounds_deltas_an_engine_too_far_behind_gets_the_whole_table():
    table = HotPrefixTable(max_blocks=1)
    table.add({b"a": (POOL_A,)})
    held = table.snapshot()
    for i in range(DROP_LOG + 1):
        table.add({f"k{i}".encode(): (POOL_A,)})
    assert table.since(held.revision) == table.snapshot()
    assert isinstance(table.since(table.snapshot().revision - 1), HotPrefixDelta)


def test_a_table_with_its_revision_pickles_as_pushed():
    table = HotPrefixTable(start=5)
    table.add({b"a": (POOL_A,)})
    assert pickle.loads(pickle.dumps(table.since(5))) == table.since(5)


def test_readers_of_a_hot_block_start_at_the_pool_their_node_picks_so_the_named_pools_share_them():
    pools = [(f"shard-{i}", i) for i in range(8)]
    starts = Counter(spread(pools, f"node-{n}")[0] for n in range(800))
    assert set(starts) == set(pools)  # every named pool is some nodes' first
    assert max(starts.values()) < 2 * 800 / len(pools)
    order = spread(pools, "node-3")
    assert sorted(order) == sorted(pools) and spread(pools, "node-3") == order  # all of them, the same each time
    assert spread(pools[:1], "node-3") == pools[:1]


def test_copies_announced_within_the_push_interval_ride_on_one_push():
    clock = AdvancingClock()
    clock.freeze()
    pacer = PushPacer(every_s=1.0, clock=clock)
    assert pacer.due() == 0.0  # the first: at once
    assert pacer.due() is None  # scheduled already: carried by it
    pacer.pushed()
    clock.advance(0.25)
    assert pacer.due() == 0.75  # the next waits out the interval since the last push
    assert pacer.due() is None
    clock.advance(0.75)
    pacer.pushed()
    clock.advance(5.0)
    assert pacer.due() == 0.0


def test_the_directory_builds_one_answer_per_revision_not_one_per_engine_that_asks():
    """Every engine's long poll is answered at each push (1,000 at 1,000 nodes): a full table at
    its bound (4,096 rows naming 100 pools each) took ~1.2 ms to copy and ~0.4 ms to diff per
    answer on the CPU box, ~1.6 s of the directory's one thread per push. Engines at the same
    revision get the same answer, built once; a change builds the next."""
    table = HotPrefixTable(start=10)
    system = chain("system", 0, 4)
    table.add({key: (POOL_A,) for key in system})
    held = table.revision
    table.add_copies(POOL_B, system[:2], bound=0)
    assert table.snapshot() is table.snapshot()
    assert table.since(held) is table.since(held)
    first = table.since(held)
    table.add_copies(POOL_C, system[:1], bound=0)
    assert table.since(held) is not first and table.since(held) == HotPrefixDelta(
        held, table.revision, {}, (), {system[0]: (POOL_B, POOL_C), system[1]: (POOL_B,)})
    assert table.snapshot().pools[system[0]] == (POOL_A, POOL_B, POOL_C)
