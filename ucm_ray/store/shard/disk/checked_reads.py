"""The disk tier's reads: runs of adjacent slots read into staging buffers, each entry checked
against its CRC32 there and only then copied to its destination (a pool slot).

Why reading and checking are on different threads: with one thread doing a run's read, then its
checksums and copies, the reader threads fell into lock step on a disk whose bandwidth they
shared. Their reads ended together, and the disk stood idle while all of them checked: 2 MiB
entries promoted at 0.5-0.88 of raw reads (performance log, 2026-12-06). Here a reader hands a
filled buffer to a checker and starts its next read at once, so the disk always has a read in
flight while earlier bytes are checked. The rule that unchecked bytes never reach a destination
is unchanged: a checker copies an entry only once its CRC32 matched.

Staging buffers are reused (an ``O_DIRECT`` read into freshly touched memory, or straight into
pool pages, ran at half the rate here: performance log); at most ``STAGING_BUFFERS`` exist, so a
checker falling behind slows the readers rather than growing memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ucm_ray.store.checksum import checksum
from ucm_ray.store.shard.disk.fileops import aligned_buffer

READ_DEPTH = 2
"""Reads one call keeps in flight. Two keep the disk busy while a reader thread wakes up; more
(4 before) only split the same bandwidth and added thread hand-offs, which cost far more than
their CPU time on this VM (performance log, 2026-12-06)."""
CHECK_THREADS = 1
"""Threads checking and copying what the readers read: CRC32 runs at ~3.7 GB/s a core here,
against a disk of 1.3-1.8 GB/s, so one keeps up; a second one measured slower (more wake-ups)."""
STAGING_BUFFERS = READ_DEPTH + CHECK_THREADS + 2
"""Buffers in use at once at most: one per read in flight, one per check, and two waiting."""

Outcome = bool | None | OSError
"""Per entry: checked and copied (True), failed its check (False), not started by the deadline
(None), or the error that stopped its read."""


@dataclass
class Entry:
    """One entry of a run: where it starts in the run, its size, its CRC32 and its destination."""
    at: int
    size: int
    crc: int
    out: torch.Tensor


@dataclass
class Run:
    """Entries lying next to each other in one file: one read of ``length`` bytes at ``offset``."""
    file: int
    offset: int
    length: int
    entries: list[Entry]
    results: list[int]
    """Index in the caller's outcome list of each entry."""


class _Staging:
    """A bounded pool of aligned buffers, each as large as the largest run it was taken for."""

    def __init__(self, count: int) -> None:
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._count = count
        self._cond = threading.Condition()

    def take(self, size: int) -> torch.Tensor:
        with self._cond:
            while not self._free and self._made >= self._count:
                self._cond.wait()
            if self._free:
                buffer = self._free.pop()
                if buffer.numel() >= size:
                    return buffer
            else:
                self._made += 1
        # the old buffer (too small) goes with its last view (a traceback may hold one)
        return torch.frombuffer(aligned_buffer(size), dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()


class CheckedReads:
    """Reads and checks runs on its own threads; ``read`` is the one system call (``FileOps``)."""

    def __init__(self, read: Callable[[int, memoryview, int], int]) -> None:
        """``read(file, buffer, offset)``: bytes read into ``buffer`` from ``file`` at ``offset``."""
        self._read = read
        self._staging = _Staging(STAGING_BUFFERS)
        self._readers: ThreadPoolExecutor | None = None
        self._checkers: ThreadPoolExecutor | None = None

    def start(self, runs: Sequence[Run], results: list[Outcome], deadline: float | None,
              now: Callable[[], float]) -> Callable[[], None]:
        """Start reading ``runs`` (head first, up to ``READ_DEPTH`` at once), setting each entry's
        outcome in ``results``; the call returned waits until every outcome is set. A run not
        started by ``deadline`` (``now``'s clock) is None throughout."""
        depth = max(1, min(READ_DEPTH, len(runs)))
        if len(runs) <= 1:  # one run: read and check it here, no hand-offs
            for run in runs:
                self._check(run, self._read_run(run, results, deadline, now), results)
            return lambda: None
        if self._readers is None or self._checkers is None:
            self._readers = ThreadPoolExecutor(READ_DEPTH, thread_name_prefix="ucm-ray-disk-read")
            self._checkers = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="ucm-ray-disk-check")
        checkers = self._checkers
        checks: list[Future] = []

        def read_stripe(first: int) -> None:  # runs first, first + depth, ...: the head goes first
            for run in runs[first::depth]:
                buffer = self._read_run(run, results, deadline, now)
                if buffer is not None:
                    checks.append(checkers.submit(self._check, run, buffer, results))

        stripes = [self._readers.submit(read_stripe, t) for t in range(depth)]  # a task per thread, not per run

        def finish() -> None:
            for stripe in stripes:
                stripe.result()
            for check in checks:  # complete: every stripe has appended its checks
                check.result()

        return finish

    def _read_run(self, run: Run, results: list[Outcome], deadline: float | None,
                  now: Callable[[], float]) -> torch.Tensor | None:
        """Read ``run`` into a staging buffer: the buffer, or None with the run's outcomes set
        (late, or the error)."""
        if deadline is not None and now() > deadline:
            for i in run.results:
                results[i] = None
            return None
        buffer = self._staging.take(run.length)
        try:
            done = self._read(run.file, memoryview(buffer[:run.length].numpy()), run.offset)
            if done != run.length:
                raise OSError(5, f"short read: {done} of {run.length} bytes")  # EIO
        except OSError as e:
            self._staging.give(buffer)
            for i in run.results:
                results[i] = e
            return None
        return buffer

    def _check(self, run: Run, buffer: torch.Tensor | None, results: list[Outcome]) -> None:
        """Check each entry of ``run`` in ``buffer`` and copy the good ones out; give the buffer back."""
        if buffer is None:
            return
        try:
            for entry, i in zip(run.entries, run.results):
                data = buffer[entry.at:entry.at + entry.size]
                ok = checksum(data) == entry.crc
                if ok:
                    entry.out.copy_(data)
                results[i] = ok
        finally:
            self._staging.give(buffer)

    def close(self) -> None:
        for pool in (self._readers, self._checkers):
            if pool is not None:
                pool.shutdown()
        self._readers = self._checkers = None
