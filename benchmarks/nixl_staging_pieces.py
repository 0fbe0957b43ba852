"""A NIXL batch staged through host memory whole (one slab) against in pieces (a bound below the
batch: ``HostStaging``'s pieces of half the bound, one after another through one slab), CPU
memory with staging forced ``on``, real NIXL to a pool in a Ray actor. Arms interleaved per
repeat so the host's load falls on both; best of ``--repeat`` per arm.

    PYTHONPATH=. .venv/bin/python benchmarks/nixl_staging_pieces.py --batch-mib 32 --bounds-mib 16,4
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from tests.support.nixl_pool_actor import pool_actor_class
from tests.support.small_ray import own_or_session_ray
from ucm_ray.transport.base import Ranges
from ucm_ray.transport.nixl import NixlPoolTransport, shutdown_client_agent
from ucm_ray.transport.nixl.staging import HostStaging


def _batch(buffer: torch.Tensor, range_bytes: int) -> Ranges:
    """``buffer`` in ranges of ``range_bytes``, each at a shuffled slot of the pool (so the
    pool side is out of order, as a step's blocks are)."""
    n = buffer.numel() // range_bytes
    slots = np.random.default_rng(0).permutation(n).astype(np.int64)
    return Ranges((buffer,), np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64) * range_bytes,
                  slots * range_bytes, np.full(n, range_bytes, dtype=np.int64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-mib", type=int, default=32)
    parser.add_argument("--range-kib", type=int, default=64)
    parser.add_argument("--bounds-mib", default="16,4", help="staging bounds below the batch (pieces)")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    nbytes = args.batch_mib << 20
    arms = {"whole": None, **{f"bound {b} MiB": int(b) << 20 for b in args.bounds_mib.split(",")}}
    with own_or_session_ray() as ray:
        actor = pool_actor_class().remote(nbytes)
        desc = ray.get(actor.descriptor.remote("bench", 1), timeout=120)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        stagings = {arm: HostStaging("on", rdma=[], max_bytes=bound) for arm, bound in arms.items()}
        transports = {arm: NixlPoolTransport(desc, staging=staging) for arm, staging in stagings.items()}
        writes, reads = _batch(src, args.range_kib << 10), _batch(dst, args.range_kib << 10)
        for transport in transports.values():
            transport.register_local(src)
            transport.register_local(dst)
        best: dict[str, dict[str, float]] = {arm: {"save": float("inf"), "load": float("inf")} for arm in arms}
        try:
            for round_ in range(args.repeat + 1):  # the first round makes the slabs: not counted
                for arm, transport in transports.items():
                    started = time.perf_counter()
                    transport.write(writes).wait(60)
                    saved = time.perf_counter() - started
                    dst.zero_()
                    started = time.perf_counter()
                    transport.read(reads).wait(60)
                    loaded = time.perf_counter() - started
                    assert torch.equal(dst, src), f"{arm}: bytes read back differ"
                    if round_:
                        best[arm]["save"] = min(best[arm]["save"], saved)
                        best[arm]["load"] = min(best[arm]["load"], loaded)
        finally:
            for transport in transports.values():
                transport.close()
            for staging in stagings.values():
                staging.close()
            ray.get(actor.close.remote(), timeout=60)
            ray.kill(actor)
            shutdown_client_agent()
            if desc.shm_path and os.path.exists(desc.shm_path):
                os.unlink(desc.shm_path)
    base = best["whole"]
    print(json.dumps({arm: {what: {"s": round(t, 5), "x_whole": round(t / base[what], 3)} for what, t in b.items()}
                      for arm, b in best.items()}, indent=1))


if __name__ == "__main__":
    main()
