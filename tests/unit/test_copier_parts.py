"""The worker's ``Copier`` on CPU tensors through a real shared-memory pool: a load posted
layer by layer (``prepare_parts``, ``post_through``) goes as one layer's ranges repeated
(``RepeatedRanges``) where its layers are laid out alike, and as every layer's ranges where they
are not; a load at once (``post_by_pool``) too where a layer's ranges are many; either way each
layer's part lands exactly its own bytes. (On CPU the shm transport makes the repeated ranges
out in full; the CUDA path plans them once: ``test_gather.py``, ``tests/gpu``.)"""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
import torch

from ucm_ray.transport.base import PoolDescriptor, RepeatedRanges, Transfer
from ucm_ray.transport.pools import PoolConnections
from ucm_ray.transport.shm import SharedPool
from ucm_ray.vllm.layout import base_buffers, build_layouts
from ucm_ray.vllm.stats import UcmRayStats
from ucm_ray.vllm.worker import copies
from ucm_ray.vllm.worker.copies import Copier
from ucm_ray.vllm.worker.plan import Entries, KvCaches

BLOCKS, LAYERS = 12, 3


def _caches(alike: bool) -> KvCaches:
    shapes = [(2, BLOCKS, 4, 2, 8)] * LAYERS  # K and V apart: two segments a block
    if not alike:
        shapes[-1] = (BLOCKS, 4, 2, 16)  # the same bytes a block as one segment
    kv = {f"l{i}": torch.zeros(shape, dtype=torch.float32) for i, shape in enumerate(shapes)}
    layouts = build_layouts(kv, [list(kv)], BLOCKS)
    buffers = tuple(base_buffers(kv))
    at = {b.data_ptr(): i for i, b in enumerate(buffers)}
    return KvCaches(layouts, np.asarray([layouts[0].entry_bytes]), np.ones(1, dtype=bool), buffers,
                    {layer.name: at[layer.storage_address] for layer in layouts[0].layers}, torch.device("cpu"))


@pytest.mark.parametrize("how", ["layers", "at_once", "at_once_few"])
@pytest.mark.parametrize("alike", [True, False])
def test_a_load_layer_by_layer_lands_every_layer_exactly(alike, how, monkeypatch):
    """``how``: posted layer by layer; at once with one layer's ranges at least
    ``REPEAT_AT_ONCE_RANGES`` (one layer's ranges repeated, every layer in one transfer); at
    once with fewer (every layer's ranges)."""
    monkeypatch.setattr(copies, "REPEAT_AT_ONCE_RANGES", 1 if how == "at_once" else 1 << 20)
    caches = _caches(alike)
    layout = caches.layouts[0]
    slots = [0, 1, 2, 5, 6, 9]
    blocks = np.asarray([7, 0, 3, 11, 4, 8], dtype=np.int64)
    offsets = np.asarray(slots, dtype=np.int64) * layout.entry_bytes
    path = os.path.join("/dev/shm", f"ucmray-copiertest-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    owner = SharedPool(path, 10 * layout.entry_bytes, create=True)
    owner.tensor.copy_(torch.randint(1, 256, (owner.size,), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(3)))
    pools = PoolConnections("shm", "here")
    key = ("shard-0", 1)
    pools.sync({key: PoolDescriptor("shard-0", "here", owner.size, path, None, None, 0, incarnation=1)})
    copier = Copier(pools, 10.0, UcmRayStats())
    copier.register(caches)
    seen: list[object] = []
    prepare = pools.prepare
    monkeypatch.setattr(pools, "prepare", lambda pool, ranges, ends, *, write: (
        seen.append(ranges), prepare(pool, ranges, ends, write=write))[1])
    try:
        entries = {key: {0: Entries(blocks, offsets, [])}}
        parts = [((0, index),) for index in range(LAYERS)]
        if how == "layers":
            posts = copier.prepare_parts(entries, parts, write=False)
            copier.post_through(posts, LAYERS - 1)
            posted = posts.posted
        else:
            posted = [copier.post_by_pool(entries, tuple(layer for (layer,) in parts), write=False)]
        assert isinstance(seen[0], RepeatedRanges) == (alike and how != "at_once_few")
        assert len(posted) == (LAYERS if how == "layers" else 1)
        for out in posted:
            assert not copier.wait(out, deadline=float("inf")).pools and not out.failed
        for layer in range(LAYERS):
            for block, offset in zip(blocks.tolist(), offsets.tolist()):
                at = offset + layout.layer_offset(layer)
                got = torch.cat([s for s in layout.layers[layer].segments(block)])
                assert torch.equal(got, owner.tensor[at: at + layout.layers[layer].block_bytes]), (layer, block)
        loaded = {b for b in blocks.tolist()}
        for layer in layout.layers:  # no other block written
            assert all(not torch.cat(layer.segments(b)).any() for b in range(BLOCKS) if b not in loaded)
    finally:
        copier.shutdown()
        owner.close()


class _Recorded(Transfer):
    """A transfer that records whether its consumer abandoned it."""

    def __init__(self) -> None:
        self.abandoned = False

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        return None

    def abandon(self) -> None:
        self.abandoned = True


class _LatePosts(PoolConnections):
    """Every batch posted ``late_s`` after the copy thread took it (a host that left it no core)."""

    def __init__(self, late_s: float) -> None:
        super().__init__("shm", "here")
        self.late_s = late_s
        self.posted: list[_Recorded] = []

    def post(self, by_pool, *, write):
        time.sleep(self.late_s)
        self.posted.append(_Recorded())
        return [(("shard-0", 1), self.posted[-1])], set()


def test_a_batch_posted_after_its_deadline_is_abandoned_as_it_is_posted():
    """The step gave up on a copy task still running (its deadline passed): whatever the task
    posts afterwards is abandoned (a staged NIXL load then scatters nothing into blocks that may
    be another request's, and gives its slab back); one posted in time is not."""
    pools = _LatePosts(late_s=0.3)
    copier = Copier(pools, 10.0, UcmRayStats())
    try:
        batch = copies.Batch((), {})
        late = copier.move_later(time.monotonic() + 5.0, batch, write=False)
        assert copier.posted_by_deadline(late, time.monotonic() + 0.05) is None
        late.result(timeout=10)
        settled = time.monotonic() + 10  # a future's callbacks run after ``result`` returns
        while not pools.posted[0].abandoned and time.monotonic() < settled:
            time.sleep(0.001)
        assert pools.posted[0].abandoned
        pools.late_s = 0.0
        on_time = copier.move_later(time.monotonic() + 5.0, batch, write=False)
        posted = copier.posted_by_deadline(on_time, time.monotonic() + 5.0)
        assert posted is not None and not pools.posted[1].abandoned
    finally:
        copier.shutdown()


def test_a_save_given_up_on_while_it_posts_stops_no_step():
    """A save's copy task still posting when its job's deadline passed (a host that left the copy
    thread no core, staging waiting for room) writes into no KV block: the next step neither
    waits for it nor stops the worker. Before: it was kept with the late reads, and the next
    step's fence waited up to ``transfer_timeout_s`` for its post, then raised ``LateReadError``
    (an engine stopped by a slow save)."""
    pools = _LatePosts(late_s=1.5)
    copier = Copier(pools, 0.2, UcmRayStats())
    try:
        save = copier.move_later(time.monotonic() + 5.0, copies.Batch((), {}), write=True)
        assert copier.posted_by_deadline(save, time.monotonic() + 0.05) is None
        started = time.monotonic()
        copier.fence_late_reads()
        assert time.monotonic() - started < 0.1, "the next step waited for a save's post"
        assert not copier.late_reads
    finally:
        copier.shutdown()


def test_a_load_given_up_on_while_it_posts_is_fenced_until_posted():
    """A load's copy task still posting at its step's deadline may post a read into blocks vLLM
    reuses: the next step's fence waits for the post (and its reads), within ``transfer_timeout_s``."""
    pools = _LatePosts(late_s=0.5)
    copier = Copier(pools, 5.0, UcmRayStats())
    try:
        load = copier.move_later(time.monotonic() + 5.0, copies.Batch((), {}), write=False)
        assert copier.load_by_deadline(load, time.monotonic() + 0.05) is None
        assert copier.late_reads == [load]
        copier.fence_late_reads()
        assert load.done() and not copier.late_reads
    finally:
        copier.shutdown()
