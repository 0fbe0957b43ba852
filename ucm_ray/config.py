"""The one validated configuration of ucm-ray.

It comes from vLLM's ``kv_connector_extra_config`` (a dict), a YAML file, or
CLI flags; all three go through ``UcmRayConfig.from_dict`` so that a typo or
a bad value fails the same way everywhere: at start-up, naming the key and
what is allowed, before anything is started.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names which and why."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}

TRANSPORTS = ("auto", "shm", "nixl")


def parse_size(value: Any, key: str) -> int:
    """Bytes from an int or a string such as ``"512MiB"`` / ``"2GB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a byte size such as 1073741824 or '1GiB', got {value!r}")
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ConfigError(f"{key}: expected a byte size such as 1073741824 or '1GiB', got {value!r}")
    unit = (m.group(2) or "").upper().rstrip("B") if (m.group(2) or "").upper() != "B" else "B"
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class UcmRayConfig:
    """Everything that can be configured; defaults suit one local machine."""

    namespace: str = "ucm"
    """Label mixed into every key; engines share blocks only within one namespace."""
    ray_namespace: str = "ucm_ray"
    """Ray namespace holding the named directory and shard actors."""
    ray_address: str = "auto"
    """Where engines find the Ray cluster when their process is not connected yet."""
    num_shards: int = 2
    pool_bytes: int = 1 << 30
    """Size of each shard's preallocated pool (accepts '1GiB')."""
    replication: int = 1
    transport: str = "auto"
    """auto: shared memory for same-node shards, NIXL for others; shm / nixl force one."""
    layerwise: bool = True
    lookup_timeout_s: float = 5.0
    """A shard slower than this to answer a control call is a miss (and suspect for a while)."""
    transfer_timeout_s: float = 10.0
    """Deadline of one step's copies: the most a hung pool can stall a forward pass; what has
    not landed by then is a failed load (vLLM recomputes) or a save that never shows."""
    lease_s: float = 60.0
    """How long a read pin protects an entry from eviction if its reader vanishes."""
    reserve_timeout_s: float = 60.0
    """How long a reserved-but-uncommitted slot is kept before it is reclaimed."""
    checksum: bool = False
    """Paranoid mode: checksum at commit, verify on load; a mismatch is a miss."""
    shm_dir: str = "/dev/shm"
    shard_cpus: float = 0.5

    def __post_init__(self) -> None:
        def need(cond: bool, key: str, allowed: str) -> None:
            if not cond:
                raise ConfigError(f"{key}: {getattr(self, key)!r} is not allowed; expected {allowed}")

        need(bool(self.namespace) and isinstance(self.namespace, str), "namespace", "a non-empty string")
        for key in ("ray_namespace", "ray_address"):
            need(bool(getattr(self, key)) and isinstance(getattr(self, key), str), key, "a non-empty string")
        need(self.num_shards >= 1, "num_shards", "an integer >= 1")
        need(self.pool_bytes >= 4096, "pool_bytes", "a size >= 4096 bytes")
        need(1 <= self.replication <= self.num_shards, "replication",
             f"an integer between 1 and num_shards ({self.num_shards})")
        need(self.transport in TRANSPORTS, "transport", " | ".join(TRANSPORTS))
        for key in ("lookup_timeout_s", "transfer_timeout_s", "lease_s", "reserve_timeout_s"):
            need(getattr(self, key) > 0, key, "a number of seconds > 0")
        # A pin must outlive the copies it protects: lookups older than lease_s / 2 are redone
        # before their loads are dispatched, and a step's copies end by transfer_timeout_s.
        need(self.lease_s >= 2 * self.transfer_timeout_s, "lease_s",
             f"at least 2 x transfer_timeout_s ({2 * self.transfer_timeout_s:g})")
        # Likewise a write slot must outlive the copies into it.
        need(self.reserve_timeout_s >= 2 * self.transfer_timeout_s, "reserve_timeout_s",
             f"at least 2 x transfer_timeout_s ({2 * self.transfer_timeout_s:g})")
        need(self.shard_cpus >= 0, "shard_cpus", "a number >= 0")

    # --- loading -------------------------------------------------------------------------

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, ignore: tuple[str, ...] = ()) -> UcmRayConfig:
        """Build from a mapping; ``ignore`` lists foreign keys that may share the mapping."""
        data = dict(data or {})
        for k in ignore:
            data.pop(k, None)
        allowed = cls.keys()
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(unknown)}; allowed keys: {', '.join(allowed)}")
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in data:
                kwargs[f.name] = _coerce(f, data[f.name])
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path) -> UcmRayConfig:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys to values")
        return cls.from_dict(data)

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One ``--flag`` per field (``--pool-bytes 2GiB``), plus ``--config FILE``."""
        parser.add_argument("--config", help="YAML file with ucm-ray settings; flags override it")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                parser.add_argument(flag, dest=f.name, default=None,
                                    action=argparse.BooleanOptionalAction)
            else:
                parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper())

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> UcmRayConfig:
        base = cls.from_yaml(args.config) if getattr(args, "config", None) else cls()
        overrides = {f.name: getattr(args, f.name) for f in fields(cls)
                     if getattr(args, f.name, None) is not None}
        return cls.from_dict({**dataclasses.asdict(base), **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """Turn a dict/YAML/CLI value into the field's type, or say which key is wrong."""
    key, typ = f.name, f.type
    if key == "pool_bytes":
        return parse_size(value, key)
    if typ in ("bool", bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ in ("int", int):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if typ in ("float", float):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if typ in ("str", str):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value
