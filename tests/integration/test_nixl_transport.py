"""NixlPoolTransport against a real pool in another process (a Ray actor), through real NIXL/UCX.

The actor plays the shard: a /dev/shm-backed pool exported with NixlPoolExporter.
The test process plays a client: it writes and reads byte ranges of mixed, odd
sizes and checks them against what the actor sees in its own memory.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.support.nixl_pool_actor import pool_actor_class
from tests.support.small_ray import own_or_session_ray
from ucm_ray.transport.base import CopyOp, Ranges, TransferError

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ucm_ray.transport.nixl as nixl  # noqa: E402  (a dependency: missing NIXL fails, never skips)

assert nixl.nixl_available(), "NIXL is a dependency of ucm-ray; `make test` installs it"

POOL = 64 << 20
LOCAL = 16 << 20
WAIT_S = 30.0


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def cluster():
    with own_or_session_ray() as ray:
        yield ray


@pytest.fixture(scope="module")
def shard(cluster):
    ray = cluster
    actor = pool_actor_class().remote(POOL)
    desc = ray.get(actor.descriptor.remote(), timeout=120)
    yield actor, desc
    try:
        ray.get(actor.close.remote(), timeout=60)
    finally:
        ray.kill(actor)


@pytest.fixture(scope="module")
def client(shard):
    """A transport plus two registered local buffers: ``src`` (random) and ``dst``."""
    _, desc = shard
    transport = nixl.NixlPoolTransport(desc)
    src = _random_bytes(LOCAL, seed=7)
    dst = torch.zeros(LOCAL, dtype=torch.uint8)
    transport.register_local(src)
    transport.register_local(dst)
    yield transport, src, dst
    transport.close()
    nixl.shutdown_client_agent()


def test_descriptor_carries_small_metadata(shard):
    _, desc = shard
    assert desc.pool_bytes == POOL and desc.pool_base_addr > 0
    assert desc.nixl_agent and desc.nixl_agent.encode() in desc.nixl_metadata
    assert 0 < len(desc.nixl_metadata) < 4096


def test_write_lands_in_pool_and_reads_back_exact(shard, client):
    actor, _ = shard
    transport, src, dst = client
    sizes = [4096, 2 << 20, 1, 4097, 12345, 65539, 1 << 20, 999_999, 3, (2 << 20) - 1]
    ops, ranges, local_offs = [], [], []
    pool_off, local_off = 5, 1
    for k, n in enumerate(sizes):
        ops.append(CopyOp(pool_off, src[local_off:local_off + n]))
        ranges.append((pool_off, n))
        local_offs.append(local_off)
        pool_off += n + 4099 * (k + 1)
        local_off += n + 17 * k
    ops.append(CopyOp(POOL - 777, src[local_off:local_off + 777]))  # ends exactly at the pool's end
    ranges.append((POOL - 777, 777))
    local_offs.append(local_off)

    transport.write(Ranges.of(ops)).wait(WAIT_S)
    got = ray_get(actor.digests.remote(ranges))
    assert got == [_sha(op.local) for op in ops]

    dst.fill_(0xAB)
    back, at = [], 3
    for (off, n) in ranges:  # other local offsets than on the way in
        back.append(CopyOp(off, dst[at:at + n]))
        at += n + 11
    transport.read(Ranges.of(back)).wait(WAIT_S)
    for w, r in zip(ops, back):
        assert torch.equal(w.local, r.local)
    # nothing around the ranges was touched
    assert int(dst[:3].eq(0xAB).sum()) == 3
    assert int(dst[at - 11:at].eq(0xAB).sum()) == 11


def test_read_bytes_the_shard_wrote(shard, client):
    actor, _ = shard
    transport, _, dst = client
    off, n = (40 << 20) + 7, (3 << 20) + 5
    ray_get(actor.fill.remote(off, n, 99))
    cuts = [0, 4096, 4096 + 1_000_001, n]
    ops = [CopyOp(off + a, dst[100 + a:100 + b]) for a, b in zip(cuts, cuts[1:])]
    t = transport.read(Ranges.of(ops))
    t.wait(WAIT_S)
    assert t.done()
    assert torch.equal(dst[100:100 + n], _random_bytes(n, 99))


def test_out_of_bounds_op_moves_nothing(shard, client):
    actor, _ = shard
    transport, src, dst = client
    good_range = (50 << 20, 8192)
    before = ray_get(actor.digests.remote([good_range]))
    good = CopyOp(good_range[0], src[:8192])
    for bad in (CopyOp(POOL - 10, src[:4096]), CopyOp(-1, src[:16]), CopyOp(POOL, src[:1])):
        with pytest.raises(ValueError, match="outside"):
            transport.write(Ranges.of([good, bad]))
    assert ray_get(actor.digests.remote([good_range])) == before

    dst[:8192].fill_(0x5A)
    with pytest.raises(ValueError, match="outside"):
        transport.read(Ranges.of([CopyOp(good_range[0], dst[:4096]), CopyOp(POOL - 100, dst[4096:8192])]))
    assert bool(dst[:8192].eq(0x5A).all())


def test_unregistered_or_bad_local_buffer_is_rejected(client):
    transport, src, _ = client
    stray = torch.ones(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="register_local"):
        transport.write(Ranges.of([CopyOp(0, src[:10]), CopyOp(4096, stray)]))
    with pytest.raises(ValueError, match="register_local"):
        transport.read(Ranges.of([CopyOp(0, stray)]))
    with pytest.raises(ValueError, match="uint8"):
        transport.write(Ranges.of([CopyOp(0, torch.zeros(4, dtype=torch.float32))]))
    with pytest.raises(ValueError, match="uint8"):
        transport.write(Ranges.of([CopyOp(0, src[:64].view(8, 8).t())]))  # not contiguous


def test_register_is_idempotent_and_transports_share_the_agent(shard, client):
    _, desc = shard
    transport, src, dst = client
    agent = nixl.client_agent()
    n_regions = len(agent._regions)
    transport.register_local(src)
    transport.register_local(src[123:4567])  # a view of a registered storage: nothing new
    assert len(agent._regions) == n_regions

    second = nixl.NixlPoolTransport(desc)  # same process: same agent, same remote, same regions
    second.register_local(src)
    assert len(agent._regions) == n_regions
    second.write(Ranges.of([CopyOp(60 << 20, src[:4096])])).wait(WAIT_S)
    second.close()
    second.close()
    with pytest.raises(RuntimeError, match="closed"):
        second.read(Ranges.of([CopyOp(0, dst[:1])]))
    # the first transport still works: its remote and registrations outlived the second
    transport.read(Ranges.of([CopyOp(60 << 20, dst[:4096])])).wait(WAIT_S)
    assert torch.equal(dst[:4096], src[:4096])


def test_empty_batch_is_done_at_once(client):
    transport, _, dst = client
    t = transport.read(Ranges.of([]))
    assert t.done()
    t.wait(0)


def test_wait_after_shard_death_raises(cluster):
    """A transport whose shard died reports TransferError instead of hanging."""
    ray = cluster
    actor = pool_actor_class().remote(1 << 20)
    desc = ray.get(actor.descriptor.remote(), timeout=120)
    transport = nixl.NixlPoolTransport(desc)
    buf = torch.zeros(4096, dtype=torch.uint8)
    transport.register_local(buf)
    transport.write(Ranges.of([CopyOp(0, buf)])).wait(WAIT_S)
    path = desc.shm_path
    ray.kill(actor)
    try:
        with pytest.raises(TransferError):
            for _ in range(50):  # the kill is asynchronous: retry until the peer is gone
                transport.read(Ranges.of([CopyOp(0, buf)])).wait(5)
                time.sleep(0.1)
    finally:
        transport.close()
        if path and os.path.exists(path):
            os.unlink(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_buffers_round_trip(shard):
    """GPU memory registers as VRAM and moves to/from the host pool (not run on CPU boxes)."""
    actor, desc = shard
    transport = nixl.NixlPoolTransport(desc)
    try:
        src = _random_bytes(3 << 20, seed=5).cuda()
        dst = torch.zeros_like(src)
        transport.register_local(src)
        transport.register_local(dst)
        ops = [CopyOp(30 << 20, src[:1 << 20]), CopyOp((32 << 20) + 3, src[1 << 20:])]
        transport.write(Ranges.of(ops)).wait(WAIT_S)
        assert ray_get(actor.digests.remote([(30 << 20, 1 << 20), ((32 << 20) + 3, 2 << 20)])) == [
            _sha(op.local.cpu()) for op in ops]
        transport.read(Ranges.of([CopyOp(30 << 20, dst[:1 << 20]), CopyOp((32 << 20) + 3, dst[1 << 20:])])).wait(WAIT_S)
        assert torch.equal(src, dst)
    finally:
        transport.close()


def test_module_imports_without_nixl():
    code = (
        "import sys\n"
        "for m in ('nixl', 'nixl_cu12', 'nixl_cu13'): sys.modules[m] = None\n"
        "import torch\n"
        "import ucm_ray.transport.nixl as n\n"
        "assert not n.nixl_available()\n"
        "try:\n"
        "    n.NixlPoolExporter(torch.zeros(8, dtype=torch.uint8), 'x')\n"
        "except n.NixlUnavailableError as e:\n"
        "    assert 'pip install nixl' in str(e), e\n"
        "    print('clear error')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "clear error" in out.stdout


def ray_get(ref):
    import ray

    return ray.get(ref, timeout=60)
