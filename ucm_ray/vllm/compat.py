"""The one place that knows how supported vLLM versions differ (0.26 GPU machine, 0.32 CPU, 0.33).

Everything else imports vLLM names from here when they are not present in every
supported version.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

try:  # vLLM >= 0.32 reports async load failures per request through this
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - vLLM 0.26
    KVConnectorTransferResults = None

__all__ = ["KVConnectorTransferResults", "KVConnectorWorkerMetadata"]
