"""The seed's hit policy, exact, through vLLM's real Scheduler and real shards."""

from __future__ import annotations

import pytest

from tests.sched_harness import make_engine, prompt, write_model_dir


@pytest.fixture
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("model")))


@pytest.fixture
def store(fleet):
    return fleet(num_shards=2, transport="shm", pool_bytes=64 << 20)


# Seed table 1: QwQ-32B-like, block 128, k = 3, layerwise (recompute 5), 8192 tokens cached.
# (request B length, external hit tokens returned, tokens vLLM computes)
DENSE_ROWS = [
    (8192, 8187, 5),
    (8193, 8188, 5),
    (8196, 8191, 5),
    (8197, 8192, 5),
    (8200, 8192, 8),
]


def test_dense_seed_table(store, model_dir):
    a = make_engine(store, model_dir, num_spec=3)
    assert a.connector.scheduler_part.recompute == 5
    p = prompt(8200)
    assert a.serve("A", p[:8192]) == (0, 8192)  # cold: everything computed, then saved
    for n, ext, computed in DENSE_ROWS:
        b = make_engine(store, model_dir, num_spec=3)  # a fresh engine: no local prefix cache
        got = b.serve(f"B{n}", p[:n])
        assert got == (ext, computed), f"request of {n} tokens: got {got}, seed says {(ext, computed)}"
    b = make_engine(store, model_dir, num_spec=3)
    assert b.serve("other", prompt(8192, seed=1)) == (0, 8192)  # different prompt: no hit


def test_non_layerwise_recomputes_one_token(store, model_dir):
    a = make_engine(store, model_dir, layerwise=False)
    p = prompt(1024)
    a.serve("A", p)
    b = make_engine(store, model_dir, layerwise=False)
    assert b.connector.scheduler_part.recompute == 1
    assert b.serve("B", p) == (1023, 1)


def test_local_hit_combined_with_external_hit(store, model_dir):
    a = make_engine(store, model_dir)
    p = prompt(4096 + 300)
    a.serve("A", p[:4096])
    b = make_engine(store, model_dir)
    b.serve("warm", p[:1024 + 50])  # B's own prefix cache now holds 8 blocks (1024 tokens)
    req = b.add("B", p)
    b.run(req)
    assert b.first["B"] == (4096, 300)
    assert b.loaded_blocks["B"] == (4096 - 1024) // 128  # the first 8 blocks came from B's own cache


# Seed tables 2 and 3: hybrid, LCM block 2048, truncate before lookup, states only at chunk ends.
# vLLM 0.32 itself ends a prefill chunk at the last cacheable boundary before the prompt's end
# (an 8192-token prompt runs as 6144 + 2048), so the seed's single-chunk store state (only the
# chunk-end state at 8192) is made by an 8193-token request A, whose first chunk is [0, 8192).
# (A's length, A's max_num_batched_tokens, k, request B length, external tokens, tokens computed)
HYBRID_ROWS = [
    # table 2, with MTP (k = 3): states at 6144 and 8192
    (8192, 8192, 3, 8192, 6144, 2048),
    (8192, 8192, 3, 8193, 6144, 2049),
    (8192, 8192, 3, 8196, 6144, 2052),
    (8192, 8192, 3, 8197, 8192, 5),
    (8192, 8192, 3, 8200, 8192, 8),
    # table 3, without MTP (k = 0): only the chunk-end state at 8192
    (8193, 8192, 0, 8192, 0, 8192),  # graceful degradation to 0
    (8193, 8192, 0, 8194, 8192, 2),
    (8193, 8192, 0, 8200, 8192, 8),
    # max_num_batched_tokens == lcm: a state at every boundary, so truncation keeps 3 blocks
    (8192, 2048, 0, 8192, 6144, 2048),
]


@pytest.mark.parametrize("a_len, a_chunk, k, n, ext, computed", HYBRID_ROWS)
def test_hybrid_seed_tables(store, model_dir, a_len, a_chunk, k, n, ext, computed):
    p = prompt(8200, seed=a_len + a_chunk + k)
    a = make_engine(store, model_dir, block_size=2048, hybrid=True, num_spec=k, max_batched=a_chunk)
    assert a.connector.scheduler_part.recompute == 2 + k
    a.serve("A", p[:a_len])
    b = make_engine(store, model_dir, block_size=2048, hybrid=True, num_spec=k, max_batched=8192)
    got = b.serve("B", p[:n])
    assert got == (ext, computed), f"A={a_len}/{a_chunk}, k={k}, B={n}: got {got}, seed says {(ext, computed)}"


def test_hybrid_different_prompt_no_hit(store, model_dir):
    a = make_engine(store, model_dir, block_size=2048, hybrid=True, num_spec=3)
    a.serve("A", prompt(8192, seed=11))
    b = make_engine(store, model_dir, block_size=2048, hybrid=True, num_spec=3)
    assert b.serve("B", prompt(8192, seed=12)) == (0, 8192)


def test_lookup_in_flight_for_several_steps(store, model_dir):
    """A shard that does not answer (its process stopped) defers the request, never blocks
    the scheduler; when it answers, the hit is taken."""
    import os
    import signal

    from ucm_ray.store.fleet import fleet_status

    a = make_engine(store, model_dir)
    p = prompt(2048)
    a.serve("A", p)
    b = make_engine(store, model_dir)
    pids = [s["pid"] for s in fleet_status(store)["shards"]]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        req = b.add("B", p + [5] * 10)
        for _ in range(5):
            b.step()  # returns at once each time: the request waits, nothing is scheduled
        assert b.deferred["B"] == 5 and "B" not in b.first
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    b.run(req)
    assert b.first["B"] == (2048, 10)


def test_preempted_request_resumes_with_a_store_hit(store, model_dir):
    """Out of KV blocks, vLLM preempts a request; when it comes back its prefix is loaded
    from the store instead of recomputed."""
    eng = make_engine(store, model_dir, num_blocks=24)
    x = eng.add("X", prompt(1280, seed=3), max_tokens=400)
    y = eng.add("Y", prompt(1280, seed=4), max_tokens=400)
    eng.run(x, y)
    preempted = [r for r in (x, y) if r.num_preemptions > 0]
    assert preempted, "the scenario must preempt a request"
    for r in preempted:
        # On resume the whole prompt (10 blocks) is back without recompute: what vLLM's own
        # cache lost to the other request came from the store.
        assert min(eng.resumed_at[r.request_id]) >= 1280
        assert eng.loaded_blocks.get(r.request_id, 0) > 0


def test_per_process_block_hashes_are_refused_at_start_up(store, model_dir, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='xxhash'.*PYTHONHASHSEED"):
        make_engine(store, model_dir, hash_algo="xxhash")


def test_bad_connector_config_is_named_at_start_up(store, model_dir):
    from ucm_ray.config import ConfigError

    with pytest.raises(ConfigError, match="unknown key.*lookup_timout_s.*allowed keys"):
        make_engine(store, model_dir, extra={"lookup_timout_s": 1})
    with pytest.raises(ConfigError, match="replication"):
        make_engine(store, model_dir, extra={"replication": 5})
