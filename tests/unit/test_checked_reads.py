"""The disk tier's reads with reading and checking on different threads, on real files:
a reader never waits for the checks of what it read, checked bytes alone reach a destination
(also when checks run on another thread), a failing read is reported per entry, and the staging
memory stays bounded however far the checks fall behind."""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

from ucm_ray.store.shard.disk import DiskStore, FileOps, checked_reads
from ucm_ray.store.shard.disk import store as store_module
from ucm_ray.store.shard.disk.store import shard_dir

SLOT = 8192
SHARD = "s0"


def key(i: int) -> bytes:
    return b"key-%d" % i


def payload(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (SLOT,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


class Timeline:
    """When each read and each check started and ended (``time.monotonic``), by file offset."""

    def __init__(self) -> None:
        self.reads: dict[int, tuple[float, float]] = {}
        self.checks: list[tuple[float, float]] = []
        self.lock = threading.Lock()


class TimedReads(FileOps):
    def __init__(self, timeline: Timeline, fail_at: int | None = None) -> None:
        self.timeline = timeline
        self.fail_at = fail_at

    def preadv(self, fd, buffers, offset):
        started = time.monotonic()
        if offset == self.fail_at:
            raise OSError(errno.EIO, "injected")
        done = super().preadv(fd, buffers, offset)
        with self.timeline.lock:
            self.timeline.reads[offset] = (started, time.monotonic())
        return done


@pytest.fixture
def one_read_per_entry(monkeypatch):
    monkeypatch.setattr(store_module, "COALESCE_BYTES", SLOT)  # a run per key: the threaded path


def slow_checks(monkeypatch, timeline: Timeline, delay_s: float) -> None:
    """Checks take ``delay_s`` longer (the real CRC32 after a sleep): a checker far behind the disk."""
    real = checked_reads.checksum

    def slow(data):
        started = time.monotonic()
        time.sleep(delay_s)
        value = real(data)
        with timeline.lock:
            timeline.checks.append((started, time.monotonic()))
        return value

    monkeypatch.setattr(checked_reads, "checksum", slow)


def filled(root: str, n: int, ops: FileOps) -> DiskStore:
    store = DiskStore([root], SHARD, 4 * n * SLOT, ops=ops)
    for i in range(n):
        assert store.put(key(i), payload(i))
    return store


def test_reads_go_on_while_earlier_entries_are_checked(tmp_path, monkeypatch, one_read_per_entry):
    """With checks ten times slower than reads, every read is done before the checks are half
    done: a reader hands its buffer on and reads the next entry (before, each reader thread
    checked what it had read before reading again, and the disk waited)."""
    timeline = Timeline()
    monkeypatch.setattr(checked_reads, "STAGING_BUFFERS", 16)
    store = filled(str(tmp_path), 8, TimedReads(timeline))
    slow_checks(monkeypatch, timeline, 0.05)
    outs = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(8)]
    assert store.get_many([key(i) for i in range(8)], outs) == [True] * 8
    assert all(torch.equal(outs[i], payload(i)) for i in range(8))
    last_read_ended = max(end for _, end in timeline.reads.values())
    checks_ended = sorted(end for _, end in timeline.checks)
    assert last_read_ended < checks_ended[3], (last_read_ended, checks_ended)
    store.close()


def test_staging_stays_bounded_when_checks_fall_behind(tmp_path, monkeypatch, one_read_per_entry):
    """Readers wait for a buffer rather than make more: at most ``STAGING_BUFFERS`` exist."""
    timeline = Timeline()
    monkeypatch.setattr(checked_reads, "STAGING_BUFFERS", 3)
    made = []
    real_buffer = checked_reads.aligned_buffer
    monkeypatch.setattr(checked_reads, "aligned_buffer", lambda size: made.append(size) or real_buffer(size))
    store = filled(str(tmp_path), 12, TimedReads(timeline))
    slow_checks(monkeypatch, timeline, 0.01)
    outs = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(12)]
    assert store.get_many([key(i) for i in range(12)], outs) == [True] * 12
    assert all(torch.equal(outs[i], payload(i)) for i in range(12))
    assert 1 <= len(made) <= 3, made
    store.close()


def test_checked_on_another_thread_a_corrupt_entry_never_reaches_its_destination(tmp_path, one_read_per_entry):
    root = str(tmp_path)
    store = filled(root, 6, FileOps())
    bad = store.slot_of(key(3))
    store.close()
    with open(f"{shard_dir(root, SHARD)}/data-0", "r+b") as f:
        f.seek(bad.offset + 100)
        byte = f.read(1)
        f.seek(bad.offset + 100)
        f.write(bytes([byte[0] ^ 0x80]))
    again = DiskStore([root], SHARD, 24 * SLOT)
    outs = [torch.full((SLOT,), 0xAB, dtype=torch.uint8) for _ in range(6)]
    assert again.get_many([key(i) for i in range(6)], outs) == [True, True, True, False, True, True]
    assert all(torch.equal(outs[i], payload(i)) for i in (0, 1, 2, 4, 5))
    assert bool((outs[3] == 0xAB).all()), "a corrupt entry's bytes reached the destination"
    assert again.snapshot().corrupt == 1 and not again.contains([key(3)])[0]
    again.close()


def test_a_failing_read_among_several_turns_the_tier_off_and_serves_nothing_unchecked(tmp_path, one_read_per_entry):
    timeline = Timeline()
    ops = TimedReads(timeline)
    store = filled(str(tmp_path), 6, ops)
    ops.fail_at = store.slot_of(key(2)).offset
    outs = [torch.full((SLOT,), 0xAB, dtype=torch.uint8) for _ in range(6)]
    got = store.get_many([key(i) for i in range(6)], outs)
    assert got[2] is False and not store.enabled
    assert not any(got[2:]), got  # from the failed read on, nothing is served
    for i in range(6):  # a destination holds its checked bytes or is untouched, nothing between
        assert torch.equal(outs[i], payload(i)) or (not got[i] and bool((outs[i] == 0xAB).all())), i
    assert bool((outs[2] == 0xAB).all())
    store.close()
