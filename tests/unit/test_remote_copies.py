"""Copies of blocks read from another node (``remote_copy_reads``), through both connector halves
(vLLM's real scheduler, real bytes): kept only from a load that landed whole, saved from the
loaded blocks as the request's own, no wrong byte. Which pools are another node's is the Ray
client's to say (``RayBlockStore.remote_rows``), and a node's reads of each block its family root
owner's (``RemoteReads``): tests/e2e/test_multinode.py runs both across three raylets. Here a
client of the in-process store sees every pool on another node, and copies at the first read."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from ucm_ray.store.engine.family import ENOUGH_COPIES, mark_enough_copies
from ucm_ray.store.local import LocalBlockStore
from ucm_ray.store.placement import copy_bound
from ucm_ray.store.types import NO_HINT, Done, Locations, Pending, Publishes, ReadLease
from ucm_ray.testing.harness import make_engine, prompt
from ucm_ray.testing.timing import timed_calls
from ucm_ray.transport.base import PoolKey

BLOCKS = 16  # prompt(2048) in blocks of 128
HOT = 8


class EveryPoolElsewhere(LocalBlockStore):
    """A client of ``shared``'s shards that sees each of them on another node."""

    def __init__(self, shared: LocalBlockStore) -> None:
        super().__init__(_shared=shared)

    def remote_rows(self, locations: Locations) -> list[int]:
        return list(range(len(locations.pool)))


class HotPrefixElsewhere(EveryPoolElsewhere):
    """As ``EveryPoolElsewhere``, with the fleet's hot-prefix table listing a prompt's first
    ``HOT`` blocks; keeps the family each committed key names (what ``HintPoster`` registers it under)."""

    def __init__(self, shared: LocalBlockStore) -> None:
        super().__init__(shared)
        self.families: dict[bytes, bytes] = {}

    def hot_prefix(self, chain: Sequence[bytes]) -> int:
        return min(HOT, len(chain))

    def commit(self, publish: Publishes,
               free: Mapping[tuple[PoolKey, int], Sequence[int]] = {}) -> Pending[list[bool]]:
        self.families.update(zip(publish.keys, publish.family_keys()))
        return super().commit(publish, free)


class EnoughCopiesElsewhere(EveryPoolElsewhere):
    """As ``EveryPoolElsewhere``, with every block's root owner naming as many pools as the
    fleet's copy bound allows (``copy_nodes_per_pool``: ``FamilyAcquire`` marks them)."""

    def acquire(self, keys: Sequence[bytes], pin: Collection[PoolKey] = (),
                chain: int | None = None, recompute_bytes_s: float = 0.0) -> Pending[ReadLease]:
        lease = super().acquire(keys, pin, chain, recompute_bytes_s).result()
        lease.earlier_reads = np.full(len(keys), ENOUGH_COPIES, dtype=np.int64)
        return Done(lease)


def _reader(store: LocalBlockStore, model_dir: str):
    return make_engine(EveryPoolElsewhere(store), model_dir, extra={"remote_copy_reads": 1})


def _written(store: LocalBlockStore, model_dir: str) -> tuple[list[int], list[bytes]]:
    """A document saved by a writer (with checksums), and its block keys."""
    writer = make_engine(store.client(), model_dir, extra={"checksum": True})
    document = prompt(2048)
    writer.serve("A", document)
    writer.settle()
    return document, writer.block_keys(document)


def test_a_read_from_another_node_saves_the_loaded_blocks_again(store, model_dir):
    document, _ = _written(store, model_dir)
    reader = _reader(store, model_dir)
    reader.serve("B", document + [3] * 40)
    reader.settle()
    stats = reader.stats()
    assert stats["hit_tokens"] == 2048 and stats["copies_kept"] == BLOCKS
    # every copy was copied out of vLLM's blocks and sent to commit (here to the shard that already
    # holds its key: the in-process store has no nodes, so the commit is not visible)
    assert stats["saved_blocks"] == stats["commits_not_visible"] == BLOCKS
    assert reader.wrong_blocks == 0 and reader.failed_loads == 0


def test_copies_of_a_hot_prefixs_blocks_register_no_hint(store, model_dir):
    """A hot prefix's readers take the table's pools or their own node's and never ask its first
    block's owner, so a copy of one of its blocks tells that owner nothing (every node's copy
    was posted there: the hottest shard at 1,000 nodes, docs/scaling.md). The blocks past it are
    registered under the family root as before, and so is a writer's own save of a hot block."""
    document, keys = _written(store, model_dir)
    client = HotPrefixElsewhere(store)
    reader = make_engine(client, model_dir, extra={"remote_copy_reads": 1})
    reader.serve("B", document + [5] * 40)
    reader.settle()
    assert reader.stats()["copies_kept"] == BLOCKS
    assert [client.families.get(key) for key in keys] == [NO_HINT] * HOT + [keys[HOT]] * (BLOCKS - HOT)
    writer_client = HotPrefixElsewhere(store)
    writer = make_engine(writer_client, model_dir)
    writer.serve("C", prompt(2048, seed=77))
    writer.settle()
    fresh = writer.block_keys(prompt(2048, seed=77))
    assert [writer_client.families.get(key) for key in fresh] == [fresh[0]] * HOT + [fresh[HOT]] * (BLOCKS - HOT)


def test_a_block_enough_pools_hold_is_not_copied(store, model_dir):
    """Copies take pool room from the fleet's distinct blocks: once the root's owner names one
    pool per ``copy_nodes_per_pool`` nodes for a block, its readers keep no more copies of it,
    whatever ``remote_copy_reads`` says."""
    document, _ = _written(store, model_dir)
    reader = make_engine(EnoughCopiesElsewhere(store), model_dir, extra={"remote_copy_reads": 1})
    reader.serve("B", document + [6] * 40)
    reader.settle()
    stats = reader.stats()
    assert stats["hit_tokens"] == 2048 and stats.get("copies_kept", 0) == 0


def test_the_copy_bound_is_one_pool_per_copy_nodes_per_pool_nodes():
    """Rounded up: a fleet of up to 10 nodes (the default) copies nothing past the writer's pool,
    1,000 nodes up to 100 pools; 0 is no bound. Rows named that many pools or more are marked."""
    assert [copy_bound(nodes, 10) for nodes in (1, 3, 10, 11, 100, 1000)] == [1, 1, 1, 2, 10, 100]
    assert copy_bound(1000, 0) == 0 and copy_bound(3, 1) == 3
    earlier = np.array([0, 1, 5, 0], dtype=np.int64)
    mark_enough_copies(earlier, [0, 1, 2], [1, 2, 3], 2)
    assert earlier.tolist() == [0, ENOUGH_COPIES, ENOUGH_COPIES, 0]
    mark_enough_copies(earlier, [3], [4], 0)
    assert earlier[3] == 0


def test_a_load_that_failed_keeps_no_copy(store, model_dir):
    """One stored block is bad: it fails its checksum, vLLM recomputes from it, and none of the
    loaded blocks is copied (a failed block's neighbours may be rewritten by the recompute)."""
    document, keys = _written(store, model_dir)
    reader = _reader(store, model_dir)
    probe = store.client()
    lease = probe.acquire(keys[BLOCKS // 2:BLOCKS // 2 + 1]).result()
    bad = lease.locations[0]
    assert bad is not None
    store.pool_of(bad).tensor[bad.offset] ^= 0xFF  # a bad DIMM, a stray writer
    probe.release(lease.lease_ids).result()
    reader.serve("B", document + [4] * 40)
    reader.settle()
    stats = reader.stats()
    assert stats["checksum_mismatches"] == 1 and reader.failed_loads >= 1 and reader.wrong_blocks == 0
    assert stats.get("copies_kept", 0) == 0


def test_copies_a_resumed_request_got_back_from_vllms_cache_are_not_kept_pending(store, model_dir):
    """Copies still waiting for slots when vLLM preempted the request are no longer valid
    (``resume``); when vLLM resumes it with those blocks from its own prefix cache, nothing will
    recompute them. Kept pending, they made every later step plan the request again (no decode
    fast path, no batching of its generated blocks' saves)."""
    engine = make_engine(store.client(), model_dir, block_size=16, num_blocks=512)
    part = engine.connector.scheduler_part
    request = engine.add("R", prompt(200, seed=40), max_tokens=80)
    while not request.num_output_tokens:
        engine.step()
    for _ in range(4):
        engine.step()  # the prompt's saves planned
    tracked = part._requests.get("R")
    tracked.keep_copies(0, 0, [0, 1])  # copies waiting for slots ...
    tracked.resume(tracked.block_ids)  # ... when it was preempted and resumed with the same blocks
    with timed_calls([(part.saves, ("_plan_saves",), "scheduler")]) as timed:
        for _ in range(64):
            engine.step()
    assert not tracked.pending
    assert len(timed["scheduler._plan_saves"]) <= 2 * 64 // 16 + 2
    engine.run(request)
    assert engine.wrong_blocks == 0
