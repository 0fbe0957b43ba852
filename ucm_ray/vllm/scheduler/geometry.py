"""What this engine's kv cache looks like to the store, fixed at start-up.

Which groups are stored (full attention and mamba states), their block sizes and LCM, the
namespace of each tensor-parallel rank, the bytes of one entry per group, and how a block's
key is derived from vLLM's chained block hashes. The start-up checks refuse what the tier
cannot serve before the engine takes a request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import vllm
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from ucm_ray import policy
from ucm_ray.config import UcmRayConfig
from ucm_ray.keys import Namespace, block_keys, state_key
from ucm_ray.vllm.compat import (
    block_hashes_vary_per_process,
    check_async_loads_reportable,
    loads_land_before_scheduling,
)
from ucm_ray.vllm.layout import entry_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

NULL_BLOCK_ID = 0
"""vLLM's placeholder block (never holds data): loading into it would corrupt shared state."""


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


def _check_engine(vllm_config: VllmConfig) -> None:
    """Refuse settings under which the tier would serve nothing, or fail user requests."""
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


@dataclass
class CacheGeometry:
    """The engine's kv-cache groups as the store sees them, and the keys of their blocks."""

    groups: list[Any]
    """vLLM's kv-cache groups (``KVCacheGroupSpec``)."""
    attn: list[int]
    """Full-attention groups: stored block by block."""
    states: list[int]
    """Mamba-state groups: one state stored per LCM boundary."""
    block_sizes: list[int]
    """Tokens per block, per group."""
    lcm: int
    """Tokens of the smallest block every group's blocks align to."""
    hash_block_size: int
    """Tokens per vLLM block hash."""
    namespaces: list[bytes]
    """Per tp rank, the namespace digest mixed into this engine's keys."""
    entry_bytes: list[int]
    """Bytes of one stored entry, per group."""
    chunk_tokens: int
    """vLLM's ``max_num_batched_tokens``: the longest prompt chunk one step computes."""
    async_loads: bool
    """Loads are asynchronous (the request waits until its load landed): vLLM can take back a failed
    synchronous load of a single-group cache only (it raises for several groups), and exactly only
    under synchronous scheduling (``compat.loads_land_before_scheduling``)."""
    recompute: int
    """Prompt tokens vLLM computes itself after a dense hit (``policy.recompute_tokens``)."""
    hybrid: bool = field(init=False)
    """Some group holds mamba states. An attribute, not a property: the scheduler's hooks ask it
    several times a step, and each call costs a quiet step, its caches cold, several times what
    it costs warm (docs/performance-log.md, stop 65)."""

    def __post_init__(self) -> None:
        self.hybrid = bool(self.states)

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: UcmRayConfig) -> CacheGeometry:
        """The engine's geometry, once its settings passed the start-up checks."""
        _check_engine(vllm_config)
        groups = kv_cache_config.kv_cache_groups
        # Full attention and mamba states only: a sliding-window group's out-of-window blocks are
        # vLLM's shared null block, which must never be loaded into nor stored.
        attn = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        states = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
        other = set(range(len(groups))) - set(attn) - set(states)
        if other:
            raise ValueError(f"ucm-ray: unsupported kv-cache group spec(s) "
                             f"{sorted(type(groups[i].kv_cache_spec).__name__ for i in other)}; "
                             "ucm-ray stores full-attention and mamba-state groups only")
        check_async_loads_reportable(len(groups))
        block_sizes = [g.kv_cache_spec.block_size for g in groups]
        hash_block_size = (getattr(kv_cache_config, "hash_block_size", None)
                           or resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
        spec = vllm_config.speculative_config
        speculative = spec.num_speculative_tokens if spec is not None and spec.num_speculative_tokens else 0
        return cls(groups=list(groups), attn=attn, states=states, block_sizes=block_sizes,
                   lcm=math.lcm(*block_sizes) if block_sizes else 1, hash_block_size=hash_block_size,
                   namespaces=engine_namespaces(vllm_config, kv_cache_config, config.namespace, config.model_id),
                   entry_bytes=[entry_bytes(kv_cache_config, g) for g in range(len(groups))],
                   chunk_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                   async_loads=len(groups) > 1 or loads_land_before_scheduling(vllm_config),
                   recompute=policy.recompute_tokens(config.layerwise, speculative))

    @property
    def kv_bytes_per_token(self) -> int:
        """One rank's stored bytes a token: each attention group's entry over its block, each
        state group's over the LCM block it is stored at."""
        return round(sum(self.entry_bytes[g] / self.block_sizes[g] for g in self.attn)
                     + sum(self.entry_bytes[g] / self.lcm for g in self.states))

    def hash_at(self, hashes: list, end_token: int) -> bytes:
        """The chained hash identifying the prefix ``[0, end_token)``."""
        return hashes[end_token // self.hash_block_size - 1]

    def state_key(self, rank: int, hashes: list, group: int, position: int) -> bytes:
        """The key of a state group's state after the prefix ``[0, position)`` on one rank."""
        return state_key(self.namespaces[rank], self.hash_at(hashes, position), group, position)

    def attn_block_keys(self, rank: int, group: int, hashes: list, blocks: range) -> list[bytes]:
        """The keys of an attention group's blocks on one rank (``blocks``: their indexes)."""
        size, hash_size = self.block_sizes[group], self.hash_block_size
        return block_keys(self.namespaces[rank], [hashes[(i + 1) * size // hash_size - 1] for i in blocks], group)
