"""Drive vLLM's real v1 Scheduler (no model, no worker) with UcmRayConnector and real shards.

The test plays the worker: the keys the connector plans to save are written into the
shards with a StoreClient, loads are acknowledged (async ones through ``finished_recving``)
and their pins released. Everything else — hashing, allocation, chunking, the connector's
policy — is vLLM's and ours, unmodified.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import torch
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                         SchedulerConfig, SpeculativeConfig, VllmConfig)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        MambaSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from ucm_ray.config import UcmRayConfig
from ucm_ray.store.client import StoreClient

MAX_LEN = 16384


def write_model_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                   "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": MAX_LEN,
                   "rms_norm_eps": 1e-6, "torch_dtype": "float32"}, f)
    return path


@dataclass
class Engine:
    """One vLLM scheduler with our connector, standing in for one engine."""

    sched: Scheduler
    client: StoreClient
    block_size: int
    hasher: object
    steps: int = 0
    deferred: dict[str, int] = field(default_factory=dict)  # steps a request waited on its lookup
    first: dict[str, tuple[int, int]] = field(default_factory=dict)  # req -> (computed, scheduled)
    loaded_blocks: dict[str, int] = field(default_factory=dict)  # req -> blocks the plan loads
    prefill_computed: dict[str, int] = field(default_factory=dict)  # req -> prompt tokens computed
    resumed_at: dict[str, list[int]] = field(default_factory=dict)  # req -> computed tokens at each resume

    @property
    def connector(self):
        return self.sched.connector

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> Request:
        req = Request(request_id=req_id, prompt_token_ids=tokens, pooling_params=None,
                      sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                      block_hasher=self.hasher)
        self.sched.add_request(req)
        return req

    def step(self) -> None:
        self.steps += 1
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        for r in self.sched.waiting:
            if r.request_id not in self.first:
                self.deferred[r.request_id] = self.deferred.get(r.request_id, 0) + 1
        for new in out.scheduled_new_reqs:
            self.first.setdefault(new.req_id, (new.num_computed_tokens, out.num_scheduled_tokens[new.req_id]))
        cached = out.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            if rid in cached.resumed_req_ids:
                self.resumed_at.setdefault(rid, []).append(computed)
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            before = req.num_computed_tokens - n  # the scheduler already advanced it
            if before < req.num_prompt_tokens:
                self.prefill_computed[rid] = self.prefill_computed.get(rid, 0) + min(n, req.num_prompt_tokens - before)
        # play the worker: saves land in the shards, loads are acknowledged and unpinned
        saves = meta.saves.get(0, [])
        if saves:
            payload = torch.arange(len(saves) * 64, dtype=torch.int64).to(torch.uint8)
            self.client.register_local(payload)
            assert all(self.client.put([s.key for s in saves], [payload[i * 64:(i + 1) * 64]
                                                                for i in range(len(saves))]))
        recv = set()
        for ld in meta.loads.get(0, []):
            self.loaded_blocks[ld.req_id] = self.loaded_blocks.get(ld.req_id, 0) + len(ld.blocks)
            self.client.release_async(ld.leases)
            if ld.is_async:
                recv.add(ld.req_id)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_recving=recv or None)))

    def run(self, *reqs: Request, timeout_s: float = 120.0) -> None:
        """Step until the requests finish. Bounded by time, not steps: while a lookup is in
        flight a step schedules nothing and returns at once, however slow a busy host is."""
        deadline = time.monotonic() + timeout_s
        while not all(r.is_finished() for r in reqs):
            assert time.monotonic() < deadline, "requests did not finish"
            self.step()

    def serve(self, req_id: str, tokens: list[int]) -> tuple[int, int]:
        """Run one request to completion; returns (prompt tokens vLLM got without computing them
        when it first scheduled the request, prompt tokens it computed in all)."""
        self.run(self.add(req_id, tokens))
        return self.first[req_id][0], self.prefill_computed[req_id]


def make_engine(cfg: UcmRayConfig, model_dir: str, *, block_size: int = 128, num_spec: int = 0,
                hybrid: bool = False, max_batched: int = 8192, num_blocks: int = 256,
                layerwise: bool = True, hash_algo: str = "sha256", extra: dict | None = None) -> Engine:
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=MAX_LEN, dtype="float32", seed=0)
    spec = None
    if num_spec:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec, prompt_lookup_max=3,
                                 prompt_lookup_min=1, target_model_config=model,
                                 target_parallel_config=ParallelConfig())
    extra = {**cfg.to_dict(), "layerwise": layerwise, **(extra or {})}
    vcfg = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True,
                                 mamba_cache_mode="align" if hybrid else "none",
                                 prefix_caching_hash_algo=hash_algo),
        scheduler_config=SchedulerConfig(max_model_len=MAX_LEN, is_encoder_decoder=False,
                                         max_num_batched_tokens=max_batched, max_num_seqs=8,
                                         enable_chunked_prefill=True),
        device_config=DeviceConfig("cpu"), speculative_config=spec,
        kv_transfer_config=KVTransferConfig(kv_connector="UcmRayConnector",
                                            kv_connector_module_path="ucm_ray.vllm.connector",
                                            kv_role="kv_both", kv_load_failure_policy="recompute",
                                            kv_connector_extra_config=extra))
    vcfg.cache_config.num_gpu_blocks = num_blocks
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], attn)]
    if hybrid:
        mamba = MambaSpec(block_size=block_size, shapes=((3, 512), (8, 64, 16)),
                          dtypes=(torch.float32, torch.float32), mamba_cache_mode="align",
                          page_size_padded=attn.page_size_bytes)
        groups.append(KVCacheGroupSpec(["model.layers.2.mixer"], mamba))
    page = attn.page_size_bytes
    tensors = [KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=0, block_stride=page)
               for g in groups for n in g.layer_names]
    kcfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
    kcfg.hash_block_size = block_size
    kcfg.cache_hit_alignment_tokens = block_size
    sched = Scheduler(vllm_config=vcfg, kv_cache_config=kcfg,
                      structured_output_manager=StructuredOutputManager(vcfg),
                      block_size=block_size, hash_block_size=block_size, log_stats=True)
    init_none_hash(sha256)
    return Engine(sched, StoreClient(cfg), block_size, get_request_block_hasher(block_size, sha256))


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4000, (n,), generator=g).tolist()
