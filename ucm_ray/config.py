"""The one validated configuration of ucm-ray.

It comes from vLLM's ``kv_connector_extra_config`` (a dict), a YAML file, or
CLI flags; all three go through ``UcmRayConfig.from_dict`` so that a typo or
a bad value fails the same way everywhere: at start-up, naming the key and
what is allowed, before anything is started.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names which and why."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE | re.ASCII)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}

TRANSPORTS = ("auto", "shm", "nixl")
NIXL_STAGING = ("auto", "on", "off")
PLACEMENTS = ("writer_local", "per_block")
DISK_WRITE_POLICIES = ("back", "through")
DISK_IO = ("auto", "posix")
"""``nixl`` (NIXL's POSIX backend) is not built yet; ``auto`` is plain ``preadv``/``pwritev`` until it is."""

# Names that end up in Ray actor namespaces, shared-memory file names and block keys: a safe
# character set, not starting with '.' or '-' (so never '..', a hidden file or a CLI flag).
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", re.ASCII)
NAME_CHARS = "letters, digits, '_', '.', '-', not starting with '.' or '-'"

# Limits: every one a value that is surely a mistake beyond it, never a tuning choice.
MAX_NUM_SHARDS = 1024
MIN_POOL_BYTES = 4096
MAX_POOL_BYTES = 16 << 40
"""16 TiB per shard: more than any host's memory today; a larger value is a typo (2**70)."""
TIMEOUT_LIMITS: dict[str, tuple[float, float]] = {
    # A Ray actor call costs ~1 ms (p99 ~6 ms): below 10 ms every lookup or copy would fail.
    "lookup_timeout_s": (0.01, 3600.0),
    "transfer_timeout_s": (0.01, 3600.0),
    # Pins and grants are renewed/redone on the scheduler's step clock; below 0.1 s they would
    # lapse between two steps. Above a day they no longer protect anything from a dead reader.
    "lease_s": (0.1, 86400.0),
    "reserve_timeout_s": (0.1, 86400.0),
}
MAX_LOAD_AT_ONCE_RATIO = 1 << 20
"""A step computing one token beside a million loaded: past that the rule is off in effect (use 0)."""
MAX_PD_WAIT_S = 600.0
"""A request held longer than this for its prefill's saves (``pd_wait_s``) or its states' slots
(``state_slot_wait_s``) is surely a mistake: recomputing the longest prompt takes less."""
MAX_DISK_BYTES = 1 << 50
"""1 PiB per shard: more than any node's disks today; a larger value is a typo."""
MAX_DISK_ROOTS = 64
MAX_SHARD_CPUS = 1024.0
MIN_FRACTIONAL_CPUS = 0.0001
"""Ray refuses a non-zero resource quantity below 0.0001."""


def parse_size(value: Any, key: str) -> int:
    """Whole bytes from an int or a string such as ``"512MiB"`` / ``"2GB"`` / ``"1.5GiB"``.
    A size that is not a whole number of bytes (``"1.9"``, ``"0.3KiB"``) is refused, never
    truncated."""
    expected = f"{key}: expected a byte size such as 1073741824 or '1GiB', got {value!r}"
    if isinstance(value, bool):
        raise ConfigError(expected)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{key}: {value!r} is not a whole number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(expected)
    m = _SIZE_RE.match(value)
    if not m:
        raise ConfigError(expected)
    unit = (m.group(2) or "").upper().rstrip("B") if (m.group(2) or "").upper() != "B" else "B"
    try:
        size = Fraction(m.group(1)) * _UNITS[unit]
    except ValueError:  # more digits than Python converts
        raise ConfigError(expected) from None
    if size.denominator != 1:
        raise ConfigError(f"{key}: {value!r} is not a whole number of bytes")
    return int(size)


def _show(key: object) -> str:
    """A key as it can be printed on one line."""
    return key if isinstance(key, str) and key.isidentifier() else repr(key)


@dataclass(frozen=True)
class UcmRayConfig:
    """Everything that can be configured; defaults suit one local machine."""

    namespace: str = "ucm"
    """Label mixed into every key; engines share blocks only within one namespace."""
    model_id: str = ""
    """Names the model in every key instead of the path vLLM loaded it from, so that engines
    loading the same weights from different paths (a different mount on each node) share. Empty:
    the path names it. Revision, dtypes, block size, parallelism and KV layout still must match."""
    ray_namespace: str = "ucm_ray"
    """Ray namespace holding the named directory and shard actors."""
    ray_address: str = "auto"
    """Where engines find the Ray cluster when their process is not connected yet."""
    num_shards: int = 2
    pool_bytes: int = 1 << 30
    """Size of each shard's preallocated pool (accepts '1GiB')."""
    replication: int = 1
    placement: str = "writer_local"
    """Where a block's bytes go. writer_local: a shard on the writer's node (replicas elsewhere),
    and a hint at the owner of the prompt's first block tells other nodes where it is; per_block:
    every block at the owner of its own key (one prompt spread over every node). Identical on one
    node. A fleet-wide setting, like replication: the fleet's wins over an engine's."""
    hot_prefix_asks: int = 64
    """writer_local across nodes: a family root asked this often within 10 s becomes a hot prefix
    (what its askers share joins a table every engine holds, and their lookups and hints move to
    the block after it: no single shard answers for a system prompt); an ask is a lookup that
    calls the root's owner, whatever its keys (a writer's hints are not asks, nor is a lookup this
    node's shards answer whole). So does one asked by
    ``hot_prefixes.askers_needed`` distinct nodes (2 % of the fleet, at least 4, at most 64). 0: never."""
    remote_copy_reads: int = 2
    """writer_local across nodes: at a node's this many'th read of a block from another node's
    pool (counted by the family root's owner), the engine saves it into its own node's pool too
    (registered as its write), so a document read on many nodes is not served by its writer's
    pool alone; a hot prefix's blocks are copied at the first read. 1: at every read; 0: never
    (an engine's own setting)."""
    copy_nodes_per_pool: int = 10
    """writer_local across nodes: a block is copied (``remote_copy_reads``) only while fewer than
    one pool per this many nodes (rounded up) is named for it, by the family root's owner or, for
    a hot prefix, the table: every copy takes pool room from the fleet's distinct blocks, and in a
    small fleet the few pools that hold a block serve few nodes each (simulated at 10 nodes,
    random router, pools evicting: copies cost 4.5 points of hits unbounded, none with this
    bound; docs/scaling.md). 0: no bound (an engine's own setting)."""
    relay_hot_copies: bool = True
    """writer_local across nodes: this engine announces its copies of a hot prefix's blocks to a
    steward shard (the owner of a salted digest of the first block copied), which forwards a
    second's announcements to the directory in one call, instead of to the directory itself (one
    call per copying request: the directory's node took 15x the mean calls at 1,000 nodes in the
    simulation; docs/scaling.md, stop 58). A lost announcement (a steward that dies) leaves a copy unnamed by
    the table: other nodes load the block from the pools it names. One node never announces
    (an engine's own setting)."""
    relay_membership: bool = True
    """This engine follows the directory's long poll through its node's relay (the lowest shard id
    on its node, ``store.membership_relay``), which follows the directory with one poll for the
    node's engines: the directory answers a poll per node, not per engine, at each push (one actor
    cannot answer 1,000 nodes x 8 engines a second; docs/scaling.md, stops 63-64). A relay that
    fails or falls behind sends the engine to the directory. Off: every engine polls the directory
    (an engine's own setting)."""
    pick_by_load: bool = True
    """writer_local across nodes: this engine reports the bytes it loaded from each other node's
    pool with its membership long poll, and reads a hot prefix's blocks from the less loaded of two
    of the pools the fleet's table names, by the figure the directory pushes (``store.pool_load``):
    a hot row's readers no longer all start where a hash of their node points (the hottest node's
    bytes over the mean in the simulation: 100 nodes random / sticky and 1,000 nodes; docs/scaling.md,
    stop 65). Off: no report, today's order (an engine's own setting)."""
    transport: str = "auto"
    """auto: shared memory for same-node shards, NIXL for others; shm / nixl force one."""
    nixl_stage_through_host: str = "auto"
    """How a worker's NIXL transfers move KV: on, through host staging slabs that the worker
    copies (GPU KV on a CUDA stream of its own; NIXL then moves host memory only); off, NIXL
    moves the KV itself; auto, on a host without an RDMA port: GPU KV both ways, CPU KV's reads.
    Without RDMA, UCX moves GPU memory with CUDA copies of its own, which waited for vLLM's
    forward on the legacy default stream: a step's end came after its forward (H100, stop 64);
    and a read needs the shard's process (TCP), so one from a paused shard lands late, which
    NIXL cannot cancel: staged, in a quarantined slab; unstaged, in KV blocks vLLM reuses, so
    the worker stops the engine (``LateReadError``) once such a read outlives the next step's
    wait (stop 67)."""
    layerwise: bool = True
    load_at_once_ratio: int = 64
    """A step whose requests compute at most 1/N of the tokens their hits bring (a repeated prompt)
    gets its loads posted whole before the forward instead of layer by layer: the layers would
    have next to nothing to overlap the copies with, and each layer's post costs host time. 0:
    this rule never applies (what must land before the forward still does: a hit's last block,
    mamba states, a step too short for layer hooks)."""
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
    local_lookups: bool = True
    """Look keys of same-node shards up in the index each shard publishes in shared memory: no
    Ray call and no pin; each copy is validated afterwards (an entry evicted meanwhile is a
    failed load, recomputed). False: every lookup is a Ray call that pins what it finds."""
    shm_dir: str = "/dev/shm"
    shard_cpus: float = 0.5
    pd_wait_s: float = 2.0
    """How long a decode engine waits for the saves its prefill announced (prefill/decode
    through the tier) before it takes what is there and recomputes the rest (counted as
    ``handoff_timeouts``); 0: never wait. The prefill saves its prompt in the step after its
    response and keeps blocks waiting for write slots at most 1 s (``HOLD_S``): past that
    plus the copies and the commit, waiting longer would mostly wait for saves that never come."""
    state_slot_wait_s: float = 0.5
    """How long a hybrid model's request may wait for the write slots of its first chunks'
    states, asked for once its lookup answered: a state can only be saved in the step that
    computes it (the next step overwrites it), so one whose slot came later is lost for every
    later reader (counted in ``saves_skipped``); a shard answers a reserve within a round trip
    unless it is in trouble, and the wait delays the request's first chunk. 0: never wait. (A
    dense model's request never waits for slots.)"""
    disk_dir: str = ""
    """The capacity tier behind each shard's pool: a directory, or several separated by commas
    (one per NVMe drive, say), where each shard keeps a few preallocated files. Empty: no disk
    tier (the default). Shards demote to it ahead of eviction and promote from it on a hit, on
    both lookup paths (the published index lists disk-only keys as "ask the shard"); the files
    outlive the shard (adopted at its next start) until ``ucm-ray down --purge-disk``. A string
    rather than a list so that YAML, flags and the Helm chart carry it like every other key."""
    disk_bytes: int = 0
    """Bytes of disk each shard may use, over all roots (accepts '500GiB'); never exceeded."""
    disk_write_policy: str = "back"
    """back: entries are written to disk ahead of their eviction from the pool; through: every
    committed entry is written too."""
    disk_wait_s: float = 2.0
    """Longest a lookup call spends promoting disk entries into the pool: keys not promoted by then
    are misses, recomputed. Promotions run on the shard's disk thread, one at a time, so its slot
    asks, commits and published-index readers do not wait behind one (lookups by call where no
    published index can be read do). 2 s: with saves on the writer's node one shard reads a
    whole long prompt (a 16k-token 8B prompt is 2 GiB, ~0.4 s at 5 GB/s); 0.5 s cut 4-7 points of
    hits at 10 nodes in simulation (docs/scaling.md, stop 62). Below lookup_timeout_s, or the
    engine would give up on the shard first. Promotions queued on one shard add up, so each also
    reads only until its asker's lookup_timeout_s runs out, counted from when the engine sent it
    (its wait in the queue included; the engine sends its deadline as a time of day, nodes' clocks
    kept within milliseconds by NTP): one queued behind others gets fewer or no keys (misses),
    answered in time, rather than answering after its asker gave up on the shard (stop 63)."""
    disk_recompute_bytes_s: float = 0.0
    """How fast the engines recompute what the disk would give back, in KV bytes per second
    (prefill tokens/s x KV bytes per token; an 8B model prefilling 10k tokens/s at 128 KiB a token:
    1.3e9). A shard whose measured promotion rate is below it leaves its disk hits to be
    recomputed (one chunk is still read when nothing was for 10 s, to measure again). 0: each
    engine's own rate, measured from its prefill steps and sent with its lookups (an engine that
    has not yet timed a step of 512 tokens or more sends none: its disk hits are read). Set it
    to override the engines' rates for the whole fleet (1: always read)."""
    disk_io: str = "auto"
    """How bytes reach the disk: posix (``preadv``/``pwritev``, ``O_DIRECT`` where the file system
    takes it); auto picks the best that works here (posix for now)."""

    def __post_init__(self) -> None:
        def need(cond: bool, key: str, allowed: str) -> None:
            if not cond:
                raise ConfigError(f"{key}: {getattr(self, key)!r} is not allowed; expected {allowed}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for key, max_len in (("namespace", 128), ("ray_namespace", 64)):
            v = getattr(self, key)
            need(isinstance(v, str) and len(v) <= max_len and _NAME_RE.fullmatch(v) is not None, key,
                 f"1 to {max_len} of {NAME_CHARS}")
        need(isinstance(self.model_id, str) and len(self.model_id) <= 1024 and self.model_id.isprintable(),
             "model_id", "a model name of at most 1024 printable characters, or empty for vLLM's model path")
        need(isinstance(self.ray_address, str) and 0 < len(self.ray_address) <= 1024
             and self.ray_address.isprintable() and not any(c.isspace() for c in self.ray_address)
             and not self.ray_address.startswith("-"),
             "ray_address", "'auto' or a Ray address such as 127.0.0.1:6379 (no spaces, not starting with '-')")
        need(is_int(self.num_shards) and 1 <= self.num_shards <= MAX_NUM_SHARDS, "num_shards",
             f"an integer between 1 and {MAX_NUM_SHARDS}")
        need(is_int(self.pool_bytes) and MIN_POOL_BYTES <= self.pool_bytes <= MAX_POOL_BYTES, "pool_bytes",
             f"a whole number of bytes between {MIN_POOL_BYTES} and {MAX_POOL_BYTES} (16 TiB)")
        need(is_int(self.replication) and 1 <= self.replication <= self.num_shards, "replication",
             f"an integer between 1 and num_shards ({self.num_shards})")
        need(self.transport in TRANSPORTS, "transport", " | ".join(TRANSPORTS))
        need(self.placement in PLACEMENTS, "placement", " | ".join(PLACEMENTS))
        need(self.nixl_stage_through_host in NIXL_STAGING, "nixl_stage_through_host", " | ".join(NIXL_STAGING))
        need(is_int(self.hot_prefix_asks) and 0 <= self.hot_prefix_asks <= 1_000_000, "hot_prefix_asks",
             "an integer between 0 (never) and 1000000")
        need(is_int(self.remote_copy_reads) and 0 <= self.remote_copy_reads <= 1_000_000, "remote_copy_reads",
             "an integer between 0 (never) and 1000000")
        need(is_int(self.copy_nodes_per_pool) and 0 <= self.copy_nodes_per_pool <= 1_000_000,
             "copy_nodes_per_pool", "an integer between 0 (no bound) and 1000000")
        need(is_int(self.load_at_once_ratio) and 0 <= self.load_at_once_ratio <= MAX_LOAD_AT_ONCE_RATIO,
             "load_at_once_ratio", f"an integer between 0 (never) and {MAX_LOAD_AT_ONCE_RATIO}")
        for key in ("layerwise", "checksum", "local_lookups", "relay_hot_copies", "relay_membership", "pick_by_load"):
            need(isinstance(getattr(self, key), bool), key, "true or false")
        for key, (lo, hi) in TIMEOUT_LIMITS.items():
            v = getattr(self, key)
            need(is_num(v) and lo <= v <= hi, key, f"a number of seconds between {lo:g} and {hi:g}")
        for key in ("pd_wait_s", "state_slot_wait_s"):
            v = getattr(self, key)
            need(is_num(v) and 0 <= v <= MAX_PD_WAIT_S, key,
                 f"a number of seconds between 0 (never wait) and {MAX_PD_WAIT_S:g}")
        need(is_num(self.shard_cpus) and (self.shard_cpus == 0 or MIN_FRACTIONAL_CPUS <= self.shard_cpus
                                          <= MAX_SHARD_CPUS),
             "shard_cpus", f"0 or a number of CPUs between {MIN_FRACTIONAL_CPUS:g} and {MAX_SHARD_CPUS:g}")
        # Checked where the config is built: on the node running `ucm-ray up` (before anything
        # starts) and again on each shard's node (the shard rebuilds it); engines only map the
        # paths that shards publish, but a config naming a missing directory is wrong anywhere.
        need(isinstance(self.shm_dir, str) and "\0" not in self.shm_dir and os.path.isabs(self.shm_dir)
             and os.path.isdir(self.shm_dir), "shm_dir", "an existing directory, as an absolute path")
        self._check_disk(need)
        # Relations, after every value is valid on its own (so an error names the key at fault).
        # A pin must outlive the copies it protects: lookups older than lease_s / 2 are redone
        # before their loads are dispatched, and a step's copies end by transfer_timeout_s.
        need(self.lease_s >= 2 * self.transfer_timeout_s, "lease_s",
             f"at least 2 x transfer_timeout_s ({2 * self.transfer_timeout_s:g})")
        # Likewise a write slot must outlive the copies into it.
        need(self.reserve_timeout_s >= 2 * self.transfer_timeout_s, "reserve_timeout_s",
             f"at least 2 x transfer_timeout_s ({2 * self.transfer_timeout_s:g})")

    @property
    def disk_roots(self) -> tuple[str, ...]:
        """``disk_dir``'s directories, in order (empty: no disk tier)."""
        return tuple(p.strip() for p in self.disk_dir.split(",") if p.strip())

    def _check_disk(self, need: Callable[[bool, str, str], None]) -> None:
        # Existence is checked where the config is built, as for shm_dir: on the node running
        # `ucm-ray up` and on each shard's node.
        need(isinstance(self.disk_dir, str) and "\0" not in self.disk_dir, "disk_dir",
             "a directory or a comma-separated list of them")
        roots = self.disk_roots
        need(len(roots) <= MAX_DISK_ROOTS and len(set(roots)) == len(roots)
             and all(os.path.isabs(r) and os.path.isdir(r) for r in roots), "disk_dir",
             f"empty (no disk tier) or up to {MAX_DISK_ROOTS} distinct existing directories, "
             "as absolute paths separated by commas")
        need(isinstance(self.disk_bytes, int) and not isinstance(self.disk_bytes, bool)
             and 0 <= self.disk_bytes <= MAX_DISK_BYTES, "disk_bytes",
             f"a whole number of bytes between 0 and {MAX_DISK_BYTES} (1 PiB)")
        need(self.disk_write_policy in DISK_WRITE_POLICIES, "disk_write_policy", " | ".join(DISK_WRITE_POLICIES))
        need(isinstance(self.disk_wait_s, (int, float)) and not isinstance(self.disk_wait_s, bool)
             and 0 < self.disk_wait_s <= 3600, "disk_wait_s", "a number of seconds above 0, at most 3600")
        need(isinstance(self.disk_recompute_bytes_s, (int, float)) and not isinstance(self.disk_recompute_bytes_s, bool)
             and 0 <= self.disk_recompute_bytes_s <= 1e13, "disk_recompute_bytes_s",
             "KV bytes per second, from 0 (measured by the engines) to 1e13")
        need(self.disk_io in DISK_IO, "disk_io", " | ".join(DISK_IO) + " (nixl is not built yet)")
        # Relations: a tier needs both its place and its size; each file holds at least one 4 KiB slot.
        need(not roots or self.disk_bytes >= 4096 * len(roots), "disk_bytes",
             f"at least {4096 * len(roots)} (4 KiB per disk_dir root) when disk_dir is set")
        need(bool(roots) or self.disk_bytes == 0, "disk_bytes", "0 when disk_dir is empty (no disk tier)")
        need(not roots or self.disk_wait_s < self.lookup_timeout_s, "disk_wait_s",
             f"below lookup_timeout_s ({self.lookup_timeout_s:g}) when disk_dir is set: the engine "
             "would give up on the shard first")

    # --- loading -------------------------------------------------------------------------

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, ignore: tuple[str, ...] = ()) -> UcmRayConfig:
        """Build from a mapping; ``ignore`` lists foreign keys that may share the mapping."""
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(f"ucm-ray settings must be a mapping of keys to values, got {type(data).__name__}")
        data = dict(data or {})
        for k in ignore:
            data.pop(k, None)
        allowed = cls.keys()
        unknown = sorted((k for k in data if k not in allowed), key=str)
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(map(_show, unknown))}; "
                              f"allowed keys: {', '.join(allowed)}")
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


_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE_WORDS + _FALSE_WORDS:
        return value.lower() in _TRUE_WORDS
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:  # not an integer, or more digits than Python converts
            pass
    raise ConfigError(f"{key}: expected an integer, got {value!r}")


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{key}: {value!r} is out of range") from None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected a number, got {value!r}")


def _as_str(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


_COERCIONS: dict[Any, Callable[[str, Any], Any]] = {
    "bool": _as_bool, bool: _as_bool, "int": _as_int, int: _as_int,
    "float": _as_float, float: _as_float, "str": _as_str, str: _as_str,
}


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """Turn a dict/YAML/CLI value into the field's type, or say which key is wrong."""
    if f.name in ("pool_bytes", "disk_bytes"):
        return parse_size(value, f.name)
    if f.name == "nixl_stage_through_host" and isinstance(value, bool):
        return "on" if value else "off"  # YAML reads a bare on / off as a boolean
    coerce = _COERCIONS.get(f.type)
    return coerce(f.name, value) if coerce else value
