import argparse

import pytest

from ucm_ray.config import ConfigError, UcmRayConfig, parse_size


def test_defaults_are_valid():
    cfg = UcmRayConfig()
    assert cfg.num_shards >= 1 and cfg.replication == 1 and cfg.transport == "auto"


def test_from_dict_coerces_strings_and_sizes():
    cfg = UcmRayConfig.from_dict({"num_shards": "4", "pool_bytes": "2GiB", "layerwise": "false",
                                  "replication": 2, "lease_s": "1.5",
                                  "transfer_timeout_s": "0.75"})
    assert cfg.num_shards == 4 and cfg.pool_bytes == 2 << 30 and cfg.layerwise is False
    assert cfg.replication == 2 and cfg.lease_s == 1.5


def test_a_lease_shorter_than_two_step_deadlines_is_refused():
    with pytest.raises(ConfigError,
                       match=r"lease_s: 15 is not allowed; expected at least 2 x transfer_timeout_s \(20\)"):
        UcmRayConfig(lease_s=15, transfer_timeout_s=10)


@pytest.mark.parametrize("data, names", [
    ({"pool_size": "1GiB"}, ["pool_size", "pool_bytes"]),        # unknown key lists allowed keys
    ({"transport": "tcp"}, ["transport", "auto | shm | nixl"]),
    ({"num_shards": 0}, ["num_shards", ">= 1"]),
    ({"num_shards": 2, "replication": 3}, ["replication", "num_shards"]),
    ({"pool_bytes": "lots"}, ["pool_bytes", "1GiB"]),
    ({"layerwise": "maybe"}, ["layerwise", "true or false"]),
    ({"num_shards": 2.5}, ["num_shards", "integer"]),
    ({"lookup_timeout_s": -1}, ["lookup_timeout_s", "> 0"]),
    ({"namespace": ""}, ["namespace"]),
])
def test_bad_input_names_the_key(data, names):
    with pytest.raises(ConfigError) as e:
        UcmRayConfig.from_dict(data)
    for n in names:
        assert n in str(e.value)


def test_ignore_foreign_keys():
    cfg = UcmRayConfig.from_dict({"num_shards": 3, "vllm_thing": 1}, ignore=("vllm_thing",))
    assert cfg.num_shards == 3


def test_yaml_and_cli_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("num_shards: 5\npool_bytes: 64MiB\ntransport: nixl\n")
    assert UcmRayConfig.from_yaml(f).num_shards == 5
    parser = argparse.ArgumentParser()
    UcmRayConfig.add_cli_arguments(parser)
    args = parser.parse_args(["--config", str(f), "--num-shards", "6", "--no-layerwise"])
    cfg = UcmRayConfig.from_cli(args)
    assert (cfg.num_shards, cfg.pool_bytes, cfg.transport, cfg.layerwise) == (6, 64 << 20, "nixl", False)


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        UcmRayConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        UcmRayConfig.from_yaml(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("num_shard: 2\n")
    with pytest.raises(ConfigError, match="num_shard"):
        UcmRayConfig.from_yaml(typo)


def test_parse_size_units():
    assert parse_size("1KiB", "k") == 1024 and parse_size("1K", "k") == 1000
    assert parse_size("512MiB", "k") == 512 << 20 and parse_size(4096, "k") == 4096
    assert parse_size("1.5GiB", "k") == 3 << 29
