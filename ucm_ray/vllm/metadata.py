"""What the scheduler part hands to the worker part each step (pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ucm_ray.store.client import Location


@dataclass
class BlockLoad:
    """Copy the stored entry at ``location`` into vLLM block ``block_id`` of ``group``."""

    group: int
    block_id: int
    location: Location


@dataclass
class RequestLoad:
    req_id: str
    blocks: list[BlockLoad]
    leases: dict[str, list[int]]
    """Pins the worker releases (one batched call per shard) once its copies are done."""
    complete_in_start: bool = False
    """Load everything in ``start_load_kv``: this step runs fewer tokens than the FULL-CUDA-graph
    threshold (2 + k), so it may replay a graph in which no layer hook runs."""
    failed: bool = False
    """The plan could not place every entry: report the whole load as failed (vLLM recomputes)."""
    is_async: bool = False
    """Reported through ``finished_recving`` / ``failed_recving`` (hybrid caches: vLLM cannot
    take back a failed synchronous load of a multi-group cache)."""


@dataclass
class BlockSave:
    """Store vLLM block ``block_id`` of ``group`` under ``key``."""

    group: int
    block_id: int
    key: bytes


@dataclass
class UcmRayConnectorMetadata(KVConnectorMetadata):
    step: int = 0
    loads: dict[int, list[RequestLoad]] = field(default_factory=dict)
    """tp rank -> loads for that rank."""
    saves: dict[int, list[BlockSave]] = field(default_factory=dict)
    """tp rank -> blocks (attention) and states (mamba groups) to save this step."""
