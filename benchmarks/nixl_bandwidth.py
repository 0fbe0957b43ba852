"""Rough bandwidth of NixlPoolTransport between this process and a pool in a Ray actor.

    .venv/bin/python benchmarks/nixl_bandwidth.py [--blocks 64] [--block-mib 2] [--reps 7]

Logs the median GB/s of one batch of ``blocks`` x ``block-mib`` WRITEs and READs
(scattered pool slots, so UCX cannot merge them into one range), the latency of
a single 4 KiB READ, and the shard process's CPU use while idle (its UCX progress
thread must sleep, not spin). Not a test: numbers vary with the machine's load.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time

import torch

log = logging.getLogger("nixl_bandwidth")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import ray

    from ucm_ray.transport.base import CopyOp
    from ucm_ray.transport.nixl import NixlPoolTransport, shutdown_client_agent

    block = int(args.block_mib * (1 << 20))
    nblocks = args.blocks
    pool_bytes = 2 * nblocks * block

    @ray.remote(num_cpus=0)
    class Pool:
        def __init__(self, nbytes: int) -> None:
            import mmap
            import uuid

            from ucm_ray.transport.nixl import NixlPoolExporter

            self.path = f"/dev/shm/ucmr-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                self.mm = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            self.pool = torch.frombuffer(self.mm, dtype=torch.uint8)
            self.pool.zero_()  # fault pages in before timing
            self.exp = NixlPoolExporter(self.pool, f"ucmr-bench-{uuid.uuid4().hex[:6]}")

        def descriptor(self):
            return self.exp.descriptor("bench", "local", self.path)

        def cpu_seconds(self) -> float:
            return time.process_time()

        def close(self) -> None:
            self.exp.close()
            self.exp = self.pool = None
            self.mm.close()
            os.unlink(self.path)

    tmp = tempfile.mkdtemp(prefix=f"ucmr-{os.getpid()}-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, _node_ip_address="127.0.0.1",
             logging_level="WARNING")
    actor = None
    transport = None
    try:
        actor = Pool.remote(pool_bytes)
        desc = ray.get(actor.descriptor.remote(), timeout=120)
        log.info("pool %d MiB, NIXL metadata %d bytes", pool_bytes >> 20, len(desc.nixl_metadata))
        transport = NixlPoolTransport(desc)
        local = torch.randint(0, 256, (nblocks * block,), dtype=torch.uint8)
        transport.register_local(local)
        g = torch.Generator().manual_seed(0)
        results: dict[str, list[float]] = {"WRITE": [], "READ": []}
        for rep in range(args.reps + 1):  # the first round warms up connections
            slots = torch.randperm(2 * nblocks, generator=g)[:nblocks].tolist()
            ops = [CopyOp(s * block, local[i * block:(i + 1) * block]) for i, s in enumerate(slots)]
            for name, post in (("WRITE", transport.write), ("READ", transport.read)):
                t0 = time.perf_counter()
                post(ops).wait(60)
                dt = time.perf_counter() - t0
                if rep:
                    results[name].append(nblocks * block / dt / 1e9)
        for name, bw in results.items():
            log.info("%s %d x %.1f MiB: median %.2f GB/s (min %.2f, max %.2f)", name, nblocks,
                     block / (1 << 20), statistics.median(bw), min(bw), max(bw))

        lat = []
        for _ in range(200):
            t0 = time.perf_counter()
            transport.read([CopyOp(0, local[:4096])]).wait(10)
            lat.append(time.perf_counter() - t0)
        lat.sort()
        log.info("one 4 KiB READ: p50 %.0f us, p99 %.0f us", lat[100] * 1e6, lat[197] * 1e6)

        c0 = ray.get(actor.cpu_seconds.remote())
        time.sleep(2.0)
        c1 = ray.get(actor.cpu_seconds.remote())
        log.info("shard process CPU while idle: %.0f%% of a core", (c1 - c0) / 2.0 * 100)
    finally:
        if transport is not None:
            transport.close()
        shutdown_client_agent()
        if actor is not None:
            try:
                ray.get(actor.close.remote(), timeout=60)
            finally:
                ray.kill(actor)
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
