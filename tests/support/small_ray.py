"""A small Ray cluster of the test module's own, unless the session already runs one."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def own_or_session_ray() -> Iterator[ModuleType]:
    """``ray``, initialised: the session's cluster if one runs (shared, left running), else one of
    two CPUs on loopback in a temp dir of its own, shut down and removed afterwards."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    tmp = tempfile.mkdtemp(prefix=f"ucmr-{os.getpid()}-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, _node_ip_address="127.0.0.1",
             logging_level="WARNING")
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
