"""RemoteReads: how often each node asked for each block of a family, as its root's owner sees it.

Under writer-local placement a block's bytes stay on its writer's node, so every reader of a
document on other nodes loads it from that one pool (the hot-spot ratio of bytes served:
docs/scaling.md, design (k)). A node asks the owner of a family's root only for the blocks its
own shards lack (``where``), so the owner can tell it how often it asked for each of them before:
at the ``remote_copy_reads``-th read the node's engine keeps a copy of the block (once its load
landed), the next readers on its node find it locally, and other nodes' readers find it beside
the original. Counted per node, not per engine (a node's engines share its pool, and an engine's
own repeat reads mostly hit vLLM's prefix cache), and per block, not per family (a system prompt
not yet hot is the root of every document after it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

SESSION_S = 1.0
"""Asks of a block from one node within this long of the first are one read: a decode that asks
again while its prefill's saves land, a request looked up again after a preemption."""
MAX_KEYS = 65536
"""Blocks whose readers are remembered, the least recently asked out first (~15 MB at most)."""
MAX_READERS = 64
"""Reader nodes remembered per block, the least recent out first."""


class RemoteReads:
    """Per block, per reader node: its reads (``SESSION_S`` apart) and when the last began."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._keys: OrderedDict[bytes, dict[str, tuple[int, float]]] = OrderedDict()

    def ask(self, keys: Sequence[bytes], reader: str) -> list[int]:
        """``reader`` (a node id) asks where ``keys`` are: per key, how many reads of it by that
        node came before this one."""
        now = self._clock()
        table = self._keys
        out = []
        for key in keys:
            readers = table.pop(key, None)
            if readers is None:
                readers = {}
            table[key] = readers
            reads, began = readers.pop(reader, (0, -SESSION_S))
            if now - began >= SESSION_S:
                reads, began = reads + 1, now
            readers[reader] = (reads, began)  # re-inserted: the most recent reader last
            if len(readers) > MAX_READERS:
                del readers[next(iter(readers))]
            out.append(reads - 1)
        while len(table) > MAX_KEYS:
            table.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._keys)
