"""Will the pools fit? Checked before any actor starts, so a too-large ``pool_bytes`` is one line.

Without it, a shard whose pool does not fit fails in ``posix_fallocate`` with ENOSPC, deep in a
Ray actor-creation traceback, after the directory and the other shards have started.
"""

from __future__ import annotations

import os

from ucm_ray.config import ConfigError
from ucm_ray.store.published_layout import index_bytes

_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def human_bytes(n: int) -> str:
    """``40 GiB``, ``1.5 MiB``, ``512 bytes``."""
    for size, name in _UNITS:
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + f" {name}"
    return f"{n} bytes"


def free_bytes(shm_dir: str) -> int:
    """Bytes an unprivileged process may still allocate in ``shm_dir``'s file system."""
    try:
        st = os.statvfs(shm_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"shm_dir: cannot read the free space of {shm_dir!r}: {e}") from None
    return st.f_bavail * st.f_frsize


def check_pool_fits(shm_dir: str, pool_bytes: int, count: int, disk_bytes: int = 0) -> None:
    """Raise a one-line ``ConfigError`` naming ``pool_bytes`` when ``count`` pools of
    ``pool_bytes`` do not fit the space free in ``shm_dir`` on this node now, or naming
    ``shm_dir`` when this user cannot create files there. ``count`` is the number of pools about
    to be created in that directory on this node (shards that exist already hold theirs)."""
    if count <= 0:
        return
    free = free_bytes(shm_dir)
    if (pool_bytes + index_bytes(pool_bytes, disk_bytes)) * count > free:  # each pool has its published index
        pools = f"{count} pools of {human_bytes(pool_bytes)} do not" if count > 1 else \
            f"1 pool of {human_bytes(pool_bytes)} does not"
        raise ConfigError(f"pool_bytes: {pools} fit {shm_dir}'s {human_bytes(free)} free "
                          f"(lower pool_bytes or num_shards, or give {shm_dir} more memory)")
    if not os.access(shm_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"shm_dir: {shm_dir!r} is not writable by this user")
