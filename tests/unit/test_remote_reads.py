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
