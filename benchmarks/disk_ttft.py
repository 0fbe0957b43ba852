"""Disk-hit TTFT: a store hit served from the shard's disk tier against recomputing the prompt and
against a hit in the shard's pool (DRAM), at two prompt lengths, and the length where a disk hit
starts to beat recomputing.

One shard with a pool of about 1.25 of the longest prompt's KV, write-through to a disk tier under
``--dir``; engine "ucm-ray" (the connector) and engine "none" (no connector), the project's tiny
model (float32, 8 KiB of KV a token: a 128-token block is a 1 MiB entry). Per length and round:
- recompute: "none" serves a fresh prompt cold (1 token: the request is its TTFT);
- DRAM hit: "ucm-ray" serves prompt P (saved), its own prefix cache is emptied, P again;
- disk hit: "ucm-ray" serves a pool's worth of other prompts (P's blocks leave the pool, already
  on disk), its prefix cache is emptied, P again: the shard promotes P's blocks, then they load.
Each hit's ``cached`` tokens are checked against the prompt's full blocks (a miss is no figure).

Then decode with demotion running (``--decode-rounds``): "ucm-ray" decodes a fresh prompt right after
a pool's worth of new entries was stored (the shard writes them to disk meanwhile), and in turn after
the same store once the disk caught up, twice ("quiet" and "quiet_b"). ``disk_decode_demoting_vs_quiet=``
is the ratio of the decode rates' medians (1.0: demotion costs decode nothing; quiet: both quiet cases'
rounds), ``disk_decode_quiet_b_vs_quiet=`` the same for the two quiet cases: the run's own noise. The
share of the demotion that overlapped the decodes and the load average are logged.

``--profile bench`` runs the GPU benchmark's engines instead of the tiny model (``benchmarks/gpu``):
on a GPU the ~1B profile (bf16, 32 KiB of KV a token, 16-token blocks, vLLM's dummy weights: nothing
to write or load) at 4k and 16k tokens; without one its CPU stand-in (4 small layers, 512 and 1,024
tokens), so the same code path runs here.

Prints per length the medians (ms), then ``disk_hit_vs_recompute_<n>k=``, ``disk_hit_vs_dram_hit_<n>k=``
and ``disk_crossover_tokens=`` (interpolated between the measured lengths where the disk hit starts to
win; ``<N``: it wins at every length measured). The machine is noisy: nothing here asserts a timing.

Run: ``python benchmarks/disk_ttft.py [--lengths 4096,16384 --rounds 2 --dir /mnt/nvme]``; on a GPU
``python benchmarks/disk_ttft.py --profile bench --rounds 1 --decode-rounds 2``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*
from benchmarks.measure import keys_for  # noqa: E402
from ucm_ray.config import UcmRayConfig  # noqa: E402
from ucm_ray.demo import ENGINE_ENV, Engine, kv_transfer_config  # noqa: E402
from ucm_ray.store.engine.client import StoreClient  # noqa: E402
from ucm_ray.store.shard.disk.tier import PROMOTE_CHUNK  # noqa: E402
from ucm_ray.store.shard.fleet import fleet_status, running_fleet  # noqa: E402
from ucm_ray.tiny_model import make_tiny_model, synthetic_prompt  # noqa: E402

log = logging.getLogger("bench.disk_ttft")
TINY_KV_PER_TOKEN = 2 * 8 * 2 * 64 * 4
"""The tiny model's KV bytes a token: K and V, 8 layers, 2 KV heads of 64, float32."""
NAMESPACE = "ucm_ray_disk_ttft"
DECODE_TOKENS = 64
DECODE_PROMPT = 256


@dataclass(frozen=True)
class Setup:
    """What the runs depend on: the model, its engines, the KV bytes a token and the block size."""
    model: str
    lengths: list[int]
    kv_per_token: int
    block: int
    engine_args: dict[str, Any]
    remote: Any
    """The engine class as a Ray actor (its GPU share and environment)."""
    kv_config: dict[str, Any]
    device: str


def tiny_setup(lengths: list[int]) -> Setup:
    """The project's tiny model (float32, 8 KiB of KV a token, 128-token blocks) on CPU engines."""
    longest = max(lengths) + 128
    model = str(make_tiny_model(os.path.join(".models", f"tiny-{longest}"), max_position_embeddings=longest))
    remote = ray.remote(num_cpus=0, runtime_env={"env_vars": ENGINE_ENV})(Engine)
    return Setup(model, lengths, TINY_KV_PER_TOKEN, 128, {"max_model_len": longest, "max_num_batched_tokens": 8192},
                 remote, kv_transfer_config({"ray_namespace": NAMESPACE, "transport": "shm"}), "cpu")


def bench_setup(lengths: list[int] | None) -> Setup:
    """The GPU benchmark's profile for the device here (``benchmarks/gpu/common.py``), its engine
    actor and connector settings (loads layer by layer); on a GPU with vLLM's dummy weights."""
    from benchmarks.gpu.common import bench_model, connector_config, engine_actor, ttft_profile

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    prof = ttft_profile(device, False)
    if device.type == "cuda":  # random weights made on the device: nothing to write to disk or load
        prof = replace(prof, engine={**prof.engine, "load_format": "dummy"})
    cfg = UcmRayConfig(ray_namespace=NAMESPACE)
    return Setup(bench_model(prof, None), lengths or sorted(prof.sizes.values()), prof.kv_bytes_per_token,
                 prof.engine.get("block_size", 128), prof.engine, engine_actor(prof), connector_config(cfg),
                 torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")



def ttft(engine: Any, prompt: list[int]) -> tuple[float, int]:
    """(seconds, cached tokens) of a 1-token request: with one token, the request is its TTFT."""
    out = ray.get(engine.generate.remote(prompt, 1))
    return out["seconds"], out["cached"]


def wait_demoted(cfg: UcmRayConfig, timeout_s: float = 120.0) -> None:
    """Until the shard's write-through has written every committed entry to disk."""
    deadline = time.monotonic() + timeout_s
    while fleet_status(cfg)["shards"][0]["disk_behind"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the disk tier fell behind for two minutes")
        time.sleep(0.1)


def counters(ucm: Any, cfg: UcmRayConfig) -> dict[str, Any]:
    """What tells where a save went: the engine's save counters and the shard's."""
    engine = ray.get(ucm.connector_totals.remote())["scheduler"]
    shard = fleet_status(cfg)["shards"][0]
    return {**{k: engine.get(k, 0) for k in ("saved_blocks", "saves_dropped", "saves_skipped", "save_failures",
                                              "commits_not_visible")},
            **{f"shard_{k}": shard[k] for k in ("commits", "dropped_saves", "evictions", "evicted_dirty",
                                                "duplicate_commits", "refused_commits", "expired_reservations")},
            "disk_behind": shard["disk_behind"]}


def measure(ucm: Any, none: Any, cfg: UcmRayConfig, setup: Setup, length: int, seed: int) -> dict[str, float]:
    """One round at ``length`` tokens: seconds per case; NaN for a hit that was not one. Prompts of
    the shortest length (prefill grows faster than linearly) fill the pool in between."""
    model, block, filler_length = setup.model, setup.block, min(setup.lengths)
    fillers = -(-cfg.pool_bytes // (filler_length * setup.kv_per_token)) + 1
    full = length // block * block
    prompt = synthetic_prompt(model, length, seed=seed)
    figures = {"recompute": ttft(none, synthetic_prompt(model, length, seed=seed + 1))[0]}
    before = counters(ucm, cfg)
    ttft(ucm, prompt)  # cold: computed and saved
    saved = counters(ucm, cfg)
    assert ray.get(ucm.reset_prefix_cache.remote())
    seconds, dram_cached = ttft(ucm, prompt)
    figures["dram_hit"] = seconds if dram_cached >= full - block else float("nan")
    if dram_cached < full - block:  # say why: the counters the cold request's saves moved
        log.warning("%d tokens: DRAM hit cached only %d of %d tokens; the cold request moved %s, then "
                    "the shard had disk_behind=%s", length, dram_cached, full,
                    {k: saved[k] - before[k] for k in saved if k != "disk_behind" and saved[k] != before[k]},
                    saved["disk_behind"])
    wait_demoted(cfg)
    for n in range(fillers):  # a pool's worth and a prompt more: the prompt's blocks leave the pool
        ttft(ucm, synthetic_prompt(model, filler_length, seed=seed + 2 + n))
    wait_demoted(cfg)
    assert ray.get(ucm.reset_prefix_cache.remote())
    before = fleet_status(cfg)["shards"][0]
    rate = ray.get(ucm.prefill_bytes_s.remote())
    seconds, cached = ttft(ucm, prompt)
    after = fleet_status(cfg)["shards"][0]
    promoted = after["disk_promoted"] - before["disk_promoted"]
    if cfg.disk_recompute_bytes_s:
        figures["disk_hit"] = seconds if cached >= full - block and promoted > 0 else float("nan")
    else:  # --decide: whatever the shard chose is the figure
        figures["disk_hit"] = seconds
        log_decision(length, full * setup.kv_per_token, rate, before, promoted,
                     after["disk_promote_skipped"] - before["disk_promote_skipped"])
    log.info("%d tokens: %s (DRAM hit cached %d tokens; disk hit cached %d, %d blocks promoted)", length,
             {k: round(v * 1e3, 1) for k, v in figures.items()}, dram_cached, cached, promoted)
    return figures


def log_decision(length: int, nbytes: int, rate: float, shard: dict[str, Any], promoted: int, skipped: int) -> None:
    """The inputs of the shard's promote-or-recompute decision for a disk hit of ``nbytes`` (as
    they stood when the lookup came: the engine's measured prefill rate, the shard's fitted read
    cost), what each side predicts for the prompt and for one chunk, and what the shard did."""
    fixed, per_byte = shard["disk_read_fixed_s"], shard["disk_read_s_per_byte"]
    blocks = promoted + skipped
    chunks = -(-blocks // PROMOTE_CHUNK) if blocks else 1
    chunk_bytes = nbytes * min(blocks, PROMOTE_CHUNK) // max(blocks, 1)
    read_s = fixed * chunks + per_byte * nbytes
    recompute_s = nbytes / rate if rate else math.inf
    log.info("%d tokens, decision: engine prefill %.3g KV bytes/s, shard read cost %.3g s a chunk + %.3g s/byte "
             "(%.3g GB/s); %d MiB: read %.1f ms vs recompute %.1f ms (a %d-block chunk: %.1f vs %.1f ms); "
             "shard promoted %d blocks, left %d to recompute", length, rate, fixed, per_byte,
             (1 / per_byte / 1e9) if per_byte else math.inf, nbytes >> 20, read_s * 1e3, recompute_s * 1e3,
             min(blocks, PROMOTE_CHUNK), (fixed + per_byte * chunk_bytes) * 1e3,
             (chunk_bytes / rate * 1e3) if rate else math.inf, promoted, skipped)
    decided = "read" if not skipped else "recompute" if not promoted else "partial"
    print(f"disk_decision_{tag(length)}={decided} "
          f"prefill_bytes_s={rate:.4g} read_fixed_s={fixed:.4g} read_s_per_byte={per_byte:.4g} "
          f"predicted_read_ms={read_s * 1e3:.1f} predicted_recompute_ms={recompute_s * 1e3:.1f} "
          f"promoted={promoted} skipped={skipped}", flush=True)


class DemotionLoad:
    """Stores a pool's worth of new entries from the driver (a client of the fleet, as an engine's
    saves are): with write-through, the shard then writes them all to disk."""

    def __init__(self, cfg: UcmRayConfig, entry: int) -> None:
        self.client = StoreClient(cfg)
        self.entry = entry
        self.count = cfg.pool_bytes // entry
        self.buffer = torch.randint(0, 256, (self.count * entry,), dtype=torch.uint8)
        self.client.register_local(self.buffer)
        self.rounds = 0

    def store(self) -> int:
        """Bytes stored (new keys each time; ``put`` returns once they are committed)."""
        self.rounds += 1
        keys = keys_for(f"demotion-load-{self.rounds}", self.count)
        self.buffer[::4096].random_(0, 256)  # every entry's bytes new too
        stored = self.client.put(keys, list(torch.split(self.buffer, self.entry)))
        return sum(stored) * self.entry

    def close(self) -> None:
        self.client.close()


def decode(ucm: Any, prompt: list[int]) -> tuple[float, float]:
    """(decode tokens/s after the first token, seconds of the request) of one request."""
    r = ray.get(ucm.generate.remote(prompt, DECODE_TOKENS, ignore_eos=True))
    first = r["ttft"] if r.get("ttft") else 0.0
    return (len(r["tokens"]) - 1) / (r["seconds"] - first), r["seconds"]


def decode_while_demoting(ucm: Any, cfg: UcmRayConfig, setup: Setup, rounds: int) -> dict[str, list[float]]:
    """Per round, in rotating order: "demoting" decodes right after a pool's worth was stored (its
    demotion runs meanwhile), "quiet" and "quiet_b" after the same once the disk caught up: the two
    quiet cases against each other are the run's noise. Logs how long a pool's demotion took (quiet
    rounds) against a decode (the share of a decode it overlapped), and the load average."""
    load = DemotionLoad(cfg, setup.block * setup.kv_per_token)
    cases = ("demoting", "quiet", "quiet_b")
    rates: dict[str, list[float]] = {case: [] for case in cases}
    demotion_s: list[float] = []
    decode_s: list[float] = []
    load_before = os.getloadavg()[0]
    try:
        for r in range(rounds):
            for case in cases[r % 3:] + cases[:r % 3]:
                prompt = synthetic_prompt(setup.model, DECODE_PROMPT, seed=900000 + 10 * r + cases.index(case))
                load.store()
                if case != "demoting":
                    started = time.monotonic()
                    wait_demoted(cfg)
                    demotion_s.append(time.monotonic() - started)
                rate, seconds = decode(ucm, prompt)
                rates[case].append(rate)
                if case == "demoting":
                    decode_s.append(seconds)
                wait_demoted(cfg)
    finally:
        load.close()
    log.info("decode tok/s %s; a pool's demotion (%d MiB) took %.2f s, a demoting decode %.2f s (medians); "
             "load average %.1f -> %.1f", {case: [round(v, 1) for v in values] for case, values in rates.items()},
             cfg.pool_bytes >> 20, statistics.median(demotion_s), statistics.median(decode_s), load_before,
             os.getloadavg()[0])
    return rates


def median(values: list[float]) -> float:
    """Of the rounds that gave a figure (a hit that was not one gives NaN)."""
    got = [v for v in values if not math.isnan(v)]
    return statistics.median(got) if got else math.nan


def crossover(lengths: list[int], disk: list[float], recompute: list[float]) -> str:
    """The length where a disk hit starts to beat recomputing, interpolated between the two measured
    lengths around it; ``<N`` when it wins already at the shortest length N, ``>N`` when it still
    loses at the longest (prefill grows faster than linearly: no line is drawn outside)."""
    gaps = [r - d for d, r in zip(disk, recompute)]  # > 0: the disk hit is faster
    if gaps[0] > 0:
        return f"<{lengths[0]}"
    for (l0, g0), (l1, g1) in zip(zip(lengths, gaps), zip(lengths[1:], gaps[1:])):
        if g0 <= 0 < g1:
            return f"{l0 + (l1 - l0) * -g0 / (g1 - g0):.0f}"
    return f">{lengths[-1]}"


def file_system(path: str) -> str:
    """The type of the file system holding ``path`` (tmpfs makes the "disk" memory: say so)."""
    path, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fs = line.split()[:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fs
    return kind


def tag(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--profile", choices=("tiny", "bench"), default="tiny",
                    help="tiny: the project's tiny model on CPU; bench: the GPU benchmark's (~1B on a GPU)")
    ap.add_argument("--lengths", default=None, help="prompt lengths in tokens (tiny: 4096,16384; bench: the profile's)")
    ap.add_argument("--rounds", type=int, default=2, help="TTFT rounds per length (0: decode figures only)")
    ap.add_argument("--decode-rounds", type=int, default=3, help="decode with and without demotion running (0: skip)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk (not tmpfs)")
    ap.add_argument("--decide", action="store_true",
                    help="let the shard decide each disk hit (promote or recompute) by the engine's measured prefill "
                         "rate, and print the decision's inputs; the disk hit's figure is then whatever it chose")
    args = ap.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(",")) if args.lengths else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for k, v in {**ENGINE_ENV, "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    gpus = 1 if args.profile == "bench" and torch.cuda.is_available() else 0
    ray.init(num_cpus=4, num_gpus=gpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="WARNING", _temp_dir=tempfile.mkdtemp(prefix="ucmd-", dir="/tmp"), log_to_driver=False)
    setup = tiny_setup(lengths or [4096, 16384]) if args.profile == "tiny" else bench_setup(lengths)
    disk_dir = tempfile.mkdtemp(prefix="disk-ttft-", dir=args.dir)
    pool = (max(setup.lengths) + setup.block) * setup.kv_per_token * 5 // 4
    # disk_recompute_bytes_s 1: every disk hit is read, so that it is timed (left at 0, an engine
    # that recomputes faster than the disk reads, as on a GPU, would get misses: no figure). With
    # --decide it is left at 0: each engine's own measured rate, as in a deployment.
    cfg = UcmRayConfig(num_shards=1, pool_bytes=pool, transport="shm", ray_namespace=NAMESPACE,
                       disk_dir=disk_dir, disk_bytes=16 * pool, disk_write_policy="through", disk_wait_s=4.0,
                       disk_recompute_bytes_s=0.0 if args.decide else 1.0)
    results: dict[int, dict[str, list[float]]] = {}
    decode: dict[str, list[float]] = {}
    direct_io = False
    log.info("%s, %s tokens, pool %d MiB", setup.device, setup.lengths, pool >> 20)
    try:
        with running_fleet(cfg):
            # One engine up before the next starts: vLLM sizes a GPU engine's KV cache from the
            # device's free memory, which an engine starting beside it takes (both failed so).
            # A fresh engine's first request also pays its warm-up.
            ucm = setup.remote.remote(setup.model, setup.kv_config, **setup.engine_args)
            ttft(ucm, synthetic_prompt(setup.model, min(setup.lengths), seed=7))
            none = setup.remote.remote(setup.model, None, **setup.engine_args)
            ttft(none, synthetic_prompt(setup.model, min(setup.lengths), seed=7))
            for r in range(args.rounds):
                for length in setup.lengths:
                    got = measure(ucm, none, cfg, setup, length, 100 * r + length)
                    for case, value in got.items():
                        results.setdefault(length, {}).setdefault(case, []).append(value)
            if args.decode_rounds:
                decode = decode_while_demoting(ucm, cfg, setup, args.decode_rounds)
            direct_io = fleet_status(cfg)["shards"][0]["disk_direct_io"]
    finally:
        ray.shutdown()
        shutil.rmtree(disk_dir, ignore_errors=True)  # the tier's files (nothing purges a benchmark's)
    medians = {n: {case: median(v) for case, v in cases.items()} for n, cases in results.items()}
    print(f"\ndevice={setup.device} disk_dir_fs={file_system(args.dir)} disk_direct_io={direct_io}")
    print(f"{'tokens':>7} {'recompute ms':>13} {'DRAM hit ms':>12} {'disk hit ms':>12}")
    for n, m in medians.items():
        print(f"{n:>7} {m['recompute'] * 1e3:>13.1f} {m['dram_hit'] * 1e3:>12.1f} {m['disk_hit'] * 1e3:>12.1f}")
    for n, m in medians.items():
        print(f"disk_hit_vs_recompute_{tag(n)}={m['disk_hit'] / m['recompute']:.3f} "
              f"disk_hit_vs_dram_hit_{tag(n)}={m['disk_hit'] / m['dram_hit']:.3f}")
    if decode:
        quiet = median(decode["quiet"] + decode["quiet_b"])
        print(f"disk_decode_demoting_vs_quiet={median(decode['demoting']) / quiet:.3f} "
              f"disk_decode_quiet_b_vs_quiet={median(decode['quiet_b']) / median(decode['quiet']):.3f} (noise)")
    if medians:  # --rounds 0: the decode figures only
        print("disk_crossover_tokens=" + crossover(setup.lengths, [medians[n]["disk_hit"] for n in setup.lengths],
                                                   [medians[n]["recompute"] for n in setup.lengths]))


if __name__ == "__main__":
    main()
