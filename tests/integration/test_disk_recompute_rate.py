"""Promote or recompute, by the asking engine's own prefill rate: vLLM's real scheduler with the
connector (the two-halves harness) on a real Ray shard with a write-through disk tier, and
``disk_recompute_bytes_s`` left at 0 (measured by the engines).

Three prompts are written and pushed out of the pool (six prompts' worth) onto the disk. A slow engine (its prefill
steps take a second on its clock: 0.5 MB of KV a second) has its disk hit read; an engine that
recomputes 2,048 tokens in a microsecond (5e11 B/s: no disk reads that fast) gets a miss and
recomputes, right after, with the disk's read cost measured; the slow engine's next disk hit is
read again. Every loaded block holds what computing it writes (the harness checks each)."""

from __future__ import annotations

import time

import pytest

from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.fleet import fleet_status
from ucm_ray.testing.harness import make_engine, prompt, write_model_dir

TOKENS = 2048
BLOCKS = TOKENS // 128
ENTRY = 128 * 2 * 16 * 2 * 4  # the harness's 128-token block: 2 layers, 1 head of 16, K and V, float32
SUFFIX = 100


@pytest.fixture
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("model")))


def shard(cfg) -> dict:
    return fleet_status(cfg)["shards"][0]


def wait_demoted(cfg, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (status := shard(cfg))["disk_behind"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    return status


def test_a_fast_engine_recomputes_what_a_slow_one_reads_from_disk(fleet, tmp_path, model_dir):
    cfg = fleet(num_shards=1, transport="shm", pool_bytes=6 * BLOCKS * ENTRY + (64 << 10), disk_dir=str(tmp_path),
                disk_bytes=64 * BLOCKS * ENTRY, disk_write_policy="through", disk_wait_s=10.0)
    assert cfg.disk_recompute_bytes_s == 0  # the engines' own rates decide
    on_disk = [prompt(TOKENS + SUFFIX, seed=s) for s in (1, 2, 3)]
    writer = make_engine(StoreClient(cfg), model_dir, config=cfg)
    for n, p in enumerate(on_disk + [prompt(TOKENS, seed=s) for s in range(10, 16)]):
        writer.serve(f"w{n}", p[:TOKENS])  # the last six push the first three out of the pool
        writer.settle()
        wait_demoted(cfg)
    status = shard(cfg)
    assert status["evictions"] >= 3 * BLOCKS and status["evicted_dirty"] == 0, status
    writer.shutdown()  # its slots reserved ahead go back: room for the promotions

    slow = make_engine(StoreClient(cfg), model_dir, config=cfg)
    slow.before_worker = lambda engine, meta: engine.clock.advance(1.0)  # each step: a second
    slow.serve("s0", prompt(TOKENS, seed=7))
    slow.before_worker = None
    assert slow.connector.scheduler_part.prefill_rate.bytes_per_s == pytest.approx(TOKENS * 256 / 1.0, rel=0.05)
    fast = make_engine(StoreClient(cfg), model_dir, config=cfg)
    fast.clock.freeze()  # only what the forward "takes" counts
    fast.before_worker = lambda engine, meta: engine.clock.advance(1e-6)
    fast.serve("f0", prompt(TOKENS, seed=8))
    assert fast.connector.scheduler_part.prefill_rate.bytes_per_s >= 1e11

    before = shard(cfg)
    got = slow.serve("s1", on_disk[0])  # read from disk: the first read measures it
    read = shard(cfg)
    assert got == (TOKENS, SUFFIX), (got, {k: (before[k], v) for k, v in read.items() if before[k] != v})
    assert read["disk_promoted"] - before["disk_promoted"] == BLOCKS, read
    # the read side of the decision, as the shard's status shows it: nothing fitted before a read
    assert (before["disk_read_fixed_s"], before["disk_read_s_per_byte"]) == (0.0, 0.0)
    assert read["disk_read_s_per_byte"] > 0 or read["disk_read_fixed_s"] > 0, read
    assert fast.serve("f1", on_disk[1]) == (0, TOKENS + SUFFIX)  # recomputing is faster: a miss
    skipped = shard(cfg)
    assert skipped["disk_promoted"] == read["disk_promoted"], skipped
    assert skipped["disk_promote_skipped"] - read["disk_promote_skipped"] == BLOCKS, skipped
    assert slow.serve("s2", on_disk[2]) == (TOKENS, SUFFIX)  # a slow engine's hits are still read
    assert shard(cfg)["disk_promoted"] - skipped["disk_promoted"] == BLOCKS
    for engine in (slow, fast):
        assert engine.wrong_blocks == 0 and engine.failed_loads == 0
        engine.settle()
        engine.shutdown()
