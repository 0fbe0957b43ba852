"""NullConnector: a KV connector whose every hook does nothing.

A benchmark's yardstick, not a cache: an engine with it pays what vLLM's connector plumbing
alone costs a step (the hooks it calls, the metadata and outputs it builds and passes
around), so comparing ucm-ray with it and with no connector at all splits a decode step's
overhead into vLLM's share and ours. Load it with ``kv_connector: NullConnector`` and
``kv_connector_module_path: ucm_ray.testing.null_connector``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def null_kv_transfer_config() -> dict[str, Any]:
    """``KVTransferConfig`` fields of an engine with the NullConnector."""
    return {"kv_connector": "NullConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "ucm_ray.testing.null_connector"}


class NullConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()
