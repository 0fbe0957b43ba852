"""RemoteReads: a family root's owner counts each node's reads of each block it is asked for
(what decides a reader's copies, ``remote_copy_reads``)."""

from __future__ import annotations

from ucm_ray.store.shard import remote_reads
from ucm_ray.store.shard.remote_reads import SESSION_S, RemoteReads
from ucm_ray.testing.clock import AdvancingClock


def _reads() -> tuple[RemoteReads, AdvancingClock]:
    clock = AdvancingClock()
    clock.freeze()
    return RemoteReads(clock), clock


def test_reads_are_counted_per_node_and_block():
    reads, clock = _reads()
    assert reads.ask([b"a", b"b"], "node-1") == [0, 0]
    assert reads.ask([b"a"], "node-2") == [0]
    clock.advance(SESSION_S)
    assert reads.ask([b"a", b"c"], "node-1") == [1, 0]
    clock.advance(SESSION_S)
    assert reads.ask([b"a", b"b", b"c"], "node-1") == [2, 1, 1]
    assert reads.ask([b"a"], "node-2") == [1]


def test_asks_within_a_second_of_a_reads_first_are_that_read():
    """A decode asking again and again while its prefill's saves land is one read; asking
    steadily does not make a read last forever."""
    reads, clock = _reads()
    answers = []
    for _ in range(8):
        answers.append(reads.ask([b"doc"], "node-1")[0])
        clock.advance(SESSION_S / 4)
    assert answers == [0, 0, 0, 0, 1, 1, 1, 1]


def test_blocks_and_readers_are_bounded_least_recent_out(monkeypatch):
    monkeypatch.setattr(remote_reads, "MAX_KEYS", 2)
    monkeypatch.setattr(remote_reads, "MAX_READERS", 2)
    monkeypatch.setattr(remote_reads, "POPULAR_READERS", 0)  # counted reads only
    reads, clock = _reads()
    reads.ask([b"a", b"b"], "n1")
    clock.advance(SESSION_S)
    reads.ask([b"a"], "n1")  # b is now the least recently asked
    reads.ask([b"c"], "n1")
    assert len(reads) == 2
    clock.advance(SESSION_S)
    assert reads.ask([b"b", b"c"], "n1") == [0, 1]  # b was forgotten
    reads.ask([b"c"], "n2")
    reads.ask([b"c"], "n3")  # n1 out of c's readers
    clock.advance(SESSION_S)
    assert reads.ask([b"c"], "n1") == [0]


def test_a_block_two_other_nodes_began_reading_within_the_window_is_popular_at_a_third_nodes_first_read():
    """With a random router a popular document is read about once per node: the owner tells the
    next node to copy it at its first read once ``POPULAR_READERS`` (two) other nodes read it
    within ``POPULAR_WINDOW_S``. Two, not one: one copied 1.2x the bytes at 1,000 nodes random
    for a lower hot spot, and more at 100 nodes for a higher one (docs/scaling.md, stop 66)."""
    assert remote_reads.POPULAR_READERS == 2
    reads, clock = _reads()
    assert reads.ask([b"doc", b"other"], "node-1") == [0, 0]
    assert reads.ask([b"doc"], "node-1") == [0]  # the same read: one node so far
    assert reads.ask([b"doc"], "node-2") == [0]  # one other node
    assert reads.ask([b"doc", b"other"], "node-3") == [remote_reads.POPULAR, 0]
    assert reads.ask([b"doc"], "node-3") == [remote_reads.POPULAR]  # the same read, told the same
    assert reads.ask([b"doc"], "node-1") == [0]  # node-1's first read still
    clock.advance(SESSION_S)
    assert reads.ask([b"doc"], "node-1") == [remote_reads.POPULAR]  # its second: node-2 and node-3 read it too
    clock.advance(remote_reads.POPULAR_WINDOW_S + remote_reads.SESSION_S)
    assert reads.ask([b"doc"], "node-4") == [0]  # their reads are too old now
    assert reads.ask([b"doc"], "node-1") == [2]  # only node-4's within the window: node-1's third read


def test_readers_20_s_apart_are_popular_a_chats_turns_a_minute_apart_are_not():
    """A document read by a node every 20-25 s (a few readers a minute across a 1,000-node fleet)
    was never popular under stop 65's 10 s and its writer served every read (docs/scaling.md,
    stop 66); a chat's turns on other nodes a minute apart still are not."""
    assert remote_reads.POPULAR_WINDOW_S == 50.0
    reads, clock = _reads()
    assert reads.ask([b"doc", b"chat"], "node-1") == [0, 0]
    clock.advance(20.0)
    assert reads.ask([b"doc"], "node-2") == [0]  # one other node
    clock.advance(25.0)
    assert reads.ask([b"doc"], "node-3") == [remote_reads.POPULAR]  # node-1 45 s ago, node-2 25 s
    clock.advance(15.0)
    assert reads.ask([b"chat"], "node-2") == [0]  # node-1's turn a minute ago
    clock.advance(60.0)
    assert reads.ask([b"chat"], "node-3") == [0]  # node-2's a minute ago, node-1's two


def test_popularity_counts_reads_not_asks_and_only_within_the_window(monkeypatch):
    monkeypatch.setattr(remote_reads, "POPULAR_READERS", 3)
    reads, clock = _reads()
    for node in ("n1", "n2"):
        for _ in range(5):  # many asks of one node are one reader
            reads.ask([b"doc"], node)
            clock.advance(SESSION_S)
    assert reads.ask([b"doc"], "n3") == [0]
    clock.advance(remote_reads.POPULAR_WINDOW_S - 5 * SESSION_S)  # n1's reads all began longer ago
    assert reads.ask([b"doc"], "n4") == [0]  # n2, n3 within the window: two of three
    assert reads.ask([b"doc"], "n5") == [remote_reads.POPULAR]  # n2, n3, n4


def test_no_more_reads_of_a_block_are_told_it_is_popular_than_the_askers_copy_bound():
    """Each read told so keeps a copy: unbounded, popular copies filled evicting pools at 100
    nodes (docs/scaling.md, stop 55); the engine's own count of named pools stops at 4."""
    reads, clock = _reads()
    reads.ask([b"doc"], "n1", copy_bound=2)
    reads.ask([b"doc"], "n2", copy_bound=2)
    told = [reads.ask([b"doc"], f"n{i}", copy_bound=2)[0] for i in range(3, 7)]
    assert told == [remote_reads.POPULAR] * 2 + [0] * 2
    clock.advance(SESSION_S)
    assert reads.ask([b"doc"], "n5", copy_bound=2) == [1]  # its second read: counted, not told
    assert reads.ask([b"doc"], "n7") == [remote_reads.POPULAR]  # no bound asked


def test_an_ask_of_a_block_no_pool_holds_is_no_read():
    """A writer looks its prompt up before it writes: that miss must not count its node as a
    reader of what it then writes (two readers after it would make it popular at once)."""
    reads, clock = _reads()
    assert reads.ask([b"doc", b"new"], "writer", held=[True, False]) == [0, 0]
    assert reads.ask([b"new"], "n1") == [0]
    assert reads.ask([b"new"], "n2") == [0]  # one other reader: the writer's miss did not count
    assert reads.ask([b"new"], "n3") == [remote_reads.POPULAR]
    clock.advance(SESSION_S)
    assert reads.ask([b"doc"], "writer") == [1]  # a held key's ask is a read


def _popular_among(reads: RemoteReads, bound: int) -> None:
    """Two other nodes read ``doc``: the next new read is told it is popular if a place is free."""
    reads.ask([b"doc"], "a", copy_bound=bound)
    reads.ask([b"doc"], "b", copy_bound=bound)


def test_a_place_whose_copy_was_never_registered_is_given_back():
    """The review of stop 55: a hybrid engine or one with ``remote_copy_reads: 0`` is told, keeps
    no copy, and used to take one of the block's places for its lifetime."""
    reads, clock = _reads()
    _popular_among(reads, 1)
    assert reads.ask([b"doc"], "hybrid", copy_bound=1) == [remote_reads.POPULAR]  # never copies
    assert reads.ask([b"doc"], "n1", copy_bound=1) == [0]  # its place is held for now
    clock.advance(remote_reads.POPULAR_WINDOW_S + SESSION_S)  # past CONFIRM_S; the reads so far too old
    _popular_among(reads, 1)  # new reads by a and b: popular again
    assert reads.ask([b"doc"], "n2", copy_bound=1) == [remote_reads.POPULAR]  # the place came back
    assert reads.stats()["popular_unconfirmed"] == 1


def test_a_node_told_before_that_reads_again_lost_its_copy_and_is_told_again():
    """A node asks only for what its own shards lack: its next read means its copy is gone
    (evicted), so its place is free again, and the bound still holds against others."""
    reads, clock = _reads()
    _popular_among(reads, 1)
    assert reads.ask([b"doc"], "n1", copy_bound=1) == [remote_reads.POPULAR]
    reads.copied([b"doc"], "n1")
    clock.advance(SESSION_S)
    assert reads.ask([b"doc"], "n1", copy_bound=1) == [remote_reads.POPULAR]  # its copy was evicted
    assert reads.ask([b"doc"], "n2", copy_bound=1) == [0]


def test_a_registered_copy_holds_its_place_past_the_confirmation_time():
    reads, clock = _reads()
    _popular_among(reads, 1)
    assert reads.ask([b"doc"], "n1", copy_bound=1) == [remote_reads.POPULAR]
    reads.copied([b"doc", b"other"], "n1")
    reads.copied([b"doc"], "n9")  # no place of n9's: nothing
    clock.advance(remote_reads.POPULAR_WINDOW_S + SESSION_S)  # past CONFIRM_S; the reads so far too old
    _popular_among(reads, 1)
    assert reads.ask([b"doc"], "n2", copy_bound=1) == [0]  # n1 holds the one place
    assert reads.stats() == {"popular_told": 1, "popular_confirmed": 1, "popular_unconfirmed": 0}


def test_a_node_that_keeps_no_copy_does_not_hold_a_place_by_reading_often():
    """review56: a node told a block is popular that never registers its copy (a hybrid engine,
    ``remote_copy_reads: 0``, a failed load) but reads the block again every few seconds took its
    place afresh at each read, so its deadline never came and, under a bound of one, no node that
    copies was ever told. Its place goes once ``CONFIRM_S`` passed unconfirmed, and it is not told
    again for that block; a node that copies gets the place."""
    reads, clock = _reads()
    _popular_among(reads, 1)
    assert reads.ask([b"doc"], "nocopy", copy_bound=1) == [remote_reads.POPULAR]
    for _ in range(4):  # a read every 2 s: it copies nothing
        clock.advance(2.0)
        assert reads.ask([b"doc"], "nocopy", copy_bound=1) == [remote_reads.POPULAR]  # its place, for now
    clock.advance(1.0)
    _popular_among(reads, 1)  # t = 9 s
    clock.advance(2.0)  # t = 11 s: its place was not confirmed within CONFIRM_S
    assert reads.ask([b"doc"], "copier", copy_bound=1) == [remote_reads.POPULAR]
    clock.advance(2.0)
    assert reads.ask([b"doc"], "nocopy", copy_bound=1) == [5]  # not told again for this block
    assert reads.stats()["popular_unconfirmed"] == 1
