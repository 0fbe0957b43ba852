"""The scheduler half of the connector: owner of the block lifecycle.

Every control call of the tier is made here, through a ``BlockStore``, and
never waited on: a lookup is posted once per request (one call per shard per
tp rank) and ``get_num_new_matched_tokens`` answers ``None`` ("ask again")
until it lands. Lookups *pin* what they find, so nothing vLLM was promised can
be evicted before the worker copies it. Saves are planned into slots granted
ahead of time (``SlotSupply``): a prompt's blocks are copied from the start of
the step after its first token, beside that step's forward pass, so no save
(neither its copies nor its host work) delays a cold request's first token;
generated blocks are saved DECODE_SAVE_TOKENS at a time, the rest when the
request ends; a finished request's blocks are kept (vLLM's delayed free) until
the step that saved them reported it.
The worker reports per-job results through
vLLM's worker-to-scheduler metadata; from them this side commits the entries
that landed, frees the slots that did not, releases pins and removes entries
that failed their checksum. The worker makes no control call at all.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import vllm
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.request import RequestStatus

from ucm_ray import policy
from ucm_ray.config import UcmRayConfig
from ucm_ray.keys import Namespace, block_keys, state_key
from ucm_ray.store.blockstore import BlockStore
from ucm_ray.store.engine.slots import SlotSupply
from ucm_ray.store.types import NO_CHECKSUM, Locations, Pending, Publishes, ReadLease, Removal
from ucm_ray.transport.base import PoolKey
from ucm_ray.vllm.compat import block_hashes_vary_per_process, check_async_loads_reportable
from ucm_ray.vllm.layout import entry_bytes
from ucm_ray.vllm.metadata import BlockLoads, BlockSaves, LoadJob, UcmRayConnectorMetadata, UcmRayWorkerMetadata
from ucm_ray.vllm.stats import UcmRayStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

NULL_BLOCK_ID = 0
"""vLLM's placeholder block (never holds data): loading into it would corrupt shared state."""

LOOKUP_GRACE_S = 0.002
"""How long a new request's lookup may take before the scheduler is told to ask again: most land
within one actor round trip, and answering on the first call saves the request a scheduler step."""
STATE_SLOT_WAIT_S = 0.5
"""How long a hybrid model's request may wait for the slots of its first chunks' saves, asked for
once its lookup answered: a state can only be saved in the step that computes it (the next step
overwrites it), so one whose slot came late is lost for every later reader (a shard answers a
reserve in a few ms unless it is in trouble). A dense model's request itself never waits for
slots (only its first save may, after its first token: ``PROMPT_SLOT_WAIT_S``)."""
PROMPT_SLOT_WAIT_S = 0.05
"""How long a dense prompt's first save may wait for the slots asked for it when its first
token came out: saved with what the free stock held, it went as two jobs a step or two apart,
each planned, posted and committed (a call per shard) on its own; ~3 ms more of an H200 host's
time per 4k prompt. A grant takes a round trip (ms); an ask that fails ends the wait too."""
HOLD_S = 1.0
"""How long a finished request's blocks may be kept for saves still waiting for write slots;
then they are dropped (``saves_dropped``) and vLLM frees the blocks. A grant takes a round trip
(ms), but an engine's first ones took longer: with 0.2 s, a fresh H200 engine's first request
dropped 2 of its 4 blocks."""


DECODE_SAVE_TOKENS = 256
"""Tokens a request generates before their blocks are saved, as one job (the rest at its end):
every save job costs the engine host time (planning, posting the copies, the results and their
commit: ~0.3 ms per job on an H200 host), and a decode step of a small model takes ~2 ms of
host time, so saving each 16-token block as it filled cost decode several percent. A prompt's
blocks are saved as soon as its first token is out, whatever their number."""


def _host_timed(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A scheduler hook whose host time counts toward the step's ``schedule_seconds``."""
    @functools.wraps(hook)
    def timed(self: SchedulerPart, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self._host_s += time.perf_counter() - started
    return timed


def _draft_model(vllm_config: VllmConfig) -> str:
    """The draft model of speculative decoding, where it is one of its own: its attention layers
    join the target's kv-cache groups, so its weights shape the stored blocks too (two drafts of
    one shape would otherwise share keys). "" for n-gram, suffix and MTP (vLLM names the target
    as their draft), so those engines keep sharing with engines without speculation."""
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None)
    if draft is None or draft.model == vllm_config.model_config.model:
        return ""
    return f"{draft.model}@{draft.revision}"


def engine_namespaces(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, label: str,
                      model_id: str = "") -> list[bytes]:
    """One namespace digest per tensor-parallel rank: everything that shapes a block's bytes.
    ``model_id``, where set, names the weights instead of the path vLLM loaded them from."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    specs = ";".join(f"{type(g.kv_cache_spec).__name__}:{g.kv_cache_spec!r}:{len(g.layer_names)}"
                     for g in kv_cache_config.kv_cache_groups)
    extra = "|".join([
        f"vllm={vllm.__version__}",  # backends' memory layouts (moved in memory order) follow the version
        f"pp={pc.pipeline_parallel_size}",
        f"dcp={getattr(pc, 'decode_context_parallel_size', 1)}",
        f"device={vllm_config.device_config.device_type}",
        f"attn={getattr(vllm_config, 'attention_config', None)!r}",
        f"spec={specs}",
    ] + ([f"draft={draft}"] if (draft := _draft_model(vllm_config)) else []))
    return [Namespace(label=label, model=f"{model_id or mc.model}@{mc.revision}", dtype=str(mc.dtype),
                      cache_dtype=str(cc.cache_dtype), block_size=cc.block_size,
                      layout=vllm_config.device_config.device_type, tp_size=pc.tensor_parallel_size,
                      tp_rank=rank, extra=extra).digest()
            for rank in range(pc.tensor_parallel_size)]


@dataclass
class _Lookup:
    """One request's lookup: per tp rank, the keys asked for and the pins that came back."""

    futures: list[Pending[ReadLease]]
    attn_keys: list[list[list[bytes]]]  # [rank][attention group][block]
    state_keys: list[list[list[bytes]]]  # [rank][state group][lcm boundary - 1]
    leases: list[ReadLease] | None = None
    started: float = field(default_factory=time.monotonic)

    def ready(self) -> bool:
        return all(f.poll() for f in self.futures)


@dataclass
class _SlotAsks:
    """Slots asked for the saves of a hybrid request's first chunks, once its lookup said where
    its saves begin (asked for with the lookup, they were also asked for blocks that turn out to
    be hits, and a full pool evicted other prompts' entries, or this prompt's own, to make room
    for slots handed straight back)."""

    counts: dict[tuple[PoolKey, int], int]
    """Slots per (pool, entry size) the chunks' states need."""
    wait_s: float = STATE_SLOT_WAIT_S
    started: float = field(default_factory=time.monotonic)

    def ready(self, supply: SlotSupply) -> bool:
        """The slots are here or answered (asked for by this request or by another whose asks
        it counts on: a state cannot wait for a slot, it is lost), or too slow to wait for:
        then the request runs without them rather than being delayed."""
        return supply.ready(self.counts) or time.monotonic() - self.started > self.wait_s


@dataclass
class _Tracked:
    request: Request
    lookup: _Lookup | None = None
    slots: _SlotAsks | None = None
    hit_tokens: int = 0  # LCM/block-aligned prefix found in the store
    local_tokens: int = 0  # vLLM's block-aligned local hit at lookup time
    external_tokens: int = 0  # what vLLM took from the store at allocation (its loads bring them)
    loads: list[LoadJob] | None = None  # per rank, set after allocation, dispatched by the next plan
    block_ids: list[list[int]] = field(default_factory=list)  # per group, as the scheduler output says
    saved_blocks: dict[int, int] = field(default_factory=dict)  # group -> blocks already planned
    last_state_pos: int = 0
    pending: dict[tuple[int, int, int], bool] = field(default_factory=dict)
    """(group, rank, block index) of attention blocks still to save, and whether their bytes are
    valid yet (a block whose load failed is not, until a step recomputes it)."""
    keys: dict[tuple[int, int], list[bytes]] = field(default_factory=dict)
    """(rank, attention group) -> the keys of the request's first blocks (``_attn_keys``)."""
    expected_until: int = 0  # saves of tokens below this were announced to the slot supply
    unexpected_until: int = 0  # ... and those below this were taken back (hits) or used by saves
    computed: int = 0  # vLLM's computed tokens at the last save plan
    waiting_at: tuple[int, int] | None = None
    """(filled, hashed tokens) when the last plan found the request's blocks waiting for a later
    one (``_saves_wait``): until either moves, its answer stands (most decode steps)."""
    prompt_expected: bool = False  # a dense prompt's saves were announced to the slot supply
    awaited: dict[tuple[PoolKey, int], int] | None = None
    """Slots per (pool, entry size) that a dense prompt's first save waits for, until
    ``awaited_until`` (``PROMPT_SLOT_WAIT_S``), where the free stock lacked them."""
    awaited_until: float = 0.0
    finished_at: float | None = None
    """When vLLM finished the request while blocks of it were unsaved, or still being copied:
    vLLM keeps its blocks until the scheduler knows they landed and reports the request
    ``finished_sending`` (an idle engine would look at the copies no more)."""
    save_jobs: set[int] = field(default_factory=set)
    """Save jobs with blocks of the request whose results are not in yet."""


@dataclass
class _LoadInFlight:
    """Pins a dispatched load holds until the worker reports its copies over."""

    req_id: str
    rank: int
    lease_ids: dict[PoolKey, list[int]]
    blocks: BlockLoads
    """What was loaded: the keys of entries the worker finds corrupt, to remove them."""
    dispatched: float = field(default_factory=time.monotonic)


@dataclass
class _SaveRows:
    """One rank's saves of one step, gathered block by block; sent as ``BlockSaves`` columns."""

    groups: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    pools: list[PoolKey] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the grant of each row's slot


SaveRowsByRank = defaultdict[int, _SaveRows]
"""A step's save rows per tp rank (a rank without rows has no entry)."""


@dataclass
class _SaveInFlight:
    """A dispatched save job: per row, the key it stores and the grant of its slot; the vLLM
    blocks it copies (a step that allocates one of them again waits for it: ``fences``) and the
    requests they belong to."""

    keys: list[bytes]
    locations: Locations
    tokens: np.ndarray
    block_ids: np.ndarray
    requests: list[str]
    dispatched: float = field(default_factory=time.monotonic)


class SchedulerPart:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: UcmRayConfig,
                 store: BlockStore) -> None:
        self._config = config
        self._store = store
        algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
        if block_hashes_vary_per_process(algo):
            raise ValueError(f"ucm-ray: with prefix_caching_hash_algo={algo!r} this vLLM seeds block hashes "
                             "randomly per process, so no engine could reuse another's blocks; set "
                             "PYTHONHASHSEED to one value on every engine (or use 'sha256' where vLLM "
                             "seeds it deterministically)")
        policy_name = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy_name != "recompute":
            raise ValueError(f"ucm-ray: kv_load_failure_policy={policy_name!r} turns a cache load that fails "
                             "(a shard died mid-copy) into a failed user request; set "
                             "kv_load_failure_policy='recompute' in the kv-transfer config")
        self._groups = kv_cache_config.kv_cache_groups
        # Full attention and mamba states only: a sliding-window group's out-of-window blocks are
        # vLLM's shared null block, which must never be loaded into nor stored.
        self._attn = [i for i, g in enumerate(self._groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        self._states = [i for i, g in enumerate(self._groups) if isinstance(g.kv_cache_spec, MambaSpec)]
        other = set(range(len(self._groups))) - set(self._attn) - set(self._states)
        if other:
            raise ValueError(f"ucm-ray: unsupported kv-cache group spec(s) "
                             f"{sorted(type(self._groups[i].kv_cache_spec).__name__ for i in other)}; "
                             "ucm-ray stores full-attention and mamba-state groups only")
        # vLLM can only take back a failed synchronous load of a single-group cache (it raises for
        # several groups), so loads into a multi-group cache are asynchronous (``failed_recving``).
        self._async_loads = len(self._groups) > 1
        check_async_loads_reportable(len(self._groups))
        self._bs = [g.kv_cache_spec.block_size for g in self._groups]
        self._lcm = math.lcm(*self._bs) if self._bs else 1
        self._hash_bs = (getattr(kv_cache_config, "hash_block_size", None)
                         or resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
        spec = vllm_config.speculative_config
        k = spec.num_speculative_tokens if spec is not None and spec.num_speculative_tokens else 0
        self.recompute = policy.recompute_tokens(config.layerwise, k)
        self._ns = engine_namespaces(vllm_config, kv_cache_config, config.namespace, config.model_id)
        self._entry_bytes = [entry_bytes(kv_cache_config, g) for g in range(len(self._groups))]
        self._tracked: dict[str, _Tracked] = {}
        self._finishing: set[str] = set()  # tracked requests vLLM finished (``finished_at``)
        self._job_ids = itertools.count(1)
        self._loads: dict[int, _LoadInFlight] = {}
        self._saves: dict[int, _SaveInFlight] = {}
        self._loading: dict[str, _Tracked] = {}  # requests given load jobs since the last plan
        self._answers: list[tuple[str, Pending[Any]]] = []  # commits, releases, removals in flight
        self._orphans: list[Pending[ReadLease]] = []  # lookups of aborted requests, released on arrival
        self._pools_sent: int | None = None
        self._pin_pools: set[PoolKey] = set()  # pools some worker cannot validate unpinned loads of
        self._chunk = vllm_config.scheduler_config.max_num_batched_tokens
        self._slots = SlotSupply(store, max_free=vllm_config.scheduler_config.max_num_seqs,
                                 renew_after_s=config.reserve_timeout_s / 3, idle_s=config.reserve_timeout_s / 3,
                                 usable_s=config.reserve_timeout_s - config.transfer_timeout_s)
        self._slots.want(*self._entry_bytes)
        self.stats = UcmRayStats()
        self._host_s = 0.0  # host time in the hooks since the last step's plan (``schedule_seconds``)
        log.info("ucm-ray scheduler: groups attn=%s state=%s block sizes=%s lcm=%d hash=%d recompute=%d",
                 self._attn, self._states, self._bs, self._lcm, self._hash_bs, self.recompute)
        max_len = vllm_config.model_config.max_model_len
        if self.hybrid and self._lcm >= max_len:
            log.warning("ucm-ray: this hybrid model's LCM block is %d tokens, not shorter than max_model_len "
                        "(%d): no prompt fills one, so nothing is stored or loaded here (vLLM sizes state "
                        "blocks so without prefix caching and mamba_cache_mode='align')", self._lcm, max_len)

    def _expect_saves(self, t: _Tracked, until: int, start: int | None = None, *,
                      later: bool = False) -> dict[tuple[PoolKey, int], int]:
        """Tell the slot supply which saves the prompt's tokens ``[start, until)`` bring
        (``start``: where the last announcement ended, unless blocks must be saved again;
        ``later``: asked for at the next step's tick); their counts per (pool, entry size),
        recorded as announced (``expected_until``)."""
        until = min(until, len(t.request.block_hashes) * self._hash_bs)
        if start is None:
            start = t.expected_until
        t.expected_until = max(t.expected_until, until)
        counts = self._save_counts(t, start, until)
        self._slots.expect(counts, later=later)
        return counts

    def _save_counts(self, t: _Tracked, start: int, until: int) -> dict[tuple[PoolKey, int], int]:
        """Per (pool, entry size), how many entries saving the prompt's ``[start, until)`` writes."""
        hashes = t.request.block_hashes
        until = min(until, len(hashes) * self._hash_bs)
        if until <= start:
            return {}
        keys, sizes = [], []
        for rank, ns in enumerate(self._ns):
            for g in self._attn:
                blocks = range(start // self._bs[g], until // self._bs[g])
                keys.extend(self._attn_keys(t, rank, g, blocks))
                sizes.extend([self._entry_bytes[g]] * len(blocks))
            for g in self._states:
                for pos in range((start // self._lcm + 1) * self._lcm, until + 1, self._lcm):
                    keys.append(state_key(ns, self._hash_at(hashes, pos), g, pos))
                    sizes.append(self._entry_bytes[g])
        if not keys:
            return {}
        pools, owners = self._store.placement(keys)
        distinct = set(sizes)  # a model's groups have one or two entry sizes
        out: dict[tuple[PoolKey, int], int] = {}
        for size in distinct:
            # every replica of every key of this size, counted per owner: one ``bincount``
            # (``np.unique`` of (owner, size) pairs sorted them first: ~25 us more for the few
            # keys of a decode batch's announcement, which every decoding request makes)
            rows = owners if len(distinct) == 1 else owners[np.asarray(sizes) == size]
            counts = np.bincount(rows.ravel(), minlength=len(pools)).tolist()
            out.update(((pools[pool_at], size), count) for pool_at, count in enumerate(counts) if count)
        return out

    @property
    def namespaces(self) -> list[bytes]:
        """Per tp rank, the namespace digest mixed into this engine's keys."""
        return list(self._ns)

    @property
    def hybrid(self) -> bool:
        return bool(self._states)

    # --- lookups -------------------------------------------------------------------------

    @_host_timed
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        t = self._tracked.get(request.request_id)
        if t is None or t.request is not request:
            t = self._tracked[request.request_id] = _Tracked(request)
        t.local_tokens = num_computed_tokens
        if t.lookup is not None and time.monotonic() - t.lookup.started > self._config.lease_s / 2:
            self._release_lookup(t)  # waited so long in the queue that its pins may lapse: look again
        posted = t.lookup is None
        if posted:
            t.lookup = self._post_lookup(t, num_computed_tokens)
            if t.lookup is None:
                return 0, False
        assert t.lookup is not None
        if not self._answered(t.lookup.ready, grace=posted):
            return None, False
        if t.lookup.leases is None:
            t.lookup.leases = [f.result() for f in t.lookup.futures]
            t.hit_tokens = self._hit_tokens(t.lookup)
        if t.slots is None:
            # Saves begin where vLLM's cache and the store's hit end. A hybrid's states are saved
            # as its chunks compute them: slots for its first chunks now. A dense prompt's slots
            # are asked for once its first token is out, as its saves are.
            begin = max(num_computed_tokens, t.hit_tokens) // self._hash_bs * self._hash_bs
            t.expected_until = t.unexpected_until = begin
            t.slots = _SlotAsks(self._expect_saves(t, begin + 2 * self._chunk) if self.hybrid else {})
            posted = True
        slots = t.slots
        if not self._answered(lambda: slots.ready(self._slots), grace=posted):
            return None, False
        if t.hit_tokens <= num_computed_tokens:
            ext = 0
        elif self.hybrid:
            ext = t.hit_tokens - num_computed_tokens  # truncated before the lookup: nothing to trim
        else:
            ext = policy.dense_external_hit(request.num_tokens, num_computed_tokens, t.hit_tokens,
                                            self.recompute)
        self.stats.add(lookups=1, query_tokens=request.num_tokens, hit_tokens=ext,
                       local_hit_tokens=num_computed_tokens,
                       miss_tokens=request.num_tokens - num_computed_tokens - ext,
                       recompute_trimmed_tokens=max(0, t.hit_tokens - num_computed_tokens - ext))
        return ext, self._async_loads and ext > 0

    def _answered(self, ready: Callable[[], bool], *, grace: bool) -> bool:
        """Whether ``ready`` holds (within LOOKUP_GRACE_S when ``grace``: just posted, most answers
        land within one actor round trip); if not, the request is put back in the queue (vLLM asks
        again next step) instead of holding up the scheduler."""
        deadline = time.monotonic() + (LOOKUP_GRACE_S if grace else 0.0)
        while not ready():
            if time.monotonic() > deadline:
                self.stats.add(lookups_deferred=1)
                return False
            time.sleep(0.0001)  # leave the core to the shard and Ray's threads
        return True

    def _post_lookup(self, t: _Tracked, local_tokens: int) -> _Lookup | None:
        """Pin the request's stored blocks, or None when there is nothing to ask: vLLM's own
        prefix cache holds every full block (``local_tokens``; a repeated prompt pays no round trip)."""
        request = t.request
        hashes = request.block_hashes
        if self.hybrid:
            max_lcm = policy.hybrid_max_hit_blocks(request.num_tokens, self.recompute, self._lcm)
            max_tokens = max_lcm * self._lcm
        else:
            max_tokens = len(hashes) * self._hash_bs
        full_tokens = len(hashes) * self._hash_bs
        max_tokens = min(max_tokens, full_tokens)
        if max_tokens <= 0:
            return None
        if local_tokens >= full_tokens:  # nothing to load, nor to save in the prefill
            self.stats.add(lookups_skipped=1)
            return None
        if self._first_block_absent(t):
            return _Lookup([], [], [])  # a cold prompt: no key derived yet, and a hit of 0
        attn_keys, state_keys, futures = [], [], []
        for rank, ns in enumerate(self._ns):
            per_group = [self._attn_keys(t, rank, g, range(max_tokens // self._bs[g])) for g in self._attn]
            per_state = [[state_key(ns, self._hash_at(hashes, b * self._lcm), g, b * self._lcm)
                          for b in range(1, max_tokens // self._lcm + 1)] for g in self._states]
            attn_keys.append(per_group)
            state_keys.append(per_state)
            flat = [key for keys in per_group + per_state for key in keys]
            futures.append(self._store.acquire(flat, self._pin_pools))
        return _Lookup(futures, attn_keys, state_keys)

    def _first_block_absent(self, t: _Tracked) -> bool:
        """Whether the store surely lacks the prompt's first block on some rank (a hit is a
        prefix on every rank and attention group, so the prompt has none), as this node's
        published indexes say (``surely_absent``: no call; where none can tell, the full lookup
        asks). A 16k-token prompt's full lookup derives and locates ~1,000 keys per rank, ~0.6 ms
        of host time on the CPU box and 6 ms on an H200 host, all of it before a cold request's
        first token."""
        if not self._attn or len(t.request.block_hashes) * self._hash_bs < self._bs[self._attn[0]]:
            return False  # no attention block to ask for
        g = self._attn[0]
        return self._store.surely_absent([self._attn_keys(t, rank, g, range(1))[0] for rank in range(len(self._ns))])

    def _hash_at(self, hashes: list, end_token: int) -> bytes:
        """The chained hash identifying the prefix ``[0, end_token)``."""
        return hashes[end_token // self._hash_bs - 1]

    def _attn_keys(self, t: _Tracked, rank: int, group: int, blocks: range | list[int]) -> list[bytes]:
        """The keys of these blocks of an attention group on one rank, derived once per request:
        its lookup, the slot counts of its chunks and its saves all ask for them."""
        known = t.keys.setdefault((rank, group), [])
        needed = max(blocks, default=-1) + 1
        if needed > len(known):
            bs, hash_bs, hashes = self._bs[group], self._hash_bs, t.request.block_hashes
            known.extend(block_keys(self._ns[rank], [hashes[(i + 1) * bs // hash_bs - 1]
                                                     for i in range(len(known), needed)], group))
        if isinstance(blocks, range) and blocks.step == 1:
            return known[blocks.start:blocks.stop]
        return [known[i] for i in blocks]

    def _hit_tokens(self, lookup: _Lookup) -> int:
        """Stage 1 (longest attention prefix over all ranks and groups), then for hybrid
        models stage 2 (furthest LCM boundary whose state every rank and state group has)."""
        assert lookup.leases is not None
        if not lookup.leases:
            return 0  # the first block was absent: no other key was asked for
        prefix: int | None = None
        boundaries = len(lookup.state_keys[0][0]) if self.hybrid and lookup.state_keys[0] else 0
        states = [True] * boundaries
        for rank, lease in enumerate(lookup.leases):
            found = lease.locations.found()  # attention keys, then states
            at = 0
            for g, keys in zip(self._attn, lookup.attn_keys[rank]):
                misses = np.flatnonzero(~found[at:at + len(keys)])
                tokens = (int(misses[0]) if len(misses) else len(keys)) * self._bs[g]
                prefix = tokens if prefix is None else min(prefix, tokens)
                at += len(keys)
            for keys in lookup.state_keys[rank]:
                states = [ok and present for ok, present in zip(states, found[at:at + len(keys)].tolist())]
                at += len(keys)
        if not self.hybrid:
            return prefix or 0
        return policy.hybrid_hit_blocks((prefix or 0) // self._lcm, states) * self._lcm

    # --- allocation and the step plan ----------------------------------------------------

    @_host_timed
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        t = self._tracked.get(request.request_id)
        if t is None:
            return
        if t.lookup is None or t.lookup.leases is None:
            self._skip_saves(t, t.local_tokens)  # no lookup, or the second call of an async load
            return
        if num_external_tokens <= 0:
            self._release_lookup(t)
            self._skip_saves(t, t.local_tokens)
            return
        block_ids = blocks.get_block_ids()
        start = t.local_tokens
        end = start + num_external_tokens
        t.external_tokens = num_external_tokens
        loads = []
        for rank, lease in enumerate(t.lookup.leases):
            rows: list[range] = []  # of the rank's keys (and lease): attention groups', then states'
            groups: list[int] = []
            targets: list[int] = []
            tails: list[bool] = []
            at = 0
            for g, group_keys in zip(self._attn, t.lookup.attn_keys[rank]):
                first, last = start // self._bs[g], -(-end // self._bs[g])  # the tail block is loaded whole
                rows.append(range(at + first, at + last))
                groups.extend([g] * (last - first))
                targets.extend(block_ids[g][first:last])
                tails.extend([False] * (last - first))
                if end % self._bs[g] and last > first:
                    tails[-1] = True  # the forward writes this block's recomputed tokens
                at += len(group_keys)
            if self.hybrid:
                b = t.hit_tokens // self._lcm  # the state at the hit's end boundary
                for g, group_keys in zip(self._states, t.lookup.state_keys[rank]):
                    rows.append(range(at + b - 1, at + b))
                    groups.append(g)
                    # vLLM keeps the running state of a request that computed N tokens in the
                    # group's block N // block_size - 1; a null block there means no room for it.
                    targets.append(block_ids[g][t.hit_tokens // self._bs[g] - 1])
                    tails.append(False)  # loaded before the forward anyway: no hook waits for states
                    at += len(group_keys)
            taken = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64)
            keys = self._flat_keys(t.lookup, rank)
            blocks = BlockLoads(np.asarray(groups, dtype=np.int64), np.asarray(targets, dtype=np.int64),
                                lease.locations.take(taken), [keys[i] for i in taken.tolist()],
                                np.asarray(tails, dtype=bool))
            assert blocks.locations.found().all() and len(targets) == len(taken)
            usable = NULL_BLOCK_ID not in targets
            if not usable:
                log.error("ucm-ray: vLLM's null block is a target of %s's load at %d tokens; the load is "
                          "failed so vLLM recomputes", request.request_id, t.hit_tokens)
                blocks = BlockLoads.of([])
            job = LoadJob(next(self._job_ids), request.request_id, blocks,
                          complete_in_start=self._async_loads, is_async=self._async_loads,
                          failed=not usable)
            self._loads[job.job_id] = _LoadInFlight(request.request_id, rank, lease.lease_ids, blocks)
            loads.append(job)
        t.loads = loads
        self._loading[request.request_id] = t
        t.lookup = None  # the pins now belong to the load jobs
        self._skip_saves(t, end)
        t.last_state_pos = max(t.last_state_pos, t.hit_tokens if self.hybrid else 0)
        self.stats.add(load_blocks=len(loads[0].blocks))

    def _skip_saves(self, t: _Tracked, until: int) -> None:
        """Blocks up to token ``until`` came from vLLM's own cache or the store (a loaded tail
        block whole): no save, and the slots expected for them go back. (A block vLLM's cache
        shares with a request loading it this very step may yet fail to load: saving it here
        could publish garbage.)"""
        for g in self._attn:
            t.saved_blocks[g] = max(t.saved_blocks.get(g, 0), -(-until // self._bs[g]))
        skipped = min(until, t.expected_until)
        if skipped > t.unexpected_until:
            self._slots.unexpect(self._save_counts(t, t.unexpected_until, skipped))
            t.unexpected_until = skipped

    @staticmethod
    def _flat_keys(lookup: _Lookup, rank: int) -> list[bytes]:
        """The keys of one rank's acquire, in the order they were asked for."""
        return [key for keys in lookup.attn_keys[rank] + lookup.state_keys[rank] for key in keys]

    def build_connector_meta(self, out: SchedulerOutput) -> UcmRayConnectorMetadata:
        started = time.perf_counter()
        self._collect_answers()
        pools = self._store.pools()
        self._slots.tick(pools)
        meta = UcmRayConnectorMetadata()
        if pools.version != self._pools_sent:
            meta.pools = dict(pools.descriptors)
            self._pools_sent = pools.version
            self._pin_pools &= set(pools.descriptors)
        self._track_blocks(out)
        loading = [(req_id, t, t.loads) for req_id, t in self._loading_now() if t.loads is not None]
        if loading:
            at_once = policy.loads_at_once(out.total_num_scheduled_tokens,
                                           sum(t.external_tokens for _, t, _ in loading),
                                           self._config.load_at_once_ratio)
            for req_id, t, jobs in loading:
                # fewer tokens than the FULL-graph threshold: no layer hook may run in this step
                whole = at_once or out.num_scheduled_tokens.get(req_id, 0) < self.recompute
                for rank, job in enumerate(jobs):
                    job.complete_in_start = job.complete_in_start or whole
                    meta.loads.setdefault(rank, []).append(job)
                t.loads = None
        meta.fences = self._fences(out, meta.loads)
        with self._slots.batched():  # the step's expected saves: one slot ask per pool and size
            self._plan_step(out, meta)
        now = time.monotonic()
        for req_id in list(self._finishing):
            # vLLM frees its blocks once told (the worker says so at once): nothing is still to
            # be copied from them, or no slot came for what is left within HOLD_S
            finishing = self._tracked.get(req_id)
            if finishing is None or finishing.finished_at is None:  # tracked anew under its id
                self._finishing.discard(req_id)
            elif not finishing.save_jobs and (not self._unsaved(finishing)
                                              or now - finishing.finished_at > HOLD_S):
                meta.saved_requests.add(req_id)
                self._drop(req_id)
        self._observe_step(out, meta, time.perf_counter() - started)
        return meta

    def _loading_now(self) -> list[tuple[str, _Tracked]]:
        """The requests given load jobs since the last plan (most steps none: with many requests
        decoding, looking at each for jobs cost a step's plan ~0.1 us a request)."""
        if not self._loading:
            return []
        loading, self._loading = self._loading, {}
        return [(req_id, t) for req_id, t in loading.items() if self._tracked.get(req_id) is t]

    def _plan_step(self, out: SchedulerOutput, meta: UcmRayConnectorMetadata) -> None:
        """This step's saves (of blocks filled before it), into ``meta``; slots expected for the
        prompts whose first token is out and for decode batches as their blocks fill."""
        saves: SaveRowsByRank = defaultdict(_SaveRows)  # made for a rank once it has a row
        saving: list[str] = []  # requests with rows in this step's saves
        hybrid = self.hybrid
        hash_bs = self._hash_bs
        for req_id, t in self._tracked.items():
            request = t.request
            if t.waiting_at is not None and t.finished_at is None and not t.pending and t.awaited is None:
                # ``_plan_saves``'s first answer, asked before anything else of a running
                # request whose blocks waited at the last plan (most decode steps): with many
                # requests decoding, visiting each one was the scheduler hook's largest cost
                hashed = len(request.block_hashes) * hash_bs
                computed = request.num_computed_tokens
                if t.waiting_at == (min(computed, hashed), hashed) and request.status == RequestStatus.RUNNING:
                    t.computed = computed
                    continue
            if t.finished_at is None:
                if t.request.status != RequestStatus.RUNNING:
                    t.block_ids = []  # waiting, or preempted: its blocks are not (or no longer) its own
                    continue
                if not t.request.num_output_tokens:
                    continue  # its first token is not out yet: no save of it delays that token
            if not hybrid and not t.prompt_expected:
                # once, from where its saves begin (vLLM's own cache may have held the prompt's
                # start, or all of it); decode blocks take slots from the supply's stock
                t.prompt_expected = True
                t.expected_until = max(t.expected_until, self._saved_tokens(t))
                counts = self._expect_saves(t, t.request.num_prompt_tokens)
                if not self._slots.holds(counts):
                    t.awaited, t.awaited_until = counts, time.monotonic() + PROMPT_SLOT_WAIT_S
            if t.awaited is not None:
                if not self._slots.holds(t.awaited) and self._slots.asking(t.awaited) \
                        and time.monotonic() < t.awaited_until:
                    continue  # its slots are on their way: saved whole, as one job, once here
                t.awaited = None
            if t.block_ids and self._plan_saves(t, saves):
                saving.append(req_id)
        if saves:
            meta.saves = self._dispatch(saves, saving)
        if hybrid:
            states: SaveRowsByRank = defaultdict(_SaveRows)
            self._plan_every_state(out, states)
            if states:
                meta.state_saves = self._dispatch(states, [])

    def _plan_every_state(self, out: SchedulerOutput, states: SaveRowsByRank) -> None:
        """A hybrid model's states that this step's scheduled requests compute, and slots for
        the next chunk of a prompt while this one runs."""
        for req_id, n_sched in out.num_scheduled_tokens.items():
            scheduled = self._tracked.get(req_id)
            if scheduled is None or not scheduled.block_ids:
                continue
            end = scheduled.request.num_computed_tokens + n_sched
            self._plan_states(scheduled, end, states)
            if end < scheduled.request.num_prompt_tokens:
                self._expect_saves(scheduled, end + 2 * self._chunk)

    def _fences(self, out: SchedulerOutput, loads: dict[int, list[LoadJob]]) -> set[int]:
        """Save jobs still copying blocks that this step writes: blocks allocated again (a
        preempted request's), and the targets of its loads (an asynchronous load's request is
        not scheduled this step). A new request's computed prefix (vLLM's own hit, only read;
        an external hit's blocks are load targets) needs no wait."""
        if not self._saves:
            return set()
        allocated: list[int] = [block_id for jobs in loads.values() for job in jobs
                                for block_id in job.blocks.block_ids.tolist()]
        for new in out.scheduled_new_reqs:
            for g, ids in enumerate(new.block_ids):
                read_only = new.num_computed_tokens // self._bs[g] if g in self._attn else 0
                allocated.extend(ids[read_only:])
        for new_ids in out.scheduled_cached_reqs.new_block_ids:
            if new_ids is not None:
                for ids in new_ids:
                    allocated.extend(ids)
        if not allocated:
            return set()
        reused = np.asarray(allocated, dtype=np.int64)
        return {job_id for job_id, job in self._saves.items() if np.isin(job.block_ids, reused).any()}

    def _track_blocks(self, out: SchedulerOutput) -> None:
        """Each running request's block ids, from the scheduler output alone (vLLM 0.26 never
        binds its cache manager to a connector): new requests list all, cached ones append,
        resumed ones start over."""
        for new in out.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.block_ids = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids) if resumed else ():
            t = self._tracked.get(req_id)
            if t is not None and req_id in resumed:
                t.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
                # new blocks: what was pending is saved once recomputed (or never, if it was not)
                t.pending = dict.fromkeys(t.pending, False)
        # requests allocated a block this step (a few in a decode step), picked out without
        # Python per request: ``compress`` keeps the pairs whose ids are not None
        for req_id, new_ids in itertools.compress(zip(cached.req_ids, cached.new_block_ids), cached.new_block_ids):
            t = self._tracked.get(req_id)
            if t is not None and req_id not in resumed:
                for group, ids in enumerate(new_ids):
                    t.block_ids[group].extend(ids)

    def _plan_saves(self, t: _Tracked, saves: SaveRowsByRank) -> bool:
        """Blocks that the steps before this one filled (and hashed), copied while this one runs
        (generated ones once a batch is full or the request ended: ``_saves_wait``); blocks
        still pending (no slot yet, or recomputed after a failed load) first. Their owners are
        placed in one call for the whole request (not one per block). Whether any block of it
        is in this step's saves."""
        req = t.request
        computed = req.num_computed_tokens  # before this step: vLLM advances it after planning
        since, t.computed = min(t.computed, computed), computed
        hashed = len(req.block_hashes) * self._hash_bs
        filled = min(computed, hashed)
        if not t.pending and t.finished_at is None:
            if t.waiting_at == (filled, hashed):
                return False  # as at the last plan: nothing to save yet
            if self._saves_wait(t, filled):
                if hashed - t.expected_until >= DECODE_SAVE_TOKENS * 3 // 8:
                    # slots for the batch, asked for 2-3 times as its blocks fill, the last well
                    # before the batch is saved (the free stock covers the rest): each ask is a
                    # call per pool (every 2 blocks, it was ~1 call per block)
                    self._expect_saves(t, hashed)
                t.waiting_at = (filled, hashed)
                return False  # no block filled since the last plan, or too few past the prompt yet
        t.waiting_at = None
        wanted: list[tuple[int, int, int, bytes]] = []  # rank, group, vLLM block id, key
        pending: list[tuple[int, int, int]] = []  # (group, rank, block index) of each
        for g in self._attn:
            full = min(computed, hashed) // self._bs[g]
            first = t.saved_blocks.get(g, 0)
            computed_now = range(since // self._bs[g], full)
            for rank in range(len(self._ns)):
                retry = sorted(i for (pg, pr, i), ready in t.pending.items()
                               if pg == g and pr == rank and i < full and (ready or i in computed_now))
                blocks = list(dict.fromkeys(retry + list(range(first, full))))
                for i, key in zip(blocks, self._attn_keys(t, rank, g, blocks)):
                    wanted.append((rank, g, t.block_ids[g][i], key))
                    pending.append((g, rank, i))
            t.saved_blocks[g] = max(first, full)
        # the slots expected for what is planned now are used: a resumed request's local hit
        # must not hand them back (``_skip_saves``), or the free stock would drain
        t.unexpected_until = max(t.unexpected_until, min(self._saved_tokens(t), t.expected_until))
        if not wanted:
            return False
        bound = self._bind(saves, wanted)
        waiting = 0
        for block, ok in zip(pending, bound.tolist()):
            if ok:
                t.pending.pop(block, None)
            else:  # no slot yet: the block stays resident while the request runs (or is held)
                waiting += not t.pending.get(block, False)  # counted once, not at every retry
                t.pending[block] = True
        if waiting:
            self.stats.add(saves_skipped=waiting)
        return bool(bound.any())

    def _saves_wait(self, t: _Tracked, filled: int) -> bool:
        """Whether a running request's blocks filled up to token ``filled`` wait for a later
        plan: no block filled since the last one, or every group's prompt blocks are planned and
        fewer than DECODE_SAVE_TOKENS generated tokens are unsaved (counted in tokens over all
        groups, so groups of different block sizes save in the same step)."""
        if all(filled // self._bs[g] <= t.saved_blocks.get(g, 0) for g in self._attn):
            return True
        prompt = t.request.num_prompt_tokens
        if any(t.saved_blocks.get(g, 0) < prompt // self._bs[g] for g in self._attn):
            return False
        return filled - self._saved_tokens(t) < DECODE_SAVE_TOKENS

    def _plan_states(self, t: _Tracked, end: int, saves: SaveRowsByRank) -> None:
        """The mamba states at the LCM boundaries this step's chunk reaches (up to token ``end``),
        saved after its forward: the next step overwrites them."""
        hashes = t.request.block_hashes
        wanted: list[tuple[int, int, int, bytes]] = []
        for pos in policy.state_dump_positions(t.request.num_computed_tokens, end, self._lcm):
            if pos > len(hashes) * self._hash_bs or pos <= t.last_state_pos:
                continue
            for rank, ns in enumerate(self._ns):
                for g in self._states:
                    wanted.append((rank, g, t.block_ids[g][pos // self._bs[g] - 1],
                                   state_key(ns, self._hash_at(hashes, pos), g, pos)))
            t.last_state_pos = pos
        if wanted:
            lost = int((~self._bind(saves, wanted)).sum())  # a state cannot wait: it is lost
            if lost:
                self.stats.add(saves_skipped=lost)

    def _saved_tokens(self, t: _Tracked) -> int:
        """Tokens below which every attention group's blocks are saved or need no save."""
        return min((t.saved_blocks.get(g, 0) * self._bs[g] for g in self._attn), default=0)

    def _unsaved(self, t: _Tracked) -> bool:
        """Whether blocks the request computed are still to be saved, or being copied."""
        computed = min(t.request.num_computed_tokens, len(t.request.block_hashes) * self._hash_bs)
        return (any(computed // self._bs[g] > t.saved_blocks.get(g, 0) for g in self._attn)
                or any(t.pending.values()) or bool(t.save_jobs))

    def _observe_step(self, out: SchedulerOutput, meta: UcmRayConnectorMetadata, plan_s: float) -> None:
        """``schedule_seconds`` of a step that runs tokens and in which the connector had work:
        its host time since the last step's plan (lookups, allocations, finished requests, the
        last step's results, this plan). A forward that is host-bound waits for all of it. A
        step without work (most decode steps) records nothing: vLLM then has no stats of ours
        to aggregate and export, which cost a decode step more than the hooks themselves."""
        worked = self._host_s > 0.0 or meta.carries_work()
        self._host_s += plan_s
        if out.total_num_scheduled_tokens > 0:
            if worked:
                self.stats.observe("schedule_seconds", self._host_s)
            self._host_s = 0.0

    def _bind(self, saves: SaveRowsByRank, rows: list[tuple[int, int, int, bytes]]) -> np.ndarray:
        """Bind granted slots on the owners of each (rank, group, vLLM block id, key) to it, as
        rows of its rank's saves. Per row, whether any replica got a slot (vLLM's placeholder
        block counts as saved: it holds no data of the request); those without wait."""
        bound = np.asarray([block_id == NULL_BLOCK_ID for _, _, block_id, _ in rows], dtype=bool)
        real = np.flatnonzero(~bound)
        if not len(real):
            return bound
        real_rows = real.tolist()
        pools, owners = self._store.placement([rows[i][3] for i in real_rows])
        sizes = [self._entry_bytes[rows[i][1]] for i in real_rows]
        for replica in range(owners.shape[1]):
            # rows per slot class, in row order (``np.unique(axis=1)`` cost ~40 us a call, and
            # its first call in a process imported ``numpy.ma``: ~12 ms on an engine's first save)
            classes: dict[tuple[int, int], list[int]] = defaultdict(list)
            for row, pool_at, size in zip(real_rows, owners[:, replica].tolist(), sizes):
                classes[(pool_at, size)].append(row)
            for (pool_at, size), members in sorted(classes.items()):
                slots = self._slots.take(pools[pool_at], size, len(members))
                for row, (token, offset) in zip(members, slots):
                    rank, group, block_id, key = rows[row]
                    out = saves[rank]
                    out.groups.append(group)
                    out.block_ids.append(block_id)
                    out.keys.append(key)
                    out.pools.append(pools[pool_at])
                    out.offsets.append(offset)
                    out.sizes.append(size)
                    out.tokens.append(token)
                bound[members[:len(slots)]] = True
        return bound

    def _dispatch(self, saves: SaveRowsByRank, requests: list[str]) -> dict[int, BlockSaves]:
        """Per rank, its rows as one save job (remembered until the worker reports it), each
        job held by ``requests`` (whose blocks it copies) until it is."""
        out: dict[int, BlockSaves] = {}
        for rank, rows in saves.items():
            pools = list(dict.fromkeys(rows.pools))
            at = {pool: index for index, pool in enumerate(pools)}
            n = len(rows.keys)
            locations = Locations(pools, np.asarray([at[pool] for pool in rows.pools], dtype=np.int32),
                                  np.asarray(rows.offsets, dtype=np.int64), np.asarray(rows.sizes, dtype=np.int64),
                                  np.full(n, NO_CHECKSUM, dtype=np.int64), np.zeros(n, dtype=np.uint64))
            job = BlockSaves(next(self._job_ids), np.asarray(rows.groups, dtype=np.int64),
                             np.asarray(rows.block_ids, dtype=np.int64), locations)
            self._saves[job.job_id] = _SaveInFlight(rows.keys, locations, np.asarray(rows.tokens, dtype=np.int64),
                                                    job.block_ids, requests)
            for req_id in requests:
                self._tracked[req_id].save_jobs.add(job.job_id)
            out[rank] = job
        return out

    # --- results from the workers --------------------------------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        results = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(results, UcmRayWorkerMetadata):  # None: a step whose workers had nothing to say
            self._take_results(results)

    @_host_timed
    def _take_results(self, results: UcmRayWorkerMetadata) -> None:
        for pool in results.failed_pools:
            self._store.suspect(pool)
            self._slots.abandon_pool(pool)
        if results.unvalidated_pools - self._pin_pools:
            log.info("ucm-ray: a worker cannot read the published index of %s; pinning their entries",
                     sorted(p[0] for p in results.unvalidated_pools - self._pin_pools))
            self._pin_pools |= results.unvalidated_pools
        landed: list[Publishes] = []
        free: dict[tuple[PoolKey, int], list[int]] = defaultdict(list)
        settled: dict[tuple[PoolKey, int], int] = defaultdict(int)
        for job_id, result in results.saves.items():
            job = self._forget_save(job_id)
            if job is None:
                continue
            locations, rows = job.locations, np.flatnonzero(result.landed)
            stored = locations.take(rows)
            if result.checksums is not None:
                stored.checksum = result.checksums[rows].astype(np.int64)
            landed.append(Publishes([job.keys[row] for row in rows.tolist()], stored, job.tokens[rows]))
            for row in np.flatnonzero(~result.landed).tolist():
                pool, token = locations.pools[locations.pool[row]], int(job.tokens[row])
                if result.uncertain:
                    self._slots.abandon(pool, token)  # a late copy may land: quarantine, never reuse
                else:
                    free[(pool, token)].append(int(locations.offset[row]))
                    settled[(pool, token)] += 1
        publish = Publishes.join(landed)
        if len(publish) or free:
            self._answers.append(("commit", self._store.commit(publish, dict(free))))
            self.stats.add(saved_blocks=len(publish))
            for grant, rows in publish.grants.items():
                settled[grant] += len(rows)
            for (pool, token), count in settled.items():
                self._slots.settled(pool, token, count)
        pins: list[tuple[PoolKey, list[int]]] = []
        removals: list[Removal] = []
        for job_id in results.loads_done:
            load = self._loads.pop(job_id, None)
            if load is None:
                continue
            pins.extend(load.lease_ids.items())
            if results.corrupt:
                corrupt = set(results.corrupt)
                removals.extend(Removal(key, loc) for key, loc in zip(load.blocks.keys, load.blocks.locations)
                                if loc in corrupt)
            self._save_again(load, results.load_failures.get(job_id, []))
        self._release(pins)
        if removals:
            log.error("ucm-ray: removing %d stored entries that failed their checksum", len(removals))
            self._answers.append(("remove", self._store.remove(removals)))

    def _save_again(self, load: _LoadInFlight, failed_block_ids: list[int]) -> None:
        """Blocks that failed to load (the store evidently lost them) are saved again once vLLM
        recomputed them; only those, not the rest of the prefix."""
        t = self._tracked.get(load.req_id)
        if t is None or not failed_block_ids:
            return
        for g in self._attn:
            ids = t.block_ids[g] if g < len(t.block_ids) else []
            failed = [ids.index(b) for b in failed_block_ids if b in ids]
            for i in failed:
                t.pending[(g, load.rank, i)] = False  # garbage until a step recomputes it
            for i in failed:
                self._expect_saves(t, (i + 1) * self._bs[g], i * self._bs[g])

    def _collect_answers(self) -> None:
        """Check what the shards said to our commits, releases and removals (never waits)."""
        if not (self._answers or self._orphans or self._saves or self._loads):
            return  # most decode steps
        still = []
        for kind, answer in self._answers:
            if not answer.poll():
                still.append((kind, answer))
                continue
            result = answer.result()
            if kind == "commit":
                # Not visible from this write: another writer stored the key first (or the
                # grant had lapsed): counted, never an error.
                self.stats.add(commits_not_visible=sum(1 for visible in result if not visible))
            elif kind == "release" and result & set(self._store.pools().descriptors):
                # Cannot happen while lease_s > 2 x transfer_timeout_s (checked in the config):
                # the copies were bounded by the step deadline, well inside the lease. (A pool
                # that is gone took its pins with it: nothing lapsed there.)
                lapsed = result & set(self._store.pools().descriptors)
                log.error("ucm-ray: read pins on %s had lapsed before their release", sorted(lapsed))
                self.stats.add(lapsed_leases=len(lapsed))
        self._answers = still
        arrived = [lookup for lookup in self._orphans if lookup.poll()]
        self._orphans = [lookup for lookup in self._orphans if lookup not in arrived]
        self._release([pin for lookup in arrived for pin in lookup.result().lease_ids.items()])
        overdue = time.monotonic() - self._config.reserve_timeout_s / 2
        for job_id in [j for j, job in self._saves.items() if job.dispatched < overdue]:
            job = self._forget_save(job_id)  # its worker never reported: a copy may still land
            assert job is not None
            for pool, token in zip(job.locations.pool.tolist(), job.tokens.tolist()):
                self._slots.abandon(job.locations.pools[pool], token)
        for job_id in [j for j, load in self._loads.items() if load.dispatched < overdue]:
            self._release(list(self._loads.pop(job_id).lease_ids.items()))  # its worker never reported

    def _forget_save(self, job_id: int) -> _SaveInFlight | None:
        """A save job whose result is in (or never will be): its requests no longer wait for it."""
        job = self._saves.pop(job_id, None)
        for req_id in job.requests if job is not None else []:
            t = self._tracked.get(req_id)
            if t is not None:
                t.save_jobs.discard(job_id)
        return job

    def flush(self, timeout_s: float) -> None:
        """Wait until the store answered every commit, release and removal posted so far (tools
        and tests that hand a prefix to another engine right away; the engine never waits)."""
        deadline = time.monotonic() + timeout_s
        while self._answers and time.monotonic() < deadline:
            time.sleep(0.001)
            self._collect_answers()

    def settled(self) -> bool:
        """No job waits for a worker's result and no control call for the store's answer."""
        return not (self._loads or self._saves or self._answers or self._orphans
                    or any(t.finished_at is not None for t in self._tracked.values()))

    # --- endings -------------------------------------------------------------------------

    @_host_timed
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Blocks of the request still to be saved (those its last step filled, and generated
        blocks short of a DECODE_SAVE_TOKENS batch) keep it: vLLM holds its blocks until the next
        step saved them and reported it ``finished_sending``. Otherwise (or with no pool to save
        into) they are freed at once."""
        t = self._tracked.get(request.request_id)
        if t is None:
            return False, None
        self._release_lookup(t)
        if t.block_ids and self._unsaved(t) and self._store.pools().descriptors:
            t.finished_at = time.monotonic()
            self._finishing.add(request.request_id)
            if t.prompt_expected:  # generated blocks of an unfinished batch: slots at the next step's tick
                self._expect_saves(t, len(request.block_hashes) * self._hash_bs, later=True)
            return True, None
        self._drop(request.request_id)
        return False, None

    def _drop(self, req_id: str) -> None:
        """Forget a request; blocks of it still unsaved are never saved."""
        t = self._tracked.pop(req_id)
        self._finishing.discard(req_id)
        dropped = sum(1 for ready in t.pending.values() if ready)
        if dropped:
            self.stats.add(saves_dropped=dropped)

    def _release_lookup(self, t: _Tracked) -> None:
        """Unpin a lookup no load job took over (no hit used, or never scheduled); one still in
        flight (an abort) is released once its pins are in."""
        if t.lookup is not None:
            if t.lookup.leases is None:
                self._orphans.extend(t.lookup.futures)
            else:
                self._release([pin for lease in t.lookup.leases for pin in lease.lease_ids.items()])
        t.lookup = None
        t.loads = None

    def _release(self, pins: list[tuple[PoolKey, list[int]]]) -> None:
        by_pool: dict[PoolKey, list[int]] = defaultdict(list)
        for pool, ids in pins:
            by_pool[pool].extend(ids)
        if by_pool:
            self._answers.append(("release", self._store.release(dict(by_pool))))

    def shutdown(self) -> None:
        """Hand unused slots back (best effort: a lapsed grant frees them anyway)."""
        unused = self._slots.close()
        if unused:
            self._store.commit(Publishes.of([]), unused).result()
        self._store.close()

    def take_stats(self) -> UcmRayStats | None:
        return self.stats.take()
