"""The pools' load figure end to end on real shards (``store.pool_load``, ``pick_by_load``): an
engine's reads concentrated on one pool, reported with its long poll to its node's relay, reach the
directory with the relay's poll; the directory's push of the figure reaches another engine through
the same relay; that engine's reader of a hot prefix then starts at a less loaded pool of the
prefix's row, where before the figure every lookup of its node started at the same one (the pool a
hash of the node picks)."""

from __future__ import annotations

import time

import ray
import torch

from tests.support.store_helpers import key
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.engine.family import spread
from ucm_ray.store.engine.feed import MembershipFeed
from ucm_ray.store.hot_prefixes import COPIES_PUSH_S
from ucm_ray.store.pool_load import DECAY_S, PoolReads
from ucm_ray.store.types import DIRECTORY_NAME, Location, Publishes
from ucm_ray.transport.base import CopyOp, Ranges

HOT = 6
"""Blocks of the hot prefix, stored in each of the three pools its row names."""
LOOKUPS = 24
READ_BYTES = 64 << 20
"""What the reporting engine read from the busy pool."""


def directory(cfg):
    return ray.get_actor(DIRECTORY_NAME, namespace=cfg.ray_namespace)


def write_everywhere(client: StoreClient, pools: list, keys: list[bytes]) -> None:
    """``keys`` stored in each of ``pools`` (as readers' copies of a hot prefix are)."""
    size = 4096
    data = torch.arange(len(keys) * size, dtype=torch.int64).to(torch.uint8)
    client.register_local(data)
    for pool in pools:
        grant = client.reserve(pool, size, len(keys)).result()
        assert grant is not None
        ops = [CopyOp(offset, data[i * size:(i + 1) * size]) for i, offset in enumerate(grant.offsets)]
        assert client.connections.transfer({pool: Ranges.of(ops)}, write=True, timeout_s=10).pools == set()
        rows = [(k, Location(pool[0], pool[1], offset, size), grant.token) for k, offset in zip(keys, grant.offsets)]
        assert client.commit(Publishes.of(rows)).result() == [True] * len(keys)


def first_pools(reader: StoreClient, keys: list[bytes]) -> list:
    """The pool each lookup of ``keys`` read its first block from (all found)."""
    firsts = []
    for _ in range(LOOKUPS):
        lease = reader.acquire(keys).result()
        locations = lease.locations
        assert (locations.pool >= 0).all()
        firsts.append(locations.pools[int(locations.pool[0])])
        assert len({locations.pools[int(p)] for p in locations.pool}) == 1  # a lookup reads one pool
        reader.release(lease.lease_ids).result()
    return firsts


def test_reads_on_one_pool_reach_another_engine_through_the_relay_and_its_hot_reader_starts_elsewhere(fleet):
    cfg = fleet(num_shards=4, transport="shm")
    node = ray.get_runtime_context().get_node_id()
    writer = StoreClient(cfg)
    shards = writer.membership.shards
    row = [s.key for s in shards[:3]]  # the hot row's pools; the fourth stands for the reader's node
    keys = [key(i, "hot") for i in range(HOT)]
    write_everywhere(writer, row, keys)
    ray.get(directory(cfg).add_hot_prefix.remote({k: tuple(row) for k in keys}), timeout=30)

    reader = StoreClient(cfg)
    deadline = time.monotonic() + 30
    while reader.membership.hot.leading(keys) != HOT:
        assert time.monotonic() < deadline, "the hot table never reached the reader"
        reader.refresh()
        time.sleep(0.05)
    # one node here: the reader's node is made the fourth pool's, the row's three pools other nodes'
    reader._local = [s.key == shards[3].key for s in shards]
    reader._families = True
    busy = spread(row, node)[0]  # where this node's lookups start without a figure
    assert first_pools(reader, keys) == [busy] * LOOKUPS
    assert not reader.membership.pool_load.at

    # another engine on this node read a lot from that pool: its next long poll (to the relay) says so
    reads = PoolReads()
    reporter = MembershipFeed(cfg.ray_namespace, 20.0, relay_node=node, reads=reads)
    held = reporter.fetch()
    assert held is not None
    reads.add({busy: READ_BYTES})
    assert reporter.poll(held) is None  # posted, with the reads
    time.sleep(0.5)
    relay = ray.get_actor(shards[0].shard_id, namespace=cfg.ray_namespace)
    relayed_before = ray.get(relay.stats.remote(), timeout=30)["relayed_polls"]
    # any push answers the relay's own poll; its next one carries the node's reads to the directory
    ray.get(directory(cfg).add_hot_prefix.remote({b"other-hot": (row[0],)}), timeout=30)
    deadline = time.monotonic() + 20
    while not reader.membership.pool_load.at:
        assert time.monotonic() < deadline, "the load figure never reached the reader"
        reader.refresh()
        got = reporter.poll(held)
        held = got if got is not None else held
        time.sleep(0.05)
    membership = reader.membership
    figures = membership.pool_load.by_pool(membership.shards)
    assert list(figures) == [busy]  # only the pool read from has a figure
    assert 0.5 * READ_BYTES / DECAY_S < figures[busy] <= READ_BYTES / DECAY_S
    assert ray.get(relay.stats.remote(), timeout=30)["relayed_polls"] > relayed_before  # through the relay
    assert reader._feed.relayed > 0

    firsts = first_pools(reader, keys)
    assert busy not in firsts  # the less loaded of every pair drawn
    assert set(firsts) == set(row) - {busy}  # both others share the lookups
    for client in (reader, writer):
        client.close()


def test_reads_reported_with_every_poll_push_the_figure_at_most_once_a_copies_push_period(fleet):
    """An engine that polls the directory itself (no relay) and reports reads that move the figure
    with every poll: each report asks for a push, and the pushes come at the pacer's pace (one a
    ``COPIES_PUSH_S``, shared with the readers' copies), not once a poll; a report that moves no
    pool by ``CHANGE_SHARE`` asks for none."""
    cfg = fleet(num_shards=2, transport="shm")
    pools = [s.key for s in ray.get(directory(cfg).membership.remote(), timeout=30).shards]
    reads = PoolReads()
    engine = MembershipFeed(cfg.ray_namespace, 20.0, reads=reads)
    held = engine.fetch()
    assert held is not None
    start, versions, read = time.monotonic(), [held.version], READ_BYTES
    reads.add({pools[0]: read})  # the first poll reports: nothing else would push (a quiet fleet)
    while time.monotonic() - start < 4.0:
        got = engine.poll(held)
        if got is not None:
            held = got
            versions.append(got.version)
            read *= 2  # each report doubles what was read: every one moves the figure
            reads.add({pools[len(versions) % 2]: read})
        time.sleep(0.01)
    seconds = time.monotonic() - start
    assert len(versions) - 1 <= seconds / COPIES_PUSH_S + 2, (versions, seconds)  # paced, not one a poll
    assert len(versions) - 1 >= 2  # ... and pushed
    settle = time.monotonic() + 3 * COPIES_PUSH_S  # the push the last report asked for
    while time.monotonic() < settle and (got := engine.poll(held)) is None:
        time.sleep(0.01)
    held = got or held
    assert held.pool_load.at  # the figure rides on them
    # reads that keep every pool's share move nothing: no push for them
    figures = held.pool_load.by_pool(held.shards)
    reads.add({pool: int(figure * 0.01) for pool, figure in figures.items()})
    engine.poll(held)
    quiet = time.monotonic() + 3 * COPIES_PUSH_S
    while time.monotonic() < quiet:
        got = engine.poll(held)
        assert got is None or got.version == held.version, "a push for reads that moved nothing"
        time.sleep(0.05)
