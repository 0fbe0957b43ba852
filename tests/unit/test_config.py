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
    ({"placement": "spread"}, ["placement", "writer_local | per_block"]),
    ({"num_shards": 0}, ["num_shards", "between 1 and 1024"]),
    ({"num_shards": 2, "replication": 3}, ["replication", "num_shards"]),
    ({"pool_bytes": "lots"}, ["pool_bytes", "1GiB"]),
    ({"layerwise": "maybe"}, ["layerwise", "true or false"]),
    ({"num_shards": 2.5}, ["num_shards", "integer"]),
    ({"lookup_timeout_s": -1}, ["lookup_timeout_s", "between 0.01 and 3600"]),
    ({"namespace": ""}, ["namespace"]),
    # Limits (issue 10): each accepted before, each surely a mistake.
    ({"lease_s": float("inf")}, ["lease_s", "between 0.1 and 86400"]),
    ({"lease_s": "inf"}, ["lease_s", "between 0.1 and 86400"]),
    ({"lease_s": float("nan")}, ["lease_s", "between 0.1 and 86400"]),
    ({"lease_s": 1e-9}, ["lease_s", "between 0.1 and 86400"]),
    ({"lease_s": 10**400}, ["lease_s"]),                      # float() overflows: still a ConfigError
    ({"transfer_timeout_s": 1e-6}, ["transfer_timeout_s", "between 0.01"]),
    ({"reserve_timeout_s": 1e9}, ["reserve_timeout_s", "86400"]),
    ({"pool_bytes": 2**70}, ["pool_bytes", "16 TiB"]),
    ({"pool_bytes": "17TiB"}, ["pool_bytes", "16 TiB"]),
    ({"pool_bytes": "1.9"}, ["pool_bytes", "whole number of bytes"]),
    ({"pool_bytes": 4096.5}, ["pool_bytes", "whole number of bytes"]),
    ({"pool_bytes": "0.3KiB"}, ["pool_bytes", "whole number of bytes"]),
    ({"pool_bytes": "\u0664\u0660\u0669\u0666"}, ["pool_bytes", "byte size"]),  # non-ASCII digits
    ({"shm_dir": "/nonexistent/ucm"}, ["shm_dir", "existing directory"]),
    ({"shm_dir": "dev/shm"}, ["shm_dir", "absolute path"]),
    ({"shm_dir": "/dev/null"}, ["shm_dir", "existing directory"]),  # exists, not a directory
    ({"shm_dir": "/dev\0/shm"}, ["shm_dir"]),
    ({"ray_namespace": "../x"}, ["ray_namespace", "letters, digits"]),
    ({"ray_namespace": ".hidden"}, ["ray_namespace", "not starting with '.'"]),
    ({"ray_namespace": "a/b"}, ["ray_namespace"]),
    ({"ray_namespace": "x" * 65}, ["ray_namespace", "1 to 64"]),
    ({"namespace": " "}, ["namespace", "letters, digits"]),
    ({"namespace": "-x"}, ["namespace"]),
    ({"namespace": 7}, ["namespace", "string"]),
    ({"ray_address": "127.0.0.1: 6379"}, ["ray_address", "no spaces"]),
    ({"ray_address": "--"}, ["ray_address", "not starting with '-'"]),
    ({"num_shards": 10**6}, ["num_shards", "between 1 and 1024"]),
    ({"num_shards": "9" * 5000}, ["num_shards", "integer"]),
    ({"shard_cpus": float("inf")}, ["shard_cpus"]),
    ({"shard_cpus": 0.00001}, ["shard_cpus", "0.0001"]),     # Ray refuses it later, far from the cause
    ({"checksum": 2}, ["checksum", "true or false"]),
    ({"local_lookups": "sometimes"}, ["local_lookups", "true or false"]),
    ({"load_at_once_ratio": -1}, ["load_at_once_ratio", "between 0 (never) and"]),
    ({"load_at_once_ratio": 2.5}, ["load_at_once_ratio", "integer"]),
    ({"load_at_once_ratio": True}, ["load_at_once_ratio"]),
    ({"disk_dir": "relative/dir", "disk_bytes": "1GiB"}, ["disk_dir", "absolute paths"]),
    ({"disk_dir": "/nonexistent/ucm", "disk_bytes": "1GiB"}, ["disk_dir", "existing directories"]),
    ({"disk_dir": "/tmp,/tmp", "disk_bytes": "1GiB"}, ["disk_dir", "distinct"]),
    ({"disk_dir": "/tmp"}, ["disk_bytes", "at least 4096", "when disk_dir is set"]),
    ({"disk_bytes": "1GiB"}, ["disk_bytes", "0 when disk_dir is empty"]),
    ({"disk_dir": "/tmp", "disk_bytes": "1025TiB"}, ["disk_bytes", "1 PiB"]),
    ({"disk_dir": "/tmp", "disk_bytes": "1.5"}, ["disk_bytes", "whole number of bytes"]),
    ({"disk_write_policy": "around"}, ["disk_write_policy", "back | through"]),
    ({"disk_io": "nixl"}, ["disk_io", "auto | posix", "nixl is not built yet"]),
    ({"disk_wait_s": 0}, ["disk_wait_s", "above 0"]),
    ({"disk_dir": "/tmp", "disk_bytes": "1GiB", "disk_wait_s": 6}, ["disk_wait_s", "below lookup_timeout_s (5)"]),
    ({"bad\nkey": 1}, ["'bad\\nkey'", "allowed keys"]),    # shown on one line
    ({3: 1}, ["3", "allowed keys"]),                          # a YAML int key, sorted beside str keys
    ({3: 1, "a": 2}, ["3", "a", "allowed keys"]),
])
def test_bad_input_names_the_key(data, names):
    with pytest.raises(ConfigError) as e:
        UcmRayConfig.from_dict(data)
    for n in names:
        assert n in str(e.value)
    assert len(str(e.value).splitlines()) == 1, str(e.value)


def test_the_disk_tier_is_off_by_default_and_takes_several_roots(tmp_path):
    assert UcmRayConfig().disk_roots == () and UcmRayConfig().disk_bytes == 0
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    cfg = UcmRayConfig.from_dict({"disk_dir": f"{a}, {b}", "disk_bytes": "500GiB", "disk_write_policy": "through"})
    assert cfg.disk_roots == (str(a), str(b)) and cfg.disk_bytes == 500 << 30
    assert (cfg.disk_write_policy, cfg.disk_io) == ("through", "auto")


def test_whole_sizes_are_fine():
    assert UcmRayConfig.from_dict({"pool_bytes": "1.5GiB"}).pool_bytes == 3 << 29
    assert UcmRayConfig.from_dict({"pool_bytes": "4.5KiB"}).pool_bytes == 4608
    assert UcmRayConfig.from_dict({"pool_bytes": 8192.0}).pool_bytes == 8192
    assert UcmRayConfig.from_dict({"pool_bytes": "16TiB"}).pool_bytes == 16 << 40


def test_limits_are_inclusive():
    cfg = UcmRayConfig.from_dict({"num_shards": 1024, "lookup_timeout_s": 0.01, "transfer_timeout_s": 0.05,
                                  "lease_s": 0.1, "reserve_timeout_s": 86400, "shard_cpus": 0,
                                  "namespace": "a", "ray_namespace": "_" + "x.-" * 21})
    assert cfg.num_shards == 1024 and cfg.shard_cpus == 0


def test_settings_that_are_not_a_mapping():
    with pytest.raises(ConfigError, match="must be a mapping"):
        UcmRayConfig.from_dict(["num_shards", 2])  # type: ignore[arg-type]


def test_shm_dir_must_exist_where_the_config_is_built(tmp_path):
    assert UcmRayConfig.from_dict({"shm_dir": str(tmp_path)}).shm_dir == str(tmp_path)
    (tmp_path / "f").write_text("")
    for bad in (tmp_path / "missing", tmp_path / "f"):
        with pytest.raises(ConfigError, match=r"^shm_dir: .* expected an existing directory"):
            UcmRayConfig.from_dict({"shm_dir": str(bad)})


def test_cli_refuses_a_fractional_byte_count():
    parser = argparse.ArgumentParser()
    UcmRayConfig.add_cli_arguments(parser)
    with pytest.raises(ConfigError, match=r"^pool_bytes: '1\.9' is not a whole number of bytes$"):
        UcmRayConfig.from_cli(parser.parse_args(["--pool-bytes", "1.9"]))
    assert UcmRayConfig.from_cli(parser.parse_args(["--pool-bytes", "1.5GiB"])).pool_bytes == 3 << 29


def test_timeout_relations_name_the_key():
    with pytest.raises(ConfigError, match=r"^reserve_timeout_s: .*at least 2 x transfer_timeout_s \(4\)$"):
        UcmRayConfig(transfer_timeout_s=2, reserve_timeout_s=3)
    # A value bad on its own is named before any relation it also breaks.
    with pytest.raises(ConfigError, match=r"^transfer_timeout_s: "):
        UcmRayConfig(transfer_timeout_s=1e6)


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
    with pytest.raises(ConfigError, match="^k: '1.9' is not a whole number of bytes$"):
        parse_size("1.9", "k")
