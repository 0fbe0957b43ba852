"""Issue 40, stop 64: does a shard's membership relay delay its index calls?

With ``relay_membership`` a node's lowest shard answers its engines' long polls (its ``relay``
concurrency group, ``RELAY_THREADS`` threads) beside the index calls of its default group; both
take the shard process's GIL. This times a default-group call (``contains`` of a few absent keys,
what a lookup costs the shard) on that shard while ``--engines`` feeds follow the directory and
the directory pushes a hot-table change ``--rate`` times a second, with the feeds polling the
relay shard (``relay``) and the directory (``direct``, the baseline), arms alternated
``--rounds`` times in the same run. Prints per arm the call's p50/p99 and the relay/direct ratios,
and logs the shard process's thread count (``/proc``: this box's shard).

Run (CPU box, ~1 min)::

    env -u PYTHONPATH RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 \\
        .venv/bin/python benchmarks/relay_index_latency.py
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import threading
import time
import uuid

import ray

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.engine.feed import MembershipFeed
from ucm_ray.store.shard.fleet import start_fleet, stop_fleet
from ucm_ray.store.types import DIRECTORY_NAME, Membership

log = logging.getLogger("relay_index_latency")


def follow(feeds: list[MembershipFeed], held: list[Membership], stop: threading.Event) -> None:
    """The engines' schedulers: each polls its feed every few ms and keeps what arrives."""
    while not stop.is_set():
        for i, feed in enumerate(feeds):
            got = feed.poll(held[i])
            if got is not None:
                held[i] = got
        time.sleep(0.005)


def push(directory: ray.actor.ActorHandle, pools: list, rate: float, stop: threading.Event) -> None:
    """A hot-table change every 1/rate s (rows of new keys: an arm's pushes are not the last arm's
    again): every engine's poll is answered at each."""
    n, tag = 0, uuid.uuid4().hex[:8]
    while not stop.wait(1.0 / rate):
        rows = {f"hot{tag}-{n}-{i}".encode(): (pools[n % len(pools)],) for i in range(8)}
        ray.get(directory.add_hot_prefix.remote(rows), timeout=30)
        n += 1


def arm(cfg: UcmRayConfig, relay: bool, args: argparse.Namespace) -> list[float]:
    """The shard's ``contains`` latencies (ms) while ``args.engines`` feeds follow pushes."""
    node = ray.get_runtime_context().get_node_id() if relay else None
    feeds = [MembershipFeed(cfg.ray_namespace, 20.0, relay_node=node) for _ in range(args.engines)]
    held = [feed.fetch() for feed in feeds]
    assert all(m is not None for m in held)
    membership: Membership = held[0]  # type: ignore[assignment]
    record = membership.shards[0]
    directory = ray.get_actor(DIRECTORY_NAME, namespace=cfg.ray_namespace)
    stop = threading.Event()
    threads = [threading.Thread(target=follow, args=(feeds, held, stop), daemon=True),
               threading.Thread(target=push, args=(directory, [s.key for s in membership.shards], args.rate, stop),
                                daemon=True)]
    for thread in threads:
        thread.start()
    keys = [uuid.uuid4().bytes for _ in range(16)]
    times = []
    time.sleep(1.0)  # the relay follows the directory, every engine's poll parked
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        ray.get(record.handle.contains.remote(record.pool.incarnation, keys), timeout=30)
        times.append((time.perf_counter() - started) * 1e3)
        time.sleep(0.002)
    stop.set()
    for thread in threads:
        thread.join()
    relayed = sum(feed.relayed for feed in feeds)
    pid = ray.get(record.handle.stats.remote(), timeout=30)["pid"]
    log.info("%s: %d calls, %d relayed answers, engines at versions %s, the shard's process %d threads",
             "relay" if relay else "direct", len(times), relayed, sorted({m.version for m in held}),
             len(os.listdir(f"/proc/{pid}/task")))
    if relay:
        assert relayed > 0, "no answer came through the relay"
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=8, help="engines following the directory on this node")
    parser.add_argument("--rate", type=float, default=5.0, help="hot-table pushes a second")
    parser.add_argument("--seconds", type=float, default=8.0, help="per arm and round")
    parser.add_argument("--rounds", type=int, default=2, help="arms alternated this many times")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ray.init(logging_level="ERROR", log_to_driver=False)
    cfg = UcmRayConfig(ray_namespace=f"relaylat{uuid.uuid4().hex[:6]}", num_shards=1, pool_bytes=16 << 20,
                       transport="shm")
    start_fleet(cfg)
    try:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for relay in (False, True):
                times[relay] += arm(cfg, relay, args)
    finally:
        stop_fleet(cfg)
        ray.shutdown()
    figures = {}
    for relay, name in ((False, "direct"), (True, "relay")):
        ordered = sorted(times[relay])
        figures[name] = (statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))])
        print(f"{name:7s} contains on the relay shard: n={len(ordered)} p50={figures[name][0]:.3f} ms "
              f"p99={figures[name][1]:.3f} ms")
    print(f"relay/direct: p50 {figures['relay'][0] / figures['direct'][0]:.2f}x, "
          f"p99 {figures['relay'][1] / figures['direct'][1]:.2f}x "
          f"({args.engines} engines, {args.rate} pushes/s)")


if __name__ == "__main__":
    main()
