"""The one place that knows how supported vLLM versions differ (0.26 GPU machine, 0.32 CPU, 0.33).

Everything else imports vLLM names from here when they are not present in every
supported version.
"""

from __future__ import annotations

import os

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.core import kv_cache_utils

try:  # vLLM >= 0.32 reports async load failures per request through this
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - vLLM 0.26
    KVConnectorTransferResults = None

ASYNC_LOAD_FAILURES_REPORTABLE = KVConnectorTransferResults is not None
"""vLLM 0.26 has no ``failed_recving``: an asynchronous load can only be reported done, so a
failed one would hand wrong bytes to the model; connectors must not load asynchronously there."""

__all__ = ["ASYNC_LOAD_FAILURES_REPORTABLE", "KVConnectorTransferResults", "KVConnectorWorkerMetadata",
           "block_hashes_vary_per_process"]


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
