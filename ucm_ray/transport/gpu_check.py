"""Same-node shared-memory path against CUDA memory: correctness and bandwidth.

Used by the GPU test and the GPU benchmark (both need an NVIDIA GPU; neither
needs Ray or vLLM). A pool owner in another process creates and fills a
/dev/shm pool, as a shard does; this process maps it with ``ShmPoolTransport``
and gathers/scatters blocks into a KV-cache-shaped CUDA tensor whose K and V
halves live apart (the common GPU layout: one block is two ranges).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from dataclasses import dataclass

import torch

from ucm_ray.transport.base import CopyOp, PoolDescriptor, Ranges
from ucm_ray.transport.shm import SharedPool, ShmPoolTransport


def _own_pool(path: str, size: int, seed: int, ready, stop) -> None:
    pool = SharedPool(path, size, create=True)
    g = torch.Generator().manual_seed(seed)
    pool.tensor.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
    ready.set()
    stop.wait()
    pool.close()


@dataclass
class GpuShmResult:
    load_gbps: float
    save_gbps: float
    pinned_h2d_gbps: float
    pinned_d2h_gbps: float
    load_exact: bool
    save_exact: bool


def _best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def run(num_blocks: int = 64, block_bytes: int = 2 << 20, reps: int = 5, shm_dir: str = "/dev/shm") -> GpuShmResult:
    ctx = mp.get_context("spawn")
    path = os.path.join(shm_dir, f"ucmray-gpucheck-{uuid.uuid4().hex[:8]}")
    pool_bytes = 2 * num_blocks * block_bytes
    ready, stop = ctx.Event(), ctx.Event()
    owner = ctx.Process(target=_own_pool, args=(path, pool_bytes, 0, ready, stop))
    owner.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("pool owner did not start")
        desc = PoolDescriptor("gpu-check", "local", pool_bytes, path, None, None, 0)
        transport = ShmPoolTransport(desc)
        half = block_bytes // 2
        kv = torch.zeros((2, 2 * num_blocks, half), dtype=torch.uint8, device="cuda")  # K and V apart
        transport.register_local(kv)
        g = torch.Generator().manual_seed(1)
        slots = torch.randperm(2 * num_blocks, generator=g)[:num_blocks].tolist()
        blocks = torch.randperm(2 * num_blocks, generator=g)[:num_blocks].tolist()

        def ops() -> Ranges:
            out = []
            for s, b in zip(slots, blocks):
                off = s * block_bytes
                for seg in (kv[0, b], kv[1, b]):
                    out.append(CopyOp(off, seg))
                    off += seg.numel()
            return Ranges.of(out)

        plan = ops()
        load = _best(lambda: transport.read(plan).wait(), reps)
        pool_cpu = transport._pool.tensor
        expect = torch.stack([pool_cpu[s * block_bytes:(s + 1) * block_bytes] for s in slots]).cuda()
        got = torch.stack([torch.cat((kv[0, b], kv[1, b])) for b in blocks])
        load_exact = bool(torch.equal(got, expect))

        kv.random_(0, 256)
        save = _best(lambda: transport.write(plan).wait(), reps)
        written = torch.stack([pool_cpu[s * block_bytes:(s + 1) * block_bytes] for s in slots])
        want = torch.stack([torch.cat((kv[0, b], kv[1, b])) for b in blocks]).cpu()
        save_exact = bool(torch.equal(written, want))

        pinned = torch.empty((num_blocks, block_bytes), dtype=torch.uint8).pin_memory()
        dev = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, device="cuda")
        h2d = _best(lambda: [dev[i].copy_(pinned[i], non_blocking=True) for i in range(num_blocks)], reps)
        d2h = _best(lambda: [pinned[i].copy_(dev[i], non_blocking=True) for i in range(num_blocks)], reps)
        transport.close()
        total = num_blocks * block_bytes
        return GpuShmResult(total / load / 1e9, total / save / 1e9, total / h2d / 1e9, total / d2h / 1e9,
                            load_exact, save_exact)
    finally:
        stop.set()
        owner.join(60)


if __name__ == "__main__":
    r = run()
    print(r)
    print(f"gpu_shm_load_vs_pinned={r.load_gbps / r.pinned_h2d_gbps:.2f} "
          f"gpu_shm_save_vs_pinned={r.save_gbps / r.pinned_d2h_gbps:.2f}")
