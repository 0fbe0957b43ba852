"""ReaderSessions: a family root's owner counts each node's sessions of the family (what decides
a reader's copies, ``remote_copy_reads``)."""

from __future__ import annotations

from ucm_ray.store.shard import reader_sessions
from ucm_ray.store.shard.reader_sessions import SESSION_GAP_S, ReaderSessions
from ucm_ray.testing.clock import AdvancingClock


def test_sessions_are_counted_per_node_and_root():
    clock = AdvancingClock()
    clock.freeze()
    sessions = ReaderSessions(clock)
    assert sessions.ask(b"doc", "node-1") == 0
    assert sessions.ask(b"doc", "node-2") == 0
    assert sessions.ask(b"other", "node-1") == 0
    clock.advance(SESSION_GAP_S)
    assert sessions.ask(b"doc", "node-1") == 1
    clock.advance(SESSION_GAP_S)
    assert sessions.ask(b"doc", "node-1") == 2
    assert sessions.ask(b"doc", "node-2") == 1


def test_asks_closer_than_the_gap_are_one_session():
    """A decode asking again and again while its prefill's saves land is one session."""
    clock = AdvancingClock()
    clock.freeze()
    sessions = ReaderSessions(clock)
    for _ in range(10):
        assert sessions.ask(b"doc", "node-1") == 0
        clock.advance(SESSION_GAP_S / 4)
    clock.advance(SESSION_GAP_S)
    assert sessions.ask(b"doc", "node-1") == 1


def test_roots_and_readers_are_bounded_least_recent_out(monkeypatch):
    monkeypatch.setattr(reader_sessions, "MAX_ROOTS", 2)
    monkeypatch.setattr(reader_sessions, "MAX_READERS", 2)
    clock = AdvancingClock()
    clock.freeze()
    sessions = ReaderSessions(clock)
    for root in (b"a", b"b"):
        sessions.ask(root, "n1")
    clock.advance(SESSION_GAP_S)
    sessions.ask(b"a", "n1")  # b is now the least recently asked
    sessions.ask(b"c", "n1")
    assert len(sessions) == 2
    clock.advance(SESSION_GAP_S)
    assert sessions.ask(b"b", "n1") == 0  # forgotten
    assert sessions.ask(b"c", "n1") == 1
    for node in ("n2", "n3"):
        sessions.ask(b"c", node)  # n1 out of c's readers
    clock.advance(SESSION_GAP_S)
    assert sessions.ask(b"c", "n1") == 0
