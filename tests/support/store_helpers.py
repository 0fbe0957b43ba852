"""Deterministic block contents and a client that runs in another process (a Ray actor)."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import numpy as np
import ray
import torch

from ucm_ray.store.shard.fleet import shard_name, start_fleet
from ucm_ray.store.types import DIRECTORY_NAME, Location, Publishes, Removal
from ucm_ray.transport.base import CopyOp, Ranges

SIZES = (4096, 12288, 65536, 1000, 131072, 777)


def key(i: int, tag: str = "k") -> bytes:
    return hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest()


def prompt_keys(segments: list[tuple[str, int]]) -> list[bytes]:
    """A prompt's keys made of segments (tag, blocks), positions counted over the whole prompt:
    prompts that start with the same segments share those keys, as chained block hashes do."""
    keys: list[bytes] = []
    for tag, blocks in segments:
        keys.extend(key(i, tag) for i in range(len(keys), len(keys) + blocks))
    return keys


def block(i: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    return torch.randint(0, 256, (SIZES[i % len(SIZES)],), dtype=torch.uint8, generator=g)


def read_back(client, n: int, tag: str = "k") -> tuple[list[bool], list[torch.Tensor]]:
    """``client.get`` of blocks 0..n-1 of ``tag`` into a fresh, zeroed, registered buffer."""
    sizes = [SIZES[i % len(SIZES)] for i in range(n)]
    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    client.register_local(buf)
    views, off = [], 0
    for s in sizes:
        views.append(buf[off: off + s])
        off += s
    ok = client.get([key(i, tag) for i in range(n)], views)
    return ok, views


def written_slots(client, count: int, size: int):
    """``count`` slots of ``size`` bytes reserved in the pool that owns ``key(0)`` and written (not
    committed): (pool, grant), for a test that commits them one at a time."""
    data = torch.arange(count * size, dtype=torch.int64).to(torch.uint8)
    client.register_local(data)
    (pool,) = client.owners([key(0)])[0]
    grant = client.reserve(pool, size, count).result()
    assert grant is not None and len(grant.offsets) == count
    ops = [CopyOp(offset, data[i * size:(i + 1) * size]) for i, offset in enumerate(grant.offsets)]
    assert client.connections.transfer({pool: Ranges.of(ops)}, write=True, timeout_s=10).pools == set()
    return pool, grant


def lookups_missing_own_commits(client, pool, grant, size: int, before=None) -> int:
    """Commit each of ``written_slots``' slots as ``key(i, "fresh")`` and look it up (pinned) right
    after, as a prompt's saves then its next lookup: how many lookups missed their own commit.
    ``before()``: called ahead of each commit (a call it queues first), its result waited for after."""
    missed = 0
    for i, offset in enumerate(grant.offsets):
        queued = before() if before is not None else None
        committed = client.commit(Publishes.of([(key(i, "fresh"), Location(pool[0], pool[1], offset, size),
                                                 grant.token)]))
        lease = client.acquire([key(i, "fresh")], pin=[pool]).result()
        missed += lease.locations[0] is None
        client.release(lease.lease_ids).result()
        assert committed.result() == [True]
        if queued is not None:
            queued.result(timeout=30).answer.result(timeout=30)
    return missed


def arena(n: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One registered buffer holding blocks 0..n-1 back to back, plus views of each."""
    sizes = [SIZES[i % len(SIZES)] for i in range(n)]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    views, off = [], 0
    for i, s in enumerate(sizes):
        views.append(buf[off: off + s])
        views[-1].copy_(block(i, seed))
        off += s
    return buf, views


@ray.remote(num_cpus=0)
class ClientProcess:
    """A StoreClient living in its own worker process."""

    def __init__(self, config: dict) -> None:
        from ucm_ray.config import UcmRayConfig
        from ucm_ray.store.engine.client import StoreClient

        self.client = StoreClient(UcmRayConfig.from_dict(config))

    def write(self, n: int, seed: int = 0, tag: str = "k") -> list[bool]:
        return self.write_keys([key(i, tag) for i in range(n)], seed)

    def write_keys(self, keys: list[bytes], seed: int = 0) -> list[bool]:
        buf, views = arena(len(keys), seed)
        self.client.register_local(buf)
        return self.client.put(keys, views)

    def copy_keys(self, keys: list[bytes], seed: int = 0) -> int:
        """Keep a copy of these blocks (a hot prefix's, stored elsewhere) in this node's pool as a
        reader's connector does (``remote_copy_reads``): written whatever other pools hold them,
        and committed with no family (``NO_HINT``), so the directory is told, not a root's owner.
        How many became visible."""
        from dataclasses import replace

        from ucm_ray.store.types import NO_HINT, Location, Publishes
        from ucm_ray.transport.base import CopyOp, Ranges, as_bytes

        client = self.client
        buf, tensors = arena(len(keys), seed)
        client.register_local(buf)
        views = [as_bytes(t) for t in tensors]
        placed = client._reserve(keys, views, list(range(len(keys))))
        ops: dict = {}
        for i, pool, _, off in placed:
            ops.setdefault(pool, []).append(CopyOp(off, views[i]))
        failed = client.connections.transfer({pool: Ranges.of(batch) for pool, batch in ops.items()}, write=True,
                                             timeout_s=client.config.transfer_timeout_s).pools
        rows = [(keys[i], Location(pool[0], pool[1], off, views[i].numel(), None), token)
                for i, pool, token, off in placed if pool not in failed]
        publish = replace(Publishes.of(rows), families=[NO_HINT] * len(rows))
        return sum(client.commit(publish).result())

    def hot_pools(self, keys: list[bytes], want: int) -> dict:
        """Per key, the pools this client's hot-prefix table names for it, once each names
        ``want`` (or after 20 s), the table as the membership's long poll brought it (no forced
        fetch); and how many of the long poll's answers carried the table as a delta."""
        deadline = time.monotonic() + 20
        table = self.client.membership.hot
        while time.monotonic() < deadline and not all(len(table.pools.get(k, ())) >= want for k in keys):
            self.client.refresh()
            time.sleep(0.05)
            table = self.client.membership.hot
        return {"pools": [len(table.pools.get(k, ())) for k in keys], "revision": table.revision,
                "deltas": self.client._feed.hot_deltas}

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def read(self, n: int, seed: int = 0, tag: str = "k", *, diverge_at: int | None = None,
             gone: str | None = None) -> dict:
        """Look up and read blocks 0..n-1 of ``tag`` (from ``diverge_at`` on, keys of another tag:
        a prompt that leaves a stored one mid-way), once the membership lacks shard ``gone``;
        how many were found, how many came back exact, the shard calls the lookup took."""
        deadline = time.monotonic() + 30
        while gone is not None and gone in self.client.membership.shard_ids and time.monotonic() < deadline:
            self.client.refresh(force=True)
            time.sleep(0.1)
        return self.read_keys([key(i, tag if diverge_at is None or i < diverge_at else tag + "-other")
                               for i in range(n)], seed)

    def read_keys(self, keys: list[bytes], seed: int = 0) -> dict:
        """As ``read``, of these keys (block ``i`` of ``seed`` expected at position ``i``)."""
        n = len(keys)
        lease = self.client.acquire(keys).result()
        self.client.release(lease.lease_ids).result()
        sizes = [SIZES[i % len(SIZES)] for i in range(n)]
        buf = torch.zeros(sum(sizes), dtype=torch.uint8)
        self.client.register_local(buf)
        views = list(torch.split(buf, sizes))
        ok = self.client.get(keys, views)
        exact = sum(1 for i, (hit, view) in enumerate(zip(ok, views)) if hit and torch.equal(view, block(i, seed)))
        return {"found": int(lease.locations.found().sum()), "got": sum(ok), "exact": exact, "calls": lease.calls}

    def validation_after_removal(self, n: int, tag: str = "k") -> dict:
        """Look blocks 0..n-1 of ``tag`` up unpinned (from published indexes), check the copies
        would validate, remove the entries at their shard, check again: what a reader whose
        entry was evicted mid-copy sees."""
        keys = [key(i, tag) for i in range(n)]
        lease = self.client.acquire(keys).result()
        locations = lease.locations
        unpinned = np.flatnonzero(locations.generation.astype(bool))
        readers = self.client.access.readers
        before, unreadable = readers.stale(locations, keys, unpinned)
        removed = self.client.remove([Removal(keys[i], locations[i]) for i in unpinned.tolist()]).result()
        after, _ = readers.stale(locations, keys, unpinned)
        self.client.release(lease.lease_ids).result()
        return {"unpinned": len(unpinned), "calls": lease.calls, "stale_before": int(before.sum()),
                "removed": removed, "stale_after": int(after.sum()), "unreadable": len(unreadable)}

    def copy_marks(self, keys: list[bytes]) -> list[int] | None:
        """One lookup (pinned, then released): per key, this node's reads of it before as the
        lookup reports them (``ReadLease.earlier_reads``: ``ENOUGH_COPIES`` where the pools
        named for it already reach the fleet's copy bound); None where nobody was asked."""
        lease = self.client.acquire(keys).result()
        self.client.release(lease.lease_ids).result()
        return None if lease.earlier_reads is None else lease.earlier_reads.tolist()

    def read_and_keep(self, keys: list[bytes], seed: int = 0) -> dict:
        """A reader's connector on this node: one lookup (pinned, then released) telling this
        node's reads of each key before (``ReadLease.earlier_reads``) and the node of the pool
        each was found in, then the bytes (how many exact); where the root's owner counted a
        key as popular (``POPULAR``), a copy of it kept in this node's pool, committed under the
        keys' family as the connector's ``keep_copies`` saves are (its hint goes to the root's
        owner). How many copies became visible."""
        from ucm_ray.store.shard.remote_reads import POPULAR
        from ucm_ray.store.types import Location, Publishes
        from ucm_ray.transport.base import CopyOp, Ranges, as_bytes

        client = self.client
        lease = client.acquire(keys).result()
        client.release(lease.lease_ids).result()
        nodes = {pool: d.node_id for pool, d in client.pools().descriptors.items()}
        sources = [None if loc is None else nodes.get(loc.pool) for loc in lease.locations]
        marks = [] if lease.earlier_reads is None else lease.earlier_reads.tolist()
        got = self.read_keys(keys, seed)
        popular = [i for i, mark in enumerate(marks) if mark == POPULAR]
        kept = 0
        if popular:
            buf, tensors = arena(len(keys), seed)
            client.register_local(buf)
            views = [as_bytes(t) for t in tensors]
            placed = client._reserve(keys, views, popular)
            ops: dict = {}
            for i, pool, _, off in placed:
                ops.setdefault(pool, []).append(CopyOp(off, views[i]))
            failed = client.connections.transfer({pool: Ranges.of(batch) for pool, batch in ops.items()},
                                                 write=True, timeout_s=client.config.transfer_timeout_s).pools
            rows = [(keys[i], Location(pool[0], pool[1], off, views[i].numel(), None), token)
                    for i, pool, token, off in placed if pool not in failed]
            kept = sum(client.commit(Publishes.of(rows, family=keys[0])).result())
        return {"marks": marks, "sources": sources, "exact": got["exact"], "kept": kept}

    def ask(self, keys: list[bytes]) -> dict:
        """One lookup (pinned, then released): how many it found, the shard calls it took."""
        lease = self.client.acquire(keys).result()
        self.client.release(lease.lease_ids).result()
        return {"found": int(lease.locations.found().sum()), "calls": lease.calls}

    def slot_nodes(self, size: int = 65536, ticks: int = 20) -> list[str]:
        """The nodes of the pools an engine's slot supply on this client keeps free slots on,
        after ``ticks`` full ticks with no save announced (the baseline alone)."""
        from ucm_ray.store.engine.slots import SlotSupply

        skipped = [0.0]  # its clock runs ahead by a quiet tick's interval a tick: each tick is a full one
        supply = SlotSupply(self.client, max_free=8, renew_after_s=20, idle_s=20, usable_s=50,
                            clock=lambda: time.monotonic() + skipped[0])
        supply.want(size)
        for _ in range(ticks):
            supply.tick(self.client.pools())
            skipped[0] += supply.quiet_tick_s
            time.sleep(0.05)  # the asks' answers come in meanwhile
        pools = self.client.pools().descriptors
        unused = supply.close()
        self.client.commit(Publishes.of([]), unused).result()  # handed back, as an engine's shutdown does
        return sorted({pools[pool].node_id for pool, _ in unused if pool in pools})

    def hot_blocks(self) -> int:
        """Blocks of the fleet's hot-prefix table this client holds, once it asked for news."""
        self.client.refresh(force=True)
        return len(self.client.membership.hot)

    def transports(self) -> list[str]:
        return sorted({self.client.transport_kind(s) for s in self.client.membership.shard_ids})


def shard_pid(cfg, i: int) -> int:
    return ray.get(ray.get_actor(shard_name(i), namespace=cfg.ray_namespace).stats.remote(), timeout=30)["pid"]


def restart_shard(cfg, i: int) -> None:
    """kill -9 shard ``i``, wait until the directory saw it die, start the fleet again."""
    os.kill(shard_pid(cfg, i), signal.SIGKILL)
    directory = ray.get_actor(DIRECTORY_NAME, namespace=cfg.ray_namespace)
    deadline = time.monotonic() + 30
    while shard_name(i) in ray.get(directory.membership.remote(), timeout=10).shard_ids:
        assert time.monotonic() < deadline, "the directory never noticed the kill"
        time.sleep(0.1)
    start_fleet(cfg)


def corrupt_stored_blocks(store, engine, tokens: list[int], blocks: list[int] | None = None) -> int:
    """Flip the first byte of the stored blocks of ``tokens`` (a bad DIMM, a stray writer):
    ``blocks`` (their indices) or all; ``store`` a ``LocalBlockStore``, ``engine`` a harness
    engine. Returns how many were stored and flipped."""
    reader = store.client()
    lease = reader.acquire(engine.block_keys(tokens)).result()
    flipped = 0
    for index, loc in enumerate(lease.locations):
        if loc is not None and (blocks is None or index in blocks):
            store.pool_of(loc).tensor[loc.offset] ^= 0xFF
            flipped += 1
    reader.release(lease.lease_ids).result()
    return flipped


def corrupt_fleet_entries(config, keys: list[bytes], offset: int = 4096, length: int = 64) -> None:
    """Flip ``length`` bytes at ``offset`` into the stored entries of ``keys`` in their shards'
    shared-memory pool files (real corruption: what a reader maps), found through a store client
    of the fleet ``config`` names."""
    from ucm_ray.store.engine.client import StoreClient

    client = StoreClient(config)
    try:
        lease = client.acquire(keys).result()
        pools = {shard.shard_id: shard.pool.shm_path for shard in client.membership.shards}
        for loc in lease.locations:
            with open(pools[loc.shard_id], "r+b") as f:
                f.seek(loc.offset + offset)
                good = f.read(length)
                f.seek(loc.offset + offset)
                f.write(bytes(b ^ 0xFF for b in good))
        client.release(lease.lease_ids).result()
    finally:
        client.close()
