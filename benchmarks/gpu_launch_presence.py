"""Diagnostic (GPU): whether what the tier adds to an engine's process makes that process's own
CUDA launches dearer (issue 43's batch-decode gap: with every hook of the connector answering
"nothing" at once, the ``hollow`` variant of ``gpu_decode_stall.py``, an 8B batch still decoded
~2% slower than an engine without the tier, and in a traced step each of vLLM's
``cudaLaunchKernel`` calls took ~13.5 us against ~10.4).

One process, no vLLM: the host time of a tiny kernel launch, of a small pinned host-to-device
copy and of a fixed piece of Python (medians of ``--repeat``), measured in stages that add what
an engine with the tier holds, one at a time: nothing of ours; a store client (its threads and
Ray calls); every shard pool mapped (faulted in); the pools page-locked and mapped into the GPU's
address space (``cudaHostRegister``, as the worker does once it registers its KV cache). Each
stage is measured ``--rounds`` times in a row, the stages one after another (no stage is
undone to re-measure the one before: a drift of the host between stages reads as a stage's
cost); the last stage is measured interleaved with itself (``registered_again``), which shows
how far two measurements of one state drift. Prints ``launch_presence: <stage>_launch_us=... ...``
(each figure the median over its rounds).

Run: ``python benchmarks/gpu_launch_presence.py [--pool-gib 6]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.measure import local_ray  # noqa: E402
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.store.engine.client import StoreClient  # noqa: E402
from ucm_ray.store.shard.fleet import running_fleet  # noqa: E402
from ucm_ray.transport.pools import PoolConnections  # noqa: E402

log = logging.getLogger("bench.launch_presence")


def probes(device: torch.device, repeat: int) -> dict[str, float]:
    """Median host microseconds of one tiny launch, one small pinned copy and one fixed piece of
    Python in this process now."""
    small = torch.zeros(16, device=device)
    host = torch.zeros(1024, pin_memory=device.type == "cuda")
    target = torch.empty(1024, device=device)
    python_work = list(range(256))

    def python() -> None:
        sum(x * 2 for x in python_work)

    out: dict[str, float] = {}
    work: tuple[tuple[str, Callable[[], object]], ...] = (
        ("launch_us", lambda: small.add_(1)),
        ("h2d_copy_us", lambda: target.copy_(host, non_blocking=True)),
        ("python_us", python))
    for name, call in work:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out[name] = 1e6 * statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--pool-gib", type=float, default=6.0, help="each of the two shards' pool")
    ap.add_argument("--repeat", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    local_ray("ucmp-", num_cpus=4, logging_level="WARNING", namespace="ucm_ray_launch_presence")
    cfg = UcmRayConfig(num_shards=2, transport="shm", pool_bytes=int(args.pool_gib * (1 << 30)),
                       ray_namespace="ucm_ray_launch_presence_tier")
    figures: dict[str, list[float]] = {}

    def measure(stage: str) -> None:
        for name, value in probes(device, args.repeat).items():
            figures.setdefault(f"{stage}_{name}", []).append(value)

    with running_fleet(cfg):
        for _ in range(args.rounds):
            measure("bare")
        client = StoreClient(cfg)
        pools = PoolConnections("shm")
        try:
            descriptors = client.pools().descriptors
            for _ in range(args.rounds):
                measure("client")
            pools.sync(descriptors)
            started = time.perf_counter()
            pools.open_all()
            log.info("%d pools mapped in %.1f s", len(descriptors), time.perf_counter() - started)
            for _ in range(args.rounds):
                measure("mapped")
            if device.type == "cuda":
                started = time.perf_counter()
                pools.register_local(torch.empty(1 << 20, dtype=torch.uint8, device=device))
                log.info("pools page-locked and mapped for the GPU in %.1f s", time.perf_counter() - started)
            for _ in range(args.rounds):
                measure("registered")
                measure("registered_again")  # the same state twice: how far two measurements of one state drift
        finally:
            pools.sync({})
            client.close()
    for name, values in figures.items():
        log.info("%s: %s", name, ", ".join(f"{v:.2f}" for v in values))
    print("launch_presence: " + " ".join(f"{name}={statistics.median(values):.2f}"
                                          for name, values in figures.items()))
    ray.shutdown()


if __name__ == "__main__":
    main()
