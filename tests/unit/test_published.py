"""The shard's published index: what same-node readers look up without a Ray call.

A reader must never take one key's entry for another's, nor an entry that was torn
mid-update, and a copy it validates must be from an entry that stayed listed.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from ucm_ray.store.engine.published_reader import IndexReader, IndexReaders
from ucm_ray.store.published_layout import index_path, table_buckets
from ucm_ray.store.shard.index import BlockIndex
from ucm_ray.store.shard.published_writer import PublishedIndex
from ucm_ray.transport.base import PoolDescriptor

INCARNATION = 0x5EED
OWNER = 7


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


@pytest.fixture
def path():
    p = f"/dev/shm/ucmray-test-published-{uuid.uuid4().hex[:8]}"
    yield p
    for leftover in (p, index_path(p)):  # a test that failed before closing its table
        if os.path.exists(leftover):
            os.unlink(leftover)


def test_entries_are_found_by_key_and_unlisted_ones_are_misses(path):
    table = PublishedIndex(path, 64 << 20, INCARNATION)
    reader = IndexReader(path, INCARNATION)
    gens = [table.publish(key(i), offset=4096 * i, size=4096, checksum=i if i % 2 else None) for i in range(100)]
    assert sorted(set(gens)) == gens and gens[0] > 0  # one fresh generation per entry
    table.unpublish(key(3))
    found = reader.lookup([key(i) for i in range(105)])
    assert found is not None and found.known.all()
    assert found.generation[3] == 0 and (found.generation[100:] == 0).all()
    listed = [i for i in range(100) if i != 3]
    assert found.offset[listed].tolist() == [4096 * i for i in listed]
    assert found.checksum[1] == 1 and found.checksum[2] == -1
    assert reader.validate([key(5), key(3)], np.array([gens[5], gens[3]]), np.array([4096 * 5, 4096 * 3]),
                           np.array([4096, 4096])).tolist() == [True, False]
    # the same key listed again is another entry: a copy of the old one does not validate
    table.unpublish(key(5))
    table.publish(key(5), 0, 4096, None)
    assert reader.validate([key(5)], np.array([gens[5]]), np.array([0]), np.array([4096])).tolist() == [False]
    reader.close()
    table.close()
    assert not os.path.exists(path)


def test_a_reader_of_another_incarnation_is_refused(path):
    table = PublishedIndex(path, 1 << 20, INCARNATION)
    with pytest.raises(ValueError, match="not the index of incarnation"):
        IndexReader(path, INCARNATION + 1)
    table.close()


def test_tombstones_are_dropped_by_rebuilds_without_losing_entries(path):
    table = PublishedIndex(path, 1 << 20, INCARNATION)  # the smallest table: 1024 buckets
    reader = IndexReader(path, INCARNATION)
    assert table.buckets == 1024
    live: dict[int, int] = {}
    for i in range(5000):  # churn: far more inserts than buckets, 300 live at most
        live[i] = table.publish(key(i), i, 64, None)
        if len(live) > 300:
            oldest = min(live)
            table.unpublish(key(oldest))
            del live[oldest]
    found = reader.lookup([key(i) for i in range(5000)])
    assert found is not None
    assert np.flatnonzero(found.generation).tolist() == sorted(live)
    assert found.generation[sorted(live)].tolist() == [live[i] for i in sorted(live)]
    table.close()


def test_a_rebuild_keeps_chains_that_wrap_past_the_last_bucket(path):
    """Keys whose home is the last bucket spill over to the first ones; a rebuild (tombstones
    dropped, entries placed again as arrays) must keep every one of them reachable."""
    table = PublishedIndex(path, 1 << 20, INCARNATION)
    reader = IndexReader(path, INCARNATION)
    last = table.buckets - 1
    homed = [(last + table.buckets * i).to_bytes(8, "little") + bytes([i]) * 8 for i in range(1, 11)]
    homed += [(table.buckets * i).to_bytes(8, "little") + bytes([i]) * 8 for i in range(1, 6)]  # home 0
    gens = {k: table.publish(k, 64 * n, 64, None) for n, k in enumerate(homed)}
    for i in range(5000):  # tombstones pile up past three quarters of the table: rebuilt
        table.publish(key(i), 0, 64, None)
        if i >= 300:
            table.unpublish(key(i - 300))
    assert int(reader._header["epoch"][0]) >= 2, "no rebuild happened"
    found = reader.lookup(homed)
    assert found is not None and found.known.all()
    assert found.generation.tolist() == [gens[k] for k in homed]
    assert found.offset.tolist() == [64 * n for n in range(len(homed))]
    table.close()


def test_keys_that_are_not_digests_are_never_listed(path):
    table = PublishedIndex(path, 1 << 20, INCARNATION)
    assert table.publish(b"a key of another length", 0, 64, None) == 0
    desc = PoolDescriptor("s0", "node-a", 1 << 20, None, None, None, 0, INCARNATION, index_path=path)
    readers = IndexReaders("node-a")
    readers.sync({desc.key: desc})
    assert readers.locate(desc.key, [b"a key of another length"]) is None  # asked of the shard
    table.close()


def test_a_full_table_says_so_and_misses_of_what_did_not_fit_are_not_answers(path):
    table = PublishedIndex(path, 1 << 20, INCARNATION)
    index = BlockIndex(1 << 20, lease_s=60, reserve_timeout_s=60, published=table)
    reader = IndexReader(path, INCARNATION)
    buckets = table_buckets(1 << 20)
    n = buckets // 2 + 100  # more entries than the table takes (64 B each fit the pool)
    token, offsets = index.reserve(OWNER, 64, n + 1)
    assert len(offsets) == n + 1
    other = (b"a key of another length", offsets[n], None)  # never listed: must not hold up a refill
    index.commit(OWNER, token, [(key(i), off, None) for i, off in enumerate(offsets[:n])] + [other])
    found = reader.lookup([key(i) for i in range(n)] + [key(10**6)])
    assert found is not None
    assert (found.generation[: buckets // 2] > 0).all() and (found.generation[buckets // 2: n] == 0).all()
    assert not found.known[buckets // 2: n].any() and not found.known[-1]  # ask the shard
    # Removing entries makes room: what did not fit is published, and misses are answers again.
    index.remove([(key(i), offsets[i]) for i in range(300)])
    found = reader.lookup([key(i) for i in range(n)] + [key(10**6)])
    assert found is not None and found.known.all()
    assert (found.generation[300:n] > 0).all() and (found.generation[:300] == 0).all()
    table.close()


def test_eviction_unlists_an_entry_before_its_slot_is_handed_out(path):
    pool = 64 * 8
    table = PublishedIndex(path, pool, INCARNATION)
    index = BlockIndex(pool, lease_s=60, reserve_timeout_s=60, published=table)
    reader = IndexReader(path, INCARNATION)
    token, offsets = index.reserve(OWNER, 64, 8)
    index.commit(OWNER, token, [(key(i), off, None) for i, off in enumerate(offsets)])
    keys = [key(i) for i in range(8)]
    found = reader.lookup(keys)
    assert found is not None and (found.generation > 0).all()
    _, reused = index.reserve(OWNER, 64, 1)  # evicts the least recently used entry
    assert len(reused) == 1
    evicted = found.offset.tolist().index(reused[0])
    valid = reader.validate(keys, found.generation, found.offset, found.size).tolist()
    assert valid == [i != evicted for i in range(8)]  # unlisted already: a copy of it would not count
    table.close()


def test_a_bucket_left_mid_update_is_not_an_answer(path):
    """A shard paused or killed while it rewrote a bucket leaves its seqlock odd: the key is
    neither a hit nor a miss for readers (they ask the shard), whatever they read there."""
    table = PublishedIndex(path, 1 << 20, INCARNATION)
    table.publish(key(1), 64, 64, None)
    table._table["seq"][table._where[key(1)]] += 1  # odd: the writer stopped mid-update
    found = IndexReader(path, INCARNATION).lookup([key(1)])
    assert found is not None and found.generation[0] == 0 and not found.known[0]
    table.close()


def test_readers_map_only_indexes_of_their_own_node(path):
    table = PublishedIndex(path, 1 << 20, INCARNATION)
    table.publish(key(1), 128, 64, None)
    desc = PoolDescriptor("s0", "node-a", 1 << 20, None, None, None, 0, INCARNATION, index_path=path)
    here, elsewhere = IndexReaders("node-a"), IndexReaders("node-b")
    for readers in (here, elsewhere):
        readers.sync({desc.key: desc})
    assert elsewhere.locate(desc.key, [key(1)]) is None  # it would look up through Ray
    found = here.locate(desc.key, [key(1), key(2)])
    assert found is not None
    assert found.offset[0] == 128 and found.generation[0] > 0
    assert found.generation[1] == 0 and found.known.all()
    here.sync({})  # a pool that left the membership: its mapping is closed
    assert here.locate(desc.key, [key(1)]) is None
    table.close()


def mapped_kib(path: str) -> tuple[int, int] | None:
    """(size, resident) in KiB of this process's read-only mapping of ``path`` (a reader's; the
    writer's is read-write); None when it maps none."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for at, line in enumerate(lines):
        if line.endswith(" " + path) and line.split()[1] == "r--s":
            fields = dict(entry.split(":", 1) for entry in lines[at + 1: at + 8] if ":" in entry)
            return int(fields["Size"].split()[0]), int(fields["Rss"].split()[0])
    return None


def wait_for_mapping(path: str, present: bool) -> tuple[int, int] | None:
    deadline = time.monotonic() + 10
    while (mapped_kib(path) is not None) != present and time.monotonic() < deadline:
        time.sleep(0.01)
    return mapped_kib(path)


def test_an_index_is_mapped_whole_before_its_first_lookup(path):
    """A fresh engine's first lookups took a page fault per bucket they probed (1,024 keys:
    3-3.5 ms against 0.6 ms once mapped): readers map a new pool's index whole as soon as they
    learn of it, on a thread of their own; a pool that leaves meanwhile has it unmapped."""
    table = PublishedIndex(path, 64 << 20, INCARNATION)
    table.publish(key(1), 128, 64, None)
    desc = PoolDescriptor("s0", "node-a", 64 << 20, None, None, None, 0, INCARNATION, index_path=path)
    readers = IndexReaders("node-a")
    readers.sync({desc.key: desc})
    mapped = wait_for_mapping(path, present=True)  # no lookup yet
    assert mapped is not None, "the index was not mapped ahead of its first lookup"
    size, resident = mapped
    assert size >= (table_buckets(64 << 20) * 64) >> 10 and resident == size, mapped
    found = readers.locate(desc.key, [key(1)])
    assert found is not None and found.offset[0] == 128
    readers.sync({})
    assert wait_for_mapping(path, present=False) is None
    readers.sync({desc.key: desc})
    readers.sync({})  # left while its mapping may still be being made: unmapped once made
    assert wait_for_mapping(path, present=False) is None
    table.close()


def test_a_process_forked_while_an_index_is_being_mapped_looks_it_up_at_once(path):
    """The child of a fork inherits the mapping in progress but not its thread (and a large
    index takes seconds to map whole): its lookup maps the index as usual instead of waiting."""
    table = PublishedIndex(path, 2 << 30, INCARNATION)  # a 16 MiB index: tens of ms to map whole
    table.publish(key(1), 128, 64, None)
    desc = PoolDescriptor("s0", "node-a", 2 << 30, None, None, None, 0, INCARNATION, index_path=path)
    readers = IndexReaders("node-a")
    readers.sync({desc.key: desc})
    child = os.fork()
    if child == 0:  # pragma: no cover -- the child reports through its exit status
        signal.alarm(10)
        found = readers.locate(desc.key, [key(1)])
        os._exit(0 if found is not None and found.offset[0] == 128 else 3)
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child's lookup hung or failed: {status}"
    found = readers.locate(desc.key, [key(1)])
    assert found is not None and found.offset[0] == 128
    readers.close()
    assert wait_for_mapping(path, present=False) is None
    table.close()


WRITER = textwrap.dedent("""
    import hashlib, sys
    from ucm_ray.store.shard.published_writer import PublishedIndex

    def key(i):
        return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()

    table = PublishedIndex(sys.argv[1], 1 << 20, 0x5EED)
    print("ready", flush=True)
    live = []
    for round in range(60000):
        i = round % 700
        if len(live) >= 400:
            table.unpublish(key(live.pop(0)))
        generation = table.publish(key(i), i * 1000003, 0, None) if i not in live else 0
        if generation:
            # offset and size name the key and the generation: a torn or misread bucket shows
            table.unpublish(key(i))
            generation = table.publish(key(i), i * 1000003, generation, None)
            live.append(i)
    sys.stdin.read()
    table.close()
""")


def test_a_reader_in_another_process_never_sees_a_torn_or_foreign_entry(path):
    """The shard writes in one process while a reader looks up in another: every entry found
    is exactly what was published for that key (offset names the key; size, once relisted, the
    generation of its first listing)."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, index_path(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        reader = IndexReader(index_path(path), INCARNATION)
        keys = [key(i) for i in range(700)]
        seen = lookups = 0
        while writer.poll() is None and lookups < 3000:
            found = reader.lookup(keys)
            lookups += 1
            if found is None:
                continue
            hit = np.flatnonzero(found.generation)
            seen += len(hit)
            assert (found.offset[hit] == hit * 1000003).all()
            sizes = found.size[hit]  # 0 while first listed, then the generation it had then
            assert ((sizes == 0) | (sizes + 1 == found.generation[hit].astype(np.int64))).all()
        assert seen > 0
    finally:
        writer.stdin.close()  # type: ignore[union-attr]
        writer.wait(timeout=60)


def test_one_key_probe_answers_as_the_lookup_does(path):
    """``generation_of`` (a cold prompt's first-block probe, without arrays) gives what
    ``lookup`` gives for the same key: listed, unlisted (behind tombstones too), not an answer
    when the table is full or a bucket is mid-update."""
    table = PublishedIndex(path, 1 << 20, INCARNATION)
    index = BlockIndex(1 << 20, lease_s=60, reserve_timeout_s=60, published=table)
    reader = IndexReader(path, INCARNATION)
    buckets = table_buckets(1 << 20)
    n = buckets // 2 + 50  # past what the table takes: the last ones are not listed, misses no answers

    def agree(keys: list[bytes]) -> list[int | None]:
        found = reader.lookup(keys)
        assert found is not None
        expected = [int(g) if known else None for g, known in zip(found.generation, found.known)]
        assert [reader.generation_of(k) for k in keys] == expected
        return expected

    token, offsets = index.reserve(OWNER, 64, n)
    index.commit(OWNER, token, [(key(i), off, None) for i, off in enumerate(offsets)])
    full = agree([key(i) for i in range(n + 200)])
    assert None in full and all(g for g in full[: buckets // 2])
    index.remove([(key(i), offsets[i]) for i in range(0, n, 3)])  # tombstones, then room again
    again = agree([key(i) for i in range(n + 200)])
    assert 0 in again and None not in again
    table._table["seq"][table._where[key(1)]] += 1  # the writer stopped mid-update
    assert reader.generation_of(key(1)) is None and agree([key(1)]) == [None]
    with pytest.raises(ValueError, match="16 bytes"):
        reader.generation_of(b"short")
    reader.close()
    table.close()
