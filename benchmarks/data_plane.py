"""Data-plane benchmark: client <-> shard bandwidth per transport, a step's blocks through the
connector, lookup latency.

Baselines measured in the same run: single-thread memcpy into a preallocated
buffer (numpy copyto) and moving the same bytes through Ray's object store to
an actor. Clients: ``shm`` (same-node lookups in the shards' published
indexes), ``shm_pinned`` (every lookup a pinning Ray call, as between nodes),
``nixl`` (``nixl_stage_through_host`` auto: on a host without RDMA its reads go through host
staging since stop 67, 0.73-0.78x the unstaged throughput over UCX's same-host transports here;
``nixl_staged`` too with ``--staged``: both ways, ``on``, what a GPU host without RDMA does, here
over CPU memory); each stores one key per block
through ``put`` / ``get`` (a call per batch for each of lookup, reservation and commit).

The connector does not move a step's blocks that way: one key covers a block of every layer,
slots are granted ahead and commits answered beside later steps. ``connector step`` rows
measure that path: engine A (vLLM's real scheduler with both halves of our connector, the
harness's stand-in forward, a real fleet) computes a prompt of ``--step-mib`` MiB of KV over
``--step-layers`` layers (fewer where an entry would exceed 8 MiB), whose layer blocks are
each the column's size, and saves it; a fresh engine B loads it. The figure is the step's
bytes over the host time the engines spent inside the connector's hooks (lookup, planning,
posting the copies and every wait for them, posting slot asks and commits), both halves,
every step until the saves were committed and the loads' leases released: what the engine's
steps pay for the tier, control included. The Ray round trips themselves are answered between
steps and not counted; nor is copy work that overlaps the harness's stand-in forward (a
save's, between ``bind`` and ``wait_for_save``; B's loads are posted whole and waited for in
``start_load_kv`` while a step loads 64 times what it computes: 9 blocks or more, smaller
steps are refused). Best of ``--repeat`` prompts. Per size a line
``step_load_vs_memcpy_<size>=<ratio> step_save_vs_memcpy_<size>=<ratio>``.

``decode`` rows (``--decode-requests``): what our hooks add to a decode step's host time, with
1 and 8 requests decoding together on the harness and a real fleet, per step and over vLLM's own
scheduler work in the same steps (``decode_hooks_us_per_step_<n>``,
``decode_hooks_vs_vllm_scheduler_<n>``): a host-bound GPU decode step (a small model under CUDA
graphs) pays this directly. The last line is
``data_plane_load_vs_memcpy=<ratio>`` (2 MiB blocks, same-node path, data plane only).

Run: ``make bench`` or ``python benchmarks/data_plane.py [--sizes 256KiB,2MiB,16MiB]``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.measure import best, keys_for, local_ray  # noqa: E402
from ucm_ray.config import UcmRayConfig, parse_size  # noqa: E402
from ucm_ray.store.engine.client import StoreClient  # noqa: E402
from ucm_ray.store.shard.fleet import running_fleet  # noqa: E402
from ucm_ray.transport.base import (  # noqa: E402
    CopyOp,
    PoolKey,  # noqa: E402
    Ranges,
)

log = logging.getLogger("bench")
BATCH = 64
STEP_BLOCK_TOKENS = 16
STEP_HEAD_SIZE = 128
STEP_ENTRY_MAX = 8 << 20
"""The most bytes one stored entry (a block of every layer) holds in the connector step rows:
larger layer blocks get fewer layers, so an entry stays a small share of the benchmark's pools,
as a model's entries are of a real pool (with 64 MiB entries the free slots the two engines
keep for their next saves took the pools' room and evicted what A had just saved)."""


@ray.remote(num_cpus=0)
class Sink:
    def take(self, arrays: list) -> int:
        return sum(a.nbytes for a in arrays)


def measure_size(block: int, clients: dict[str, StoreClient], repeat: int) -> dict[str, float]:
    total = BATCH * block
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    blocks = [src[i * block:(i + 1) * block] for i in range(BATCH)]
    outs = [dst[i * block:(i + 1) * block] for i in range(BATCH)]
    res: dict[str, float] = {}
    s_np, d_np = src.numpy(), dst.numpy()
    res["memcpy"] = total / best(lambda: np.copyto(d_np, s_np), repeat)
    sink = Sink.remote()
    ray.get(sink.take.remote([]))
    arrays = [b.numpy() for b in blocks]
    res["ray_object_store"] = total / best(lambda: ray.get(sink.take.remote(arrays)), repeat)
    ray.kill(sink)
    for name, client in clients.items():
        client.register_local(src)
        client.register_local(dst)
        ks = keys_for(f"{name}-{block}", BATCH)
        # end to end: acquire + copy + release (load), lookup + reserve + copy + commit (save)
        assert all(client.put(ks, blocks)), "benchmark pool too small"
        res[f"{name}_load_e2e"] = total / best(lambda c=client, ks=ks: c.get(ks, outs), repeat)
        assert torch.equal(src, dst), f"{name}: bytes differ"
        # data plane only: copies out of / into slots already held (pinned, committed).
        # Rewriting a slot with the bytes it already holds changes nothing a reader could see.
        lease = client.acquire(ks).result()
        res[f"{name}_load"] = total / best(lambda c=client, ls=lease: move(c, ls.locations, outs, write=False),
                                           repeat)
        res[f"{name}_save"] = total / best(lambda c=client, ls=lease: move(c, ls.locations, blocks, write=True),
                                           repeat)
        client.release(lease.lease_ids).result()
        dst.zero_()
        # Last (fresh keys each time evict the older entries): best of N, so the figure is the
        # steady state, not the first writes into never-touched pool pages.
        fresh = iter(range(repeat))
        res[f"{name}_save_e2e"] = total / best(
            lambda c=client, tag=f"{name}-{block}", n=fresh: c.put(keys_for(f"{tag}-fresh{next(n)}", BATCH), blocks),
            repeat)
    return res


def move(client: StoreClient, locations, tensors, *, write: bool) -> None:
    """One batch per pool, all posted before any is waited on (as the connector's worker does)."""
    by_pool: dict[PoolKey, list[CopyOp]] = {}
    for loc, t in zip(locations, tensors):
        by_pool.setdefault(loc.pool, []).append(CopyOp(loc.offset, t))
    failed = client.connections.transfer({pool: Ranges.of(ops) for pool, ops in by_pool.items()}, write=write,
                                         timeout_s=client.config.transfer_timeout_s).pools
    assert not failed, f"transfer with {sorted(failed)} failed"


def connector_steps(cfg: UcmRayConfig, layer_block: int, layers: int, step_bytes: int, repeat: int,
                    model_dir: str) -> dict[str, float]:
    """Bytes per second of connector time (see the module's docstring) of a step that saves and
    of one that loads a prompt's blocks, ``layer_block`` bytes per block per layer (float32 KV,
    16-token blocks), and memcpy of as many bytes: best of ``repeat`` prompts, after one untimed."""
    from ucm_ray.testing.harness import make_engine, prompt
    from ucm_ray.testing.timing import CONNECTOR_HOOKS, timed_calls

    heads, rest = divmod(layer_block, STEP_BLOCK_TOKENS * 2 * STEP_HEAD_SIZE * 4)
    if rest or not heads:
        raise ValueError(f"a layer block of {layer_block} bytes is not a whole number of 128-wide float32 heads")
    layers = max(1, min(layers, STEP_ENTRY_MAX // layer_block))
    blocks = max(1, step_bytes // (layers * layer_block))
    total = blocks * layers * layer_block
    if blocks < 9:
        raise ValueError(f"--step-mib: {blocks} blocks of {layers} x {layer_block} bytes per step; at least 9 "
                         "keep B's loads posted whole, waited for inside its hooks")
    shape = {"block_size": STEP_BLOCK_TOKENS, "num_layers": layers, "kv_heads": heads,
             "head_size": STEP_HEAD_SIZE, "num_blocks": blocks + 4, "max_batched": blocks * STEP_BLOCK_TOKENS + 64}
    engines = {role: make_engine(StoreClient(cfg), model_dir, config=cfg, **shape) for role in ("save", "load")}
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.empty_like(src)
    res = {"memcpy": total / best(lambda: np.copyto(dst, src), repeat)}
    spent: dict[str, list[float]] = {role: [] for role in engines}
    try:
        for attempt in range(repeat + 1):
            # one token more than the step's blocks hold: B computes it (and, the seed's rule, the
            # last loaded block's last token again), so B loads every block A saved
            tokens = prompt(blocks * STEP_BLOCK_TOKENS + 1, seed=1000 * layer_block + attempt)
            for role, engine in engines.items():
                # A decodes one token: the step after its prompt's posts the saves, as in a serving engine
                targets = [(engine.connector, CONNECTOR_HOOKS, "scheduler"), (engine.worker, CONNECTOR_HOOKS, "worker")]
                with timed_calls(targets) as timed:
                    engine.serve(f"{role}-{attempt}", tokens, max_tokens=2 if role == "save" else 1)
                    engine.settle()
                if attempt:  # the first of each: pools mapped, grants made, code warm
                    spent[role].append(sum(sum(calls) for calls in timed.values()))
                    log.debug("%s %s: %s", role, attempt, {hook: round(1e3 * sum(calls), 2)
                                                           for hook, calls in timed.items() if calls})
            load = engines["load"]
            if load.loaded_blocks.get(f"load-{attempt}") != blocks or load.wrong_blocks or load.failed_loads:
                raise RuntimeError(f"connector step at {layer_block} bytes: B loaded "
                                   f"{load.loaded_blocks.get(f'load-{attempt}')} of {blocks} blocks "
                                   f"({load.wrong_blocks} wrong, {load.failed_loads} failed)")
    finally:
        for engine in engines.values():
            engine.shutdown()
    res["connector_step_save"] = total / min(spent["save"])
    res["connector_step_load"] = total / min(spent["load"])
    log.info("connector step, %d KiB layer blocks: %d blocks x %d layers = %d MiB; connector ms save %s load %s",
             layer_block >> 10, blocks, layers, total >> 20, [round(1e3 * s, 1) for s in spent["save"]],
             [round(1e3 * s, 1) for s in spent["load"]])
    return res


def decode_steps(cfg: UcmRayConfig, requests: int, steps: int, model_dir: str) -> dict[str, float]:
    """What the connector adds to a decode step's host time: ``requests`` requests (1k-token
    prompts, 16 layers, 16-token blocks, a real fleet) decode ``steps`` steps together; most
    steps fill no block, one in 16 per request does (saved in batches of DECODE_SAVE_TOKENS).
    Our hooks' time (both halves) per step, and over vLLM's own scheduler work in the same steps
    (``schedule`` and ``update_from_output`` less our hooks inside them). A GPU engine's step
    also prepares the model's inputs and samples, so there the share is smaller."""
    from ucm_ray.testing.harness import make_engine, prompt
    from ucm_ray.testing.timing import CONNECTOR_HOOKS, timed_calls

    engine = make_engine(StoreClient(cfg), model_dir, config=cfg, block_size=16, num_layers=16,
                         num_blocks=requests * (1024 + steps + 64) // 16 + 8, max_seqs=max(8, requests))
    try:
        for i in range(requests):
            engine.add(f"decode-{i}", prompt(1024, seed=7000 + i), max_tokens=steps + 64)
        while any(not req.num_output_tokens for req in engine.sched.requests.values()):
            engine.step()  # prompts computed, first tokens out: every step from here decodes
        for _ in range(16):
            engine.step()  # the prompts' saves posted and landed
        # vLLM calls the scheduler half's hooks inside ``schedule`` and ``update_from_output``
        targets = [(engine.connector, CONNECTOR_HOOKS, "scheduler"), (engine.worker, CONNECTOR_HOOKS, "worker"),
                   (engine.sched, ("schedule", "update_from_output"), "vllm")]
        gc.collect()
        gc.freeze()  # as vLLM's engine does after start-up: no full collection of its heap mid-step
        with timed_calls(targets) as timed:
            for _ in range(steps):
                engine.step()
    finally:
        gc.unfreeze()
        engine.shutdown()
    spent = {part: sum(sum(calls) for name, calls in timed.items() if name.startswith(f"{part}."))
             for part in ("scheduler", "worker", "vllm")}
    ours, vllm = spent["scheduler"] + spent["worker"], spent["vllm"] - spent["scheduler"]
    # a typical step's: each hook's median call, as many calls as it makes a step (the mean
    # above also carries the steps that save, ask for slots or take results, and this box's noise)
    typical = sum(statistics.median(calls) * len(calls) / steps for name, calls in timed.items()
                  if calls and not name.startswith("vllm."))
    log.info("decode, %d request(s), %d steps: our hooks %.1f us a step (a typical step %.1f us), vLLM's scheduler "
             "%.1f us a step", requests, steps, ours / steps * 1e6, typical * 1e6, vllm / steps * 1e6)
    return {"hooks_us": ours / steps * 1e6, "vs_vllm": ours / vllm, "typical_us": typical * 1e6}


def lookup_latency(client: StoreClient, n: int, iters: int) -> tuple[float, float]:
    """The engine's lookup (``acquire``) of ``n`` keys, half of them stored: p50 and p99 seconds.
    Pins taken through Ray are released after each timing, off the clock (as the engine does)."""
    ks = keys_for(f"lookup-{n}", n)
    stored = torch.zeros(n // 2, 64, dtype=torch.uint8)
    client.register_local(stored)
    if not all(client.put(ks[: n // 2], list(stored))):
        raise RuntimeError("lookup benchmark: pool too small for its keys")
    lat = []
    for _ in range(iters):
        t = time.perf_counter()
        lease = client.acquire(ks).result()
        lat.append(time.perf_counter() - t)
        assert sum(loc is not None for loc in lease.locations) == n // 2
        client.release(lease.lease_ids).result()
    lat.sort()
    return statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64KiB,256KiB,2MiB,16MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--lookup-iters", type=int, default=200)
    ap.add_argument("--step-sizes", default="64KiB,256KiB,2MiB", help="layer block sizes of the connector step rows")
    ap.add_argument("--step-layers", type=int, default=32)
    ap.add_argument("--step-mib", type=int, default=128, help="KV bytes a connector step moves")
    ap.add_argument("--decode-requests", default="1,8,64", help="requests decoding together, per decode row")
    ap.add_argument("--decode-steps", type=int, default=256)
    ap.add_argument("--staged", action="store_true", help="also a NIXL client whose transfers go through host "
                    "staging (nixl_stage_through_host: on)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    step_sizes = [parse_size(s, "--step-sizes") for s in args.step_sizes.split(",")] if args.step_sizes else []
    pool = max(BATCH * max(sizes) // 4 * 3, 64 << 20, 3 * args.step_mib << 20)
    local_ray("ucmb-", num_cpus=4, logging_level="WARNING")
    cfg = UcmRayConfig(num_shards=4, pool_bytes=pool, ray_namespace="ucm_ray_bench")
    try:
        with running_fleet(cfg):
            # shm: same-node lookups read the shards' published indexes (no call, no pin);
            # shm_pinned: every lookup a Ray call that pins (the path between nodes).
            variants = {"shm": {"transport": "shm"}, "shm_pinned": {"transport": "shm", "local_lookups": False},
                        "nixl": {"transport": "nixl"}}
            if args.staged:
                variants["nixl_staged"] = {"transport": "nixl", "nixl_stage_through_host": "on"}
            clients = {name: StoreClient(UcmRayConfig.from_dict({**cfg.to_dict(), **v}))
                       for name, v in variants.items()}
            rows = {}
            for size in sizes:
                log.info("measuring %d x %d KiB blocks", BATCH, size >> 10)
                rows[size] = measure_size(size, clients, args.repeat)
            lookups = {(name, n): lookup_latency(clients[name], n, args.lookup_iters)
                       for name in ("shm", "shm_pinned") for n in (1000, 10000)}
            with tempfile.TemporaryDirectory(prefix="ucmb-model-") as model_dir:
                from ucm_ray.testing.harness import write_model_dir

                write_model_dir(model_dir)
                steps = {}
                for size in step_sizes:
                    log.info("connector step, %d KiB layer blocks", size >> 10)
                    steps[size] = connector_steps(cfg, size, args.step_layers, args.step_mib << 20, args.repeat,
                                                  model_dir)
                decodes = {n: decode_steps(cfg, n, args.decode_steps, model_dir)
                           for n in (int(n) for n in args.decode_requests.split(",") if n)}
    finally:
        ray.shutdown()

    cols = list(next(iter(rows.values())))
    print(f"\n{'GB/s':>22}" + "".join(f"{s >> 10:>10} KiB" for s in sizes))
    for c in cols:
        print(f"{c:>22}" + "".join(f"{rows[s][c] / 1e9:>14.2f}" for s in sizes))
    print()
    for (name, n), (p50, p99) in lookups.items():
        how = "published index" if name == "shm" else "Ray calls"
        print(f"lookup {n:>6} keys / 4 shards ({how}): p50 {p50 * 1e3:.2f} ms  p99 {p99 * 1e3:.2f} ms")
    if steps:
        print(f"\n{'connector step GB/s':>22}" + "".join(f"{s >> 10:>10} KiB" for s in steps))
        for c in ("memcpy", "connector_step_load", "connector_step_save"):
            print(f"{c:>22}" + "".join(f"{steps[s][c] / 1e9:>14.2f}" for s in steps))
        for s, r in steps.items():
            print(f"step_load_vs_memcpy_{s >> 10}KiB={r['connector_step_load'] / r['memcpy']:.2f} "
                  f"step_save_vs_memcpy_{s >> 10}KiB={r['connector_step_save'] / r['memcpy']:.2f}")
    for n, d in decodes.items():
        print(f"decode_hooks_us_per_step_{n}={d['hooks_us']:.1f} decode_hooks_vs_vllm_scheduler_{n}={d['vs_vllm']:.2f} "
              f"decode_hooks_typical_step_us_{n}={d['typical_us']:.1f}")
    ref = 2 << 20 if (2 << 20) in rows else sizes[0]
    r = rows[ref]
    print(f"shm_load_vs_memcpy={r['shm_load'] / r['memcpy']:.2f} shm_save_vs_memcpy={r['shm_save'] / r['memcpy']:.2f} "
          f"nixl_load_vs_memcpy={r['nixl_load'] / r['memcpy']:.2f} "
          f"object_store_vs_memcpy={r['ray_object_store'] / r['memcpy']:.2f}")
    if args.staged:
        for s in sizes:
            print(f"nixl_staged_vs_nixl_{s >> 10}KiB: load {rows[s]['nixl_staged_load'] / rows[s]['nixl_load']:.2f} "
                  f"save {rows[s]['nixl_staged_save'] / rows[s]['nixl_save']:.2f}")
    print(f"data_plane_load_vs_memcpy={r['shm_load'] / r['memcpy']:.2f}")


if __name__ == "__main__":
    main()
