"""Test hook: a shard that kills itself (SIGKILL, as ``kill -9`` does) at a chosen point of its disk
tier's I/O, so a test can restart it there and check what it adopts.

``UCM_RAY_TEST_DISK_CRASH=<call>:<n>`` in the environment of the process that starts a fleet
(``ucm-ray up``, or a driver's ``start_fleet``) reaches every shard it starts; each shard's disk
store then sends its own process SIGKILL right after the ``n``-th call of ``<call>`` returned:

- ``pwritev``: mid-demotion, an entry's bytes are on disk but no manifest lists them yet;
- ``write_synced``: mid-manifest, the new manifest is written under its temporary name, not renamed;
- ``replace``: renamed, the directory not yet synced.

Unset (always, outside tests) it changes nothing. A value of another form is refused in one line.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

from ucm_ray.store.shard.disk.fileops import FileOps

ENV = "UCM_RAY_TEST_DISK_CRASH"
CALLS = ("pwritev", "write_synced", "replace")


class CrashingFileOps(FileOps):
    """The real calls; the process is killed right after call number ``n`` of ``call`` returned."""

    def __init__(self, call: str, n: int) -> None:
        self.call, self.left = call, n

    def _after(self, call: str) -> None:
        if call == self.call:
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        done = super().pwritev(fd, buffers, offset)
        self._after("pwritev")
        return done

    def write_synced(self, path: str, data: bytes) -> None:
        super().write_synced(path, data)
        self._after("write_synced")

    def replace(self, src: str, dst: str) -> None:
        super().replace(src, dst)
        self._after("replace")


def ops_from_env() -> FileOps | None:
    """The disk store's ``FileOps`` this process's environment asks for (None: the plain ones)."""
    value = os.environ.get(ENV)
    if not value:
        return None
    call, _, count = value.partition(":")
    if call not in CALLS or not count.isdigit() or int(count) < 1:
        raise ValueError(f"{ENV}={value!r}: expected <call>:<n> with call one of {', '.join(CALLS)} and n >= 1")
    return CrashingFileOps(call, int(count))


def shard_env() -> dict[str, str]:
    """What a fleet's driver passes on to the shards it starts (empty outside tests)."""
    value = os.environ.get(ENV)
    return {ENV: value} if value else {}
