"""Host time the engine thread spends planning one save on a stream-ordered pool, on CPU.

A batch decode step that posts a save spent 3.7-4.7 ms in ``Copier.post_by_pool`` on an H100
(issue 43): the save's ranges, then the shm transport's ``prepare``, most of it a
``GatherPlan``. This times the same planning with CPU tensors (the plan's numpy and index work,
not the copies): a ~1B Llama's KV caches (16 layers, K and V, 16-token blocks of 8 heads x 64,
bf16: 16 KiB segments), ``--requests`` x ``--blocks`` entries saved in adjacent pool slots, as
``post_by_pool`` plans a save (every layer as one part, ranges entry by entry). A decode step's
save job is ``--requests 8 --blocks 1`` (a block for each request that filled one: 512 ranges
of the 8B's, one stretch of the pool).

``--device cuda`` times what the worker does on a GPU instead: the KV caches on the device, a
``/dev/shm`` pool opened by the shm transport (page-locked and mapped once, untimed), and the
host time of its ``prepare`` (the gather plan on the mapped pool, its indices uploaded) and of
posting the one part (``post_ms``: the staging gather and the DMA copies queued); the device's
work is waited for outside the timing. ``--shape 8b``: Llama-3.1-8B's KV (32 layers, 8 heads of
128: 32 KiB segments) instead of the ~1B's. ``gather_ms``: the gather plan alone (on CUDA built
again, as ``prepare`` builds it, outside its timing): ``prepare_ms`` less it is the range check
and, on CUDA, the streams' calls.

``--load``: a load posted layer by layer instead (``start_load_kv``'s stream-ordered path): a
part per layer, as one layer's ranges repeated where the checkout has ``repeated_ranges``
(stop 58), else every layer's ranges; on CUDA the parts are posted as the worker posts them.
Each child also counts, in a probe outside the timing, the calls one post makes
(``*_calls_per_post``: torch functions and tensor methods, CUDA stream and event calls, DMA
copy calls; on CPU a post is ``GatherPlan.move``), and on CUDA times the worker's own
``Copier`` calls for the same step (``worker_ms``: ranges, prepare and every post) and the part
of them that ``start_load_kv`` makes (``start_ms``): since stop 60 a load layer by layer is
planned there and only its first ``loads.LAYERS_AHEAD`` layers posted, each later layer posted
from a layer hook (timed here as the hooks post them, one call a layer, into ``worker_ms``);
before, ``start_load_kv`` posted every layer (``start_ms`` = ``worker_ms``). ``start_posts``:
the layer posts ``start_load_kv`` makes in that checkout (printed on CPU too, where the posts
are memcpys and are not timed).

``--at-once`` (with ``--load``): a load of every layer before the forward instead (one part of
every layer, as ``start_load_kv`` posts loads that cannot wait for layer hooks); since stop 59
planned as one layer's ranges repeated and posted whole where its layer's ranges reach
``copies.REPEAT_AT_ONCE_RANGES``, before it (or below that) as every layer's ranges.

``--baseline PATH`` times another checkout's code in the same run (each in its own process,
rounds alternating) and prints ``save_plan_vs_baseline=<ratio>`` (ranges, prepare and posts
together) and a ratio per stage (``ranges_vs_baseline``, ``prepare_vs_baseline``, on CUDA
``post_vs_baseline`` and ``worker_vs_baseline``): this checkout's time over the baseline's,
below 1 is cheaper.

``--cold``: the host's caches evicted before each plan (a 256 MiB buffer written), as the rest of an
engine's step evicts them between two save jobs: timed back to back, a plan finds its code and
data cached, which no job in an engine does (docs/performance-log.md, stop 64: a decode job's plan
several times dearer cold).

Run: ``python benchmarks/save_plan.py [--baseline /path/to/other/checkout]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

log = logging.getLogger("bench.save_plan")
EVICT_BYTES = 256 << 20
"""``--cold``'s buffer: larger than a server's last-level cache."""

SHAPES = {"1b": (16, 8, 64), "8b": (32, 8, 128)}
"""Layers, KV heads, head size."""
BLOCK_TOKENS = 16
ALIGN = 2 << 20


def _aligned(device: str, *shape: int):
    """A zeroed bf16 tensor starting on a 2 MiB boundary, as CUDA's allocator places vLLM's
    per-layer KV caches (so the layers' buffers share one span, as on a GPU)."""
    import numpy as np
    import torch

    if device != "cpu":  # CUDA's allocator places large tensors on 2 MiB boundaries itself
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    nbytes = 2 * int(np.prod(shape))
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return torch.from_numpy(raw[skip: skip + nbytes]).view(torch.bfloat16).view(*shape)


def time_plans(requests: int, blocks: int, repeat: int, device: str = "cpu", shape: str = "1b",
               load: bool = False, at_once: bool = False, cold: bool = False) -> dict[str, float]:
    """Median ms of the save's ranges (``post_by_pool``'s part), and of the shm transport's
    ``prepare`` on them (the range check and the gather plan), over ``repeat`` plans; on CUDA
    also of posting them (``post_ms``)."""
    import numpy as np
    import torch

    from ucm_ray.vllm.layout import base_buffers, build_layouts
    from ucm_ray.vllm.worker.plan import Batch, Entries, KvCaches

    layers, heads, head_dim = SHAPES[shape]
    num_blocks = requests * blocks + 64
    kv = {f"layer.{i}": _aligned(device, 2, num_blocks, BLOCK_TOKENS, heads, head_dim) for i in range(layers)}
    built = build_layouts(kv, [list(kv)], num_blocks)
    buffers = tuple(base_buffers(kv))
    at = {b.data_ptr(): i for i, b in enumerate(buffers)}
    caches = KvCaches(built, np.asarray([built[0].entry_bytes]), np.ones(1, dtype=bool), buffers,
                      {layer.name: at[layer.storage_address] for layer in built[0].layers}, torch.device(device))
    entry = built[0].entry_bytes
    count = requests * blocks
    block_ids = np.random.default_rng(0).permutation(num_blocks)[:count].astype(np.int64)
    entries = {("shard-0", 1): {0: Entries(block_ids, (np.arange(count, dtype=np.int64) + 3) * entry, [])}}
    every = caches.every_layer()
    # a save: every layer as one part, ranges entry by entry; a load: a part per layer, posted
    # layer by layer (``StepLoads._post_by_layer``): since stop 58 one layer's ranges repeated
    # (``KvCaches.repeated_ranges``), before it every layer's ranges layer by layer
    layers = [((0, index),) for _, index in every]
    parts = layers if load and not at_once else [every]
    repeats = load and hasattr(caches, "repeated_ranges") and \
        (not at_once or _repeated_at_once(caches, layers, entries))
    moves = len(layers) if repeats else len(parts)  # the plan's parts (a repeated load at once: a layer each)
    transport, pool = _pool((count + 8) * entry, device)
    ranges_s, plan_s, post_s, gather_s = [], [], [], []
    plans = []
    try:
        evictor = np.ones(EVICT_BYTES, dtype=np.uint8) if cold else None
        for _ in range(repeat):
            if evictor is not None:
                evictor += 1  # every cache line of it written: the plan's code and data evicted
            started = time.perf_counter()
            if repeats:
                ranges = caches.repeated_ranges(layers, entries)[("shard-0", 1)]
                ends = ranges.ends()
            else:
                ranges = caches.ranges(Batch(every, entries), by_entry=not load or at_once)[("shard-0", 1)]
                ends = _part_ends(caches, entries[("shard-0", 1)], parts, ranges)
            planned = time.perf_counter()
            if transport is None:
                ranges.check(pool.numel(), "the pool")  # as the shm transport's prepare does first
                checked = time.perf_counter()
                plan = _gather_plan(pool, pool, ranges, ends, repeats)
                assert load or plan.staged(0), "not planned as on a GPU: staged DMA"
                done = posted = time.perf_counter()
                gather_s.append(done - checked)
                plans.append(plan)
            else:
                copies = transport.prepare_repeated(ranges, to_pool=False) if repeats else \
                    transport.prepare(ranges, ends, to_pool=not load)
                done = time.perf_counter()
                _post_all(copies, len(parts))
                posted = time.perf_counter()
                torch.cuda.synchronize()
                plans.append(copies)
                gather_s.append(_gather_on_cuda(transport, ranges, ends, repeats, to_pool=not load))
            ranges_s.append(planned - started)
            plan_s.append(done - planned)
            post_s.append(posted - done)
            del plans[:-1]
        calls = _calls_per_post(plans[-1], len(parts), moves, load)
        worker_ms, start_ms = _worker_ms(caches, entries, parts, transport, repeat, load) \
            if transport is not None else (0.0, 0.0)
    finally:
        if transport is not None:
            transport.close()
    return {"ranges_ms": 1e3 * statistics.median(ranges_s), "prepare_ms": 1e3 * statistics.median(plan_s),
            "gather_ms": 1e3 * statistics.median(gather_s),
            "post_ms": 1e3 * statistics.median(post_s), "ranges": len(ranges), "worker_ms": worker_ms,
            "start_ms": start_ms, "start_posts": _start_posts(len(parts)), **calls}


def _gather_plan(pool, host_pool, ranges, ends, repeats: bool):
    """The gather plan of these ranges, as the shm transport's ``prepare`` builds it."""
    from ucm_ray.transport.gather import GatherPlan

    plan = GatherPlan.build_repeated(pool, ranges, host_pool=host_pool) if repeats else \
        GatherPlan.build(pool, ranges, ends, host_pool=host_pool)
    assert plan is not None, "no gather plan for these ranges"
    return plan


def _gather_on_cuda(transport, ranges, ends, repeats: bool, *, to_pool: bool) -> float:
    """Seconds of the gather plan alone (``gather_ms``: ``prepare``'s share that is the plan, its
    index upload included), built on the pool's stream for that direction as ``prepare`` builds
    it, outside the timed ``prepare``; 0.0 where the pool has no mapped view (no plan)."""
    import torch

    if transport._uva is None:
        return 0.0
    with torch.cuda.stream(transport._streams[to_pool]):
        started = time.perf_counter()
        plan = _gather_plan(transport._uva, transport.pool_tensor, ranges, ends, repeats)
        seconds = time.perf_counter() - started
    torch.cuda.synchronize()  # its index upload landed before the plan goes
    del plan
    return seconds


def _part_ends(caches, by_group, parts, ranges) -> list[int]:
    """Where each part's ranges end, as the checkout's worker finds them (``copies.part_ends``;
    before it, its layers' segments counted for every step)."""
    import numpy as np

    from ucm_ray.vllm.worker import copies

    if hasattr(copies, "part_ends"):
        return copies.part_ends(caches, by_group, parts, ranges)
    return np.cumsum(caches.segment_counts(by_group, parts)).tolist()


def _layers_ahead() -> int | None:
    """``loads.LAYERS_AHEAD`` of the checkout: layers a load layer by layer posts in
    ``start_load_kv`` (None before stop 60: every layer)."""
    from ucm_ray.vllm.worker import loads

    return getattr(loads, "LAYERS_AHEAD", None)


def _start_posts(parts: int) -> int:
    """Layer posts ``start_load_kv`` makes for a load of ``parts`` parts in this checkout."""
    ahead = _layers_ahead()
    return parts if parts == 1 or ahead is None else min(ahead, parts)


def _repeated_at_once(caches, layers, entries) -> bool:
    """Whether the checkout's worker plans this load at once as one layer's ranges repeated
    (``copies.REPEAT_AT_ONCE_RANGES``, stop 59; none before)."""
    from ucm_ray.vllm.worker import copies

    threshold = getattr(copies, "REPEAT_AT_ONCE_RANGES", None)
    repeated = caches.repeated_ranges(layers, entries) if threshold is not None else None
    return repeated is not None and min(len(r.template) for r in repeated.values()) >= threshold


def _calls_per_post(prepared, parts: int, moves: int, load: bool) -> dict[str, float]:
    """A probe (benchmark only): per posted part, the torch calls (functions and tensor methods,
    through a ``TorchFunctionMode``), the CUDA stream and event calls, and the DMA copy calls
    (the CUDA runtime's, or their CPU stand-in) that a post makes, on a plan already made. On
    CPU a post is ``GatherPlan.move`` (the CUDA wrapper around it does not run there)."""
    import torch
    from torch.overrides import TorchFunctionMode

    counts = {"torch": 0, "cuda": 0, "copy": 0}

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            counts["torch"] += 1
            return func(*args, **(kwargs or {}))

    def counted(kind: str, call):
        def wrapped(*args, **kwargs):
            counts[kind] += 1
            return call(*args, **kwargs)
        return wrapped

    patched = []
    plan = getattr(prepared, "_plan", prepared)  # the CUDA wrapper's gather plan, or the plan
    for owner, name, kind in _probed(plan):
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, counted(kind, getattr(owner, name)))
    try:
        with Count():
            if hasattr(prepared, "post"):
                _post_all(prepared, parts)
            else:
                for part in range(moves):
                    prepared.move(part, to_pool=not load)
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {f"{kind}_calls_per_post": value / parts for kind, value in counts.items()}


def _post_all(copies, parts: int) -> None:
    """Every part posted as the worker posts one pool's parts: in one ``post_each`` since stop
    58, one ``post`` each before; one part whole (``post_whole``, stop 59: every layer of a
    repeated load at once), ``post(0)`` before."""
    if parts == 1:
        copies.post_whole() if hasattr(copies, "post_whole") else copies.post(0)
    elif hasattr(copies, "post_each"):
        copies.post_each(parts)
    else:
        for part in range(parts):
            copies.post(part)


def _probed(plan) -> list[tuple[object, str, str]]:
    """(owner, attribute, kind) of each call ``_calls_per_post`` counts: the DMA copies (the
    plan's bound ``_copy_rows`` since stop 58, the module's ``copy_2d`` before), the CUDA
    stream and event calls."""
    import torch

    from ucm_ray.transport import gather

    probed: list[tuple[object, str, str]] = [(owner, name, "copy") for owner, name in ((gather, "copy_2d"),
                                                                                      (plan, "_copy_rows"))
                                             if hasattr(owner, name)]
    probed += [(torch.cuda, name, "cuda") for name in ("current_stream", "set_stream", "current_device")]
    return probed + [(torch.cuda.Event, "record", "cuda"), (torch.cuda.Event, "__init__", "cuda"),
                     (torch.cuda.Stream, "wait_stream", "cuda")]


def _worker_ms(caches, entries, parts, transport, repeat: int, load: bool) -> tuple[float, float]:
    """Median ms of the worker's own calls on the transport's pool (the same code in both
    checkouts): everything (ranges, prepare and every post) and what ``start_load_kv`` does of
    it. A load layer by layer posted ahead of the hooks (stop 60: ``Copier.prepare_parts``, then
    ``post_through`` the first ``LAYERS_AHEAD`` layers in ``start_load_kv`` and one more a hook);
    else ``Copier.post_by_pool`` (a list of parts before stop 60, one part's layers since), all of
    it in ``start_load_kv``."""
    import torch

    from ucm_ray.transport.pools import PoolConnections
    from ucm_ray.vllm.stats import UcmRayStats
    from ucm_ray.vllm.worker.copies import Copier

    pools = PoolConnections("shm", "local")
    pools._open[("shard-0", 1)] = transport  # the pool opened already (page-locked, mapped)
    pools._descriptors[("shard-0", 1)] = transport._desc
    copier = Copier(pools, 60.0, UcmRayStats())
    copier.caches = caches
    ahead = _layers_ahead() if load and len(parts) > 1 else None
    times, starts = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        if ahead is not None:
            posts = copier.prepare_parts(entries, parts, write=False)
            copier.post_through(posts, ahead - 1)
            start_s = time.perf_counter() - started
            for layer in range(len(parts)):  # as the hooks post them
                copier.post_through(posts, layer + ahead)
            posted = posts.posted
        elif hasattr(copier, "prepare_parts"):  # stop 60: one part is a tuple of layers
            posted = [copier.post_by_pool(entries, parts[0], write=not load)]
            start_s = time.perf_counter() - started
        else:
            posted = copier.post_by_pool(entries, parts, write=not load)
            start_s = time.perf_counter() - started
        times.append(time.perf_counter() - started)
        starts.append(start_s)
        assert not any(p.failed or p.failed_pools for p in posted), "the worker's copies failed: see its log"
        torch.cuda.synchronize()
    copier._thread.shutdown(wait=True)
    return 1e3 * statistics.median(times), 1e3 * statistics.median(starts)


def _pool(nbytes: int, device: str):
    """(None, a CPU pool) on CPU; on CUDA (the shm transport over a fresh /dev/shm pool, its
    tensor), the pool page-locked and mapped for the GPU before any timing."""
    import torch

    if device == "cpu":
        return None, torch.zeros(nbytes, dtype=torch.uint8)
    from ucm_ray.transport.base import PoolDescriptor
    from ucm_ray.transport.shm import SharedPool, ShmPoolTransport

    path = f"/dev/shm/ucm-ray-save-plan-{os.getpid()}"
    owner = SharedPool(path, nbytes, create=True)
    try:
        transport = ShmPoolTransport(PoolDescriptor("save-plan", "local", nbytes, path, None, None, 0))
    finally:
        owner.close()  # unlinked; the transport's mapping keeps the memory
    transport.register_local(torch.zeros(1, device=device))  # page-lock and map it now
    return transport, None


def run_in(checkout: str, requests: int, blocks: int, repeat: int, device: str, shape: str,
           load: bool, at_once: bool, cold: bool) -> dict[str, float]:
    """``time_plans`` in a fresh process importing ``checkout``'s ``ucm_ray`` (this file run as
    a script: its own directory first on the path, then only ``checkout``)."""
    # the checkout first, then whatever the path held (on the GPU machine: the bundle's vLLM)
    path = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--requests", str(requests),
                          "--blocks", str(blocks), "--repeat", str(repeat), "--device", device, "--shape", shape]
                         + (["--load"] if load else []) + (["--at-once"] if at_once else [])
                         + (["--cold"] if cold else []),
                         env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"save_plan in {checkout} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=16, help="entries saved per request")
    ap.add_argument("--repeat", type=int, default=50, help="plans timed per process (the median is kept)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per checkout, alternating")
    ap.add_argument("--baseline", default=None, help="another checkout whose ucm_ray is timed in the same run")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the worker's path on a GPU (see above)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--load", action="store_true", help="a load posted layer by layer instead of a save")
    ap.add_argument("--at-once", action="store_true", help="with --load: every layer at once, before the forward")
    ap.add_argument("--cold", action="store_true", help="the host's caches evicted before each plan")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(time_plans(args.requests, args.blocks, args.repeat, args.device, args.shape, args.load,
                                    args.at_once, args.cold)))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkouts = {"this": here, **({"baseline": args.baseline} if args.baseline else {})}
    got: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, path in checkouts.items():
            got[name].append(run_in(path, args.requests, args.blocks, args.repeat, args.device, args.shape, args.load,
                                    args.at_once, args.cold))
            log.info("%s: %s", name, got[name][-1])
    figures: dict[str, float] = {}
    for name, runs in got.items():
        prefix = "save_plan" if name == "this" else "save_plan_baseline"
        for key in ("ranges_ms", "prepare_ms", "gather_ms", "post_ms", "worker_ms", "start_ms"):
            figures[f"{prefix}_{key}"] = statistics.median(r[key] for r in runs)
        figures[f"{prefix}_start_posts"] = runs[0]["start_posts"]
        figures[f"{prefix}_ms"] = sum(figures[f"{prefix}_{key}"] for key in ("ranges_ms", "prepare_ms", "post_ms"))
        for kind in ("torch", "cuda", "copy"):
            figures[f"{prefix}_{kind}_calls_per_post"] = runs[0][f"{kind}_calls_per_post"]
    figures["save_plan_ranges"] = got["this"][0]["ranges"]
    if args.baseline:
        for key in ("ms", "ranges_ms", "prepare_ms", "gather_ms") + (("post_ms", "worker_ms", "start_ms")
                                                        if args.device != "cpu" else ()):
            name = "save_plan_vs_baseline" if key == "ms" else f"{key.removesuffix('_ms')}_vs_baseline"
            figures[name] = figures[f"save_plan_{key}"] / max(figures[f"save_plan_baseline_{key}"], 1e-9)
    for name, value in figures.items():
        print(f"{name}={value:.3f}" if isinstance(value, float) else f"{name}={value}")


if __name__ == "__main__":
    main()
