"""Unlink a shard's pool file when its process ends, however it ends.

A shard unlinks its pool on ``shutdown``, but a process can also end without running any
Python: ``kill -9``, an OOM kill, or the end of the Ray cluster it lives in (``ray.shutdown()``
of a local cluster, ``serve run`` interrupted with Ctrl-C) — and /dev/shm is memory that stays
taken until the file is gone. So each pool gets a watcher: a tiny ``sh`` that blocks reading a
pipe only the shard holds open; the kernel closes that pipe when the shard ends, and the watcher
removes the file. Clients that mapped the pool keep their mapping; new ones get ENOENT, a miss.

The watcher is detached: started in a session of its own (signals to the shard's process group
do not reach it) by an ``sh`` that exits at once, so it is no child of the shard either. A Ray
worker that exits because its cluster went away (its driver killed) kills its children first,
and a watcher that was the shard's child died with the pool still there.
"""

from __future__ import annotations

import os
import subprocess

_WATCH = 'exec 3<&0; (cat <&3 >/dev/null; rm -f -- "$@") & exit 0'
"""A background job's stdin is /dev/null: the pipe goes to it as fd 3."""


class PoolReaper:
    """Holds the pipe end whose closing (this process's end) makes the watcher unlink ``paths``
    (a pool and its published index)."""

    def __init__(self, *paths: str) -> None:
        read_end, self._write_end = os.pipe()  # both close-on-exec: no other child inherits them
        try:
            starter = subprocess.Popen(["sh", "-c", _WATCH, "ucm-ray-reaper", *paths], stdin=read_end,
                                       start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            starter.wait(timeout=10)  # it only starts the watcher; reaped here, no zombie
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)

    def close(self) -> None:
        """The pool was unlinked cleanly: let the watcher go (its ``rm -f`` finds nothing)."""
        if self._write_end >= 0:
            os.close(self._write_end)
            self._write_end = -1
