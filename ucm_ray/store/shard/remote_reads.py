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

A block that ``POPULAR_READERS`` other nodes (two) began reading within ``POPULAR_WINDOW_S``
(50 s) is popular: the next node copies it at its first read. With a random router a popular document is
read about once per node in a large fleet, so a node's second read rarely comes and every reader
loaded it from its writer's pool (44.8 of the hottest node's 45.3x the mean bytes at 1,000 nodes,
docs/scaling.md, stop 55). At most the asker's copy bound (``copy_nodes_per_pool``: one pool per
that many nodes) of nodes hold a place of a block's at once, each told so: the engine's own count
of the pools named for a block stops at the 4 a root's owner names (``MAX_POOLS_PER_KEY``), and
unbounded, popular copies filled evicting pools at 100 nodes (2.8 points of hits below per-block
placement).

A place is held while its node is believed to hold the copy, not for the block's lifetime (what
stop 55 built: once the bound's count of readers were told, no later one was, even after their
copies were evicted or never made). A place is given back when its node's copy was not
registered here within ``CONFIRM_S`` of the tell (``copied``: a hybrid engine, one with
``remote_copy_reads: 0`` or a load that failed keeps none), and when its node begins another read
of the block after its copy was registered: a node asks only for what its own shards lack, so its
copy is gone (evicted). A node that reads again before its copy was registered keeps its place
and its deadline (renewed at each read, a node that keeps no copy and reads often held its place
for ever, review56), and a node whose place was given back unconfirmed is not told again for that
block until it registers a copy of it. A copy evicted on a node that never reads the block again
keeps its place: this owner cannot see it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

SESSION_S = 1.0
"""Asks of a block from one node within this long of the first are one read: a decode that asks
again while its prefill's saves land, a request looked up again after a preemption."""
MAX_KEYS = 65536
"""Blocks whose readers are remembered, the least recently asked out first: ~23 MiB a shard with
one reader node a block, ~363 MiB were every block read by ``MAX_READERS`` nodes (5.8 KB a block),
~555 MiB were each of those reads also told the block is popular under a bound of 100 (8.9 KB a
block: the places; measured with ``tracemalloc``: docs/performance-log.md, stop 56)."""
MAX_READERS = 64
"""Reader nodes remembered per block, the least recent out first."""
POPULAR_READERS = 2
"""Other nodes whose read of a block began within ``POPULAR_WINDOW_S`` that make it popular: two,
so a document's third reader node keeps a copy. One (stop 66's first try: the second reader
copies) took the hottest node's bytes from 3.34 to 2.95x the mean at 1,000 nodes random for 112
MiB more copied a request (1,304 -> 1,416: 3.6 points of that ratio a GiB) and left the summary
line's hot spot, which the calls set, at 4.16 against 4.22; at 100 nodes it copied 182 MiB more
for a hotter node (2.62 against 2.55; docs/scaling.md, stop 66, helper hotwriter20b)."""
POPULAR_WINDOW_S = 50.0
"""How recent those reads must be: a popular document's readers come together, while a chat's
turns on other nodes (one user's history, read by whichever node the router picked) come a
user's reply apart. 10 s through stop 65 (the hot-prefix learner's window): at 1,000 nodes a
document read by a few nodes a minute was never popular and its writer served every read
(3.56x the mean, 1,000 nodes random); 50 s took that to 3.34 (30 s: 3.48) and 100 nodes random
from 2.80 to 2.55, for 0.26 points of hits at 100 nodes, 0.02 at 1,000 (docs/scaling.md,
stop 66). The readers remembered per block (``MAX_READERS``) bound the walk, not the window."""
POPULAR = 1 << 30
"""What a popular block counts as read before: past any ``remote_copy_reads``."""
CONFIRM_S = 10.0
"""How long a node told a block is popular holds its place before its copy is registered here
(``copied``): a copy is saved once its load landed and committed, well within this; one that
never comes (a hybrid engine, ``remote_copy_reads: 0``, a failed load) frees the place after it.
A copy registered later is one past the bound, at most one a late node."""
MAX_BARRED = 8
"""Nodes remembered per block as keeping no copy (a place given back unconfirmed): past it, a
further such node may take a place again once its last one was given back (one ``CONFIRM_S``
a read). Bounds the memory: 1.6 KB a block with this many (``MAX_KEYS`` blocks: ~98 MiB were every
block's places given back by this many nodes; ``tracemalloc``, 56-character node ids)."""
HELD = float("inf")
"""A place's deadline once its copy is registered: held until its node reads the block again."""


class _Block:
    """One block's reader nodes, least recent first: per node, its reads, when the last began and
    whether that read was told the block is popular; and its places (``copy_bound``): per node
    told so under a bound, the time by which its copy must be registered, or ``HELD`` once it was
    (None: no place taken, most blocks). At most the largest bound asked (one per node and
    ``copy_nodes_per_pool`` nodes): an unbounded tell takes none. ``barred``: the nodes whose
    place was given back unconfirmed, not told again (None: none, most blocks; at most
    ``MAX_BARRED``)."""

    __slots__ = ("readers", "places", "barred")

    def __init__(self) -> None:
        self.readers: dict[str, tuple[int, float, bool]] = {}
        self.places: dict[str, float] | None = None
        self.barred: set[str] | None = None


class RemoteReads:
    """Per block, per reader node: its reads (``SESSION_S`` apart) and when the last began."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._keys: OrderedDict[bytes, _Block] = OrderedDict()
        self.told = 0
        """Reads told a block is popular (each took a place, under a bound)."""
        self.confirmed = 0
        """Of those, places whose copy was registered here (``copied``)."""
        self.unconfirmed = 0
        """Places given back because no copy was registered within ``CONFIRM_S``."""

    def ask(self, keys: Sequence[bytes], reader: str, held: Sequence[bool] | None = None,
            copy_bound: int = 0) -> list[int]:
        """``reader`` (a node id) asks where ``keys`` are: per key, how many reads of it by that
        node came before this one, or ``POPULAR`` where other nodes read it often enough
        (decided at a read's first ask; each read told so takes one of the block's places, at
        most ``copy_bound`` held at once: the asker's ``copy_nodes_per_pool`` bound, 0: none;
        see the module's docstring for when a place is given back). ``held``: per key,
        whether any pool is named for it (None: all are); an ask of a key nobody holds is no
        read (a writer looks its prompt up before it writes), 0."""
        now = self._clock()
        table = self._keys
        out = []
        for at, key in enumerate(keys):
            if held is not None and not held[at]:
                out.append(0)
                continue
            block = table.pop(key, None)
            if block is None:
                block = _Block()
            table[key] = block
            readers = block.readers
            reads, began, told = readers.pop(reader, (0, -SESSION_S, False))
            if now - began >= SESSION_S:  # a new read
                reads, began = reads + 1, now
                places = block.places
                if places is not None and self._keeps_place(block, places, reader, now):
                    told = True  # not copied yet: its place and deadline stand
                else:
                    told = (not (block.barred and reader in block.barred)
                            and self._may_take_place(block, now, copy_bound) and _popular(readers, reader, now))
                    if told:
                        self.told += 1
                        if copy_bound:
                            if places is None:
                                places = block.places = {}
                            places[reader] = now + CONFIRM_S
            readers[reader] = (reads, began, told)  # re-inserted: the most recent reader last
            if len(readers) > MAX_READERS:
                del readers[next(iter(readers))]
            out.append(POPULAR if told else reads - 1)
        while len(table) > MAX_KEYS:
            table.popitem(last=False)
        return out

    def copied(self, keys: Sequence[bytes], node: str) -> None:
        """``node``'s pool registered ``keys`` (a write's hints): a place it was told to take for
        any of them is held (until it reads that block again)."""
        table = self._keys
        for key in keys:
            block = table.get(key)
            places = block.places if block is not None else None
            if places and places.get(node, HELD) != HELD:
                places[node] = HELD
                self.confirmed += 1
            if block is not None and block.barred:
                block.barred.discard(node)  # it keeps copies after all (a load that failed once)

    def stats(self) -> dict[str, int]:
        return {"popular_told": self.told, "popular_confirmed": self.confirmed,
                "popular_unconfirmed": self.unconfirmed}

    def _may_take_place(self, block: _Block, now: float, copy_bound: int) -> bool:
        """Whether a place of ``block``'s is free under ``copy_bound`` (0: no bound), once the
        places whose copy was not registered in time are given back."""
        places = block.places
        if not copy_bound or places is None or len(places) < copy_bound:
            return True
        late = [node for node, deadline in places.items() if deadline < now]
        for node in late:
            self._give_back(block, places, node)
        return len(places) < copy_bound

    def _keeps_place(self, block: _Block, places: dict[str, float], reader: str, now: float) -> bool:
        """At ``reader``'s new read: whether it still holds a place of ``block``'s, unconfirmed
        and in time. A confirmed one is given back (its copy is gone), a late one too (and the
        node is barred)."""
        deadline = places.get(reader)
        if deadline is None:
            return False
        if deadline == HELD:
            del places[reader]
            return False
        if deadline < now:
            self._give_back(block, places, reader)
            return False
        return True

    def _give_back(self, block: _Block, places: dict[str, float], node: str) -> None:
        """``node``'s place, never confirmed: given back, and the node not told again."""
        del places[node]
        self.unconfirmed += 1
        barred = block.barred
        if barred is None:
            barred = block.barred = set()
        if len(barred) < MAX_BARRED:
            barred.add(node)

    def __len__(self) -> int:
        return len(self._keys)


def _popular(readers: dict[str, tuple[int, float, bool]], reader: str, now: float) -> bool:
    """Whether ``POPULAR_READERS`` nodes other than ``reader`` began a read within
    ``POPULAR_WINDOW_S``: walked from the most recent asker back, stopping at the count or at
    askers too old (a read begins at most ``SESSION_S`` before its node's last ask)."""
    wanted = POPULAR_READERS
    if wanted <= 0:
        return False
    since = now - POPULAR_WINDOW_S
    for node, (_, began, _) in reversed(readers.items()):
        if began < since - SESSION_S:
            return False
        if node != reader and began >= since:
            wanted -= 1
            if not wanted:
                return True
    return False
