"""ReaderSessions: how often each node read a family, as its root's owner sees the lookups.

Under writer-local placement a block's bytes stay on its writer's node, so every reader of a
document on other nodes loads it from that one pool (the hot-spot ratio of bytes served:
docs/scaling.md, design (k)). The owner of a family's root answers every other node's lookup of
the family (``where``), so it can tell a node that it read the family before: that node's engine
then keeps a copy of what it loads from other nodes (``remote_copy_reads``), and the next readers
on its node find it locally, other nodes' readers beside the original. Counting per node, not
per engine: a node's engines share its pool, and an engine's own repeat reads mostly hit vLLM's
prefix cache, never the store.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

SESSION_GAP_S = 1.0
"""Asks of one root from one node closer together than this are one session: a decode that asks
again while its prefill's saves land, a request looked up again after a preemption."""
MAX_ROOTS = 16384
"""Family roots whose readers are remembered, the least recently asked out first."""
MAX_READERS = 64
"""Reader nodes remembered per root, the least recent out first."""


class ReaderSessions:
    """Per family root, per reader node: its sessions (asks ``SESSION_GAP_S`` apart) and when it
    last asked."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._roots: OrderedDict[bytes, OrderedDict[str, tuple[int, float]]] = OrderedDict()

    def ask(self, root: bytes, reader: str) -> int:
        """``reader`` (a node id) asks about ``root``'s family: how many sessions of it came
        before this one."""
        now = self._clock()
        readers = self._roots.pop(root, None)
        if readers is None:
            readers = OrderedDict()
        self._roots[root] = readers
        while len(self._roots) > MAX_ROOTS:
            self._roots.popitem(last=False)
        sessions, last = readers.pop(reader, (0, -SESSION_GAP_S))
        earlier = sessions if now - last >= SESSION_GAP_S else sessions - 1
        readers[reader] = (earlier + 1, now)
        while len(readers) > MAX_READERS:
            readers.popitem(last=False)
        return earlier

    def __len__(self) -> int:
        return len(self._roots)
