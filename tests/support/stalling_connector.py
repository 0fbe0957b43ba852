"""The connector, plus one test-only act: the first step that loads anything stops a process
(``UCM_RAY_TEST_STALL_PID``, a shard's; SIGSTOP) just before its loads are posted. The scheduler's
lookup answered (the shard ran then), and the step's NIXL reads go to a shard that no longer
answers: they time out in flight, as a shard paused mid-load makes them (a swapped-out host, a
long GC). Used as vLLM's ``kv_connector_module_path`` by ``tests/e2e/test_late_read_engine.py``."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil

from ucm_ray.vllm.connector import UcmRayConnector as _Connector

STALL_PID = "UCM_RAY_TEST_STALL_PID"


class UcmRayConnector(_Connector):
    _stalled = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not self._stalled and STALL_PID in os.environ and meta is not None and meta.loads:
            pid = int(os.environ[STALL_PID])
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while psutil.Process(pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
                time.sleep(0.01)
            UcmRayConnector._stalled = True
        super().start_load_kv(forward_context, **kwargs)
