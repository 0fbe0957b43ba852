"""NIXL transfers of GPU memory staged through pinned host memory (``transport.nixl.staging``),
on CUDA: every byte lands both ways through both of the worker's copy paths between GPU memory
and a slab (a gather plan for many aligned ranges, range by range for a few or odd ones), and
the slabs are reused. The pool is another process's in production; here an exporter of this
process (NIXL between two agents), as ``test_stream_order`` does. The CPU twin of these tests,
with real NIXL to other processes: ``tests/integration/test_nixl_staging.py``."""

from __future__ import annotations

import uuid

import pytest
import torch

from ucm_ray.transport.base import CopyOp, Ranges
from ucm_ray.transport.shm import FEW_RANGES

pytestmark = pytest.mark.gpu

RANGE = 16 << 10


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def remote():
    from ucm_ray.transport.nixl import NixlPoolExporter

    pool = torch.zeros(64 << 20, dtype=torch.uint8)
    exporter = NixlPoolExporter(pool, f"ucmr-gpu-stage-{uuid.uuid4().hex[:8]}")
    yield pool, exporter.descriptor("shard-1", "other-node", incarnation=3)
    exporter.close()


@pytest.mark.parametrize("shape", ["gather_plan", "one_by_one"])
def test_staged_cuda_ranges_round_trip_exactly_and_reuse_their_slab(remote, shape):
    from ucm_ray.transport.nixl import NixlPoolTransport
    from ucm_ray.transport.nixl.staging import HostStaging

    pool, desc = remote
    staging = HostStaging("on", rdma=[])  # on: staged here even where the host has RDMA
    transport = NixlPoolTransport(desc, staging=staging)
    src = _random(8 << 20, seed=1).cuda()
    dst = torch.zeros_like(src)
    transport.register_local(src)
    transport.register_local(dst)
    if shape == "gather_plan":  # many aligned ranges, scattered both sides: one gather plan
        count = 4 * FEW_RANGES
        pool_at = [(7 * k % count) * RANGE + (1 << 20) for k in range(count)]
        ops = [CopyOp(p, src[k * 2 * RANGE:k * 2 * RANGE + RANGE]) for k, p in enumerate(pool_at)]
    else:  # a few ranges of odd sizes at odd offsets: copied range by range
        sizes = [4097, 1, 65539, 3, 12345]
        ops, at, pool_off = [], 1, 5
        for n in sizes:
            ops.append(CopyOp(pool_off, src[at:at + n]))
            at, pool_off = at + n + 13, pool_off + n + 4099
    try:
        for round_ in range(3):
            pool.zero_()
            transport.write(Ranges.of(ops)).wait(30)
            for op in ops:
                assert torch.equal(pool[op.pool_offset:op.pool_offset + op.local.numel()], op.local.cpu()), \
                    f"round {round_}: the range at {op.pool_offset} did not land"
            dst.fill_(0xAB)
            back = [CopyOp(op.pool_offset, dst[op.local.data_ptr() - src.data_ptr():][:op.local.numel()])
                    for op in ops]
            transport.read(Ranges.of(back)).wait(30)
            torch.cuda.synchronize()
            for op, got in zip(ops, back):
                assert torch.equal(got.local, op.local), f"round {round_}: range at {op.pool_offset} came back wrong"
            assert staging.held_bytes == 0
        assert staging.allocations == 1, "later rounds made slabs: the first one was not reused"
    finally:
        transport.close()
        staging.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs: the KV on one, the thread's device the other")
def test_a_batch_in_pieces_of_kv_on_another_device_than_the_thread_s_lands_exactly(remote):
    """A worker's KV on cuda:1 and a thread whose current device is cuda:0 (a thread of the
    process's own starts there): a batch over the staging bound goes in pieces, each later one
    posted or scattered by whichever thread polls or waits. Each slab's streams and mapped view
    must be the KV's device's, not the thread's, or the gather kernel runs on the wrong GPU."""
    from ucm_ray.transport.nixl import NixlPoolTransport
    from ucm_ray.transport.nixl.staging import MIN_SLAB_BYTES, HostStaging

    pool, desc = remote
    staging = HostStaging("on", rdma=[], max_bytes=MIN_SLAB_BYTES)
    transport = NixlPoolTransport(desc, staging=staging)
    kv = torch.device("cuda", 1)
    src = _random(8 << 20, seed=3).to(kv)
    dst = torch.zeros_like(src)
    transport.register_local(src)
    transport.register_local(dst)
    count = 6 * FEW_RANGES  # 3 MiB of aligned ranges: pieces of half a MiB, each a gather plan
    pool_at = [(7 * k % count) * RANGE + (1 << 20) for k in range(count)]
    ops = [CopyOp(p, src[k * 2 * RANGE:k * 2 * RANGE + RANGE]) for k, p in enumerate(pool_at)]
    back = [CopyOp(op.pool_offset, dst[op.local.data_ptr() - src.data_ptr():][:RANGE]) for op in ops]
    try:
        with torch.cuda.device(0):
            transport.write(Ranges.of(ops)).wait(30)
            transport.read(Ranges.of(back)).wait(30)
        torch.cuda.synchronize(kv)
        for op in ops:
            assert torch.equal(pool[op.pool_offset:op.pool_offset + RANGE], op.local.cpu()), "a range saved wrong"
        for op, got in zip(ops, back):
            assert torch.equal(got.local, op.local), f"the range at {op.pool_offset} came back wrong"
        assert staging.held_bytes == 0 and staging.allocations == 1
    finally:
        transport.close()
        staging.close()
