"""The one place that knows how supported vLLM versions differ (0.26 GPU machine, 0.32 CPU, 0.33).

Everything else imports vLLM names from here when they are not present in every
supported version.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorWorkerMetadata
from vllm.v1.core import kv_cache_utils

try:  # vLLM >= 0.32 reports async load failures per request through this
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - vLLM 0.26
    KVConnectorTransferResults = None

try:  # vLLM >= 0.26: connectors export their own Prometheus metrics (``build_prom_metrics``)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    PROM_METRICS_HOOK = hasattr(KVConnectorBase_V1, "build_prom_metrics")
except ImportError:  # pragma: no cover - a vLLM without the hook: the stats reach only its log line
    KVConnectorPromMetrics = object
    PROM_METRICS_HOOK = False
"""Whether this vLLM asks the connector class for Prometheus metrics. vLLM 0.26 and 0.32 both
do, with the same signature, and hand ``observe`` the stats' ``data`` (0.26 reads ``.data``,
0.32 ``to_dict()``, which returns ``data``); without the hook the connector exports nothing and
vLLM still logs ``UcmRayStats.reduce()`` in its periodic "KV Transfer metrics" line."""

ASYNC_LOAD_FAILURES_REPORTABLE = KVConnectorTransferResults is not None
"""vLLM 0.26 has no ``failed_recving``: an asynchronous load can only be reported done, so a
failed one would hand wrong bytes to the model; connectors must not load asynchronously there."""


def check_async_loads_reportable(num_groups: int) -> None:
    """Refuse a cache of several kv-cache groups (a hybrid model: loads are asynchronous) where
    a failed asynchronous load cannot be reported. Both connector halves call it: vLLM builds
    the workers' caches before the scheduler, so the worker must refuse first and as clearly."""
    if num_groups > 1 and not ASYNC_LOAD_FAILURES_REPORTABLE:
        raise ValueError("ucm-ray: this vLLM cannot be told that an asynchronous load failed, which a "
                         "cache of several kv-cache groups (a hybrid model) needs; use vLLM >= 0.32 "
                         "for such models")


def check_one_compute_stream(parallel_config: Any) -> None:
    """Refuse micro-batching (``enable_dbo``, or ``ubatch_size`` > 1 where this vLLM has it): it
    runs a step's forward as micro-batches on their own threads and CUDA streams, calling each
    layer's hook once per micro-batch, while the worker orders a step's loads for one compute
    stream (the one current at ``start_load_kv`` and at a layer's first hook): another stream
    could read blocks before they land."""
    if getattr(parallel_config, "enable_dbo", False) or getattr(parallel_config, "ubatch_size", 0) > 1:
        raise ValueError("ucm-ray: micro-batching (enable_dbo / ubatch_size > 1) runs the forward pass on "
                         "several CUDA streams, and the connector orders its loads for one; turn it off "
                         "to use the tier")


__all__ = ["ASYNC_LOAD_FAILURES_REPORTABLE", "PROM_METRICS_HOOK", "KVConnectorPromMetrics",
           "KVConnectorTransferResults", "KVConnectorWorkerMetadata", "block_hashes_vary_per_process",
           "check_async_loads_reportable", "check_one_compute_stream"]


def block_hashes_vary_per_process(hash_algo: str) -> bool:
    """Whether this vLLM seeds the first block's parent hash randomly in each process, so that no
    two engines' block hashes (hence store keys) could ever match.

    vLLM 0.26 draws it from ``os.urandom`` for every algorithm unless PYTHONHASHSEED is set;
    later versions (``resolve_none_hash_seed``) only for the non-cryptographic xxhash family.
    """
    if os.getenv("PYTHONHASHSEED") is not None:
        return False
    if hasattr(kv_cache_utils, "resolve_none_hash_seed"):
        return hash_algo.startswith("xxhash")
    return True
