"""RemoteReads: the engine's count of entries it loaded from other nodes, which decides copies."""

from __future__ import annotations

from ucm_ray.store.engine.remote_reads import RemoteReads


def test_the_second_read_keeps_a_copy_and_the_count_starts_over():
    reads = RemoteReads(2)
    assert reads.count([b"a", b"b"]) == [False, False]
    assert reads.count([b"a", b"c"]) == [True, False]
    assert reads.count([b"a", b"b", b"c"]) == [False, True, True]  # a: a first read again (its copy was evicted)
    assert len(reads) == 1


def test_never_and_at_the_first_read():
    assert RemoteReads(0).count([b"a", b"a"]) == [False, False]
    first = RemoteReads(1)
    assert first.count([b"a", b"b"]) == [True, True] and len(first) == 0


def test_the_least_recently_read_entries_are_forgotten_first():
    reads = RemoteReads(2, capacity=2)
    reads.count([b"a", b"b"])
    reads.count([b"c"])  # a out (b read after it)
    assert reads.count([b"a", b"b"]) == [False, True]
    assert len(reads) == 2  # c and a
    assert reads.count([b"c"]) == [True]
