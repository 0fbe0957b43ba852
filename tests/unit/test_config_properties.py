"""Property tests of the config loader and the CLI flags (hypothesis).

Every valid config round-trips through ``to_dict``/``from_dict``, YAML and CLI flags; every
invalid value of any key is refused with a one-line ``ConfigError`` that starts with that key.
Values are built valid or invalid by construction, not by re-running the validator's rules.
"""

from __future__ import annotations

import argparse
import tempfile

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucm_ray.config import (
    DISK_IO,
    DISK_WRITE_POLICIES,
    NIXL_STAGING,
    PLACEMENTS,
    TRANSPORTS,
    ConfigError,
    UcmRayConfig,
)

FAST = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
_EXISTING_DIR = tempfile.gettempdir()

# --- valid ---------------------------------------------------------------------------------

_NAME_HEAD = "abcXYZ019_"
_NAME_TAIL = _NAME_HEAD + ".-"


def _names(max_len: int) -> st.SearchStrategy[str]:
    return st.builds(lambda h, t: h + t, st.sampled_from(_NAME_HEAD),
                     st.text(alphabet=_NAME_TAIL, max_size=max_len - 1))


_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KiB": 1024, "MiB": 1 << 20, "GB": 1000**3,
          "GiB": 1 << 30, "TiB": 1 << 40, "mib": 1 << 20}


@st.composite
def _pool_bytes(draw: st.DrawFn) -> tuple[object, int]:
    """(what the user writes, the bytes it means)."""
    unit = draw(st.sampled_from(sorted(_UNITS)))
    scale = _UNITS[unit]
    lo, hi = -(-4096 // scale), (16 << 40) // scale
    n = draw(st.integers(lo, hi))
    if unit == "":
        return draw(st.sampled_from([n, str(n), float(n)])), n
    if scale % 2 == 0 and n < hi and draw(st.booleans()):
        return f"{n}.5{unit}", n * scale + scale // 2  # a half unit is whole bytes
    return f"{n} {unit}", n * scale


def _seconds(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


@st.composite
def valid_settings(draw: st.DrawFn) -> tuple[dict[str, object], dict[str, object]]:
    """(settings as a user may write them, the values they mean)."""
    num_shards = draw(st.integers(1, 1024))
    pool_raw, pool = draw(_pool_bytes())
    transfer = draw(_seconds(0.01, 3600))
    disk_dir = draw(st.sampled_from(["", _EXISTING_DIR, f"{_EXISTING_DIR},/dev/shm", f" {_EXISTING_DIR} ,"]))
    disk_roots = [p for p in disk_dir.split(",") if p.strip()]
    # with a disk tier, a promotion's bound stays below the engine's lookup timeout
    lookup = draw(_seconds(1.0, 3600)) if disk_roots else draw(_seconds(0.01, 3600))
    meant: dict[str, object] = {
        "namespace": draw(_names(128)),
        "ray_namespace": draw(_names(64)),
        "model_id": draw(st.one_of(st.just(""), st.sampled_from(["meta-llama/Llama-3.1-8B", "/models/llama 8b"]),
                                   st.text(st.characters(categories=["L", "N", "P", "S"]), max_size=40))),
        "ray_address": draw(st.one_of(st.sampled_from(["auto", "127.0.0.1:6379", "ray://10.0.0.1:10001"]),
                                      st.text(st.characters(categories=["L", "N", "P", "S"]),
                                              min_size=1, max_size=40).filter(lambda a: not a.startswith("-")))),
        "num_shards": num_shards,
        "pool_bytes": pool,
        "replication": draw(st.integers(1, num_shards)),
        "transport": draw(st.sampled_from(TRANSPORTS)),
        "nixl_stage_through_host": draw(st.sampled_from(NIXL_STAGING)),
        "placement": draw(st.sampled_from(PLACEMENTS)),
        "hot_prefix_asks": draw(st.integers(0, 1_000_000)),
        "remote_copy_reads": draw(st.integers(0, 1_000_000)),
        "copy_nodes_per_pool": draw(st.integers(0, 1_000_000)),
        "layerwise": draw(st.booleans()),
        "load_at_once_ratio": draw(st.integers(0, 1 << 20)),
        "lookup_timeout_s": lookup,
        "transfer_timeout_s": transfer,
        "lease_s": draw(_seconds(max(0.1, 2 * transfer), 86400)),
        "reserve_timeout_s": draw(_seconds(max(0.1, 2 * transfer), 86400)),
        "checksum": draw(st.booleans()),
        "local_lookups": draw(st.booleans()),
        "relay_hot_copies": draw(st.booleans()),
        "relay_membership": draw(st.booleans()),
        "pick_by_load": draw(st.booleans()),
        "shm_dir": draw(st.sampled_from(["/dev/shm", _EXISTING_DIR])),
        "shard_cpus": draw(st.one_of(st.just(0.0), _seconds(0.0001, 1024))),
        "pd_wait_s": draw(st.one_of(st.just(0.0), _seconds(0.0001, 600))),
        "state_slot_wait_s": draw(st.one_of(st.just(0.0), _seconds(0.0001, 600))),
        "disk_dir": disk_dir,
        "disk_bytes": draw(st.integers(4096 * len(disk_roots), 1 << 50)) if disk_roots else 0,
        "disk_write_policy": draw(st.sampled_from(DISK_WRITE_POLICIES)),
        "disk_io": draw(st.sampled_from(DISK_IO)),
        "disk_wait_s": draw(_seconds(0.0001, 0.99)) if disk_roots else draw(_seconds(0.0001, 3600)),
        "disk_recompute_bytes_s": draw(_seconds(0.0, 1e13)),
    }
    written: dict[str, object] = {}
    for key, value in meant.items():
        if key == "pool_bytes":
            written[key] = pool_raw
        elif isinstance(value, bool):
            written[key] = draw(st.sampled_from([value, str(value).lower(), "on" if value else "off"]))
        elif isinstance(value, (int, float)) and draw(st.booleans()):
            written[key] = repr(value)  # YAML and environment values arrive as strings
        else:
            written[key] = value
    keep = draw(st.sets(st.sampled_from(sorted(meant))))  # any subset of keys may be left out
    keep |= {"lease_s", "reserve_timeout_s", "transfer_timeout_s", "num_shards", "replication",
             "disk_dir", "disk_bytes"}  # a disk tier needs both
    if disk_roots and "lookup_timeout_s" in keep:
        keep.add("disk_wait_s")  # the default (2 s) may not be below a drawn lookup timeout (>= 1 s)
    return {k: written[k] for k in keep}, {k: meant[k] for k in keep}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    UcmRayConfig.add_cli_arguments(parser)
    return parser


def _argv(settings_: dict[str, object]) -> list[str]:
    argv = []
    for key, value in settings_.items():
        flag = "--" + key.replace("_", "-")
        if key in ("layerwise", "checksum", "local_lookups", "relay_hot_copies", "relay_membership",
                   "pick_by_load"):
            on = value is True or str(value).lower() in ("true", "1", "yes", "on")
            argv.append(flag if on else "--no-" + flag[2:])
        else:
            argv.append(f"{flag}={value}")  # '=' keeps a value starting with '-' a value
    return argv


@FAST
@given(valid_settings())
def test_valid_settings_load_and_round_trip(case):
    written, meant = case
    cfg = UcmRayConfig.from_dict(written)
    for key, value in meant.items():
        assert getattr(cfg, key) == value, key
    assert UcmRayConfig.from_dict(cfg.to_dict()) == cfg
    assert UcmRayConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg
    parser = _parser()
    assert UcmRayConfig.from_cli(parser.parse_args(_argv(cfg.to_dict()))) == cfg
    assert UcmRayConfig.from_cli(parser.parse_args(_argv(written))) == cfg


# --- invalid -------------------------------------------------------------------------------

_GARBAGE = st.text(st.characters(exclude_categories=["Nd"], exclude_characters="0123456789"), max_size=12)
_NOT_A_STRING = st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=2))
_NON_FINITE = st.sampled_from([float("inf"), float("-inf"), float("nan"), "inf", "nan", "-Infinity"])


def _bad_name(max_len: int) -> st.SearchStrategy[object]:
    return st.one_of(
        st.just(""), st.just("x" * (max_len + 1)), st.sampled_from(["../x", " ", "a b", ".x", "-x", "a/b", "é"]),
        st.builds(lambda a, c, b: a + c + b, _names(20), st.sampled_from(" /\\:\n\t\0*?é$\u2028"),
                  st.text(alphabet=_NAME_TAIL, max_size=5)),
        _NOT_A_STRING)


def _bad_seconds(lo: float, hi: float) -> st.SearchStrategy[object]:
    too_small = st.floats(max_value=lo, exclude_max=True, allow_nan=False)
    too_large = st.floats(min_value=hi, exclude_min=True, allow_nan=False)
    return st.one_of(too_small, too_large, too_small.map(repr), too_large.map(repr), _NON_FINITE,
                     st.integers(min_value=10**400, max_value=10**401), _GARBAGE, st.none(), st.just(True))


def _bad_int(lo: int, hi: int) -> st.SearchStrategy[object]:
    out = st.one_of(st.integers(max_value=lo - 1), st.integers(min_value=hi + 1))
    return st.one_of(out, out.map(str), st.floats(lo, hi).filter(lambda f: not f.is_integer()),
                     _GARBAGE, _NON_FINITE, st.just("1.0"), st.just(True), st.none())


INVALID: dict[str, st.SearchStrategy[object]] = {
    "namespace": _bad_name(128),
    "ray_namespace": _bad_name(64),
    "ray_address": st.one_of(st.just(""), st.sampled_from(["a b", " auto", "x\n", "\t", "a\u2028b", "--", "-x"]),
                             _NOT_A_STRING),
    "model_id": st.one_of(st.sampled_from(["a\nb", "\t", "x\0", "m" * 1025]), _NOT_A_STRING),
    "num_shards": _bad_int(1, 1024),
    "replication": _bad_int(1, 1024),
    "pool_bytes": st.one_of(
        st.integers(max_value=4095), st.integers(min_value=(16 << 40) + 1),
        st.integers(max_value=4095).map(str), st.sampled_from(["1.9", "4096.5", "0.3KiB", "17TiB", "1e9",
                                                               "-4096", "1 GiBs", "٤٠٩٦"]),
        st.floats(4096, 1 << 40).filter(lambda f: not f.is_integer()), _GARBAGE, _NON_FINITE,
        st.just(True), st.none()),
    "transport": st.one_of(_GARBAGE.filter(lambda s: s not in TRANSPORTS), _NOT_A_STRING),
    "nixl_stage_through_host": st.one_of(_GARBAGE.filter(lambda s: s not in NIXL_STAGING), _NOT_A_STRING),
    "placement": st.one_of(_GARBAGE.filter(lambda s: s not in PLACEMENTS), _NOT_A_STRING),
    "hot_prefix_asks": _bad_int(0, 1_000_000),
    "remote_copy_reads": _bad_int(0, 1_000_000),
    "copy_nodes_per_pool": _bad_int(0, 1_000_000),
    "layerwise": st.one_of(_GARBAGE.filter(lambda s: s.lower() not in ("true", "yes", "on", "false", "no", "off")),
                           st.integers(2), st.none()),
    "checksum": st.one_of(st.sampled_from(["maybe", "2", "", "truee"]), st.integers(min_value=2), st.none()),
    "local_lookups": st.one_of(st.sampled_from(["sometimes", "-1", "", "onn"]), st.integers(min_value=2),
                               st.none()),
    "relay_hot_copies": st.one_of(st.sampled_from(["often", "-1", "", "offf"]), st.integers(min_value=2),
                                  st.none()),
    "relay_membership": st.one_of(st.sampled_from(["rarely", "-1", "", "onn"]), st.integers(min_value=2),
                                  st.none()),
    "pick_by_load": st.one_of(st.sampled_from(["mostly", "-1", "", "offf"]), st.integers(min_value=2), st.none()),
    "load_at_once_ratio": _bad_int(0, 1 << 20),
    "lookup_timeout_s": _bad_seconds(0.01, 3600),
    "transfer_timeout_s": _bad_seconds(0.01, 3600),
    "lease_s": _bad_seconds(0.1, 86400),
    "reserve_timeout_s": _bad_seconds(0.1, 86400),
    "pd_wait_s": _bad_seconds(0.0, 600),
    "state_slot_wait_s": _bad_seconds(0.0, 600),
    "shm_dir": st.one_of(st.sampled_from(["", "dev/shm", "/nonexistent/ucm", "/dev/null", "/dev/shm\0",
                                          "./tmp"]),
                         st.text(max_size=10).filter(lambda s: not s.startswith("/")), _NOT_A_STRING),
    "shard_cpus": st.one_of(st.floats(max_value=0, exclude_max=True, allow_nan=False),
                            st.floats(min_value=1e-9, max_value=0.0001, exclude_max=True),
                            st.floats(min_value=1024, exclude_min=True, allow_nan=False), _NON_FINITE,
                            _GARBAGE, st.none()),
    "disk_dir": st.one_of(st.sampled_from(["tmp", "/nonexistent/ucm", "/dev/null", "/tmp\0", "/tmp,/tmp",
                                           "/tmp,relative", ",/nonexistent"]), st.integers(), st.just(True)),
    "disk_bytes": st.one_of(st.integers(max_value=-1), st.integers(min_value=(1 << 50) + 1),
                            st.sampled_from(["-1", "2PiB", "1.5", "lots"]), st.just(True), st.none(), _NON_FINITE),
    "disk_write_policy": st.one_of(_GARBAGE.filter(lambda s: s not in DISK_WRITE_POLICIES), _NOT_A_STRING),
    "disk_io": st.one_of(st.sampled_from(["nixl", "gds", ""]), _NOT_A_STRING),
    "disk_wait_s": _bad_seconds(0.0, 3600),
    "disk_recompute_bytes_s": st.one_of(st.floats(max_value=0, exclude_max=True, allow_nan=False),
                                        st.floats(min_value=1e13, exclude_min=True, allow_nan=False), _NON_FINITE,
                                        _GARBAGE, st.none(), st.just(True)),
}


def test_every_key_has_an_invalid_strategy():
    assert sorted(INVALID) == sorted(UcmRayConfig.keys())


@st.composite
def invalid_settings(draw: st.DrawFn) -> tuple[dict[str, object], str]:
    written, _ = draw(valid_settings())
    key = draw(st.sampled_from(sorted(INVALID)))
    written[key] = draw(INVALID[key])
    return written, key


def _one_line_naming(e: ConfigError, key: str) -> None:
    msg = str(e)
    assert msg.startswith(f"{key}: "), msg
    assert len(msg.splitlines()) == 1, msg


@FAST
@given(invalid_settings())
def test_any_invalid_value_is_one_line_naming_its_key(case):
    written, key = case
    with pytest.raises(ConfigError) as e:
        UcmRayConfig.from_dict(written)
    _one_line_naming(e.value, key)


@FAST
@given(invalid_settings())
def test_any_invalid_flag_is_one_line_naming_its_key(case):
    written, key = case
    bad = written[key]
    if isinstance(bad, bool) or not isinstance(bad, (str, int, float)) or (
            not isinstance(bad, str)
            and key in ("namespace", "ray_namespace", "ray_address", "transport", "placement", "shm_dir", "model_id",
                        "disk_dir", "disk_write_policy", "disk_io", "nixl_stage_through_host")):
        # what a flag can carry that is still invalid: "" for every key but model_id (where it
        # means "the model's path"), which refuses a tab
        bad = {"model_id": "\t", "disk_dir": "relative"}.get(key, "")
    if key in ("layerwise", "checksum", "local_lookups", "relay_hot_copies", "relay_membership",
                   "pick_by_load"):
        written.pop(key)  # on/off flags take no value: argparse itself refuses anything else
        bad_yaml = {key: bad}
    else:
        written[key] = bad
        bad_yaml = {}
    parser = _parser()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(bad_yaml, f)
        f.flush()
        args = parser.parse_args(["--config", f.name, *_argv(written)])
        with pytest.raises(ConfigError) as e:
            UcmRayConfig.from_cli(args)
    _one_line_naming(e.value, key)


@FAST
@given(valid_settings(), st.text(min_size=1, max_size=12).filter(lambda k: k not in UcmRayConfig.keys()))
def test_an_unknown_key_is_named_on_one_line(case, extra):
    written, _ = case
    with pytest.raises(ConfigError) as e:
        UcmRayConfig.from_dict({**written, extra: 1})
    msg = str(e.value)
    assert msg.startswith("unknown key(s) ") and len(msg.splitlines()) == 1, msg
    assert extra in msg or repr(extra) in msg


@FAST
@given(valid_settings())
def test_a_lease_or_grant_shorter_than_two_step_deadlines_names_its_key(case):
    written, meant = case
    transfer = meant["transfer_timeout_s"]
    assert isinstance(transfer, float)
    if transfer <= 0.1:
        transfer = written["transfer_timeout_s"] = 0.5
    base = {**written, "lease_s": 86400, "reserve_timeout_s": 86400}
    for key in ("lease_s", "reserve_timeout_s"):
        with pytest.raises(ConfigError) as e:
            UcmRayConfig.from_dict({**base, key: transfer * 1.999})
        _one_line_naming(e.value, key)
        assert "2 x transfer_timeout_s" in str(e.value)
