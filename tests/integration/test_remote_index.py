"""A shard's published index read from another process over real NIXL/UCX
(``RemoteIndexReader``), against the same table mapped locally (``IndexReader``).

The actor plays the shard: a published index in /dev/shm, exported with a pool by
``NixlPoolExporter``. The test process reads it one-sidedly, as a reader on another node does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np
import pytest

from tests.support.nixl_index_actor import INCARNATION, index_actor_class
from tests.support.small_ray import own_or_session_ray
from ucm_ray.store.engine.published_reader import IndexReader
from ucm_ray.store.engine.remote_index import WINDOW, RemoteIndexReader

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ucm_ray.transport.nixl as nixl  # noqa: E402  (a dependency: missing NIXL fails, never skips)


def key(i: int) -> bytes:
    return hashlib.blake2b(f"remote-{i}".encode(), digest_size=16).digest()


def same_home(i: int, home: bytes = b"\x07" * 8) -> bytes:
    """Keys whose first word (their home bucket) is the same: one probe chain."""
    return home + hashlib.blake2b(f"chain-{i}".encode(), digest_size=8).digest()


@pytest.fixture(scope="module")
def cluster():
    with own_or_session_ray() as ray:
        yield ray


@pytest.fixture(scope="module")
def shard(cluster):
    import uuid

    ray = cluster
    actor = index_actor_class().remote(f"/dev/shm/ucmr-idxtest-{uuid.uuid4().hex[:8]}")
    desc = ray.get(actor.descriptor.remote(), timeout=120)
    yield actor, desc
    try:
        ray.get(actor.close.remote(), timeout=60)
    finally:
        ray.kill(actor)


@pytest.fixture(scope="module")
def readers(shard):
    _, desc = shard
    remote = RemoteIndexReader(desc)
    local = IndexReader(desc.index_path, INCARNATION)
    yield remote, local
    remote.close()
    local.close()
    nixl.shutdown_client_agent()


def test_a_remote_lookup_answers_as_the_mapped_table_does(cluster, shard, readers):
    actor, _ = shard
    remote, local = readers
    keys = [key(i) for i in range(600)]
    cluster.get(actor.publish.remote(keys[:500], [4096 * i for i in range(500)]))
    cluster.get(actor.unpublish.remote(keys[100:150]))
    far, near = remote.lookup(keys), local.lookup(keys)
    assert far is not None and near is not None and near.known.all()
    assert far.known.all()
    for field in ("generation", "offset", "size", "checksum"):
        assert (getattr(far, field)[far.known] == getattr(near, field)[far.known]).all(), field
    assert (far.generation[:100][far.known[:100]] > 0).all() and (far.generation[100:150] == 0).all()


def test_a_chain_longer_than_the_window_is_unknown_not_a_miss(cluster, shard, readers):
    actor, _ = shard
    remote, local = readers
    chain = [same_home(i) for i in range(WINDOW + 2)]
    cluster.get(actor.publish.remote(chain, [4096 * (1000 + i) for i in range(len(chain))]))
    found, mapped = remote.lookup(chain), local.lookup(chain)
    assert found is not None and mapped is not None and mapped.known.all() and (mapped.generation > 0).all()
    # the chain's head is within its window (other keys may sit in it too), its tail is not: the
    # tail is unknown, and the lookup asks the shard for it instead of taking a miss
    known = found.known.tolist()
    assert known[0] and not known[-1] and known == sorted(known, reverse=True)
    assert (found.generation[found.known] == mapped.generation[found.known]).all()


def test_a_chain_that_runs_past_the_tables_end_is_read_from_its_start(cluster, shard, readers):
    """Keys whose home is the last bucket: the table's first buckets hold the rest of their chain,
    and the window read goes on there (before, such keys were unknown and their lookup paid a pin
    call on the shard: the multinode test's flake, docs/performance-log.md, stop 66)."""
    actor, _ = shard
    remote, local = readers
    last = (remote.buckets - 1).to_bytes(8, "little")
    chain = [same_home(100 + i, last) for i in range(3)]  # buckets: the last, then 0 and 1
    cluster.get(actor.publish.remote(chain, [4096 * (4000 + i) for i in range(len(chain))]))
    found, mapped = remote.lookup(chain), local.lookup(chain)
    assert found is not None and mapped is not None and mapped.known.all() and (mapped.generation > 0).all()
    assert found.known.all()
    for field in ("generation", "offset", "size"):
        assert (getattr(found, field) == getattr(mapped, field)).all(), field
    assert remote.validate(chain, found.generation, found.offset, found.size).all()
    absent = same_home(200, last)  # its chain ends at the first empty bucket past the start
    miss = remote.lookup([absent])
    assert miss is not None and miss.known.all() and miss.generation[0] == 0


def test_a_copy_validates_only_while_its_entry_is_listed_as_it_was_read(cluster, shard, readers):
    actor, _ = shard
    remote, _ = readers
    keys = [key(1000 + i) for i in range(4)]
    cluster.get(actor.publish.remote(keys, [4096 * (2000 + i) for i in range(4)]))
    found = remote.lookup(keys)
    assert found is not None and found.known.all()
    assert remote.validate(keys, found.generation, found.offset, found.size).all()
    # key 0 evicted, key 1 listed again elsewhere (another generation), key 2 read at a wrong offset
    cluster.get(actor.unpublish.remote(keys[:2]))
    cluster.get(actor.publish.remote(keys[1:2], [4096 * 3000]))
    offsets = found.offset.copy()
    offsets[2] += 64
    assert remote.validate(keys, found.generation, offsets, found.size).tolist() == [False, False, False, True]


def test_another_incarnations_table_is_not_read(shard, readers):
    _, desc = shard
    other = RemoteIndexReader(dataclasses.replace(desc, incarnation=INCARNATION + 1))
    try:
        assert other.lookup([key(0)]) is None
        assert not other.validate([key(0)], np.array([1], dtype=np.uint64), np.array([0]), np.array([4096])).any()
    finally:
        other.close()
