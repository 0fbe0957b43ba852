"""Test hooks on a shard's disk I/O, set in the environment of the process that starts a fleet
(``ucm-ray up``, or a driver's ``start_fleet``), which passes them on to every shard it starts.
Unset (always, outside tests) they change nothing; a value of another form is refused in one line.

``UCM_RAY_TEST_DISK_CRASH=<call>:<n>``: a shard that kills itself (SIGKILL, as ``kill -9`` does)
right after the ``n``-th call of ``<call>`` returned, so a test can restart it there and check what
it adopts:

- ``pwritev``: mid-demotion, an entry's bytes are on disk but no manifest lists them yet;
- ``write_synced``: mid-manifest, the new manifest is written under its temporary name, not renamed;
- ``replace``: renamed, the directory not yet synced.

``UCM_RAY_TEST_DISK_READ_GATE=<path>``: every read of the disk's data waits until the file
``path`` exists (at most ``GATE_WAIT_S``), having made ``<path>.waiting``: a promotion held
mid-read for as long as a test needs, to see what the shard does meanwhile.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence

from ucm_ray.store.shard.disk.fileops import FileOps

ENV = "UCM_RAY_TEST_DISK_CRASH"
CALLS = ("pwritev", "write_synced", "replace")
GATE_ENV = "UCM_RAY_TEST_DISK_READ_GATE"
GATE_WAIT_S = 60.0


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


class GatedReadFileOps(FileOps):
    """The real calls; each data read first says it waits (``<gate>.waiting``), then waits until
    the file ``gate`` exists."""

    def __init__(self, gate: str) -> None:
        self.gate = gate

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        with open(self.gate + ".waiting", "a"):
            pass
        deadline = time.monotonic() + GATE_WAIT_S
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return super().preadv(fd, buffers, offset)


def ops_from_env() -> FileOps | None:
    """The disk store's ``FileOps`` this process's environment asks for (None: the plain ones)."""
    gate = os.environ.get(GATE_ENV)
    if gate:
        return GatedReadFileOps(gate)
    value = os.environ.get(ENV)
    if not value:
        return None
    call, _, count = value.partition(":")
    if call not in CALLS or not count.isdigit() or int(count) < 1:
        raise ValueError(f"{ENV}={value!r}: expected <call>:<n> with call one of {', '.join(CALLS)} and n >= 1")
    return CrashingFileOps(call, int(count))


def shard_env() -> dict[str, str]:
    """What a fleet's driver passes on to the shards it starts (empty outside tests)."""
    return {name: os.environ[name] for name in (ENV, GATE_ENV) if os.environ.get(name)}
