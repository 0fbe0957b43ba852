"""Remote index reads that time out while their shard is stalled, over real NIXL/UCX.

A read NIXL reports in flight cannot be cancelled: it lands once the shard runs again
(tests/integration/test_nixl_late_reads.py). So a ``RemoteIndexReader`` whose read timed out must
keep that buffer registered and out of use until the read is over, keep a bounded number of
them (a flapping node must not cost a registration per timeout), and not free one on ``close``
while a read may still land in it. The stalled shard's actor runs UCX over TCP (``UCX_TLS=tcp``):
on one host UCX would pick ``cma``, which reads a stopped process's memory without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import uuid
from collections.abc import Iterator

import psutil
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tests.support.nixl_index_actor import INCARNATION, index_actor_class
from tests.support.polling import until
from tests.support.small_ray import own_or_session_ray
from ucm_ray.store.engine.published_reader import IndexReader
from ucm_ray.store.engine.remote_index import MAX_QUARANTINED, RemoteIndexReader, close_finished_readers
from ucm_ray.transport.base import CopyOp, Ranges
from ucm_ray.transport.nixl import NixlPoolTransport, shutdown_client_agent

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

LANDS_S = 30.0
"""How long late reads are given to land once the shard runs again (they take milliseconds)."""


def key(i: int) -> bytes:
    return hashlib.blake2b(f"late-{i}".encode(), digest_size=16).digest()



@pytest.fixture(scope="module")
def cluster():
    with own_or_session_ray() as ray:
        yield ray
    shutdown_client_agent()


@dataclasses.dataclass
class StalledIndex:
    actor: object
    desc: object
    pid: int

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        assert until(lambda: psutil.Process(self.pid).status() == psutil.STATUS_STOPPED, 10.0), "never stopped"

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


@pytest.fixture
def shard(cluster) -> Iterator[StalledIndex]:
    actor = index_actor_class().options(runtime_env={"env_vars": {"UCX_TLS": "tcp"}}).remote(
        f"/dev/shm/ucmr-idxlate-{uuid.uuid4().hex[:8]}")
    desc = cluster.get(actor.descriptor.remote(), timeout=120)
    pid = cluster.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)
    cluster.get(actor.publish.remote([key(i) for i in range(8)], [4096 * i for i in range(8)]), timeout=60)
    stalled = StalledIndex(actor, desc, pid)
    yield stalled
    stalled.resume()
    try:
        cluster.get(actor.close.remote(), timeout=60)
    finally:
        cluster.kill(actor)


def _connect(desc) -> None:
    """One read of the index with a long timeout: UCX's TCP connection to the shard is up before
    the reader's first 0.25 s read (the reader must be open: the connection is kept while it is)."""
    transport = NixlPoolTransport(dataclasses.replace(desc, pool_base_addr=desc.index_base_addr,
                                                      pool_bytes=desc.index_bytes))
    buf = torch.zeros(4096, dtype=torch.uint8)
    transport.register_local(buf)
    try:
        transport.read(Ranges.of([CopyOp(0, buf)])).wait(60)
    finally:
        transport.close()


def _registered(reader: RemoteIndexReader) -> list:
    """The storages the reader's transport holds registered (white-box: what a timeout leaks)."""
    return [region.keep for region in reader._transport._regions.values()]


def test_timed_out_reads_keep_a_bounded_number_of_buffers_out_of_use_until_they_are_over(shard):
    """The shard stalls; lookups time out (or, past the bound, answer None without posting). Each
    timed-out read's buffer stays registered and unused; at most ``MAX_QUARANTINED`` of them.
    The shard runs again: the late reads land, their buffers are freed, and lookups answer as the
    mapped table does. Before: every timeout left its buffer registered until the reader closed
    (one more registration per timeout, unbounded)."""
    reader = RemoteIndexReader(shard.desc)
    local = IndexReader(shard.desc.index_path, INCARNATION)
    keys = [key(i) for i in range(8)]
    try:
        _connect(shard.desc)
        assert reader.lookup(keys) is not None
        assert len(_registered(reader)) == 1
        shard.stop()
        timeouts = MAX_QUARANTINED + 4
        for i in range(timeouts):
            assert reader.lookup(keys[: 1 + i % 8]) is None, "a stalled shard's index was read"
        held = _registered(reader)
        assert len(held) <= MAX_QUARANTINED + 1, f"{len(held)} buffers registered after {timeouts} timeouts"
        assert reader.quarantined == MAX_QUARANTINED
        freed = [StorageWeakRef(s) for s in held]
        del held
        shard.resume()
        assert until(lambda: reader.lookup(keys) is not None and reader.quarantined == 0, LANDS_S), \
            "the quarantined buffers never came back once their reads were over"
        assert len(_registered(reader)) == 1
        assert sum(ref.expired() for ref in freed) >= MAX_QUARANTINED, "a finished read's buffer was kept"
        far, near = reader.lookup(keys), local.lookup(keys)
        assert far is not None and near is not None and far.known.all()
        for field in ("generation", "offset", "size"):
            assert (getattr(far, field) == getattr(near, field)).all(), field
    finally:
        shard.resume()
        reader.close()
        local.close()


def test_a_reader_closed_while_its_read_may_land_keeps_the_buffer_until_it_is_over(shard):
    """The shard stalls, a lookup times out, the reader closes: the buffer that read may still
    land in stays allocated (and registered) until the read is over, then is freed. Before: close
    deregistered and freed it, and the late read wrote into freed memory."""
    reader = RemoteIndexReader(shard.desc)
    keys = [key(i) for i in range(4)]
    try:
        _connect(shard.desc)
        assert reader.lookup(keys) is not None
        shard.stop()
        assert reader.lookup(keys) is None
        buffers = [StorageWeakRef(s) for s in _registered(reader)]
        assert buffers
        reader.close()
        close_finished_readers()
        assert not any(ref.expired() for ref in buffers), "a buffer a read may still land in was freed"
        shard.resume()
        assert until(lambda: (close_finished_readers(), all(ref.expired() for ref in buffers))[1], LANDS_S), \
            "the closed reader's buffer was never freed once its read was over"
    finally:
        shard.resume()
        reader.close()
