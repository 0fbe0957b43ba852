"""Both connector halves (``ucm_ray.testing.harness``) on real Ray shards: what only the Ray
store can show. The seed's tables and the in-process faults are in ``test_two_halves.py``."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from ucm_ray.config import ConfigError
from ucm_ray.store.engine.client import StoreClient
from ucm_ray.store.shard.fleet import fleet_status
from ucm_ray.testing.harness import make_engine, prompt, write_model_dir


@pytest.fixture
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("model")))


@pytest.fixture
def store(fleet):
    return fleet(num_shards=2, transport="shm", pool_bytes=64 << 20)


def test_dense_hit_through_ray_shards(store, model_dir):
    a = make_engine(StoreClient(store), model_dir, config=store)
    p = prompt(2048 + 100)
    a.serve("A", p[:2048])
    a.settle()
    b = make_engine(StoreClient(store), model_dir, config=store)
    assert b.serve("B", p) == (2048, 100)
    assert b.loaded_blocks["B"] == 16 and b.wrong_blocks == 0 and b.failed_loads == 0


def mapped_files() -> set[str]:
    """Files this process has mapped (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        return {fields[5] for fields in map(str.split, f) if len(fields) > 5}


def test_a_fresh_engine_maps_the_fleets_pools_before_its_first_request(store, model_dir):
    """Opening a pool (mapping all of it; on a GPU also page-locking it, ~0.3 s a GiB) was left
    to the engine's first step, so a fresh engine's first store hit paid for it in its TTFT:
    132 ms of a 339 ms store hit with two 512 MiB pools on the CPU box, where the next hits
    spent 6.5 ms loading. The worker opens the pools its directory lists as the engine starts."""
    pools = StoreClient(store).pools().descriptors
    paths = {desc.shm_path for desc in pools.values()}
    assert len(paths) == 2 and not paths & mapped_files()  # this test's fleet: nothing mapped yet
    engine = make_engine(StoreClient(store), model_dir, config=store)
    assert paths <= mapped_files(), "the engine's worker left the pools to its first step"
    p = prompt(1024 + 50)
    a = make_engine(StoreClient(store), model_dir, config=store)
    a.serve("A", p[:1024])
    a.settle()
    assert engine.serve("B", p) == (1024, 50)  # a pool opened at start serves loads as before
    assert engine.loaded_blocks["B"] == 8 and engine.wrong_blocks == 0 and engine.failed_loads == 0


@pytest.mark.parametrize("local_lookups", [False, True])
def test_lookup_in_flight_for_several_steps(store, model_dir, local_lookups):
    """A shard that does not answer (its process stopped) defers the request, never blocks
    the scheduler; when it answers, the hit is taken. Its published index needs no answer:
    with local lookups the hit is taken at once, loaded from the stopped shard's pool."""
    a = make_engine(StoreClient(store), model_dir, config=store)
    p = prompt(2048)
    a.serve("A", p)
    a.settle()
    config = dataclasses.replace(store, local_lookups=local_lookups)
    b = make_engine(StoreClient(config), model_dir, config=config)
    pids = [s["pid"] for s in fleet_status(store)["shards"]]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        req = b.add("B", p + [5] * 10)
        for _ in range(5):
            b.step()  # returns at once each time: the request waits, nothing is scheduled
        if local_lookups:
            assert b.deferred.get("B", 0) == 0 and b.first["B"] == (2048, 10)
        else:
            assert b.deferred["B"] == 5 and "B" not in b.first
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    b.run(req)
    assert b.first["B"] == (2048, 10) and b.wrong_blocks == 0 and b.failed_loads == 0


def test_per_process_block_hashes_are_refused_at_start_up(store, model_dir, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='xxhash'.*PYTHONHASHSEED"):
        make_engine(StoreClient(store), model_dir, config=store, hash_algo="xxhash")


def test_bad_connector_config_is_named_at_start_up(store, model_dir):
    with pytest.raises(ConfigError, match="unknown key.*lookup_timout_s.*allowed keys"):
        make_engine(StoreClient(store), model_dir, config=store, extra={"lookup_timout_s": 1})
    with pytest.raises(ConfigError, match="replication"):
        make_engine(StoreClient(store), model_dir, config=store, extra={"replication": 5})


def test_a_cold_lookup_that_cannot_read_the_indexes_makes_no_extra_call(store, model_dir):
    """The first-block probe answers from this node's published indexes only. An engine that
    cannot read them (another node's shards; here ``local_lookups=False``) asks the shards for
    the prompt's keys once: no call of its own for the first block before the full lookup."""
    config = dataclasses.replace(store, local_lookups=False)
    a = make_engine(StoreClient(config), model_dir, config=config)

    def keys_asked() -> int:
        return sum(s["lookups"] for s in fleet_status(store)["shards"])

    before = keys_asked()
    assert a.serve("cold", prompt(2048, seed=9)) == (0, 2048)
    assert keys_asked() - before == 16  # its 16 blocks' keys, each asked of its owner once
